"""The trainer's contract: exact resume (also after SIGKILL of the CLI), phases, time limit,
non-finite losses, batch plans, config/data checks, the train command and incomplete checkpoints.

Every run trains the tiny U-Net on the session's tiny latent datasets (``latent_fixtures``) on
CPU in fp32, with one intra-op thread: results are compared bit for bit, and CPU kernels may
split reductions differently with another thread count (the subprocesses get
``OMP_NUM_THREADS=1`` for the same reason; two contended threads were also ~20x slower here).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from latentforge import checkpoint as ckpt
from latentforge.cli import main as cli_main
from latentforge.config import apply_overrides, from_dict, load_config
from latentforge.errors import ConfigError, UserError
from latentforge.train.optim import OptimConfig, lr_multiplier
from latentforge.train.run import DATA_META, TRAIN_CONFIG, RunConfig, train
from latentforge.distributed.env import World
from latentforge.train.trainer import TrainConfig, Trainer, TrainingDiverged, batch_plan
from latent_fixtures import latent_data  # noqa: F401  (session fixture)

STEPS = 8  # optimizer steps of the main run; checkpoints every STEPS // 2


pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(data: dict[str, Path], *overrides: str, phases: list[dict] | None = None) -> dict[str, Any]:
    """Plain RunConfig data: v-prediction, min-SNR, offset noise, EMA, cosine LR with warmup,
    micro batch 4 x 2 accumulation steps, caption dropout 0.2, a log line every step;
    ``overrides`` are dotted ``key=value`` strings as on the command line."""
    base = {
        "train": {
            "seed": 3,
            "unet": {"preset": "tiny"},
            "noise": {"prediction_type": "v_prediction"},
            "min_snr_gamma": 5.0,
            "offset_noise": 0.1,
            "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "cosine"},
            "ema": {"decay": 0.9},
            "phases": phases or [{"datasets": [{"path": str(data["latent16"])}], "steps": STEPS}],
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "log_every": 1,
            "checkpoint": {"every_steps": STEPS // 2, "keep_last": 20},
            "loggers": [],
        },
        "data": {"seed": 1, "caption_dropout": 0.2, "num_workers": 0, "shuffle_window_shards": 2,
                 "cache_dir": str(data["cache"])},
    }
    return apply_overrides(base, list(overrides))


def run(cfg: dict[str, Any], run_dir: Path, resume: str = "auto") -> dict[str, Any]:
    return train(from_dict(RunConfig, cfg), run_dir, resume=resume, progress=False)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The log records without the throughput (which depends on timing)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timed = ("img_per_s", "mfu")  # wall-clock figures differ between runs
    return [{k: v for k, v in json.loads(line).items() if k not in timed} for line in lines]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / ckpt.CHECKPOINTS).glob("step-*") if "." not in p.name)


def load_step(run_dir: Path, step: int) -> ckpt.Checkpoint:
    return ckpt.load_checkpoint(run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(step))


def assert_same_tensors(a: ckpt.Checkpoint, b: ckpt.Checkpoint, groups: tuple[str, ...] = ("model", "ema")) -> None:
    for group in groups:
        ta, tb = a.tensors[group], b.tensors[group]
        assert ta.keys() == tb.keys(), group
        differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not differ, f"{group}: {len(differ)} of {len(ta)} tensors differ, e.g. {differ[:3]}"


def assert_same_run(a: Path, b: Path) -> None:
    """Same log record at every step (loss, grad norm, lr, cursor...) and bitwise the same final
    model and EMA."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == [r["step"] for r in ma]
    for ra, rb in zip(ma, mb):
        assert ra == rb, f"step {ra['step']}: {ra} != {rb}"
    assert_same_tensors(ckpt.load_checkpoint(ckpt.find_latest(a)), ckpt.load_checkpoint(ckpt.find_latest(b)))


class Killed(BaseException):
    """Stands for a crash of the process (not an Exception, so nothing catches it on the way)."""


def kill_before_step(monkeypatch, step: int) -> None:
    """Make the next run die when it is about to train optimizer step ``step`` (1-based)."""
    original = Trainer.train_step

    def train_step(self, batches):
        if self.step + 1 == step:
            raise Killed(step)
        return original(self, batches)

    monkeypatch.setattr(Trainer, "train_step", train_step)


