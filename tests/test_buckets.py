"""Aspect-ratio buckets: the round schedule (pure, at fake scale), the bucketed encode, the
bucket-aware loader (one shape per batch, exact resume, leftovers counted) and fine-tuning on it."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from latentforge.cli import main
from latentforge.data.buckets import BucketSchedule, build_bucket_loader, read_buckets
from latentforge.data.encode import EncodeConfig, encode_dataset
from latentforge.data.ingest import ingest
from latentforge.data.loader import LoaderConfig, StreamConfig
from latentforge.errors import ConfigError, UserError
from latentforge.recipe import load_recipe
from latentforge.train.trainer import Trainer
from test_finetune import make_tiny_pipeline
from test_trainer import Killed, assert_same_tensors, kill_before_step, load_step, metrics

# (width, height) of the source images: ingest snaps them to 32 px-area buckets of 8 px steps.
SHAPES = {(64, 64): 7, (96, 48): 5, (48, 96): 3}


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the schedule (pure)


def _consumed(schedule: BucketSchedule, num_epochs: int) -> dict[int, list[tuple[int, int]]]:
    """Per bucket, the (start, length) of its rounds in reading order over ``num_epochs`` epochs."""
    out: dict[int, list[tuple[int, int]]] = {b: [] for b in range(len(schedule.sizes))}
    for e in range(num_epochs):
        for b, start, length in zip(*schedule.epoch(e)):
            out[int(b)].append((int(start), int(length)))
    return out


@pytest.mark.parametrize("sizes, round_size", [([1000, 37, 5], 64), ([7, 5, 3], 4), ([3], 4), ([8, 16], 8)])
def test_carry_reads_every_bucket_stream_contiguously(sizes, round_size):
    schedule = BucketSchedule(sizes, round_size, seed=1, leftovers="carry")
    epochs = 7
    for b, rounds in _consumed(schedule, epochs).items():
        n = sizes[b]
        # No gap and no overlap: round k of bucket b reads [k R, (k+1) R) of its endless stream ...
        assert rounds == [(k * round_size, round_size) for k in range(len(rounds))]
        # ... and after each epoch the bucket has read all it could in full rounds; the rest is carried.
        assert len(rounds) == epochs * n // round_size
        carried = epochs * n - len(rounds) * round_size
        assert carried == schedule.leftover_counts(epochs - 1).get(b, 0) < round_size


@pytest.mark.parametrize("sizes, round_size", [([1000, 37, 5], 64), ([7, 5, 3], 4)])
def test_small_batch_reads_each_sample_once_per_epoch(sizes, round_size):
    schedule = BucketSchedule(sizes, round_size, seed=1, leftovers="small_batch")
    for e in range(3):
        for b, rounds in _consumed(BucketSchedule(sizes, round_size, 1, "small_batch"), e + 1).items():
            n = sizes[b]
            per_epoch = -(-n // round_size)  # ceil(n / R)
            mine = rounds[-per_epoch:]  # the rounds of epoch e
            covered = sorted(p for start, length in mine for p in range(start, start + length))
            assert covered == list(range(e * n, (e + 1) * n))
            assert sum(length < round_size for _, length in mine) == (1 if n % round_size else 0)
    assert schedule.leftover_counts(0) == {b: n % round_size for b, n in enumerate(sizes) if n % round_size}


def test_schedule_is_a_function_of_seed_and_epoch_and_resumes_anywhere():
    a = BucketSchedule([50, 20, 9], 4, seed=3, leftovers="carry")
    b = BucketSchedule([50, 20, 9], 4, seed=3, leftovers="carry")
    c = BucketSchedule([50, 20, 9], 4, seed=4, leftovers="carry")
    first = list(itertools.islice(a.rounds(0), 100))
    assert first == list(itertools.islice(b.rounds(0), 100))
    assert first != list(itertools.islice(c.rounds(0), 100))
    for start in (0, 1, 19, 20, 21, 57):
        assert list(itertools.islice(BucketSchedule([50, 20, 9], 4, 3, "carry").rounds(start), 100 - start)) \
            == first[start:]
    buckets_of_epoch0 = [r[1] for r in first if r[0] == 0]
    assert buckets_of_epoch0 != sorted(buckets_of_epoch0)  # shuffled, not bucket by bucket


@pytest.mark.parametrize("leftovers", ["carry", "small_batch"])
def test_samples_before_a_round_sums_the_lengths_of_the_rounds_before_it(leftovers):
    schedule = BucketSchedule([7, 5, 3], 4, seed=1, leftovers=leftovers)
    lengths = [length for _, _, _, length in itertools.islice(schedule.rounds(0), 30)]
    assert [schedule.samples_before(i) for i in range(31)] == [0, *itertools.accumulate(lengths)]


# ------------------------------------------------------------------ encode and load


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("buckets")
    src = root / "images"
    src.mkdir()
    rng = np.random.default_rng(0)
    i = 0
    for (w, h), n in SHAPES.items():
        for _ in range(n):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(src / f"{i:03d}.png")
            (src / f"{i:03d}.txt").write_text("a red circle" if i % 2 else "a big blue square")
            i += 1
    recipe = load_recipe(None, ["ingest.image.resolution=32", "ingest.image.crop=buckets", "ingest.image.bucket_step=8",
                                "ingest.image.format=png", "ingest.num_workers=1"])
    ingest([str(src)], root / "raw", recipe.ingest, progress=False)
    pipe = make_tiny_pipeline(root / "pipes", "sd1")
    cfg = EncodeConfig(vae=str(pipe), text_encoder=str(pipe), max_length=12, batch_size=4, device="cpu")
    summary = encode_dataset(str(root / "raw"), str(root / "latents"), cfg, progress=False)
    assert summary["written"] == sum(SHAPES.values())
    return {"root": root, "pipe": pipe, "latents": root / "latents", "cache": root / "cache"}


def test_bucketed_encode_writes_one_dataset_per_shape(bucketed):
    buckets = read_buckets(str(bucketed["latents"]))
    # 64x64 -> 32x32; 96x48 (aspect 2) -> 40x24, the bucket of at most 32x32 px with 8 px sides and aspect
    # at most 2 that is nearest in aspect; 48x96 -> 24x40.
    assert {(b["width"], b["height"]): b["num_samples"] for b in buckets} == {(32, 32): 7, (40, 24): 5, (24, 40): 3}
    for b in buckets:
        index = json.loads((Path(b["path"]) / "index.json").read_text())
        assert index["columns"]["latent_mean"] == f"ndarray:float16:4,{b['height'] // 2},{b['width'] // 2}"
        assert index["meta"]["bucket"] == [b["width"], b["height"]]


def test_bucketed_encode_refuses_a_foreign_or_plain_output_dir(bucketed, tmp_path):
    """A bucketed encode writes only into an empty directory or its own earlier output: not into an
    unrelated directory, nor into a plain (one-shape) encode's output."""
    cfg = EncodeConfig(vae=str(bucketed["pipe"]), text_encoder=str(bucketed["pipe"]), max_length=12, batch_size=4,
                       device="cpu")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    plain = tmp_path / "plain"
    (plain / ".progress").mkdir(parents=True)
    (plain / ".progress" / "meta.json").write_text("{}")
    for out in (foreign, plain):
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(UserError) as err:
            encode_dataset(str(bucketed["root"] / "raw"), str(out), cfg, progress=False)
        assert str(err.value) == (f"{out}: exists, is not empty and holds no bucketed encode output "
                                  "(no .progress/buckets): use a new or empty directory")
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def _loader(bucketed, micro: int, leftovers: str = "carry", rank: int = 0, world_size: int = 1):
    cfg = LoaderConfig(datasets=[StreamConfig(path=str(bucketed["latents"]))], seed=2, num_workers=0,
                       cache_dir=str(bucketed["cache"]), bucket_leftovers=leftovers)
    return build_bucket_loader(cfg, micro, rank=rank, world_size=world_size)


