"""The training loader on tiny real shard datasets: exact resume, ranks, mixing, dropout, S3 cache."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

import latentforge
from latentforge import storage
from latentforge.data import schema
from latentforge.data.loader import (
    EMPTY_PROMPT,
    LoaderConfig,
    ShardCache,
    StreamConfig,
    build_loader,
    open_dataset,
    worker_init,
)
from latentforge.errors import ConfigError, UserError
from latentforge.interrupt import InterruptConfig, StopOnSignal, caught_signals
from s3_server import new_bucket, start_moto, use_endpoint

LATENT_COLUMNS = {
    "key": "str",
    "caption": "str",
    "latent_mean": "ndarray:float16:4,4,4",
    "text_hidden": "ndarray:float16:8,16",
    "text_mask": "ndarray:uint8:8",
}


def write_latent_dataset(root: Path, prefix: str, num_shards: int = 16, per_shard: int = 125,
                         columns: dict[str, str] = LATENT_COLUMNS) -> Path:
    """Sample i of the dataset holds i in its tensors, so a batch can be checked against its keys."""
    shards = []
    i = 0
    for s in range(num_shards):
        rows = []
        for _ in range(per_shard):
            rows.append({"key": f"{prefix}{i}", "caption": f"a photo number {i}",
                         "latent_mean": np.full((4, 4, 4), i % 2048, np.float16),
                         "text_hidden": np.full((8, 16), i % 2048, np.float16),
                         "text_mask": np.ones(8, np.uint8), "extra": i})
            i += 1
        shards.append(schema.write_shard(root / f"shard-{s:06d}.parquet", rows, columns, row_group_size=50))
    schema.write_index(root, schema.DatasetIndex("latent", columns, shards))
    empty = {"text_hidden": np.full((8, 16), -1, np.float16), "text_mask": np.zeros(8, np.uint8)}
    (root / EMPTY_PROMPT).write_bytes(safetensors.numpy.save(empty))
    return root


@pytest.fixture(scope="module")
def latent_ds(tmp_path_factory) -> Path:
    return write_latent_dataset(tmp_path_factory.mktemp("latent"), "a")


@pytest.fixture(scope="module")
def small_ds(tmp_path_factory) -> Path:
    return write_latent_dataset(tmp_path_factory.mktemp("small"), "b", num_shards=5, per_shard=40)


def config(tmp_path: Path, *roots: Path, weights=None, **kw) -> LoaderConfig:
    weights = weights or [1.0] * len(roots)
    kw.setdefault("num_workers", 0)
    kw.setdefault("shuffle_window_shards", 4)
    return LoaderConfig(datasets=[StreamConfig(str(r), w) for r, w in zip(roots, weights)],
                        cache_dir=str(tmp_path / "cache"), **kw)


def take(loader, n: int) -> list[dict]:
    return list(itertools.islice(iter(loader), n))


def keys_of(batches) -> list[str]:
    return [k for b in batches for k in b["key"]]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def test_batches_hold_the_rows_of_their_keys(tmp_path, latent_ds):
    loader = build_loader(config(tmp_path, latent_ds), micro_batch_size=16)
    batches = take(loader, 130)  # 2080 samples: the whole epoch and the head of the next
    b = batches[0]
    assert b["latent_mean"].shape == (16, 4, 4, 4) and b["latent_mean"].dtype == torch.float16
    assert b["text_mask"].dtype == torch.uint8 and b["_position"].tolist() == list(range(16))
    for b in batches:
        ids = torch.tensor([int(k[1:]) for k in b["key"]], dtype=torch.float16)
        assert torch.equal(b["latent_mean"][:, 0, 0, 0], ids)
        assert torch.equal(b["text_hidden"][:, 3, 5], ids)
        assert b["caption"] == [f"a photo number {k[1:]}" for k in b["key"]]
    keys = keys_of(batches)
    assert sorted(keys[:2000]) == sorted(f"a{i}" for i in range(2000))  # one epoch: each sample once
    assert loader.cursor == 130 * 16 and loader.samples_per_epoch == 2000
    loader.close()


@pytest.mark.parametrize("workers_before,workers_after", [(2, 0), (0, 2)])
def test_resume_with_another_worker_count_is_exact(tmp_path, latent_ds, workers_before, workers_after):
    full = take(build_loader(config(tmp_path, latent_ds, caption_dropout=0.2), 24), 90)  # crosses an epoch

    first = build_loader(config(tmp_path, latent_ds, caption_dropout=0.2, num_workers=workers_before), 24)
    head = take(first, 37)
    state = first.state_dict()
    first.close()
    assert state["cursor"] == 37 * 24

    resumed = build_loader(config(tmp_path, latent_ds, caption_dropout=0.2, num_workers=workers_after), 24)
    resumed.load_state_dict(state)
    tail = take(resumed, 90 - 37)
    resumed.close()
    assert_same_batches(head + tail, full)


def test_two_ranks_read_the_epoch_exactly_once(tmp_path, latent_ds):
    ranks = [build_loader(config(tmp_path, latent_ds, num_workers=1), 25, rank=r, world_size=2) for r in range(2)]
    per_rank = [keys_of(take(r, 40)) for r in ranks]  # 2 x 40 x 25 = 2000
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(f"a{i}" for i in range(2000))
    for r in ranks:
        r.close()


def test_a_worker_outlives_a_stop_signal_sent_to_the_whole_process_group(tmp_path, latent_ds, capfd):
    """Ctrl-C, ``timeout`` and ``kill -- -PGID`` signal the data workers too. torch's workers died on
    SIGTERM, and the dead worker raised "DataLoader worker ... is killed by signal" in the middle of the
    parent's step: the demo stopped so in its VAE stage exited 1 with a traceback and no checkpoint. Under
    a StopOnSignal the workers ignore the signals it catches when another process sends them, and print
    nothing (a forked worker printed the stop message a second time); the parent alone decides when to
    stop, and reads on until then. SIGTERM from the parent still ends a worker, as torch's handler does."""
    assert caught_signals() == () and worker_init(0) is None
    loader = build_loader(config(tmp_path, latent_ds, num_workers=1), 25)
    before = set(multiprocessing.active_children())
    with StopOnSignal(InterruptConfig(), what="reader") as stop:
        assert set(caught_signals()) == {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}
        assert pickle.loads(pickle.dumps(worker_init(1))).args == (caught_signals(),)  # for "spawn" too
        batches = iter(loader)
        first = next(batches)
        workers = [w for w in multiprocessing.active_children() if w not in before]
        assert len(workers) == 1
        for name in ("TERM", "INT", "USR1"):  # from another process, as a signal to the group comes
            subprocess.run(["kill", f"-{name}", str(workers[0].pid)], check=True)
        workers[0].join(timeout=3)  # returns at once if the worker died
        assert workers[0].is_alive() and not stop.requested
        rest = [next(batches) for _ in range(8)]
        workers[0].terminate()  # SIGTERM from the parent (torch's shutdown of a worker) still ends it
        workers[0].join(timeout=30)
        assert workers[0].exitcode == 0
    loader.close()
    assert keys_of([first, *rest]) == keys_of(take(build_loader(config(tmp_path, latent_ds), 25), 9))
    assert "received" not in capfd.readouterr().err


