"""Metric loggers of a training run: TensorBoard (embedded, the default), W&B and MLflow when
installed and asked for.

Each logger continues the same experiment-tracker run when training resumes: the W&B run id and
the MLflow run id are kept in ``RUN/loggers.json``, and TensorBoard purges the events written after
the checkpoint the run resumed from, so a resumed run never shows a step twice.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Protocol

from latentforge.errors import UserError

IDS_FILE = "loggers.json"
PROJECT = "latentforge"


class MetricLogger(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _import(name: str, pip_name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UserError(f"train.loggers: {name} is asked for but not installed: pip install {pip_name}, "
                        f"or remove {name} from train.loggers") from None


class TensorBoardLogger:
    def __init__(self, run_dir: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events past the checkpoint a resumed run restarts from
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, ids: dict[str, str], config: dict[str, Any]):
        wandb = _import("wandb", "wandb")
        self.run = wandb.init(project=PROJECT, name=run_dir.name, dir=str(run_dir), id=ids.get("wandb"),
                              resume="allow", config=config)
        ids["wandb"] = self.run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({f"train/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowLogger:
    def __init__(self, run_dir: Path, ids: dict[str, str], config: dict[str, Any]):
        self.mlflow = _import("mlflow", "mlflow")
        resumed = "mlflow" in ids
        run = self.mlflow.start_run(run_id=ids.get("mlflow"), run_name=None if resumed else run_dir.name)
        ids["mlflow"] = run.info.run_id
        if not resumed:  # MLflow refuses to change a logged parameter, so log them once
            self.mlflow.log_params(_flatten(config))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({f"train/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:500]  # older MLflow servers cap parameter values at 500 characters
    return out


def open_loggers(names: list[str], run_dir: Path, step: int, config: dict[str, Any]) -> list[MetricLogger]:
    """The loggers ``names`` for ``run_dir``, resuming at ``step``; ``config``: logged once as the
    run's parameters. Run ids are saved at once, so a crash before the first checkpoint still resumes
    the same tracker run."""
    ids_path = run_dir / IDS_FILE
    ids: dict[str, str] = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    loggers: list[MetricLogger] = []
    try:
        for name in names:
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(run_dir, step))
            elif name == "wandb":
                loggers.append(WandbLogger(run_dir, ids, config))
            elif name == "mlflow":
                loggers.append(MLflowLogger(run_dir, ids, config))
            else:
                raise UserError(f"train.loggers: unknown logger {name!r}: use tensorboard, wandb or mlflow")
    except BaseException:
        close_loggers(loggers)
        raise
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return loggers


def close_loggers(loggers: list[MetricLogger]) -> None:
    for lg in loggers:
        lg.close()