def test_batches_hold_one_shape_and_resume_exactly(bucketed, caplog):
    loader = _loader(bucketed, micro=2)
    with caplog.at_level(logging.INFO, logger="latentforge.data.buckets"):
        batches = list(itertools.islice(iter(loader), 20))
    assert all(len(b["latent_mean"]) == 2 for b in batches)
    shapes = {tuple(b["latent_mean"].shape[2:]) for b in batches}
    assert shapes == {(16, 16), (12, 20), (20, 12)}
    # Every bucket has an odd size: one sample of each is carried over each epoch, and said so.
    assert "carried into the next epoch" in caplog.text and "32x32 1" in caplog.text
    # Noise seeds: unique per sample across buckets.
    positions = [p for b in batches for p in b["_position"]]
    assert len(set(positions)) == len(positions)

    fresh = _loader(bucketed, micro=2)
    part = list(itertools.islice(iter(fresh), 7))
    state = fresh.state_dict()
    resumed = _loader(bucketed, micro=2)
    resumed.load_state_dict(state)
    rest = list(itertools.islice(iter(resumed), 13))
    for a, b in zip(batches, part + rest):
        assert a["key"] == b["key"] and torch.equal(a["latent_mean"], b["latent_mean"])


def test_two_ranks_read_the_rounds_of_one_rank(bucketed):
    one = list(itertools.islice(iter(_loader(bucketed, micro=4)), 6))
    r0 = list(itertools.islice(iter(_loader(bucketed, micro=2, rank=0, world_size=2)), 6))
    r1 = list(itertools.islice(iter(_loader(bucketed, micro=2, rank=1, world_size=2)), 6))
    for whole, a, b in zip(one, r0, r1):
        assert sorted(whole["key"]) == sorted(a["key"] + b["key"])
        assert a["latent_mean"].shape == b["latent_mean"].shape