def test_a_crash_with_a_loader_open_exits_and_does_not_wait_for_its_worker(tmp_path, latent_ds):
    """After a crash the traceback holds the loader open, and at exit Python's multiprocessing sends
    SIGTERM to the workers left and waits for them: workers that ignored every SIGTERM (the first
    version of the fix above) hung the crashed command for ever instead of letting it exit 1."""
    code = (f"from latentforge.data.loader import LoaderConfig, StreamConfig, build_loader\n"
            f"from latentforge.interrupt import StopOnSignal\n"
            f"loader = build_loader(LoaderConfig(datasets=[StreamConfig({str(latent_ds)!r})], "
            f"cache_dir={str(tmp_path / 'cache')!r}, num_workers=1), 25)\n"
            f"with StopOnSignal():\n"
            f"    batches = iter(loader)\n"
            f"    next(batches)\n"
            f"    raise RuntimeError('a crash in the step')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(latentforge.__file__).parents[1])}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip().endswith("RuntimeError: a crash in the step"), p.stderr[-2000:]


@pytest.mark.parametrize("old,new", [((1, 30), (3, 10)), ((2, 12), (3, 7)), ((4, 5), (1, 16))])
def test_resume_with_another_world_size_continues_the_global_sequence(tmp_path, latent_ds, old, new):
    (w0, m0), (w1, m1) = old, new
    reference = keys_of(take(build_loader(config(tmp_path, latent_ds), 50), 60))  # positions 0..2999

    before = [build_loader(config(tmp_path, latent_ds), m0, r, w0) for r in range(w0)]
    read: dict[int, str] = {}
    for loader in before:
        for b in take(loader, 11):
            read.update(zip(b["_position"].tolist(), b["key"]))
    state = before[0].state_dict()
    assert all(loader.state_dict() == state for loader in before)

    after = [build_loader(config(tmp_path, latent_ds), m1, r, w1) for r in range(w1)]
    n = (3000 - state["cursor"]) // (w1 * m1)
    for loader in after:
        loader.load_state_dict(state)
        for b in take(loader, n):
            positions = b["_position"].tolist()
            assert not set(positions) & set(read)  # nothing read twice
            read.update(zip(positions, b["key"]))
    end = state["cursor"] + n * w1 * m1
    assert sorted(read) == list(range(end))  # nothing skipped
    assert [read[p] for p in range(end)] == reference[:end]


def test_caption_dropout(tmp_path, latent_ds):
    batches = take(build_loader(config(tmp_path, latent_ds, caption_dropout=0.25), 50), 40)
    dropped = torch.cat([b["_caption_dropped"] for b in batches])
    assert abs(dropped.float().mean().item() - 0.25) < 0.04
    for b in batches:
        for i, d in enumerate(b["_caption_dropped"].tolist()):
            if d:
                assert b["caption"][i] == ""
                assert torch.all(b["text_hidden"][i] == -1) and torch.all(b["text_mask"][i] == 0)
            else:
                assert b["caption"][i].startswith("a photo number")
                assert torch.all(b["text_mask"][i] == 1)
            assert b["latent_mean"][i, 0, 0, 0].item() == int(b["key"][i][1:])  # latents untouched
    again = take(build_loader(config(tmp_path, latent_ds, caption_dropout=0.25), 50), 40)
    assert torch.equal(dropped, torch.cat([b["_caption_dropped"] for b in again]))


def test_dropout_needs_the_empty_prompt(tmp_path):
    root = write_latent_dataset(tmp_path / "ds", "c", num_shards=2, per_shard=10)
    (root / EMPTY_PROMPT).unlink()
    with pytest.raises(ConfigError, match="caption_dropout: needs .*empty_prompt"):
        open_dataset(config(tmp_path, root, caption_dropout=0.1))
    open_dataset(config(tmp_path, root))  # fine without dropout


def test_raw_dataset_values_and_dropout(tmp_path):
    rows = [{"key": f"r{i}", "image": bytes([i, 255, 0]) * 5, "image_format": "png", "caption": f"cap {i}",
             "width": 32 + i, "height": 16, "orig_width": 64, "orig_height": 32, "source": "/x", "license": "",
             "sha256": "0" * 64, "meta": {"url": f"http://x/{i}", "score": i / 10}} for i in range(60)]
    root = tmp_path / "raw"
    shards = [schema.write_shard(root / f"shard-{s:06d}.parquet", rows[s * 20:(s + 1) * 20], schema.RAW_COLUMNS)
              for s in range(3)]
    schema.write_index(root, schema.DatasetIndex("raw", dict(schema.RAW_COLUMNS), shards))
    batches = take(build_loader(config(tmp_path, root, caption_dropout=0.3), 20), 3)
    for b in batches:
        assert isinstance(b["image"][0], bytes) and isinstance(b["meta"][0], dict)
        assert b["width"].dtype == torch.int64
        for i, key in enumerate(b["key"]):
            n = int(key[1:])
            assert b["image"][i] == bytes([n, 255, 0]) * 5
            assert b["width"][i].item() == 32 + n and b["meta"][i] == {"url": f"http://x/{n}", "score": n / 10}
            assert b["caption"][i] == ("" if b["_caption_dropped"][i] else f"cap {n}")
    dropped = torch.cat([b["_caption_dropped"] for b in batches])
    assert 0 < dropped.sum() < 60


def test_mixture_proportions_and_resume(tmp_path, latent_ds, small_ds):
    cfg = dict(weights=[3.0, 1.0], mix_block=100, num_workers=2)
    full = take(build_loader(config(tmp_path, latent_ds, small_ds, **cfg), 20), 40)  # 800 positions
    ds = torch.cat([b["_dataset"] for b in full])
    for block in ds.split(100):
        assert block.bincount().tolist() == [75, 25]
    small = [k for k in keys_of(full) if k.startswith("b")]
    assert len(small) == 200 and sorted(small) == sorted(f"b{i}" for i in range(200))  # one epoch of it

    first = build_loader(config(tmp_path, latent_ds, small_ds, **cfg), 20)
    head = take(first, 13)
    rest = build_loader(config(tmp_path, latent_ds, small_ds, **(cfg | {"num_workers": 0})), 20)
    rest.load_state_dict(first.state_dict())
    first.close()
    assert_same_batches(head + take(rest, 27), full)


def test_refuses_datasets_with_different_columns(tmp_path, latent_ds):
    other = write_latent_dataset(tmp_path / "other", "d", 2, 10, columns={**LATENT_COLUMNS, "extra": "int64"})
    with pytest.raises(UserError, match="cannot be mixed"):
        open_dataset(config(tmp_path, latent_ds, other))


def test_state_from_another_data_config_is_refused(tmp_path, latent_ds, small_ds):
    loader = build_loader(config(tmp_path, latent_ds), 10)
    take(loader, 2)
    state = loader.state_dict()
    with pytest.raises(UserError, match="shuffle_window_shards: 4 -> 8"):
        build_loader(config(tmp_path, latent_ds, shuffle_window_shards=8), 10).load_state_dict(state)
    with pytest.raises(UserError, match="seed 0 in the checkpoint, 5 in the config"):
        build_loader(config(tmp_path, latent_ds, seed=5), 10).load_state_dict(state)
    with pytest.raises(UserError, match=r"datasets\[0\].content"):
        build_loader(config(tmp_path, small_ds), 10).load_state_dict(state)
    moved = build_loader(config(tmp_path, latent_ds, num_workers=2, caption_dropout=0.5), 7, 1, 3)
    moved.load_state_dict(state)  # workers, dropout, ranks and batch size may change
    assert moved.cursor == 20


def test_config_validation(tmp_path, latent_ds):
    LoaderConfig().validate()  # recipes may leave the datasets to the command
    with pytest.raises(ConfigError, match="datasets: empty"):
        open_dataset(LoaderConfig())
    with pytest.raises(ConfigError, match=r"datasets\[1\].weight: must be > 0"):
        config(tmp_path, latent_ds, latent_ds, weights=[1.0, 0.0]).validate()
    with pytest.raises(ConfigError, match=r"caption_dropout: must be in \[0, 1\)"):
        config(tmp_path, latent_ds, caption_dropout=1.0).validate()
    with pytest.raises(ConfigError, match="mix_block: a block of 10 positions gives datasets"):
        open_dataset(config(tmp_path, latent_ds, latent_ds, weights=[100.0, 1.0], mix_block=10))
    with pytest.raises(ConfigError, match="cache_limit_gb: .* two shuffle windows"):
        open_dataset(config(tmp_path, latent_ds, cache_limit_gb=0.0001))


def test_dataset_pickles_for_spawned_workers(tmp_path, latent_ds):
    dataset = open_dataset(config(tmp_path, latent_ds))
    before = dataset[1234]
    copy = pickle.loads(pickle.dumps(dataset))
    after = copy[1234]
    assert before["key"] == after["key"] and torch.equal(before["latent_mean"], after["latent_mean"])


def test_eviction_keeps_shards_in_use_and_cleans_dead_conversions(tmp_path, latent_ds):
    index = schema.read_index(str(latent_ds))
    shard_bytes = max(s.num_bytes for s in index.shards)
    cache = ShardCache(tmp_path / "cache", 3 * shard_bytes, [str(latent_ds)], [index])
    reader = cache.reader(0, 0, tag=0)  # open: holds the shared lock
    (tmp_path / "cache" / f".reserve-999999999-1-x-{10 * shard_bytes}").touch()  # of a dead process
    for s in range(1, 8):
        cache.fetch(0, s, prefetch=False)
        assert cache.usage_bytes() <= 3 * shard_bytes
    assert cache.path(0, 0).exists() and reader.table.column("key")[3].as_py() == "a3"
    assert not list((tmp_path / "cache").glob(".reserve-*"))
    reader.close()
    # a prefetch never exceeds the limit: with everything protected it declines
    protect = frozenset(p.stem for p in (tmp_path / "cache").glob("*.arrow"))
    assert not cache.fetch(0, 9, prefetch=True, protect=protect)


def test_prefetch_converts_the_current_and_next_window(tmp_path, latent_ds):
    loader = build_loader(config(tmp_path, latent_ds, shuffle_window_shards=4), 10)
    stream = loader.dataset.streams[0]
    cursor = 2000 + 600  # epoch 1, inside window 1 (500 samples per window)
    loader._prefetcher._cursor = cursor
    loader._prefetcher.run_once()
    cached = {p.stem for p in (tmp_path / "cache").glob("*.arrow")}
    expected = {loader.dataset.cache.key(0, int(s))
                for w in (1, 2) for s in stream.window_shard_ids(1, w)}
    assert cached == expected
    assert stream.sample_at(cursor).window[0] == 1


# --- S3 through a real local endpoint -------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint():
    url, stop = start_moto()
    yield url
    stop()


def test_s3_streams_through_a_bounded_cache(tmp_path, monkeypatch, moto_endpoint, latent_ds):
    use_endpoint(moto_endpoint, monkeypatch)
    bucket = new_bucket()
    client = storage.s3_client()
    for f in sorted(os.listdir(latent_ds)):
        client.upload_file(str(latent_ds / f), bucket, f"ds/{f}")
    index = schema.read_index(str(latent_ds))
    shard_bytes = max(s.num_bytes for s in index.shards)
    window = 2
    limit = (2 * window + 2) * shard_bytes * 1.05  # 6.3 of 16 shards
    cfg = LoaderConfig(datasets=[StreamConfig(f"s3://{bucket}/ds")], cache_dir=str(tmp_path / "cache"),
                       cache_limit_gb=limit / 1e9, shuffle_window_shards=window, num_workers=1)

    peak = [0]
    stop = threading.Event()

    def watch():  # every file in the cache dir, temporary ones included
        while not stop.is_set():
            total = 0
            for e in os.scandir(tmp_path / "cache"):
                try:
                    total += e.stat().st_size
                except FileNotFoundError:
                    pass
            peak[0] = max(peak[0], total)

    (tmp_path / "cache").mkdir()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        loader = build_loader(cfg, 40)
        got = take(loader, 75)  # 1.5 epochs
        loader.close()
    finally:
        stop.set()
        watcher.join()
    local = take(build_loader(config(tmp_path / "local", latent_ds, shuffle_window_shards=window), 40), 75)
    assert_same_batches(got, local)
    assert 0 < peak[0] <= limit + shard_bytes
    assert len(list((tmp_path / "cache").glob("*.arrow"))) < 16  # it really evicted
