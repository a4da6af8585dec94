"""W&B and MLflow logging, through stand-in modules that record what the trainer calls: the
same run id is continued on resume, every logged step arrives once, and a logger that is asked
for but not installed is a one-line error."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from latentforge.errors import UserError
from latentforge.train.loggers import IDS_FILE
from latent_fixtures import latent_data  # noqa: F401  (session fixture)
from test_trainer import STEPS, kill_before_step, metrics, run, run_config, Killed


class Recorder:
    """Stand-in for the ``wandb`` and ``mlflow`` modules: records calls, hands out run ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.num_runs = 0

    # wandb
    def init(self, project: str, name: str, dir: str, id: str | None, resume: str, config: dict) -> Any:
        self.num_runs += 1
        run_id = id or f"wandb-{self.num_runs}"
        self.calls.append(("init", run_id))
        rec = self
        return types.SimpleNamespace(
            id=run_id,
            log=lambda data, step: rec.calls.append(("log", step, data)),
            finish=lambda: rec.calls.append(("finish", run_id)))

    # mlflow
    def start_run(self, run_id: str | None, run_name: str | None) -> Any:
        self.num_runs += 1
        run_id = run_id or f"mlflow-{self.num_runs}"
        self.calls.append(("start_run", run_id))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

    def log_params(self, params: dict) -> None:
        self.calls.append(("log_params", params))

    def log_metrics(self, data: dict, step: int) -> None:
        self.calls.append(("log", step, data))

    def end_run(self) -> None:
        self.calls.append(("end_run", None))

    def logged_steps(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "log"]


def _module(name: str, rec: Recorder) -> types.ModuleType:
    mod = types.ModuleType(name)
    for attr in ("init", "start_run", "log_params", "log_metrics", "end_run"):
        setattr(mod, attr, getattr(rec, attr))
    return mod


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_tracker_continues_the_same_run_after_a_crash(name, latent_data, tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setitem(sys.modules, name, _module(name, rec))
    cfg = run_config(latent_data, f"train.loggers=[{name}]")
    run_dir = tmp_path / "run"

    with monkeypatch.context() as m:
        kill_before_step(m, STEPS // 2 + 2)  # dies after the checkpoint at STEPS/2 and one more logged step
        with pytest.raises(Killed):
            run(cfg, run_dir)
    first_id = rec.calls[0][1]
    assert rec.logged_steps() == list(range(1, STEPS // 2 + 2))
    run(cfg, run_dir)

    starts = [c[1] for c in rec.calls if c[0] in ("init", "start_run")]
    assert starts == [first_id, first_id], "the resumed run must continue the tracker run, not open a new one"
    assert (run_dir / IDS_FILE).exists()
    # the resumed run logs again from the checkpoint's next step; the tracker gets every step
    assert rec.logged_steps() == list(range(1, STEPS // 2 + 2)) + list(range(STEPS // 2 + 1, STEPS + 1))
    last = [c for c in rec.calls if c[0] == "log"][-1]
    assert last[2]["train/loss"] == metrics(run_dir)[-1]["loss"]
    assert {"train/lr", "train/grad_norm", "train/img_per_s", "train/samples_seen"} <= set(last[2])
    if name == "mlflow":
        params = [c[1] for c in rec.calls if c[0] == "log_params"]
        assert len(params) == 1 and params[0]["optim.lr"] == "0.001"  # parameters are logged once
        assert rec.calls[-1] == ("end_run", None)
    else:
        assert rec.calls[-1] == ("finish", first_id)


def test_logger_not_installed_is_one_line(latent_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match=r"^train.loggers: wandb is asked for but not installed: pip install wandb"):
        run(run_config(latent_data, "train.loggers=[tensorboard,wandb]"), tmp_path / "run")
    assert not (Path(tmp_path / "run") / IDS_FILE).exists()
