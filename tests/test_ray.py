"""Ray: ``train --ray`` on 2 workers against a plain run, recovery from a killed worker, the Ray
Data encode against the local one, and online encoding against precomputed latents.

One local Ray instance (2 CPUs, a 300 MB object store, no dashboard) serves the whole module:
starting one costs several seconds, a 2-worker TorchTrainer about 30 s more on this machine.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
import yaml

from latentforge import checkpoint as ckpt
from latentforge.cli import main as cli_main
from latentforge.config import apply_overrides, from_dict, to_dict
from latentforge.distributed.ray_cluster import RayConfig, local_temp_dir
from latentforge.distributed.ray_launch import FAIL_ENV, resources_per_worker, train_on_ray
from latentforge.data.encode import CONFIG_FILE, EMPTY_PROMPT, REJECTED, EncodeConfig, encode_dataset
from latentforge.data.loader import LoaderConfig, StreamConfig, build_loader
from latentforge.data.schema import INDEX, decode_value, read_index, read_shard
from latentforge.distributed.ray_data import OnlineSource, encode_on_ray
from latentforge.errors import ConfigError
from latentforge.train.run import DATA_META, RunConfig, train
from latent_fixtures import TEXT_LEN, latent_data  # noqa: F401  (session fixture)
from tiny_models import make_raw_dataset



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
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the Ray workers (OMP_NUM_THREADS=1 for a 1-CPU share)
    try:
        assert train(run_config(latent_data), run_dir, progress=False)["step"] == STEPS
    finally:
        torch.set_num_threads(before)
    return run_dir


@pytest.fixture(scope="module")
def ray_run(latent_data, tmp_path_factory, ray_instance) -> tuple[Path, Path, str]:
    """``latentforge train --ray --num-workers 2``, in which rank 1 exits abruptly right after
    checkpoint 4 (once). One Ray Train run serves both the comparison with one process and the
    recovery test: each costs about a minute here."""
    root = tmp_path_factory.mktemp("ray")
    run_dir, marker, recipe = root / "run", root / "failed-once", root / "recipe.yaml"
    cfg = to_dict(run_config(latent_data))
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    os.environ[FAIL_ENV] = f"1:4:{marker}"
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli_main(["train", str(run_dir), "--recipe", str(recipe), "--ray", "--num-workers", "2",
                             "--max-failures", "1", "--quiet"])
    finally:
        del os.environ[FAIL_ENV]
    assert code == 0
    return run_dir, marker, out.getvalue()


def test_two_ray_workers_run_to_the_end_like_one_process(plain_run, ray_run):
    """Same steps, samples, losses and final weights as one process with the same global batch:
    the workers train one DDP model (gradients averaged over the ranks), through a crash and restart."""
    run_dir, _, stdout = ray_run
    assert stdout.strip().splitlines()[-1].startswith(f"train: finished at step {STEPS} ")
    a, b = metrics(plain_run), metrics(run_dir)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["samples_seen"] for r in b] == [r["samples_seen"] for r in a] == [8 * s for s in range(1, STEPS + 1)]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    assert [r["lr"] for r in b] == [r["lr"] for r in a]
    last = ckpt.load_checkpoint(ckpt.find_latest(run_dir))
    assert last.meta["world_size"] == 2 and last.meta["step"] == STEPS
    single = ckpt.load_checkpoint(ckpt.find_latest(plain_run))
    for group in ("model", "ema"):
        for key, value in single.tensors[group].items():
            torch.testing.assert_close(last.tensors[group][key], value, rtol=0, atol=1e-5)


def test_killed_worker_restarts_from_the_newest_checkpoint(ray_run):
    """Rank 1 exited abruptly right after checkpoint 4; FailureConfig restarted the worker group,
    which resumed from step 4 (not an older one: checkpoints 2 and 4 were never rewritten) and
    finished with every step logged once, leaving no partial checkpoint behind. Every checkpoint
    was reported to Ray (as a pointer into the run directory)."""
    run_dir, marker, _ = ray_run
    assert marker.exists(), "the worker never failed: nothing was tested"
    assert checkpoint_entries(run_dir) == [ckpt.checkpoint_dir_name(s) for s in range(EVERY, STEPS + 1, EVERY)]
    crashed_at = marker.stat().st_mtime
    saved = {s: ckpt.load_checkpoint(run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(s)).meta["saved_unix"]
             for s in range(EVERY, STEPS + 1, EVERY)}
    assert saved[2] < saved[4] <= crashed_at < saved[6] < saved[8]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))
    final = ckpt.load_checkpoint(ckpt.find_latest(run_dir))
    assert final.meta["loader"] is None and final.meta["phase"] == 1
    pointers = sorted((run_dir / "ray" / "latentforge").glob("checkpoint_*/latentforge_checkpoint.json"))
    steps = [json.loads(p.read_text())["step"] for p in pointers]
    assert steps == list(range(EVERY, STEPS + 1, EVERY))


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
    # with an online encoder actor beside each worker: 4 processes share 1.75 cores
    assert resources_per_worker(RayConfig(num_workers=2), {"CPU": 2.0}, actors_per_worker=1) == {"CPU": 0.4375}
    cluster = resources_per_worker(RayConfig(address="auto", num_workers=8), {"CPU": 64.0, "GPU": 8.0})
    assert cluster == {"CPU": 1.0, "GPU": 1.0}
    assert resources_per_worker(RayConfig(address="auto", gpus_per_worker=0), {"GPU": 8.0}) == {"CPU": 1.0}


# ------------------------------------------------------------------------------- encoding


def _latent_rows(root: Path) -> list[dict[str, Any]]:
    index = read_index(str(root))
    return [{k: decode_value(v, index.columns[k]) for k, v in r.items()}
            for s in index.shards for r in read_shard(str(root / s.name)).to_pylist()]


@pytest.mark.slow  # the default suite keeps under 15 minutes; this test took 12-49 s on a quiet machine
def test_ray_data_encode_equals_the_local_encode_and_resumes_per_shard(latent_data, tmp_path, ray_instance):
    """3 raw shards with one undecodable image, 2 encoder actors with batches that cross shard
    boundaries: the same shards, samples, order, rejects and index meta as ``encode_dataset``,
    values equal up to float16 rounding. A rerun re-encodes only the shard whose record is gone."""
    raw = make_raw_dataset(tmp_path / "raw", n=30, resolution=16, num_shards=3, seed=5, bad_images=[4])
    cfg = EncodeConfig(vae=str(latent_data["vae"]), text_encoder=str(latent_data["bert"]), max_length=TEXT_LEN,
                       batch_size=7, device="cpu")
    local, remote = tmp_path / "local", tmp_path / "ray"
    expected = encode_dataset(str(raw), str(local), cfg, progress=False)
    assert encode_on_ray(str(raw), str(remote), cfg, RayConfig(), num_actors=2, progress=False) == expected
    assert expected["rejected"] == {"undecodable_image": 1}

    a, b = read_index(str(local)), read_index(str(remote))
    assert b.meta == a.meta and b.columns == a.columns
    assert [(s.name, s.num_samples) for s in b.shards] == [(s.name, s.num_samples) for s in a.shards]
    for name in (REJECTED, EMPTY_PROMPT, CONFIG_FILE):
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name
    rows_a, rows_b = _latent_rows(local), _latent_rows(remote)
    assert [r["key"] for r in rows_b] == [r["key"] for r in rows_a] and len(rows_a) == 29
    for ra, rb in zip(rows_a, rows_b):
        for k, v in ra.items():
            if isinstance(v, np.ndarray):
                np.testing.assert_allclose(rb[k].astype(np.float32), v.astype(np.float32), rtol=2e-3, atol=2e-3,
                                           err_msg=k)
            else:
                assert rb[k] == v, k

    middle = b.shards[1].name
    before = {s.name: (remote / s.name).stat().st_mtime_ns for s in b.shards}
    (remote / ".progress" / f"{middle}.json").unlink()
    assert encode_on_ray(str(raw), str(remote), cfg, RayConfig(), num_actors=1, progress=False) == expected
    after = {s.name: (remote / s.name).stat().st_mtime_ns for s in b.shards}
    assert [n for n in before if after[n] != before[n]] == [middle]
    assert (remote / INDEX).exists()


def _loader_cfg(data: dict[str, Path], path: Path) -> LoaderConfig:
    return LoaderConfig(datasets=[StreamConfig(path=str(path))], seed=1, caption_dropout=0.3, num_workers=0,
                        shuffle_window_shards=2, cache_dir=str(data["cache"]))


def _online_source(data: dict[str, Path]) -> OnlineSource:
    """The encode settings ``latent_fixtures`` made latent16 with."""
    return OnlineSource(EncodeConfig(vae=str(data["vae"]), text_encoder=str(data["bert"]), max_length=TEXT_LEN,
                                     batch_size=32, device="cpu"), num_actors=1)


def _assert_same_batches(online: list[dict], precomputed: list[dict]) -> None:
    assert len(online) == len(precomputed)
    for x, y in zip(online, precomputed):
        assert sorted(x) == sorted(y)
        for k, v in y.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert x[k].dtype == v.dtype and x[k].shape == v.shape, k
                torch.testing.assert_close(x[k].float(), v.float(), rtol=2e-3, atol=2e-3, msg=k)
            elif isinstance(v, torch.Tensor):
                assert torch.equal(x[k], v), k
            else:
                assert x[k] == v, k


def test_online_encoded_batches_equal_precomputed_ones_and_resume(latent_data, ray_instance):
    """raw16 encoded by a Ray actor during loading vs latent16 (its offline encode): the same
    batches (positions, keys, dropped captions, latents, text states), also after resuming from a
    cursor saved mid-stream."""
    source = _online_source(latent_data)
    online = source.build_loader(_loader_cfg(latent_data, latent_data["raw16"]), 4)
    pre = build_loader(_loader_cfg(latent_data, latent_data["latent16"]), 4)
    first = list(itertools.islice(iter(online), 3))
    _assert_same_batches(first, list(itertools.islice(iter(pre), 3)))
    assert sum(sum(b["_caption_dropped"]) for b in first) > 0, "no caption dropped: the empty prompt is untested"
    state = online.state_dict()
    assert state["cursor"] == 12 == pre.cursor
    online.close()

    resumed = source.build_loader(_loader_cfg(latent_data, latent_data["raw16"]), 4)
    resumed.load_state_dict(state)
    _assert_same_batches(list(itertools.islice(iter(resumed), 3)), list(itertools.islice(iter(pre), 3)))
    resumed.close()
    pre.close()


def test_training_on_online_encoded_raw_shards_equals_precomputed(latent_data, plain_run, tmp_path, ray_instance):
    """The same run on raw16 with online encoding: every step's loss and grad norm as on latent16."""
    cfg = run_config(latent_data, f"train.phases.0.datasets.0.path={latent_data['raw16']}")
    run_dir = tmp_path / "online"
    assert train(cfg, run_dir, progress=False, source=_online_source(latent_data))["step"] == STEPS
    a, b = metrics(plain_run), metrics(run_dir)
    assert [r["samples_seen"] for r in b] == [r["samples_seen"] for r in a]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4), ra["step"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3), ra["step"]
    saved = json.loads((run_dir / DATA_META).read_text())
    assert saved == json.loads((plain_run / DATA_META).read_text())


