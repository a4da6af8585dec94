"""Read speed and shuffle spread of the training loader on a synthetic latent dataset.

Writes ``--samples`` samples (latents 4x32x32 fp16 mean and std, text_hidden 77x384 fp16,
text_mask) into a temporary directory, then prints samples/s with 0 and 2 workers, cold (the
shards are converted into the cache on the way) and warm (cache filled), and the shuffle spread:
distinct 1000-sample-id blocks per batch of 64 (uniformly random batches: about 19.3 for 20k).
Figures only; nothing is asserted.

    python bench/bench_loader.py [--samples 20000] [--shards 64] [--batches 150]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import safetensors.numpy

from latentforge.data import order, schema
from latentforge.data.loader import EMPTY_PROMPT, LoaderConfig, StreamConfig, build_loader


def write_dataset(root: Path, num_samples: int, num_shards: int, text_len: int, text_dim: int) -> schema.DatasetIndex:
    latent = (4, 32, 32)
    columns = {
        "key": "str",
        "caption": "str",
        "latent_mean": schema.ndarray_type(np.float16, latent),
        "latent_std": schema.ndarray_type(np.float16, latent),
        "text_hidden": schema.ndarray_type(np.float16, (text_len, text_dim)),
        "text_mask": schema.ndarray_type(np.uint8, (text_len,)),
    }
    rng = np.random.default_rng(0)
    bounds = np.linspace(0, num_samples, num_shards + 1).astype(int)
    shards = []
    for s in range(num_shards):
        ids = range(bounds[s], bounds[s + 1])
        n = len(ids)

        def fixed(shape, dtype):  # n arrays as one binary column, written without a Python loop per value
            data = rng.standard_normal((n, *shape), dtype=np.float32).astype(dtype)
            width = int(np.prod(shape)) * np.dtype(dtype).itemsize
            offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
            return pa.Array.from_buffers(pa.binary(), n, [None, offsets.buffers()[1], pa.py_buffer(data.tobytes())])

        table = pa.table({
            "key": pa.array([f"{i:08d}" for i in ids]),
            "caption": pa.array([f"synthetic caption number {i}" for i in ids]),
            "latent_mean": fixed(latent, np.float16),
            "latent_std": fixed(latent, np.float16),
            "text_hidden": fixed((text_len, text_dim), np.float16),
            "text_mask": fixed((text_len,), np.uint8),
        })
        shards.append(schema.write_table(root / f"shard-{s:06d}.parquet", table))
    index = schema.DatasetIndex("latent", columns, shards)
    schema.write_index(root, index)
    empty = {"text_hidden": np.zeros((text_len, text_dim), np.float16), "text_mask": np.zeros(text_len, np.uint8)}
    (root / EMPTY_PROMPT).write_bytes(safetensors.numpy.save(empty))
    return index


def read(cfg: LoaderConfig, batch_size: int, num_batches: int) -> tuple[float, np.ndarray]:
    """(samples/s, sample ids in read order); the clock starts after the first batch (worker start-up)."""
    loader = build_loader(cfg, batch_size)
    batches = iter(loader)
    ids = [int(k) for k in next(batches)["key"]]
    start = time.perf_counter()
    for b in itertools.islice(batches, num_batches - 1):
        ids += [int(k) for k in b["key"]]
    rate = (num_batches - 1) * batch_size / (time.perf_counter() - start)
    loader.close()
    return rate, np.asarray(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--text-len", type=int, default=77)
    ap.add_argument("--text-dim", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--batches", type=int, default=150, help="batches timed per run")
    ap.add_argument("--window", type=int, default=16, help="shuffle_window_shards of the timed runs")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        root = Path(tmp, "data")
        t = time.perf_counter()
        index = write_dataset(root, args.samples, args.shards, args.text_len, args.text_dim)
        total = sum(s.num_bytes for s in index.shards)
        print(f"dataset: {args.samples} samples in {args.shards} shards, {total / 1e6:.0f} MB "
              f"({total / args.samples / 1e3:.1f} kB/sample), written in {time.perf_counter() - t:.1f} s")

        for workers in (0, 2):
            cache = Path(tmp, f"cache-{workers}")
            cfg = LoaderConfig(datasets=[StreamConfig(str(root))], cache_dir=str(cache), num_workers=workers,
                               shuffle_window_shards=args.window, caption_dropout=0.1)
            cold, _ = read(cfg, args.batch_size, args.batches)
            warm, ids = read(cfg, args.batch_size, args.batches)
            print(f"workers={workers}: {cold:8.0f} samples/s cold (converting shards into the cache), "
                  f"{warm:8.0f} samples/s warm;  shuffle spread {order.shuffle_spread(ids, 64):.1f}")

        print(f"shuffle spread (distinct 1000-id blocks per batch of 64) over one epoch, {args.shards} shards:")
        uniform = order.shuffle_spread(np.random.default_rng(0).permutation(args.samples))
        print(f"  uniformly random: {uniform:.1f}")
        sizes = [s.num_samples for s in index.shards]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        for window in sorted({1, 4, args.window, args.shards}):
            loc = order.StreamOrder(sizes, seed=0, window_shards=window).sample_at(np.arange(args.samples))
            spread = order.shuffle_spread(starts[loc.shard] + loc.row)
            per_window = window * args.samples // args.shards
            print(f"  shuffle_window_shards={window:3d} ({per_window} samples/window): {spread:.1f}")


if __name__ == "__main__":
    main()
