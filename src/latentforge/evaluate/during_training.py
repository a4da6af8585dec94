"""Evaluation during training (``train.eval.every_steps``): ``latentforge eval`` on each
checkpoint the trainer writes at an evaluation step.

The evaluation is the recipe's ``eval`` section as it is, with the checkpoint of the step and, if
``train.eval.num_images`` is set, a fixed subset of its prompts (the first N, the same at every
step, so the curve compares like with like). Its images and results stay in
``RUN/eval/step-N/``; a run stopped in the middle of one resumes it (``evaluate`` keeps finished
batches). The trainer logs the metrics against step, training images, GPU-hours and dollars.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from latentforge import checkpoint as ckpt
from latentforge.errors import ConfigError
from latentforge.evaluate.eval import EvalConfig, evaluate
from latentforge.evaluate.inputs import load_prompts, load_reference

EVAL_DIR = "eval"


def check_inputs(cfg: EvalConfig) -> None:
    """What an evaluation needs, checked before training starts: prompts, a metric and its inputs."""
    if not (cfg.inception or cfg.fd_encoders or cfg.clip):
        raise ConfigError("train.eval.every_steps: the recipe's eval section names no metric model: set eval.inception "
                          "(FID/KID), eval.fd_encoders and/or eval.clip")
    if not cfg.prompts:
        raise ConfigError("train.eval.every_steps: set eval.prompts (a prompt file or raw shards with captions)")
    load_prompts(cfg.prompts, cfg.prompt_column)
    if cfg.inception or cfg.fd_encoders:
        load_reference(cfg.reference, cfg.max_reference)
    for path in [cfg.inception, cfg.clip, *cfg.fd_encoders]:
        if path and not Path(path).exists():
            raise ConfigError(f"eval: {path}: no such file or directory")


def training_evaluator(cfg: EvalConfig, every: Any, run: Path, world: Any) -> Callable[[Any, Path], dict | None]:
    """``eval_fn(trainer, checkpoint)`` for the trainer: evaluates ``checkpoint`` into
    ``RUN/eval/<checkpoint name>`` on every rank (generation is split across ranks); rank 0
    returns the results."""
    check_inputs(cfg)
    num_images = every.num_images or cfg.num_images

    def evaluate_checkpoint(trainer: Any, checkpoint: Path) -> dict | None:
        out = Path(run) / EVAL_DIR / Path(checkpoint).name
        started = out / "generation.json"  # written when an evaluation of this step starts
        marker = Path(checkpoint) / ckpt.MARKER
        if world.is_main and started.exists() and started.stat().st_mtime < marker.stat().st_mtime:
            # images of an earlier checkpoint of the same step (the run went on from an older checkpoint):
            # never mixed with this one's. The other ranks wait in evaluate's first barrier.
            shutil.rmtree(out)
        step_cfg = replace(cfg, checkpoint=str(checkpoint), num_images=num_images)
        return evaluate(step_cfg, out, progress=False, world=world)

    return evaluate_checkpoint