def test_a_checkpoint_uploaded_to_s3_is_restored_into_a_run_dir_that_lacks_it(plain_run, tmp_path, monkeypatch):
    """The restore half of ``--storage s3://``: Ray's newest checkpoint (here uploaded to a local
    S3 server the way Ray's default upload does, with pyarrow) is newer than the run directory's,
    so it is downloaded into RUN_DIR/checkpoints whole; one that is not newer is left alone."""
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from latentforge.distributed.ray_launch import _restore_uploaded
    from s3_server import new_bucket, start_moto, use_endpoint

    url, stop = start_moto()
    try:
        use_endpoint(url, monkeypatch)
        bucket = new_bucket()
        fs = pafs.S3FileSystem(endpoint_override=url, access_key="testing", secret_key="testing",
                               region="us-east-1", scheme="http")
        newest = ckpt.find_latest(plain_run)
        remote = f"{bucket}/ray/latentforge/checkpoint_0001"
        pafs.copy_files(str(newest), remote, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)

        class FakeTrain:  # ray.train's get_checkpoint() as a restarted worker sees it
            @staticmethod
            def get_checkpoint():
                return Checkpoint(remote, filesystem=fs)

        run_dir = tmp_path / "run"
        shutil.copytree(plain_run / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(EVERY),
                        run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(EVERY))
        _restore_uploaded(FakeTrain, run_dir)
        restored = ckpt.find_latest(run_dir)
        assert restored.name == newest.name
        a, b = ckpt.load_checkpoint(restored), ckpt.load_checkpoint(newest)  # sha256 of every file checked
        assert a.meta == b.meta and all(torch.equal(a.tensors["model"][k], v) for k, v in b.tensors["model"].items())
        assert checkpoint_entries(run_dir) == [ckpt.checkpoint_dir_name(EVERY), newest.name]

        before = restored.stat().st_mtime_ns
        _restore_uploaded(FakeTrain, run_dir)  # not newer than the run directory's: nothing happens
        assert restored.stat().st_mtime_ns == before
    finally:
        stop()


