"""The training sample order as pure functions of (seed, epoch, global position).

Nothing here holds state that depends on how far training got: a global position (the number of
samples consumed before it, over all ranks) determines which sample is read, so a data cursor
alone resumes training exactly, with any number of ranks or loader workers.

Order of one dataset (a "stream": its epochs back to back), after mosaicml-streaming's
two-level shuffle:

1. per epoch, permute the shards (O(num_shards) memory, never O(num_samples));
2. group consecutive permuted shards into windows of ``window_shards`` shards: a window is
   read to its end before the next one starts, so a remote dataset needs only the current
   and the next window on local disk;
3. within a window, permute the window's samples.

Several datasets are mixed per block of ``block`` global positions: each dataset gets a fixed
count of the block (largest remainder of its weight), and the block's positions are permuted.
Each dataset's stream runs through its own epochs independently.

Permutations are a keyed Feistel network with cycle-walking, its round function built from the
splitmix64 hash: the same seed gives the same order forever, on any numpy version and machine
(numpy's Generator streams are not promised to stay the same across releases). All functions
take numpy arrays (vectorised over positions, uint64 arithmetic wraps) or Python ints.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

__all__ = [
    "splitmix64",
    "hash64",
    "feistel_permute",
    "largest_remainder",
    "StreamOrder",
    "SampleLoc",
    "Mixture",
    "caption_dropped",
    "shuffle_spread",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
FEISTEL_ROUNDS = 6  # even (the half widths swap back); 4 suffice for Luby-Rackoff, 2 more cost little

# Domain tags keep the hashes of different uses independent (part of the order: never change).
_TAG_SHARDS = 1
_TAG_WINDOW = 2
_TAG_MIX = 3
_TAG_DROPOUT = 4


def _u64(x) -> np.ndarray:
    """At least 1-d uint64 (0-d arithmetic would be numpy scalars, which warn on wrap-around)."""
    if isinstance(x, (int, np.integer)):
        return np.array([int(x) & _MASK64], dtype=np.uint64)
    a = np.asarray(x)
    if a.dtype != np.uint64:
        a = a.astype(np.int64).astype(np.uint64)  # negative int64 wraps like & MASK64
    return np.atleast_1d(a)


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def splitmix64(x) -> np.ndarray:
    """splitmix64 output function (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number
    generators"; constants of Java's SplittableRandom), elementwise on uint64."""
    return _mix(_u64(x))


def hash64(*parts) -> np.ndarray:
    """A 64-bit hash of a tuple of integers (each an int or an array; arrays broadcast)."""
    h = splitmix64(parts[0])
    for p in parts[1:]:
        h = _mix(h ^ _u64(p))
    return h


def _bit_length(v: np.ndarray) -> np.ndarray:
    """``int.bit_length`` of each element (exact below 2**53)."""
    return np.frexp(v.astype(np.float64))[1].astype(np.uint64)


def feistel_permute(x, n, key) -> np.ndarray:
    """Image of ``x`` under a keyed bijection of [0, n): a Feistel network (Luby & Rackoff 1988)
    over the next power of two, its two halves a and b = a or a - 1 bits wide, swapping widths
    every round (an even number of rounds), restricted to [0, n) by cycle-walking (Black &
    Rogaway 2002, "Ciphers with arbitrary finite domains"). ``x``, ``n`` and ``key`` broadcast.

    The Feistel domain is less than 2n, so an element takes fewer than 2 passes on average.
    """
    x, n, key = (a.copy() for a in np.broadcast_arrays(_u64(x), _u64(n), _u64(key)))
    if n.size and (n.min() < 1 or n.max() >= 1 << 52):
        raise ValueError(f"feistel_permute: domain size must be in [1, 2**52), got {n.min()}..{n.max()}")
    if np.any(x >= n):
        raise ValueError("feistel_permute: x must be < n")
    bits = np.maximum(_bit_length(n - np.uint64(1)), np.uint64(2))
    low = bits // np.uint64(2)
    mask_high = (np.uint64(1) << (bits - low)) - np.uint64(1)
    mask_low = (np.uint64(1) << low) - np.uint64(1)
    round_keys = [_mix(key ^ np.uint64(r)) for r in range(FEISTEL_ROUNDS)]
    todo = np.arange(x.size)
    while todo.size:
        y, b = x[todo], low[todo]
        m_left, m_right = mask_high[todo], mask_low[todo]
        left, right = y >> b, y & m_right
        for rk in round_keys:
            left, right = right, left ^ (_mix(right ^ rk[todo]) & m_left)
            m_left, m_right = m_right, m_left
        x[todo] = (left << b) | right
        todo = todo[x[todo] >= n[todo]]
    return x


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` into integer counts proportional to ``weights`` (Hamilton's method: floor of
    each quota, then one more to the largest remainders, ties to the lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    quotas = total * w / w.sum()
    counts = np.floor(quotas).astype(np.int64)
    short = total - int(counts.sum())
    by_remainder = sorted(range(len(w)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:short]:
        counts[i] += 1
    return [int(c) for c in counts]


class SampleLoc(NamedTuple):
    """Where a stream position lands (arrays of equal length)."""

    epoch: np.ndarray
    window: np.ndarray  # index of the shard window within the epoch
    shard: np.ndarray  # index into the dataset's shard list (index.json order)
    row: np.ndarray  # row within that shard


class StreamOrder:
    """The sample order of one dataset's stream: epoch after epoch, two-level shuffled.

    Memory and time per epoch are O(num_shards); a few epochs' tables are memoised (a batch
    can straddle an epoch boundary, and prefetching looks one window ahead).
    """

    _MEMO_EPOCHS = 4

    def __init__(self, shard_sizes: Sequence[int], seed: int, stream_id: int = 0, shuffle: bool = True,
                 window_shards: int = 16) -> None:
        self.sizes = np.asarray(shard_sizes, dtype=np.int64)
        if self.sizes.ndim != 1 or self.sizes.size == 0 or self.sizes.min() < 0:
            raise ValueError("StreamOrder: shard sizes must be a non-empty list of counts >= 0")
        if window_shards < 1:
            raise ValueError(f"StreamOrder: window_shards must be >= 1, got {window_shards}")
        self.num_samples = int(self.sizes.sum())
        if self.num_samples == 0:
            raise ValueError("StreamOrder: the dataset has no samples")
        self.num_shards = int(self.sizes.size)
        self.seed = int(seed)
        self.stream_id = int(stream_id)
        self.shuffle = bool(shuffle)
        self.window_shards = int(window_shards)
        self.num_windows = -(-self.num_shards // self.window_shards)
        self._memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def shard_order(self, epoch: int) -> np.ndarray:
        """Shard indices in the order epoch ``epoch`` reads them (windows are consecutive runs)."""
        return self._tables(epoch)[0]

    def window_shard_ids(self, epoch: int, window: int) -> np.ndarray:
        """The shards of one window, in reading order."""
        s = self.window_shards
        return self.shard_order(epoch)[window * s:(window + 1) * s]

    def _tables(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard permutation, cumulative sample counts along it) of one epoch."""
        epoch = int(epoch)
        got = self._memo.get(epoch)
        if got is None:
            ids = np.arange(self.num_shards, dtype=np.uint64)
            if self.shuffle:
                key = hash64(self.seed, self.stream_id, _TAG_SHARDS, epoch)
                perm = feistel_permute(ids, self.num_shards, key).astype(np.int64)
            else:
                perm = ids.astype(np.int64)
            cum = np.zeros(self.num_shards + 1, dtype=np.int64)
            np.cumsum(self.sizes[perm], out=cum[1:])
            if len(self._memo) >= self._MEMO_EPOCHS:  # (the prefetch thread may be evicting too)
                self._memo.pop(next(iter(self._memo), None), None)
            got = self._memo[epoch] = (perm, cum)
        return got

    def sample_at(self, stream_position) -> SampleLoc:
        """Which sample sits at each stream position (``epoch * num_samples + offset``)."""
        q = np.atleast_1d(np.asarray(stream_position, dtype=np.int64))
        if q.size and q.min() < 0:
            raise ValueError("StreamOrder.sample_at: positions must be >= 0")
        epoch, offset = np.divmod(q, self.num_samples)
        window = np.empty_like(q)
        shard = np.empty_like(q)
        row = np.empty_like(q)
        s = self.window_shards
        for e in np.unique(epoch):
            sel = epoch == e
            perm, cum = self._tables(int(e))
            starts = cum[::s]  # sample offset where each window begins (plus the end, if aligned)
            r = offset[sel]
            w = np.searchsorted(starts, r, side="right") - 1
            start = starts[w]
            if self.shuffle:
                size = cum[np.minimum((w + 1) * s, self.num_shards)] - start
                key = hash64(self.seed, self.stream_id, _TAG_WINDOW, int(e), w)
                r = start + feistel_permute(r - start, size, key).astype(np.int64)
            slot = np.searchsorted(cum, r, side="right") - 1
            window[sel] = w
            shard[sel] = perm[slot]
            row[sel] = r - cum[slot]
        return SampleLoc(epoch, window, shard, row)


class Mixture:
    """Weighted interleaving of datasets: global position -> (dataset, position in its stream).

    Every block of ``block`` global positions holds exactly ``counts[d]`` samples of dataset d
    (largest remainder of the weights), at positions permuted per block; so proportions are exact
    per block, and dataset d's stream position is ``block_index * counts[d] + rank within block``.
    """

    def __init__(self, weights: Sequence[float], block: int, seed: int) -> None:
        if not weights or min(weights) <= 0:
            raise ValueError("Mixture: weights must be a non-empty list of numbers > 0")
        if block < len(weights):
            raise ValueError(f"Mixture: block ({block}) must be >= the number of datasets ({len(weights)})")
        self.block = int(block)
        self.seed = int(seed)
        self.counts = np.asarray(largest_remainder(weights, self.block), dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])

    @property
    def num_datasets(self) -> int:
        return int(self.counts.size)

    def mix_at(self, position) -> tuple[np.ndarray, np.ndarray]:
        """(dataset id, position within that dataset's stream) of each global position."""
        p = np.atleast_1d(np.asarray(position, dtype=np.int64))
        if p.size and p.min() < 0:
            raise ValueError("Mixture.mix_at: positions must be >= 0")
        if self.num_datasets == 1:  # one dataset: its own stream, position for position
            return np.zeros_like(p), p
        b, o = np.divmod(p, self.block)
        slot = feistel_permute(o, self.block, hash64(self.seed, _TAG_MIX, b)).astype(np.int64)
        d = np.searchsorted(self.starts, slot, side="right") - 1
        return d, b * self.counts[d] + slot - self.starts[d]

    def stream_range(self, dataset: int, start: int, stop: int) -> tuple[int, int]:
        """Bounds [lo, hi) of the stream positions of ``dataset`` that global positions
        [start, stop) can read (whole blocks: which slots of a block are whose is permuted)."""
        if self.num_datasets == 1:
            return int(start), int(stop)
        c = int(self.counts[dataset])
        return int(start) // self.block * c, -(-int(stop) // self.block) * c


def caption_dropped(seed: int, position, p: float) -> np.ndarray:
    """Whether the caption of the sample at each global position is dropped (probability ``p``),
    from a hash of (seed, position): the same decision on every rank, worker count and resume."""
    u = hash64(seed, _TAG_DROPOUT, position) >> np.uint64(11)  # 53 uniform bits
    return u < np.uint64(int(p * (1 << 53)))


def shuffle_spread(sample_ids, batch_size: int = 64, block: int = 1000) -> float:
    """Mean number of distinct ``block``-sized id ranges per batch: how widely a batch draws from
    the dataset (uniformly random batches of 64 from 20k ids: about 19.3; one shard at a time: 1)."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    n = ids.size // batch_size * batch_size
    blocks = (ids[:n] // block).reshape(-1, batch_size)
    return float(np.mean([np.unique(b).size for b in blocks]))