@pytest.fixture(scope="module")
def straight(latent_data, tmp_path_factory, one_thread) -> Path:
    """STEPS uninterrupted steps: the reference the interrupted runs must reproduce exactly."""
    run_dir = tmp_path_factory.mktemp("straight")
    summary = run(run_config(latent_data), run_dir)
    assert summary == {**summary, "step": STEPS, "finished": True, "skipped_steps": 0}
    return run_dir


# ------------------------------------------------------------------------------- exact resume


def test_straight_run_logs_every_step_with_the_lr_it_used(straight):
    records = metrics(straight)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["samples_seen"] for r in records] == [8 * s for s in range(1, STEPS + 1)]
    optim = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine")
    for r in records:
        assert r["lr"] == pytest.approx(1e-3 * lr_multiplier(r["step"] - 1, optim, STEPS), rel=1e-12, abs=1e-15)
        assert math.isfinite(r["loss"]) and r["skipped_steps"] == 0
    assert checkpoint_steps(straight) == [STEPS // 2, STEPS]
    meta = load_step(straight, STEPS // 2).meta
    assert meta["step"] == STEPS // 2 and meta["phase"] == 0 and meta["loader"]["cursor"] == 8 * STEPS // 2


def test_resume_after_sigkill_of_the_cli_is_exact(straight, latent_data, tmp_path):
    """`latentforge train` is SIGKILLed after its checkpoint at STEPS/2 and rerun with --resume
    auto and 2 loader workers (0 before): every logged step and the final model and EMA match
    the uninterrupted in-process run bit for bit. Also checks what the command leaves behind."""
    cfg = run_config(latent_data, "train.loggers=[tensorboard]")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "latentforge", "train", str(run_dir), "--recipe", str(recipe), "--quiet"]

    half = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(STEPS // 2)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not half.exists():  # renamed into place only when complete
            assert proc.poll() is None, f"train exited with {proc.returncode}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert checkpoint_steps(run_dir) == [STEPS // 2], "the run finished before it was killed: nothing was tested"

    resumed = subprocess.run(command + ["--resume", "auto", "loader.num_workers=2"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1].startswith(f"train: finished at step {STEPS}")
    assert_same_run(straight, run_dir)

    assert checkpoint_steps(run_dir) == [STEPS // 2, STEPS]
    # TensorBoard holds every step once, with the logged values, across the kill (the resumed
    # writer purges what the killed one wrote after the checkpoint).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    logged = metrics(run_dir)
    for key in ("loss", "lr", "grad_norm"):
        events = board.Scalars(f"train/{key}")
        assert [e.step for e in events] == list(range(1, STEPS + 1)), key
        assert [e.value for e in events] == pytest.approx([r[key] for r in logged], rel=1e-6), key
    saved = load_config(RunConfig, run_dir / TRAIN_CONFIG)
    assert saved.train.unet.cross_attention_dim == 16 and saved.data.num_workers == 2
    data_meta = json.loads((run_dir / DATA_META).read_text())
    assert data_meta["latent_shape"] == [4, 8, 8] and data_meta["text_shape"] == [8, 16]


def test_resume_in_a_fresh_trainer_is_exact(straight, latent_data, tmp_path, monkeypatch):
    """A crash two steps after the checkpoint (their log lines are dropped on resume), then a
    fresh Trainer with 2 loader workers instead of 0."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        kill_before_step(m, STEPS // 2 + 3)
        with pytest.raises(Killed):
            run(run_config(latent_data), run_dir)
    assert checkpoint_steps(run_dir) == [STEPS // 2]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS // 2 + 3))
    run(run_config(latent_data, "data.num_workers=2"), run_dir)
    assert_same_run(straight, run_dir)


def test_a_muon_run_resumes_exactly(latent_data, tmp_path, monkeypatch):
    """Muon's momentum buffers and AdamW's moments go through the checkpoint: a crash two steps
    after it, then a fresh Trainer, logs and ends as the uninterrupted Muon run, bit for bit."""
    muon = "train.optim.name=muon"
    run(run_config(latent_data, muon), tmp_path / "straight")
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        kill_before_step(m, STEPS // 2 + 3)
        with pytest.raises(Killed):
            run(run_config(latent_data, muon), run_dir)
    run(run_config(latent_data, muon), run_dir)
    assert_same_run(tmp_path / "straight", run_dir)
    optim_state = ckpt.load_checkpoint(ckpt.find_latest(run_dir)).state["optimizer"]
    assert [g["muon"] for g in optim_state["param_groups"]] == [True, False, False]
    assert any("momentum_buffer" in s for s in optim_state["state"].values())


def test_two_phases_switch_by_themselves_and_resume_exactly_mid_phase(latent_data, tmp_path, monkeypatch):
    """Phase 1: 4 steps at 8x8 latents; phase 2: 22 samples (= 6 steps of 4) of 16x16 latents with
    another batch size and peak lr. A crash in phase 2 resumes from its mid-phase checkpoint."""
    phases = [
        {"name": "low", "datasets": [{"path": str(latent_data["latent16"])}], "steps": 4},
        {"name": "high", "datasets": [{"path": str(latent_data["latent32"])}], "samples": 22,
         "micro_batch_size": 2, "global_batch_size": 4, "lr": 5e-4},
    ]
    cfg = run_config(latent_data, "train.checkpoint.every_steps=3", phases=phases)
    a, b = tmp_path / "straight", tmp_path / "killed"
    assert run(cfg, a)["step"] == 10

    records = metrics(a)
    assert [r["phase"] for r in records] == [0] * 4 + [1] * 6
    assert [r["samples_seen"] for r in records] == [8, 16, 24, 32, 36, 40, 44, 48, 52, 56]
    optim = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine")
    for r in records:
        peak = 1e-3 if r["phase"] == 0 else 5e-4
        assert r["lr"] == pytest.approx(peak * lr_multiplier(r["step"] - 1, optim, 10), rel=1e-12, abs=1e-15)
    assert checkpoint_steps(a) == [3, 4, 6, 9, 10]
    end_of_phase = load_step(a, 4).meta
    assert end_of_phase["phase"] == 1 and end_of_phase["loader"] is None

    with monkeypatch.context() as m:
        kill_before_step(m, 8)
        with pytest.raises(Killed):
            run(cfg, b)
    assert checkpoint_steps(b) == [3, 4, 6]
    # Phase 2 reads on at global position 32, where phase 1 stopped: 2 steps of 4 samples into it.
    assert load_step(b, 6).meta["loader"]["cursor"] == 32 + 8
    run(apply_overrides(cfg, ["data.num_workers=2"]), b)
    assert_same_run(a, b)


def test_a_phase_on_the_same_data_reads_on_where_the_previous_one_stopped(latent_data, tmp_path, monkeypatch):
    """Two phases over one dataset (a masked then an unmasked phase, or a loss-weighting change):
    the second reads the global positions after the first's, so no (sample, timestep, noise) of
    the first phase comes again and the samples past its end are reached."""
    seen: list[tuple[int, list[int]]] = []
    step = Trainer.train_step

    def record(self, batches):
        seen.append((self.phase, [int(p) for b in batches for p in b["_position"]]))
        return step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", record)
    same = [{"path": str(latent_data["latent16"])}]
    run(run_config(latent_data, phases=[{"datasets": same, "steps": 2}, {"datasets": same, "steps": 3}]),
        tmp_path / "run")
    assert [phase for phase, _ in seen] == [0, 0, 1, 1, 1]
    assert [p for _, positions in seen for p in positions] == list(range(5 * 8))


def test_max_seconds_stops_with_a_checkpoint_and_each_rerun_continues(straight, latent_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = run_config(latent_data, "train.max_seconds=1.0e-9")  # out of time after every step
    summaries = []
    while not summaries or not summaries[-1]["finished"]:
        assert len(summaries) < STEPS + 2
        summaries.append(run(cfg, run_dir))
        assert checkpoint_steps(run_dir)[-1] == summaries[-1]["step"]
    assert [s["step"] for s in summaries] == list(range(1, STEPS + 1)), "one step per run, the last one finished"
    assert_same_run(straight, run_dir)


def test_incomplete_checkpoint_is_skipped_by_resume_auto(straight, tmp_path, latent_data, caplog):
    """The newest checkpoint lost its COMPLETE marker (a crash while writing it): resume=auto
    warns, takes the one before, and the retrained steps come out the same."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    newest = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(STEPS)
    (newest / ckpt.MARKER).unlink()
    with caplog.at_level(logging.WARNING, logger="latentforge.checkpoint"):
        summary = run(run_config(latent_data), run_dir)
    assert any("incomplete checkpoint" in r.getMessage() and newest.name in r.getMessage() for r in caplog.records)
    assert summary["step"] == STEPS and summary["finished"]
    assert (newest / ckpt.MARKER).exists()
    assert_same_run(straight, run_dir)


def test_ema_copies_the_weights_before_start_step(latent_data, tmp_path):
    """ema.start_step=2: optimizer steps 0 and 1 (0-based) copy the weights, so after two steps
    the EMA equals the model; the third step averages."""
    run_dir = tmp_path / "run"
    run(run_config(latent_data, "train.ema.start_step=2", "train.checkpoint.every_steps=1",
                   "train.phases.0.steps=3"), run_dir)
    assert_same_tensors(load_step(run_dir, 2), _as_model(load_step(run_dir, 2)), groups=("ema",))
    with pytest.raises(AssertionError):
        assert_same_tensors(load_step(run_dir, 3), _as_model(load_step(run_dir, 3)), groups=("ema",))


def _as_model(c: ckpt.Checkpoint) -> ckpt.Checkpoint:
    """The checkpoint with its model weights in place of the EMA."""
    return ckpt.Checkpoint(c.path, {"ema": c.tensors["model"]}, c.state, c.meta)


# ------------------------------------------------------------------------------- non-finite loss


def inject_nonfinite(monkeypatch, steps: set[int], where: str) -> None:
    """Optimizer steps ``steps`` (1-based) get a NaN loss (``where="loss"``), or a finite loss
    whose gradients are NaN (``"grad"``: an overflow in the backward pass)."""
    original = Trainer.loss_on

    class NaNGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    def loss_on(self, batch):
        loss = original(self, batch)
        if self.step + 1 in steps:
            return loss * float("nan") if where == "loss" else NaNGrad.apply(loss)
        return loss

    monkeypatch.setattr(Trainer, "loss_on", loss_on)


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_stop_names_the_last_good_checkpoint(latent_data, tmp_path, monkeypatch, where):
    run_dir = tmp_path / "run"
    inject_nonfinite(monkeypatch, {5}, where)
    with pytest.raises(TrainingDiverged) as e:
        run(run_config(latent_data, "train.checkpoint.every_steps=2"), run_dir)
    message = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in message
    assert "at step 5" in message and str(run_dir / ckpt.CHECKPOINTS / "step-00000004") in message
    assert checkpoint_steps(run_dir) == [2, 4], "nothing may be saved after the non-finite step"
    assert all(torch.isfinite(t).all() for t in load_step(run_dir, 4).tensors["model"].values())


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_skip_leaves_the_state_unchanged_and_stops_past_the_limit(latent_data, tmp_path, monkeypatch,
                                                                            where):
    run_dir = tmp_path / "run"
    inject_nonfinite(monkeypatch, {3, 5}, where)
    cfg = run_config(latent_data, "train.nonfinite=skip", "train.max_skipped_steps=1", "train.checkpoint.every_steps=1")
    with pytest.raises(TrainingDiverged) as e:
        run(cfg, run_dir)
    message = str(e.value)
    assert "\n" not in message and "at step 5" in message and "max_skipped_steps" in message
    assert checkpoint_steps(run_dir) == [1, 2, 3, 4]

    before, skipped, after = load_step(run_dir, 2), load_step(run_dir, 3), load_step(run_dir, 4)
    assert_same_tensors(before, skipped)
    for i, s in before.state["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, skipped.state["optimizer"]["state"][i][k]), f"optimizer state {i}.{k} changed"
    with pytest.raises(AssertionError):
        assert_same_tensors(skipped, after)  # training went on after the skipped step
    assert [before.meta["skipped_steps"], skipped.meta["skipped_steps"], after.meta["skipped_steps"]] == [0, 1, 1]
    records = metrics(run_dir)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1]
    assert not math.isfinite(records[2]["loss"] if where == "loss" else records[2]["grad_norm"])


# ------------------------------------------------------------------------------- batch plans and config


def test_batch_plan():
    assert batch_plan(4, 8, 1) == 2
    assert batch_plan(4, 16, 2) == 2
    assert batch_plan(4, 0, 3) == 1
    with pytest.raises(ConfigError, match=r"^train\.global_batch_size: 8 is not divisible by .*4\*4 = 16"):
        batch_plan(4, 8, 4)


def _trainer(cfg: TrainConfig, world: World | None = None) -> Trainer:
    """A Trainer around a stand-in model: enough to see its batch plan (it never trains)."""
    return Trainer(cfg, torch.nn.Linear(2, 2), lambda phase, micro: None, "unused",
                   {"vae": {"scaling_factor": 1.0}}, world=world, progress=False)


def test_samples_become_steps_and_batch_sizes_resolve_per_phase():
    ds = [{"path": "unused"}]
    cfg = from_dict(TrainConfig, {"micro_batch_size": 4, "global_batch_size": 8, "ema": None, "phases": [
        {"datasets": ds, "samples": 20},  # ceil(20 / 8)
        {"datasets": ds, "samples": 16, "global_batch_size": 4},
        {"datasets": ds, "steps": 5, "micro_batch_size": 2},  # global 8 from train: 4 accumulation steps
    ]})
    t = _trainer(cfg)
    assert t.phase_steps == [3, 4, 5] and t.total_steps == 12
    assert t.phase_batches == [(4, 2, 8), (4, 1, 4), (2, 4, 8)]
    no_global = from_dict(TrainConfig, {"micro_batch_size": 4, "ema": None,
                                        "phases": [{"datasets": ds, "samples": 20}]})
    assert _trainer(no_global, World(rank=0, world_size=2)).phase_steps == [3]  # global = 4 x 2 ranks


@pytest.mark.parametrize("train_batch, phase_batch, world_size, field", [
    ({"global_batch_size": 12}, {}, 1, "train.global_batch_size"),  # 12 % (8 x 1)
    ({"global_batch_size": 16}, {}, 3, "train.global_batch_size"),  # 16 % (8 x 3)
    ({}, {"global_batch_size": 20}, 1, "train.phases[0].global_batch_size"),
    ({"global_batch_size": 16}, {"micro_batch_size": 3}, 1, "train.global_batch_size"),  # micro from the phase
])
def test_indivisible_global_batch_names_the_field(train_batch, phase_batch, world_size, field):
    cfg = from_dict(TrainConfig, {"micro_batch_size": 8, **train_batch, "ema": None,
                                  "phases": [{"datasets": [{"path": "unused"}], "steps": 2, **phase_batch}]})
    with pytest.raises(ConfigError) as e:
        _trainer(cfg, World(world_size=world_size))
    assert str(e.value).startswith(f"{field}: ") and "not divisible" in str(e.value)


@pytest.mark.parametrize("phase, message", [
    ({}, "phases[0].steps: set exactly one of steps and samples"),
    ({"steps": 3, "samples": 30}, "phases[0].steps: set exactly one of steps and samples"),
    ({"steps": -1}, "phases[0].steps: must be >= 0, got -1"),
    ({"steps": 3, "micro_batch_size": -2}, "phases[0].micro_batch_size: must be >= 0, got -2"),
])
def test_phase_needs_exactly_one_of_steps_and_samples(phase, message):
    with pytest.raises(ConfigError) as e:
        from_dict(TrainConfig, {"phases": [{"datasets": [{"path": "x"}], **phase}]})
    assert str(e.value).startswith(message)


def test_batch_check_of_a_later_phase_fails_before_the_run_directory_is_touched(latent_data, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^train\.phases\[1\]\.global_batch_size: 6 is not divisible"):
        run(run_config(latent_data, phases=[{"datasets": [{"path": str(latent_data["latent16"])}], "steps": 2},
                                            {"datasets": [{"path": str(latent_data["latent16"])}], "steps": 2,
                                             "global_batch_size": 6}]), run_dir)
    assert not run_dir.exists()


@pytest.mark.parametrize("override, exc, start", [
    ("train.unet.cross_attention_dim=32", ConfigError, "train.unet.cross_attention_dim: 32 but the text encoder's "
                                                       "hidden size is 16"),
    ("train.phases.0.datasets.0.path=RAW", ConfigError, "train.phases[0].datasets[0].path: "),
    ("train.unet.in_channels=3", ConfigError, "train.unet.in_channels: the latents have 4 channels"),
    ("train.phases.0.resolution=32", ConfigError, "train.phases[0].resolution: 32 but "),
])
def test_config_that_does_not_fit_the_data_is_refused_in_one_line(latent_data, tmp_path, override, exc, start):
    override = override.replace("RAW", str(latent_data["raw16"]))
    with pytest.raises(exc) as e:
        run(run_config(latent_data, override), tmp_path / "run")
    assert str(e.value).startswith(start) and "\n" not in str(e.value)
    if "RAW" in override or "raw16" in override:
        assert "latentforge encode" in str(e.value)


@pytest.mark.parametrize("override", ["train.unet.layers_per_block=2", "train.noise.prediction_type=epsilon",
                                      "train.seed=4"])
def test_resume_with_another_model_or_objective_is_refused(straight, latent_data, tmp_path, override):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    key = override.split("=")[0].split(".")[1]
    with pytest.raises(UserError, match=rf"resuming with a different train\.{key} than the run was started with"):
        run(run_config(latent_data, override), run_dir)
    assert metrics(run_dir) == metrics(straight)  # nothing was touched


def test_evaluation_and_validation_without_their_inputs_are_refused_together(latent_data, tmp_path):
    """A recipe made for the demo's data (an evaluation and a validation loss during training) on
    other data: both problems in one error, each saying how to turn it off, before the run starts."""
    with pytest.raises(ConfigError) as e:
        run(run_config(latent_data, "train.eval.every_steps=2", "train.val.every_steps=2"), tmp_path / "run")
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("train.eval.every_steps: ") and lines[1].startswith("train.val.data: ")
    assert "train.eval.every_steps=0" in lines[0] and "every_steps: 0" in lines[1]
    assert not (tmp_path / "run").exists()


def test_a_finished_phase_does_not_grow_on_resume(straight, latent_data, tmp_path):
    """The straight run finished its one phase: a rerun with more steps for it is refused in one
    line (it would otherwise end at once as "finished" and train nothing), and nothing is touched."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    config = (run_dir / "train_config.yaml").read_bytes()
    with pytest.raises(UserError, match=r"phase 0 finished at its \d+ steps; a finished phase does not grow"):
        run(run_config(latent_data, f"train.phases.0.steps={2 * STEPS}"), run_dir)
    assert metrics(run_dir) == metrics(straight) and (run_dir / "train_config.yaml").read_bytes() == config


def test_a_run_started_from_another_runs_checkpoint_is_checked_against_that_run(straight, latent_data, tmp_path,
                                                                                capsys):
    """``--resume PATH`` into a new run directory: its settings are checked against those of the run that
    wrote PATH, as a resume in place is. The finished checkpoint with more steps for its phase was reported
    "finished" with nothing trained; another U-Net ended in torch's list of shape mismatches. Both are one
    line now, and the new directory is not created. A changed learning rate from the middle checkpoint
    trains on, and the new run keeps the settings its first half ran with."""
    last = straight / "checkpoints" / f"step-{STEPS:08d}"
    middle = straight / "checkpoints" / f"step-{STEPS // 2:08d}"
    with pytest.raises(UserError, match=rf"phase 0 finished at its {STEPS} steps in the run of {last}; a finished "
                                        r"phase does not grow: add a phase to train\.phases to train on$"):
        run(run_config(latent_data, f"train.phases.0.steps={2 * STEPS}"), tmp_path / "more", resume=str(last))
    with pytest.raises(UserError, match=rf"resuming with a different train\.unet than the run of {middle} was "
                                        rf"trained with \({straight / 'train_config.yaml'}\); restore the setting"):
        run(run_config(latent_data, "train.unet.layers_per_block=2"), tmp_path / "wider", resume=str(middle))
    with pytest.raises(UserError, match=rf"resuming with a different train\.noise than the run of {middle}"):
        run(run_config(latent_data, "train.noise.prediction_type=epsilon"), tmp_path / "eps", resume=str(middle))
    assert not any((tmp_path / d).exists() for d in ("more", "wider", "eps"))
    summary = run(run_config(latent_data, "train.optim.lr=5e-4"), tmp_path / "fork", resume=str(middle))
    assert summary["step"] == STEPS and summary["finished"]
    kept = f"train_config.until-step-{STEPS // 2:08d}.yaml"
    assert f"the earlier ones are kept in {kept}" in capsys.readouterr().out
    assert (tmp_path / "fork" / kept).read_bytes() == (straight / "train_config.yaml").read_bytes()


def test_a_run_dir_that_is_a_file_is_refused_in_one_line(latent_data, tmp_path, capsys):
    """Was "afile: File exists" (the mkdir's error), which does not say what is wrong."""
    from latentforge.cli import main

    recipe = tmp_path / "recipe.yaml"
    cfg = run_config(latent_data)
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    (tmp_path / "afile").write_text("mine")
    assert main(["train", str(tmp_path / "afile"), "--recipe", str(recipe), "--quiet"]) == 2
    assert capsys.readouterr().err == f"latentforge: error: {tmp_path / 'afile'}: is a file; RUN_DIR names a run directory\n"
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_checkpoint_of_another_model_is_refused_in_one_line(straight, latent_data, tmp_path):
    """A checkpoint whose run config is gone (copied alone) and whose weights do not fit the model: one line
    naming the first difference, not torch's list of every mismatched tensor."""
    alone = tmp_path / "elsewhere" / "checkpoints" / f"step-{STEPS // 2:08d}"
    shutil.copytree(straight / "checkpoints" / alone.name, alone)
    with pytest.raises(UserError, match=rf"^{alone}: its weights do not fit this run's model \((Missing|Unexpected|size)"
                                        r"[^\n]*\); resume with the train\.model / train\.unet / train\.dit settings"):
        run(run_config(latent_data, "train.unet.layers_per_block=2"), tmp_path / "run", resume=str(alone))


def test_resume_with_changed_settings_says_so_and_keeps_the_earlier_config(straight, latent_data, tmp_path, capsys):
    """Resumed from the middle checkpoint with another learning rate: one line names the change,
    the config the first half ran with is kept beside the new one."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    before = (run_dir / "train_config.yaml").read_text()
    run(run_config(latent_data, "train.optim.lr=5e-4"), run_dir)
    out = capsys.readouterr().out
    kept = f"train_config.until-step-{STEPS // 2:08d}.yaml"
    assert f"train: resuming with changed settings (train.optim.lr: 0.001 -> 0.0005); the earlier ones are kept in {kept}" in out
    assert (run_dir / kept).read_text() == before
    assert "lr: 0.0005" in (run_dir / "train_config.yaml").read_text()
    run(run_config(latent_data, "train.optim.lr=5e-4"), run_dir)  # the same settings again: no notice
    assert "changed settings" not in capsys.readouterr().out


# ------------------------------------------------------------------------------- the command line


def test_cli_refuses_to_train_into_a_directory_that_holds_something_else(latent_data, tmp_path, capsys):
    """The latent dataset itself given as RUN_DIR: refused in one line, nothing written into it."""
    target = Path(shutil.copytree(latent_data["latent16"], tmp_path / "data"))
    before = sorted(p.name for p in target.iterdir())
    code = cli_main(["train", str(target), "--recipe", str(_recipe_file(latent_data, tmp_path)), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"latentforge: error: {target}: exists, is not empty and holds no training run "
                                 "(no train_config.yaml): use a new or empty directory\n")
    assert sorted(p.name for p in target.iterdir()) == before


def test_cli_bad_input_exits_2_with_one_line(latent_data, tmp_path, capsys):
    cfg = run_config(latent_data)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    for override, start in (("train.micro_batch_size=four", "train.micro_batch_size: expected an integer or 'auto'"),
                            ("train.nonsense=1", "train.nonsense: unknown key"),
                            ("train.unet.cross_attention_dim=32", "train.unet.cross_attention_dim: 32")):
        code = cli_main(["train", str(tmp_path / "run"), "--recipe", str(recipe), "--quiet", override])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith(f"latentforge: error: {start}") and err.count("\n") == 1, err


def _recipe_file(latent_data, tmp_path: Path, *overrides: str) -> Path:
    cfg = run_config(latent_data, *overrides)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    return recipe


def test_resume_auto_stops_over_a_run_whose_checkpoints_are_all_unusable(straight, latent_data, tmp_path, capsys):
    """The only checkpoint has a stale marker: `train --resume auto` stops in one line that says
    how to go on, and leaves the checkpoint as it was (before: a warning, step 0, overwritten)."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    shutil.rmtree(run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(STEPS // 2))
    only = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(STEPS)
    marker = json.loads((only / ckpt.MARKER).read_text())
    marker["files"]["model.safetensors"]["num_bytes"] -= 8  # from an earlier write of this directory
    (only / ckpt.MARKER).write_text(json.dumps(marker))
    before = {p.name: p.read_bytes() for p in only.iterdir()}
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    recipe = _recipe_file(latent_data, tmp_path)
    assert cli_main(["train", str(run_dir), "--recipe", str(recipe), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("latentforge: error: ") and only.name in err
    assert "--resume none" in err and "--resume PATH" in err
    assert {p.name: p.read_bytes() for p in only.iterdir()} == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert sorted(p.name for p in (run_dir / ckpt.CHECKPOINTS).iterdir()) == [only.name]


def test_resume_from_weights_that_are_not_safetensors_is_one_line(straight, latent_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    newest = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(STEPS)
    torch.save({"w": torch.zeros(2)}, newest / "model.safetensors")  # a pickle, with a marker vouching for it
    marker = json.loads((newest / ckpt.MARKER).read_text())
    marker["files"]["model.safetensors"] = {"num_bytes": (newest / "model.safetensors").stat().st_size,
                                            "sha256": ckpt._sha256(newest / "model.safetensors")}
    (newest / ckpt.MARKER).write_text(json.dumps(marker))
    recipe = _recipe_file(latent_data, tmp_path)
    assert cli_main(["train", str(run_dir), "--recipe", str(recipe), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"latentforge: error: {newest / 'model.safetensors'}: not a readable safetensors file")
    assert err.count("\n") == 1


def _last_logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)
    except (OSError, ValueError):
        return 0


def test_sigkill_at_random_points_resumes_bitwise(straight, latent_data, tmp_path):
    """The chaos test, fast: a tiny run with a checkpoint every step is SIGKILLed at random points
    (after a random step, or while a checkpoint is being written), rerun with --resume auto
    each time, then finished: every logged step and the final model and EMA equal the
    uninterrupted run bit for bit, and no checkpoint is kept aside or left half-written. The
    training processes are forked from this one (a fresh interpreter would spend ~10 s importing
    torch per kill); the kill is a real SIGKILL of a real process."""
    import multiprocessing as mp
    import random

    cfg = run_config(latent_data, "train.checkpoint.every_steps=1", "train.checkpoint.keep_last=2")
    run_dir = tmp_path / "run"
    rng = random.Random(13)
    ctx = mp.get_context("fork")
    kills = mid_write = 0
    for round_ in range(6):
        done = ckpt.find_latest(run_dir)
        start = ckpt.load_checkpoint(done, verify=False).step if done else 0
        if start >= STEPS - 1:
            break
        target = rng.randint(start + 1, STEPS - 1)  # kill once this step is logged, before the run ends
        proc = ctx.Process(target=run, args=(cfg, run_dir))
        proc.start()
        try:
            deadline = time.monotonic() + 120
            during_write = round_ % 2 == 1
            tmp = run_dir / ckpt.CHECKPOINTS / f"{ckpt.checkpoint_dir_name(target)}.tmp-{proc.pid}"
            while not (tmp.exists() if during_write else _last_logged_step(run_dir) >= target):
                assert proc.is_alive(), f"the run ended (exit code {proc.exitcode}) before the kill"
                assert time.monotonic() < deadline, "no progress in 120 s"
                time.sleep(0.001)
            if not during_write:
                time.sleep(rng.uniform(0.0, 0.05))
            assert proc.is_alive(), "the run ended before the kill: nothing was tested"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        kills += 1
        mid_write += tmp.exists()  # killed before the checkpoint was renamed into place
    assert kills >= 3 and mid_write >= 1, (kills, mid_write)
    summary = run(cfg, run_dir)
    assert summary["step"] == STEPS and summary["finished"]
    assert_same_run(straight, run_dir)
    names = sorted(p.name for p in (run_dir / ckpt.CHECKPOINTS).iterdir())
    assert names == [ckpt.checkpoint_dir_name(STEPS - 1), ckpt.checkpoint_dir_name(STEPS)], names