def test_ray_flags_without_ray_are_refused(tmp_path, capsys):
    assert cli_main(["train", str(tmp_path / "run"), "--recipe", "tiny-cpu", "--num-workers", "2"]) == 2
    assert "train: --num-workers is only used with --ray or --online-encode" in capsys.readouterr().err
    assert cli_main(["encode", str(tmp_path / "raw"), "--out", str(tmp_path / "out"), "--num-actors", "2"]) == 2
    assert "encode: --num-actors is only used with --ray" in capsys.readouterr().err


@pytest.mark.slow  # the default suite keeps under 15 minutes; this test took 12-49 s on a quiet machine
def test_a_signal_to_the_driver_stops_the_workers_with_a_checkpoint(latent_data, tmp_path, ray_instance):
    """SIGTERM to the ``train --ray`` driver (sent once checkpoint 2 of 40 steps exists): the driver
    creates STOP_REQUEST, both workers stop after the same step with a complete checkpoint, and
    the command exits 75 with the step saved; the request file is removed."""
    import signal
    import threading
    import time

    from latentforge.distributed.ray_launch import STOP_FILE
    from latentforge.interrupt import EXIT_INTERRUPTED

    steps = 40
    run_dir, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    cfg = to_dict(run_config(latent_data, f"train.phases.0.steps={steps}"))
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    second = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(2)

    def signal_after_checkpoint_2() -> None:
        deadline = time.monotonic() + 300
        while not second.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, where the driver waits

    threading.Thread(target=signal_after_checkpoint_2, daemon=True).start()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["train", str(run_dir), "--recipe", str(recipe), "--ray", "--num-workers", "2", "--quiet"])
    assert code == EXIT_INTERRUPTED, out.getvalue()
    last = ckpt.load_checkpoint(ckpt.find_latest(run_dir))
    assert 2 <= last.step < steps and last.meta["world_size"] == 2
    assert out.getvalue().strip().splitlines()[-1].startswith(f"train: interrupted by SIGTERM: saved step {last.step}")
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, last.step + 1))
    assert not (run_dir / STOP_FILE).exists()


