"""A training run's directory as training writes it and sampling, evaluation and export read it:
its config (:class:`RunConfig`, ``train_config.yaml``) and its data's meta (``data_meta.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from latentforge.config import load_config
from latentforge.data.loader import LoaderConfig
from latentforge.errors import UserError
from latentforge.evaluate.config import EvalConfig
from latentforge.train.trainer import TrainConfig

DATA_META = "data_meta.json"
TRAIN_CONFIG = "train_config.yaml"


@dataclass
class RunConfig:
    """A training run: the trainer's config plus the loader settings shared by its phases."""

    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "model, objective, phases"})
    data: LoaderConfig = field(default_factory=LoaderConfig, metadata={
        "help": "loader settings (seed, workers, caption dropout, cache); datasets come from train.phases"})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={
        "help": "what train.eval.every_steps evaluates: the recipe's eval section (its checkpoint is each step's)"})


def load_run_files(run: Path) -> tuple[RunConfig, dict[str, Any]]:
    """A run directory's config and its data's meta, as training wrote them."""
    if not (run / TRAIN_CONFIG).exists() or not (run / DATA_META).exists():
        raise UserError(f"{run}: not a latentforge training run (no {TRAIN_CONFIG} / {DATA_META})")
    cfg = load_config(RunConfig, run / TRAIN_CONFIG)
    try:
        meta = json.loads((run / DATA_META).read_text())
    except ValueError as e:
        raise UserError(f"{run / DATA_META}: not valid JSON ({e}); rerunning `latentforge train` on the run "
                        "writes it again") from None
    needed = {"vae": ("path",), "text_encoder": ("path", "max_length")}  # what sample and export read
    missing = [k for k, fields in needed.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), dict)
               or any(f not in meta[k] for f in fields)]
    if missing:
        raise UserError(f"{run / DATA_META}: damaged (no {' / '.join(missing)} record); rerunning `latentforge "
                        "train` on the run writes it again")
    return cfg, meta
