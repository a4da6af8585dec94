"""Ray: ``train --ray`` on 2 workers against a plain run, recovery from a killed worker, the Ray
Data encode against the local one, and online encoding against precomputed latents.

One local Ray instance (2 CPUs, a 300 MB object store, no dashboard) serves the whole module:
starting one costs several seconds, a 2-worker TorchTrainer about 30 s more on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from latentforge import checkpoint as ckpt
from latentforge.config import apply_overrides, from_dict
from latentforge.distributed.ray_launch import FAIL_ENV, RayConfig, local_temp_dir, resources_per_worker, train_on_ray
from latentforge.errors import ConfigError
from latentforge.train.run import RunConfig, train
from latent_fixtures import latent_data  # noqa: F401  (session fixture)



STEPS = 8
EVERY = 2  # checkpoint interval


@pytest.fixture(scope="module")
def ray_instance():
    temp = tempfile.mkdtemp(prefix="lf-ray-", dir="/tmp")  # short: Ray's unix socket paths live below it
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, object_store_memory=300_000_000, _temp_dir=temp, include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def run_config(data: dict[str, Path], *overrides: str) -> RunConfig:
    """Global batch 8: micro 4 x 2 accumulation steps on one process, micro 4 x 2 ranks on two."""
    base = {
        "train": {
            "seed": 3,
            "unet": {"preset": "tiny"},
            "optim": {"lr": 1e-3, "warmup_steps": 2},
            "ema": {"decay": 0.9},
            "phases": [{"datasets": [{"path": str(data["latent16"])}], "steps": STEPS}],
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "log_every": 1,
            "checkpoint": {"every_steps": EVERY, "keep_last": 20},
            "loggers": [],
        },
        "data": {"seed": 1, "num_workers": 0, "shuffle_window_shards": 2, "cache_dir": str(data["cache"])},
    }
    return from_dict(RunConfig, apply_overrides(base, list(overrides)))


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / ckpt.CHECKPOINTS).iterdir())


@pytest.fixture(scope="module")
def plain_run(latent_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("plain")
    torch.set_num_threads(1)
    assert train(run_config(latent_data), run_dir, progress=False)["step"] == STEPS
    return run_dir


@pytest.fixture(scope="module")
def ray_run(latent_data, tmp_path_factory, ray_instance) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("ray")
    summary = train_on_ray(run_config(latent_data), run_dir, RayConfig(num_workers=2), quiet=True)
    return run_dir, summary


def test_two_ray_workers_run_to_the_end_like_one_process(plain_run, ray_run):
    """Same steps and samples as one process with the same global batch. The first loss (same
    initial weights, same 8 samples and noise, averaged over the ranks) agrees to fp tolerance."""
    run_dir, summary = ray_run
    assert summary["step"] == STEPS and summary["finished"]
    a, b = metrics(plain_run), metrics(run_dir)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["samples_seen"] for r in b] == [r["samples_seen"] for r in a] == [8 * s for s in range(1, STEPS + 1)]
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], rel=1e-5)
    assert b[0]["lr"] == a[0]["lr"]
    assert checkpoint_entries(run_dir) == [ckpt.checkpoint_dir_name(s) for s in range(EVERY, STEPS + 1, EVERY)]
    last = ckpt.load_checkpoint(ckpt.find_latest(run_dir))
    assert last.meta["world_size"] == 2 and last.meta["step"] == STEPS
    # Each checkpoint was reported to Ray as a pointer as soon as it was complete.
    pointers = sorted((run_dir / "ray" / "latentforge").glob("checkpoint_*/latentforge_checkpoint.json"))
    assert [json.loads(p.read_text())["step"] for p in pointers] == list(range(EVERY, STEPS + 1, EVERY))


def test_killed_worker_restarts_from_the_newest_checkpoint(latent_data, ray_run, tmp_path, monkeypatch):
    """Rank 1 exits abruptly right after checkpoint 4; FailureConfig restarts the worker group,
    which resumes from step 4 (not an older one: checkpoints 2 and 4 are never rewritten) and
    finishes with the same steps and samples as the uninterrupted run, leaving no partial
    checkpoint behind."""
    run_dir = tmp_path / "run"
    marker = tmp_path / "failed-once"
    monkeypatch.setenv(FAIL_ENV, f"1:4:{marker}")
    summary = train_on_ray(run_config(latent_data), run_dir, RayConfig(num_workers=2, max_failures=1), quiet=True)
    assert marker.exists(), "the worker never failed: nothing was tested"
    assert summary["step"] == STEPS and summary["finished"]
    assert checkpoint_entries(run_dir) == [ckpt.checkpoint_dir_name(s) for s in range(EVERY, STEPS + 1, EVERY)]
    crashed_at = marker.stat().st_mtime
    saved = {s: ckpt.load_checkpoint(run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(s)).meta["saved_unix"]
             for s in range(EVERY, STEPS + 1, EVERY)}
    assert saved[2] < saved[4] <= crashed_at < saved[6] < saved[8]
    uninterrupted = metrics(ray_run[0])
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["samples_seen"] for r in records] == [r["samples_seen"] for r in uninterrupted]
    final = ckpt.load_checkpoint(ckpt.find_latest(run_dir))
    assert final.meta["loader"] is None and final.meta["phase"] == 1


def test_config_errors_are_raised_by_the_driver_not_retried(latent_data, tmp_path):
    with pytest.raises(ConfigError, match="not divisible"):
        train_on_ray(run_config(latent_data), tmp_path / "run", RayConfig(num_workers=3))
    with pytest.raises(ConfigError, match="num_workers"):
        train_on_ray(run_config(latent_data), tmp_path / "run", RayConfig(num_workers=0))


def test_local_temp_dir_falls_back_when_too_long_for_unix_sockets(tmp_path):
    short = Path("/tmp/lf")
    assert local_temp_dir(short) == (short / "ray-tmp", False)
    long_dir, fallback = local_temp_dir(tmp_path / ("x" * 80))
    assert fallback and str(long_dir).startswith("/tmp/lf-ray-") and long_dir.is_dir()
    long_dir.rmdir()
    shutil.rmtree(short, ignore_errors=True)


def test_worker_resources_leave_room_for_ray_on_two_cores():
    local = resources_per_worker(RayConfig(num_workers=2), {"CPU": 2.0})
    assert local == {"CPU": 0.875}
    assert resources_per_worker(RayConfig(num_workers=1), {"CPU": 2.0}) == {"CPU": 1.0}
    cluster = resources_per_worker(RayConfig(address="auto", num_workers=8), {"CPU": 64.0, "GPU": 8.0})
    assert cluster == {"CPU": 1.0, "GPU": 1.0}
    assert resources_per_worker(RayConfig(address="auto", gpus_per_worker=0), {"GPU": 8.0}) == {"CPU": 1.0}