@pytest.mark.slow  # Ray Data start-up and two encodes; run with -m slow
def test_a_signal_stops_encode_on_ray_between_batches_and_the_rerun_finishes_it(latent_data, tmp_path,
                                                                                ray_instance, monkeypatch):
    """SIGTERM to ``encode --ray`` right after its first shard is written: the command exits 75 and
    says so, the first shard is kept and its successor (in progress) is not; the rerun encodes only
    the rest and gives the summary and shard list of an uninterrupted local encode."""
    import signal

    from latentforge.distributed import ray_data
    from latentforge.interrupt import EXIT_INTERRUPTED

    raw = make_raw_dataset(tmp_path / "raw", n=48, resolution=16, num_shards=8, seed=3)
    cfg = EncodeConfig(vae=str(latent_data["vae"]), text_encoder=str(latent_data["bert"]), max_length=TEXT_LEN,
                       batch_size=3, device="cpu")
    expected = encode_dataset(str(raw), str(tmp_path / "local"), cfg, progress=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"encode": to_dict(cfg)}))
    out_dir = tmp_path / "ray"
    argv = ["encode", str(raw), "--out", str(out_dir), "--recipe", str(recipe), "--ray", "--quiet"]
    closed: list[str] = []
    real_close = ray_data._ShardSink.close

    def close_then_signal(self):
        record = real_close(self)
        closed.append(self.name)
        if len(closed) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler; the loop stops after this batch
        return record

    monkeypatch.setattr(ray_data._ShardSink, "close", close_then_signal)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(argv)
    assert code == EXIT_INTERRUPTED, out.getvalue()
    assert out.getvalue().strip().splitlines()[-1].startswith("encode: interrupted by SIGTERM: the finished shards")
    names = [s.name for s in read_index(str(raw)).shards]
    # The batch that finished the first shard may also hold whole later shards: they are kept too.
    assert 1 <= len(closed) < len(names) and closed == names[:len(closed)] and not (out_dir / INDEX).exists()
    assert all((out_dir / n).exists() for n in closed) and not (out_dir / names[len(closed)]).exists()
    kept = {n: (out_dir / n).stat().st_mtime_ns for n in closed}

    monkeypatch.setattr(ray_data._ShardSink, "close", real_close)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(argv) == 0
    assert json.loads((out_dir / "summary.json").read_text()) == expected
    assert [s.name for s in read_index(str(out_dir)).shards] == names
    assert {n: (out_dir / n).stat().st_mtime_ns for n in closed} == kept