def test_small_batch_loader_reads_each_sample_once_and_logs_it(bucketed, caplog):
    loader = _loader(bucketed, micro=2, leftovers="small_batch")
    with caplog.at_level(logging.INFO, logger="latentforge.data.buckets"):
        epoch = list(itertools.islice(iter(loader), 4 + 3 + 2))  # ceil(7/2) + ceil(5/2) + ceil(3/2) rounds
    keys = [k for b in epoch for k in b["key"]]
    assert len(keys) == sum(SHAPES.values()) == len(set(keys))
    assert sorted(len(b["key"]) for b in epoch) == [1, 1, 1] + [2] * 6
    assert "read as a smaller batch" in caplog.text
    with pytest.raises(ConfigError, match="small_batch"):
        _loader(bucketed, micro=2, leftovers="small_batch", world_size=2)


def _finetune_args(bucketed, run_dir: Path, *more: str, phase_steps: tuple[int, ...] = (6,)) -> list[str]:
    phases = ", ".join(f"{{datasets: [{{path: '{bucketed['latents']}'}}], steps: {n}}}" for n in phase_steps)
    return ["finetune", str(run_dir), "--from", str(bucketed["pipe"]), "--quiet", f"train.phases=[{phases}]",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.device=cpu", "train.loggers=[]",
            "train.log_every=1", "train.checkpoint.every_steps=3", "train.checkpoint.keep_last=5",
            "train.lora={rank: 2}", "train.optim.lr=1e-2", "loader.num_workers=0",
            f"loader.cache_dir={bucketed['cache']}", *more]


def test_finetune_on_buckets_resumes_exactly(bucketed, tmp_path, monkeypatch):
    def args(run_dir: Path, *more: str) -> list[str]:
        return _finetune_args(bucketed, run_dir, *more)

    straight = tmp_path / "straight"
    assert main(args(straight)) == 0
    resumed = tmp_path / "resumed"
    with monkeypatch.context() as m:
        kill_before_step(m, 5)
        with pytest.raises(Killed):
            main(args(resumed))
    assert main(args(resumed)) == 0
    assert metrics(resumed) == metrics(straight)
    assert_same_tensors(load_step(straight, 6), load_step(resumed, 6))
    # small_batch cannot be split into the 2 accumulation steps of this run
    assert main(args(tmp_path / "bad", "loader.bucket_leftovers=small_batch")) == 2


def test_a_second_phase_on_the_same_buckets_reads_the_rounds_after_the_first(bucketed, tmp_path, monkeypatch):
    """Two phases of 2 and 4 steps over one bucketed dataset read the batches, and so train the
    steps, of one phase of 6: the second phase does not replay the first one's rounds."""
    seen: list[list[int]] = []
    step = Trainer.train_step

    def record(self, batches):
        seen.append([int(p) for b in batches for p in b["_position"]])
        return step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", record)
    assert main(_finetune_args(bucketed, tmp_path / "one")) == 0
    one, seen[:] = list(seen), []
    assert main(_finetune_args(bucketed, tmp_path / "two", phase_steps=(2, 4))) == 0
    assert seen == one and len({p for batch in one for p in batch}) == sum(len(b) for b in one)
    assert [r["loss"] for r in metrics(tmp_path / "two")] == [r["loss"] for r in metrics(tmp_path / "one")]
