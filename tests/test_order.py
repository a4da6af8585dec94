"""The sample order as pure functions, tested at fake scale (no files, no loader workers)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from torch.utils.data import BatchSampler

from latentforge.data import order
from latentforge.data.loader import RankSampler


def test_splitmix64_matches_the_reference_sequence():
    # SplitMix64 seeded with 0 outputs these three numbers (the reference C implementation).
    states = [(k * 0x9E3779B97F4A7C15) & (2**64 - 1) for k in range(3)]
    got = [int(v) for v in order.splitmix64(np.array(states, dtype=np.uint64))]
    assert got == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert int(order.splitmix64(0)[0]) == got[0]  # scalars and arrays agree


def test_order_is_pinned_forever():
    """Checkpoints store only a cursor: if these values change, old runs resume on other data
    (then bump loader.ORDER_VERSION, so that old checkpoints are refused)."""
    assert order.feistel_permute(np.arange(10), 10, 7).tolist() == [5, 1, 8, 6, 2, 7, 9, 4, 3, 0]
    stream = order.StreamOrder([5, 0, 7, 3], seed=11, window_shards=2)
    assert stream.shard_order(0).tolist() == [1, 3, 2, 0]
    loc = stream.sample_at(np.arange(15))
    assert loc.shard.tolist() == [3, 3, 3, 2, 2, 2, 2, 0, 0, 0, 2, 2, 0, 0, 2]
    assert loc.row.tolist() == [1, 0, 2, 0, 2, 3, 4, 3, 4, 2, 6, 1, 0, 1, 5]
    d, q = order.Mixture([2, 1], 6, seed=3).mix_at(np.arange(12))
    assert d.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0]
    assert q.tolist() == [3, 1, 0, 1, 0, 2, 7, 2, 5, 6, 3, 4]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097, 100_003])
def test_feistel_is_a_bijection(n):
    for key in (0, 1, 2**63 + 5):
        p = order.feistel_permute(np.arange(n), n, key)
        assert np.array_equal(np.sort(p), np.arange(n))
    if n >= 64:
        a, b = order.feistel_permute(np.arange(n), n, 1), order.feistel_permute(np.arange(n), n, 2)
        assert np.mean(a == b) < 0.05  # keys give unrelated permutations
        assert np.mean(a == np.arange(n)) < 0.05  # and not near the identity


def test_feistel_per_element_domains_and_scalars():
    n = np.array([7, 1000, 3, 1000])
    x = np.array([6, 999, 0, 5])
    key = np.array([1, 1, 2, 1])
    got = order.feistel_permute(x, n, key)
    for i in range(4):
        assert int(got[i]) == int(order.feistel_permute(int(x[i]), int(n[i]), int(key[i]))[0])
    with pytest.raises(ValueError, match="feistel_permute: x must be < n"):
        order.feistel_permute(5, 5, 0)


@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_stream_covers_every_sample_once_per_epoch(window):
    sizes = np.random.default_rng(window).integers(0, 90, size=41)
    sizes[[3, 4, 5]] = 0  # empty shards, also a run of them
    stream = order.StreamOrder(sizes, seed=5, window_shards=window)
    n = stream.num_samples
    loc = stream.sample_at(np.arange(3 * n))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ids = starts[loc.shard] + loc.row
    assert np.all(loc.row < sizes[loc.shard])
    for e in range(3):
        sel = slice(e * n, (e + 1) * n)
        assert np.all(loc.epoch[sel] == e)
        assert np.array_equal(np.sort(ids[sel]), np.arange(n))
        # windows are read one after the other, each from its own shards only
        assert np.all(np.diff(loc.window[sel]) >= 0)
        for w in np.unique(loc.window[sel]):
            in_w = loc.window[sel] == w
            assert set(loc.shard[sel][in_w].tolist()) <= set(stream.window_shard_ids(e, w).tolist())
    assert not np.array_equal(ids[:n], ids[n:2 * n])  # each epoch has its own order


def test_no_shuffle_is_index_order():
    stream = order.StreamOrder([3, 0, 4], seed=1, shuffle=False, window_shards=2)
    loc = stream.sample_at(np.arange(14))
    assert loc.shard.tolist() == [0, 0, 0, 2, 2, 2, 2] * 2
    assert loc.row.tolist() == [0, 1, 2, 0, 1, 2, 3] * 2


def test_two_billion_samples_without_a_per_sample_table():
    stream = order.StreamOrder([10_000] * 200_000, seed=9, window_shards=2)  # 2e9 samples
    window_start = 2_000_000_000 * 3 + 40_000  # epoch 3, window 2: 20k positions
    loc = stream.sample_at(np.arange(window_start, window_start + 20_000))
    assert set(loc.shard.tolist()) == set(stream.window_shard_ids(3, 2).tolist())
    ids = loc.shard * 10_000 + loc.row
    assert np.unique(ids).size == 20_000
    perm, cum = stream._tables(3)
    assert perm.nbytes + cum.nbytes < 4_000_000  # O(num_shards) memory


def test_largest_remainder():
    assert order.largest_remainder([0.7, 0.3], 1000) == [700, 300]
    assert order.largest_remainder([1, 1, 1], 1000) == [334, 333, 333]
    assert order.largest_remainder([1, 2, 2], 4) == [1, 2, 1]  # tie 0.8 vs 0.8 -> lower index
    assert sum(order.largest_remainder([0.1, 0.25, 0.65, 3.0], 997)) == 997


def test_mixture_exact_per_block_and_streams_without_gaps():
    mix = order.Mixture([0.5, 0.3, 0.2, 0.0001 + 1e-9], block=1000, seed=4)
    assert mix.counts.tolist() == [500, 300, 200, 0]  # callers refuse a zero count (open_dataset)
    mix = order.Mixture([5, 3, 2], block=100, seed=4)
    d, q = mix.mix_at(np.arange(100 * 50))
    for b in range(50):
        assert np.bincount(d[b * 100:(b + 1) * 100], minlength=3).tolist() == [50, 30, 20]
    for k, c in enumerate([50, 30, 20]):
        assert np.array_equal(np.sort(q[d == k]), np.arange(c * 50))  # each stream read once, no gap
    first = d[:100]
    assert not np.array_equal(first, np.sort(first))  # datasets interleaved within a block
    for k in range(3):  # what global positions [1234, 1500) can read of each stream
        lo, hi = mix.stream_range(k, 1234, 1500)
        assert (lo, hi) == (12 * mix.counts[k], 15 * mix.counts[k])
        touched = q[1234:1500][d[1234:1500] == k]
        assert lo <= touched.min() and touched.max() < hi
    assert order.Mixture([1.0], 100, 0).stream_range(0, 1234, 1500) == (1234, 1500)


def test_mixture_resume_anywhere_is_the_same_sequence():
    mix = order.Mixture([0.7, 0.3], block=64, seed=8)
    streams = [order.StreamOrder([33] * 9, seed=8, stream_id=i, window_shards=2) for i in range(2)]

    def samples(positions):
        d, q = mix.mix_at(positions)
        shard, row = np.empty_like(q), np.empty_like(q)
        for k in range(2):
            loc = streams[k].sample_at(q[d == k])
            shard[d == k], row[d == k] = loc.shard, loc.row
        return list(zip(d.tolist(), shard.tolist(), row.tolist()))

    full = samples(np.arange(1000))
    for cut in (1, 63, 64, 65, 517):
        assert samples(np.arange(cut, 1000)) == full[cut:]


def test_256_ranks_8_workers_read_every_position_once():
    world, workers, micro, total = 256, 8, 7, 100_000
    cursor = 12_345
    seen = np.zeros(total, dtype=np.int64)
    num_batches = -(-total // (world * micro))
    for rank in range(world):
        batches = BatchSampler(RankSampler(cursor, rank, world), micro, drop_last=False)
        # DataLoader hands batch k to worker k % workers; each worker's share in turn
        per_worker = [[] for _ in range(workers)]
        for k, batch in enumerate(itertools.islice(batches, num_batches)):
            per_worker[k % workers].append(batch)
        for batch in itertools.chain.from_iterable(per_worker):
            p = np.asarray(batch) - cursor
            np.add.at(seen, p[p < total], 1)
    assert np.all(seen == 1)


@pytest.mark.parametrize("old_world,new_world,micro_old,micro_new,k", [
    (1, 2, 8, 4, 5), (2, 3, 4, 5, 7), (4, 1, 3, 12, 3), (3, 4, 7, 2, 11)])
def test_resume_with_another_world_size_reads_the_rest(old_world, new_world, micro_old, micro_new, k):
    def global_batches(cursor, world, micro, n):
        """Global positions of n global batches as the ranks read them (rank-major per batch)."""
        samplers = [iter(BatchSampler(RankSampler(cursor, r, world), micro, drop_last=False)) for r in range(world)]
        return [sorted(p for s in samplers for p in next(s)) for _ in range(n)]

    total = 600
    first = global_batches(0, old_world, micro_old, k)
    cursor = k * old_world * micro_old  # what state_dict() stores after k batches
    rest = global_batches(cursor, new_world, micro_new, -(-(total - cursor) // (new_world * micro_new)))
    seq = [p for b in first + rest for p in b]
    assert seq[:total] == list(range(total))
    for b, batch in enumerate(rest):  # each global batch is one contiguous block of positions
        assert batch == list(range(cursor + b * new_world * micro_new, cursor + (b + 1) * new_world * micro_new))


def test_caption_dropout_rate_and_determinism():
    pos = np.arange(200_000)
    a = order.caption_dropped(3, pos, 0.1)
    assert abs(a.mean() - 0.1) < 0.005
    assert np.array_equal(a[5000:6000], order.caption_dropped(3, pos[5000:6000], 0.1))
    assert not order.caption_dropped(3, pos, 0.0).any()
    assert abs(np.mean(a == order.caption_dropped(4, pos, 0.1)) - 0.82) < 0.01  # seeds independent


def test_shuffle_spread():
    ids = np.random.default_rng(0).permutation(20_000)
    assert 19.0 < order.shuffle_spread(ids) < 19.6  # uniform reference
    assert order.shuffle_spread(np.arange(20_000)) == pytest.approx(1.06, abs=0.01)  # 64 in a row
    for window, low, high in [(20, 19.0, 19.6), (4, 3.8, 4.1), (1, 1.0, 1.1)]:
        stream = order.StreamOrder([1000] * 20, seed=1, window_shards=window)
        loc = stream.sample_at(np.arange(20_000))
        assert low < order.shuffle_spread(loc.shard * 1000 + loc.row) < high


_DIGEST_SCRIPT = """
import hashlib, numpy as np
from latentforge.data import order
s = order.StreamOrder([97, 0, 13, 250, 41] * 7, seed=123, stream_id=1, window_shards=3)
m = order.Mixture([0.6, 0.4], 50, 123)
d, q = m.mix_at(np.arange(5000))
loc = s.sample_at(q)
drop = order.caption_dropped(123, np.arange(5000), 0.2)
print(hashlib.sha256(np.stack([d, loc.shard, loc.row, drop]).astype(np.int64).tobytes()).hexdigest())
"""


def test_same_order_in_another_process():
    out = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True, check=True)
    env = {}
    exec(_DIGEST_SCRIPT.replace("print(", "result = ("), env)
    assert out.stdout.strip() == env["result"]
    # The digest covers the real order: 5000 positions mixed 60/40 in blocks of 50, every row
    # inside its shard, the empty shards never read, about 20% of the captions dropped.
    d, loc, drop = env["d"], env["loc"], env["drop"]
    assert d.shape == loc.shard.shape == loc.row.shape == drop.shape == (5000,)
    assert np.bincount(d).tolist() == [3000, 2000]
    sizes = np.array([97, 0, 13, 250, 41] * 7)
    assert (loc.row >= 0).all() and (loc.row < sizes[loc.shard]).all()
    assert not np.isin(loc.shard, np.flatnonzero(sizes == 0)).any()
    assert abs(drop.mean() - 0.2) < 0.02
