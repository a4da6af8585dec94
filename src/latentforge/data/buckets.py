"""Aspect-ratio buckets: batches drawn from one bucket at a time, so images keep their shape.

A bucketed latent dataset (``encode`` of a raw dataset ingested with ``crop: buckets``) is a
directory with ``buckets.json`` and one latent dataset per bucket (image size). Each bucket is
read as its own endless, shuffled stream (:class:`latentforge.data.loader.LoaderDataset`); a
*round* is ``world_size x micro_batch_size`` consecutive positions of one bucket's stream, split
across the ranks as the plain loader splits them, so every micro batch holds latents of one shape.

Which bucket each round reads is a pure function of ``(seed, epoch)`` (:class:`BucketSchedule`):
epoch ``e`` holds every bucket's rounds of that epoch in a seeded random order. A bucket whose
size is not a multiple of the round leaves samples over at the end of an epoch. They are never
dropped; ``leftovers`` says what happens to them, and each epoch's leftovers are logged:

- ``carry``: the bucket's stream simply continues, so the leftover samples open the bucket's
  first round of the next epoch (an epoch has ``floor((e+1) N / R) - floor(e N / R)`` rounds of
  a bucket of N samples with rounds of R);
- ``small_batch``: the leftover samples form one smaller round of their own in the same epoch
  (one rank, no gradient accumulation: a smaller round cannot be split evenly across ranks or
  accumulation steps).

The loader state is the number of rounds read (plus the seed and a fingerprint), so a resumed
run reads exactly the rest of the sequence. The round size is part of the order: resuming with
another world size or micro batch size is refused.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from latentforge import storage
from latentforge.data.loader import LoaderConfig, LoaderDataset, StreamConfig, collate_samples, open_dataset, worker_init
from latentforge.data.schema import DatasetIndex, parse_ndarray, read_index
from latentforge.errors import ConfigError, UserError

log = logging.getLogger(__name__)

__all__ = ["BUCKETS", "is_bucketed", "read_buckets", "bucketed_index", "BucketSchedule", "BucketLoader",
           "build_bucket_loader"]

BUCKETS = "buckets.json"
# A sample's global id: bucket index in the high bits, its position in the bucket's stream below.
_POSITION_BITS = 40


def is_bucketed(path: str) -> bool:
    return storage.exists(storage.join(path, BUCKETS))


def read_buckets(path: str) -> list[dict[str, Any]]:
    """The buckets of a bucketed latent dataset: ``[{"path": absolute, "width", "height", "num_samples"}]``."""
    try:
        data = json.loads(storage.read_bytes(storage.join(path, BUCKETS)))
        buckets = [{**b, "path": storage.join(path, b["path"])} for b in data["buckets"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{storage.join(path, BUCKETS)}: unreadable bucket list ({e})") from None
    if not buckets:
        raise UserError(f"{path}: the bucketed dataset has no buckets")
    return buckets


def bucketed_index(path: str) -> tuple[DatasetIndex, list[int]]:
    """The index of a bucketed dataset's first bucket, after checking that every bucket was encoded
    by the same models, and the square-equivalent latent shape (C, S, S) of its resolution."""
    buckets = read_buckets(path)
    indexes = [read_index(b["path"]) for b in buckets]
    first = indexes[0]
    for b, idx in zip(buckets, indexes):
        for key in ("vae", "text_encoder"):
            if idx.meta.get(key, {}).get("fingerprint") != first.meta.get(key, {}).get("fingerprint"):
                raise UserError(f"{b['path']}: encoded with another {key.replace('_', ' ')} than {buckets[0]['path']}")
    channels = parse_ndarray(first.columns["latent_mean"])[1][0]
    side = int(first.meta["resolution"]) // int(first.meta["vae"]["downsample_factor"])
    return first, [channels, side, side]


class BucketSchedule:
    """Rounds of every epoch: (bucket, start position in its stream, number of samples)."""

    def __init__(self, sizes: Sequence[int], round_size: int, seed: int,
                 leftovers: Literal["carry", "small_batch"]) -> None:
        if round_size < 1 or not sizes or min(sizes) < 1:
            raise ValueError("BucketSchedule: needs a positive round size and non-empty buckets")
        self.sizes = [int(n) for n in sizes]
        self.round_size = round_size
        self.seed = seed
        self.leftovers = leftovers
        self._epoch_starts = [0]  # first global round of each epoch computed so far

    def _counts(self, epoch: int) -> list[int]:
        r = self.round_size
        if self.leftovers == "carry":
            return [(epoch + 1) * n // r - epoch * n // r for n in self.sizes]
        return [-(-n // r) for n in self.sizes]

    @lru_cache(maxsize=4)
    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bucket, start, length) arrays of the rounds of ``epoch``, in reading order: the buckets
        take turns in a seeded random order, and each bucket reads its own stream front to back
        (its positions only grow, as the shard cache expects)."""
        r = self.round_size
        counts = self._counts(epoch)
        labels = np.repeat(np.arange(len(self.sizes), dtype=np.int64), counts)
        buckets = labels[np.random.default_rng([self.seed, epoch, 0xB0C4]).permutation(labels.size)]
        starts = np.empty_like(buckets)
        lengths = np.empty_like(buckets)
        for b, (n, count) in enumerate(zip(self.sizes, counts)):
            k = np.arange(count, dtype=np.int64)
            where = np.flatnonzero(buckets == b)
            if self.leftovers == "carry":
                starts[where] = (epoch * n // r + k) * r
                lengths[where] = r
            else:
                starts[where] = epoch * n + k * r
                lengths[where] = np.minimum(r, n - k * r)
        return buckets, starts, lengths

    def leftover_counts(self, epoch: int) -> dict[int, int]:
        """Samples of each bucket left over at the end of ``epoch``: carried into the next epoch
        (carry) or read as the bucket's smaller round (small_batch); buckets with none omitted."""
        r = self.round_size
        if self.leftovers == "carry":
            out = {b: (epoch + 1) * n - (epoch + 1) * n // r * r for b, n in enumerate(self.sizes)}
        else:
            out = {b: n % r for b, n in enumerate(self.sizes)}
        return {b: c for b, c in out.items() if c}

    def locate(self, round_index: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of a global round."""
        while self._epoch_starts[-1] <= round_index:
            e = len(self._epoch_starts) - 1
            # With carry an epoch can have no round at all (every bucket smaller than a round).
            self._epoch_starts.append(self._epoch_starts[-1] + sum(self._counts(e)))
        e = int(np.searchsorted(self._epoch_starts, round_index, side="right")) - 1
        return e, round_index - self._epoch_starts[e]

    def samples_before(self, round_index: int) -> int:
        """Samples that the global rounds before ``round_index`` hold (all ranks together)."""
        if self.leftovers == "carry":
            return round_index * self.round_size
        epoch, i = self.locate(round_index)
        return epoch * sum(self.sizes) + int(self.epoch(epoch)[2][:i].sum())

    def rounds(self, first: int) -> Iterator[tuple[int, int, int, int]]:
        """(epoch, bucket, start, length) of every round from global round ``first`` on (endless)."""
        epoch, i = self.locate(first)
        while True:
            buckets, starts, lengths = self.epoch(epoch)
            for j in range(i, len(buckets)):
                yield epoch, int(buckets[j]), int(starts[j]), int(lengths[j])
            epoch, i = epoch + 1, 0


class _Buckets(Dataset):
    """One map-style dataset over all buckets: item ``(bucket << 40) | position``. A micro batch
    always comes from one bucket; its samples' ``_position`` becomes that global id, so the
    trainer's per-sample noise differs between buckets."""

    def __init__(self, datasets: list[LoaderDataset]) -> None:
        self.datasets = datasets

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: Sequence[int]) -> list[dict[str, Any]]:
        ids = np.asarray(items, dtype=np.int64)
        bucket = ids >> _POSITION_BITS
        if (bucket != bucket[0]).any():
            raise AssertionError("a micro batch mixes buckets")
        samples = self.datasets[int(bucket[0])].__getitems__((ids & ((1 << _POSITION_BITS) - 1)).tolist())
        for s, i in zip(samples, ids.tolist()):
            s["_position"] = i
            s["_bucket"] = int(bucket[0])
        return samples


class _RoundSampler(Sampler[list[int]]):
    """This rank's micro batches of each round (positions ``start + rank + world_size * j``)."""

    def __init__(self, loader: "BucketLoader", first_round: int) -> None:
        self.loader = loader
        self.first_round = first_round

    def __iter__(self) -> Iterator[list[int]]:
        ld = self.loader
        for _, bucket, start, length in ld.schedule.rounds(self.first_round):
            mine = list(range(start + ld.rank, start + length, ld.world_size))
            yield [(bucket << _POSITION_BITS) | p for p in mine]


class BucketLoader:
    """The :class:`latentforge.data.loader.TrainLoader` interface over a bucketed dataset: each
    yielded micro batch is one round's share of this rank (one bucket, one latent shape)."""

    def __init__(self, datasets: list[LoaderDataset], names: list[str], cfg: LoaderConfig, micro_batch_size: int,
                 rank: int, world_size: int, leftovers: Literal["carry", "small_batch"],
                 collate: Callable[[list[dict[str, Any]]], Any]) -> None:
        self.datasets = datasets
        self.names = names
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.collate = collate
        self.schedule = BucketSchedule([d.samples_per_epoch for d in datasets], self.global_batch_size, cfg.seed,
                                       leftovers)
        self.rounds = 0  # rounds read: the resume state
        self.cursor = 0  # samples read by all ranks (for logs)
        self._generation = 0
        self._logged_epoch = -1

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.micro_batch_size

    @property
    def samples_per_epoch(self) -> int:
        return sum(self.schedule.sizes)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {"buckets": [d.fingerprint for d in self.datasets], "round_size": self.global_batch_size,
                "leftovers": self.schedule.leftovers}

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.cfg.seed, "rounds": self.rounds, "cursor": self.cursor, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.cfg.seed or state.get("fingerprint") != self.fingerprint:
            raise UserError("data loader state: the checkpoint was made with another bucketed data order (seed, "
                            "buckets, world_size x micro batch or leftovers changed): restore them or start a new run")
        self._generation += 1
        self.rounds, self.cursor = int(state["rounds"]), int(state["cursor"])

    def start_at(self, samples: int) -> None:
        """Read on after ``samples`` training samples of earlier phases: from round ``ceil(samples /
        round size)``, so that a phase with the round size of the one before reads the rounds that
        follow its last (with another round size, about as far into the data). Before iterating."""
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        self._generation += 1  # an earlier iterator stops at its next step
        self.rounds = -(-samples // self.global_batch_size)
        self.cursor = self.schedule.samples_before(self.rounds)

    def _log_leftovers(self, epoch: int) -> None:
        if epoch <= self._logged_epoch or self.rank != 0:
            return
        self._logged_epoch = epoch
        left = self.schedule.leftover_counts(epoch)
        if left:
            what = "carried into the next epoch" if self.schedule.leftovers == "carry" else "read as a smaller batch"
            log.info("bucketed data, epoch %d: samples left over from a full batch, %s: %s", epoch, what,
                     ", ".join(f"{self.names[b]} {n}" for b, n in sorted(left.items())))

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        generation = self._generation
        workers = self.cfg.num_workers
        loader = DataLoader(_Buckets(self.datasets), batch_sampler=_RoundSampler(self, self.rounds),
                            num_workers=workers, collate_fn=self.collate,
                            prefetch_factor=self.cfg.prefetch_factor if workers else None,
                            pin_memory=self.cfg.pin_memory, worker_init_fn=worker_init(workers))
        return self._batches(loader, generation)

    def _batches(self, loader: DataLoader, generation: int) -> Iterator[Any]:
        rounds = self.schedule.rounds(self.rounds)
        for batch in loader:
            if generation != self._generation:
                return
            epoch, _, _, length = next(rounds)  # the round this batch belongs to (same sequence as the sampler)
            self._log_leftovers(epoch)
            self.rounds += 1
            self.cursor += length
            yield batch

    def close(self) -> None:
        self._generation += 1


def build_bucket_loader(cfg: LoaderConfig, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                        collate: Callable[[list[dict[str, Any]]], Any] = collate_samples) -> BucketLoader:
    """The loader of rank ``rank`` over the bucketed dataset ``cfg.datasets[0]`` (a single one)."""
    leftovers = cfg.bucket_leftovers
    if len(cfg.datasets) != 1:
        raise ConfigError("datasets: a bucketed dataset is read alone: mixing it with other datasets is not supported")
    if leftovers == "small_batch" and world_size > 1:
        raise ConfigError("bucket_leftovers: small_batch needs one rank (a smaller batch cannot be split evenly "
                          "across ranks): use carry")
    datasets, names = [], []
    for b in read_buckets(cfg.datasets[0].path):
        if b["num_samples"] == 0:
            log.warning("bucket %s has no samples (all rejected at encode): skipped", b["path"])
            continue
        datasets.append(open_dataset(LoaderConfig(**{**vars(cfg), "datasets": [StreamConfig(path=b["path"])]})))
        names.append(f"{b['width']}x{b['height']}")
    if not datasets:
        raise UserError(f"{cfg.datasets[0].path}: every bucket is empty")
    return BucketLoader(datasets, names, cfg, micro_batch_size, rank, world_size, leftovers, collate)
