"""Training data loader: shuffled, weighted-mixed, exactly resumable, local or ``s3://`` shards.

Global position p (samples consumed before it, summed over all ranks) determines the sample:
``order.Mixture`` picks the dataset and its stream position, ``order.StreamOrder`` the shard
and row. Rank r of W reads positions ``cursor + r + W*j`` through a plain torch ``DataLoader``
with a sampler, so a checkpoint holds only ``{seed, cursor, fingerprint}``; worker count,
prefetching and the number of ranks can change between save and resume. The stream is
continuous across epochs (a batch at an epoch end takes the head of the next epoch), so no
sample is dropped or padded and a resumed run with another W reads exactly the rest of the
same global sequence. There is no ``drop_last``: nothing is ever left over.

Shard access (:class:`ShardCache`): every parquet shard, local or S3, is converted once per node
into an uncompressed Arrow IPC file in a bounded cache directory and memory-mapped from there.
Parquet cannot be mapped without decoding (measured: ``pq.read_table(memory_map=True)`` of a
134 MB shard costs +169 MB private memory in every worker process, the IPC file +3 MB of shared
page cache), so each worker would otherwise hold whole decoded shards. The cache holds the
current and the next shuffle window; a thread of the rank's main process converts the shards of
both ahead of the workers, and evicts the least recently opened shards that no process has open.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import json
import os
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from latentforge import interrupt, storage
from latentforge.data import order
from latentforge.data.schema import EMPTY_PROMPT, DatasetIndex, ShardInfo, parse_ndarray, read_index
from latentforge.errors import ConfigError, Problems, UserError

__all__ = [
    "StreamConfig",
    "LoaderConfig",
    "build_loader",
    "open_dataset",
    "collate_samples",
    "TrainLoader",
    "LoaderDataset",
    "RankSampler",
    "ShardCache",
    "EMPTY_PROMPT",
]

ORDER_VERSION = 1  # bump when order.py changes what a (seed, position) reads: old cursors are refused
_GB = 1_000_000_000


@dataclass
class StreamConfig:
    path: str = field(default="", metadata={"help": "dataset directory with index.json: local or s3://bucket/prefix"})
    weight: float = field(default=1.0, metadata={
        "help": "share of the samples drawn from this dataset, relative to the other datasets' weights"})

    def validate(self) -> None:
        problems = Problems()
        if not self.path:
            problems.add("path: required; a dataset directory (local or s3://) with index.json")
        if not self.weight > 0:
            problems.add(f"weight: must be > 0, got {self.weight}; the dataset's share in the mix (1 = equal)")
        problems.raise_if_any()


@dataclass
class LoaderConfig:
    datasets: list[StreamConfig] = field(default_factory=list, metadata={
        "help": "datasets to read, all of one kind (all latent or all raw) with the same columns"})
    seed: int = field(default=0, metadata={"help": "seed of the sample order and of caption dropout"})
    shuffle: bool = field(default=True, metadata={
        "help": "permute shards per epoch and samples within windows of shards; false = index order"})
    shuffle_window_shards: int = field(default=16, metadata={
        "help": "shards shuffled together: a batch draws from this many shards; the cache must hold two windows"})
    mix_block: int = field(default=1000, metadata={
        "help": "global positions per mixing block: each block holds exactly the weighted share of every dataset"})
    caption_dropout: float = field(default=0.0, metadata={
        "help": "probability in [0, 1) of replacing a caption by the empty one (classifier-free guidance training)"})
    num_workers: int = field(default=2, metadata={
        "help": "DataLoader worker processes per rank (0 = read in the training process)"})
    prefetch_factor: int = field(default=2, metadata={"help": "batches each worker prepares ahead"})
    pin_memory: bool = field(default=False, metadata={
        "help": "page-locked batches for faster host-to-GPU copies (CUDA)"})
    cache_dir: str = field(default="", metadata={
        "help": "node-local directory of converted shards; empty = $XDG_CACHE_HOME or ~/.cache /latentforge/shards"})
    cache_limit_gb: float = field(default=64.0, metadata={
        "help": "size bound of cache_dir in GB (1e9 bytes); least recently used shards not in use are evicted"})
    bucket_leftovers: Literal["carry", "small_batch"] = field(default="carry", metadata={
        "help": "bucketed datasets: samples left over from a full batch at an epoch end are carried into the next "
                "epoch, or read as a smaller batch (one rank, no accumulation); see data/buckets.py"})

    def validate(self) -> None:
        problems = Problems()
        # An empty list is valid in a recipe (commands fill it in); open_dataset refuses it.
        for i, ds in enumerate(self.datasets):
            problems.nested(f"datasets[{i}]", ds)
        if not 0.0 <= self.caption_dropout < 1.0:
            problems.add(f"caption_dropout: must be in [0, 1), got {self.caption_dropout}; 0.1 is usual, 0 = off")
        if self.shuffle_window_shards < 1:
            problems.add(f"shuffle_window_shards: must be >= 1, got {self.shuffle_window_shards}; "
                         "shards shuffled together")
        if self.mix_block < max(1, len(self.datasets)):
            problems.add(f"mix_block: {self.mix_block} is less than the number of datasets "
                         f"({len(self.datasets)}); raise it")
        if self.num_workers < 0:
            problems.add(f"num_workers: must be >= 0, got {self.num_workers}; 0 = read in the training process")
        if self.prefetch_factor < 1:
            problems.add(f"prefetch_factor: must be >= 1, got {self.prefetch_factor}; batches read ahead per worker")
        if not self.cache_limit_gb > 0:
            problems.add(f"cache_limit_gb: must be > 0, got {self.cache_limit_gb}; the shard cache's size in GB")
        problems.raise_if_any()

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base, "latentforge", "shards")


def collate_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch sample dicts: tensors stacked (in shared memory inside workers), ints and bools as
    tensors, everything else (str, bytes, json dicts) as lists."""
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], (torch.Tensor, bool, int, float)):
            out[key] = default_collate(values)
        else:
            out[key] = values
    return out


# ---------------------------------------------------------------------------------------------
# Reading rows of a memory-mapped Arrow table


class _ShardReader:
    """Column access to one memory-mapped shard. Buffers are extracted once at open; ndarray
    columns become (rows, bytes) views per record batch, so gathering a batch's rows of a column
    is one numpy fancy-index copy, with no per-sample allocation."""

    def __init__(self, table: pa.Table, columns: dict[str, str], fd: int, where: str) -> None:
        self.fd = fd  # holds the shared lock that keeps the file from being evicted
        self.table = table  # keeps the memory map alive
        self.where = where
        self.last_tag = -1  # latest (epoch, window) it served, as epoch * num_windows + window
        batches = table.to_batches()
        self._starts = np.cumsum([0] + [b.num_rows for b in batches])
        self._fixed = []  # (name, dtype, shape, per batch: uint8 array of shape (rows, nbytes))
        self._other = []  # (name, coltype, per batch: (offsets or values, data or None, array if nulls))
        for name, coltype in columns.items():
            if coltype.startswith("ndarray:"):
                dtype, shape = parse_ndarray(coltype)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                self._fixed.append((name, dtype, shape, [self._rows_view(b.column(name), name, coltype, nbytes)
                                                         for b in batches]))
            else:
                self._other.append((name, coltype, [self._extract(b.column(name)) for b in batches]))

    @staticmethod
    def _extract(arr: pa.Array) -> tuple[np.ndarray, np.ndarray | None, pa.Array | None]:
        bufs = arr.buffers()
        nulls = arr if arr.null_count else None
        t = arr.type
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            values = np.frombuffer(bufs[1], dtype=t.to_pandas_dtype(), count=len(arr),
                                   offset=arr.offset * t.byte_width)
            return values, None, nulls
        large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
        off_dtype = np.dtype(np.int64 if large else np.int32)
        offsets = np.frombuffer(bufs[1], dtype=off_dtype, count=len(arr) + 1, offset=arr.offset * off_dtype.itemsize)
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
        return offsets, data, nulls

    def _rows_view(self, arr: pa.Array, name: str, coltype: str, nbytes: int) -> np.ndarray:
        offsets, data, nulls = self._extract(arr)
        if nulls is not None:
            raise UserError(f"{self.where}: column {name!r} has rows without a value")
        sizes = np.diff(offsets)
        if sizes.size and (sizes != nbytes).any():
            bad = int(np.argmax(sizes != nbytes))
            raise UserError(f"{self.where}: a value of column {name!r} holds {sizes[bad]} bytes, "
                            f"its type {coltype} needs {nbytes}")
        first = int(offsets[0]) if offsets.size else 0
        return data[first:first + len(arr) * nbytes].reshape(len(arr), nbytes)

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def read_into(self, rows: np.ndarray, slots: np.ndarray, arrays: dict[str, np.ndarray],
                  values: dict[str, list]) -> None:
        """Copy ``rows`` of this shard into position ``slots`` of the batch: ndarray columns into
        ``arrays[name]`` (batch, *shape), the others into the lists ``values[name]``."""
        chunk = np.searchsorted(self._starts, rows, side="right") - 1
        for c in np.unique(chunk):
            sel = chunk == c
            r = rows[sel] - self._starts[c]
            where = slots[sel]
            for name, dtype, shape, per_batch in self._fixed:
                arrays[name][where] = per_batch[c][r].view(dtype).reshape(-1, *shape)
            for name, coltype, per_batch in self._other:
                first, data, nulls = per_batch[c]
                out = values[name]
                for i, slot in zip(r.tolist(), where.tolist()):
                    if nulls is not None and not nulls[i].is_valid:
                        out[slot] = {} if coltype == "json" else None
                    elif data is None:
                        out[slot] = first[i].item()
                    elif coltype == "bytes":
                        out[slot] = data[first[i]:first[i + 1]].tobytes()
                    else:
                        text = data[first[i]:first[i + 1]].tobytes().decode("utf-8")
                        out[slot] = (json.loads(text) if text else {}) if coltype == "json" else text

    def close(self) -> None:
        self.table = None
        self._fixed = self._other = []
        os.close(self.fd)  # releases the shared lock


# ---------------------------------------------------------------------------------------------
# The node-local shard cache


class ShardCache:
    """Shards as uncompressed Arrow IPC files in a node-local directory bounded by ``limit_bytes``.

    Safe for all processes of a node (ranks and their workers) sharing one directory; the
    directory must be node-local (liveness of a conversion is judged by its process id):

    - ``<key>.arrow``: a complete shard, renamed into place when whole;
    - ``.tmp-<pid>-<tid>-<key>.*``: conversions in progress (removed if their process died);
    - ``.reserve-<pid>-<tid>-<key>-<bytes>``: space promised to a conversion in progress, counted
      against the limit so that concurrent conversions cannot overshoot it together;
    - ``.lock-NN``: 64 lock stripes, one converter per shard at a time; ``.cache.lock``: eviction.

    A process reading a shard holds a shared ``flock`` on it; eviction takes the exclusive lock
    without waiting, so a shard in use is never deleted (it is skipped).
    """

    _STRIPES = 64
    _OPEN_ATTEMPTS = 5

    def __init__(self, cache_dir: str | Path, limit_bytes: int, roots: Sequence[str],
                 indexes: Sequence[DatasetIndex]) -> None:
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = int(limit_bytes)
        self.roots = list(roots)
        self.indexes = list(indexes)
        self._keys = [  # a rewritten shard (other size) gets another key, so no stale copy is read
            [hashlib.sha1(f"{root}|{s.name}|{s.num_bytes}|{s.num_samples}".encode()).hexdigest()[:24]
             for s in idx.shards]
            for root, idx in zip(self.roots, self.indexes)
        ]
        self._readers: dict[tuple[int, int], _ShardReader] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:  # for spawn-started workers: open maps and locks stay behind
        state = self.__dict__.copy()
        state["_readers"] = {}
        return state

    def path(self, dataset: int, shard: int) -> Path:
        return self.dir / f"{self._keys[dataset][shard]}.arrow"

    def key(self, dataset: int, shard: int) -> str:
        return self._keys[dataset][shard]

    # -- reading

    def reader(self, dataset: int, shard: int, tag: int) -> _ShardReader:
        """The open reader of a shard in this process (converted first if missing)."""
        if os.getpid() != self._pid:  # a forked worker: the parent's locks are not ours to keep
            for r in self._readers.values():
                os.close(r.fd)
            self._readers = {}
            self._pid = os.getpid()
        r = self._readers.get((dataset, shard))
        if r is None:
            r = self._readers[(dataset, shard)] = self._open(dataset, shard)
        r.last_tag = max(r.last_tag, tag)
        return r

    def release_before(self, dataset: int, tag: int) -> None:
        """Close this process's readers of ``dataset`` last used before window ``tag`` (positions
        only grow, so they will not be needed again this epoch), letting eviction remove them."""
        for k in [k for k, r in self._readers.items() if k[0] == dataset and r.last_tag < tag]:
            self._readers.pop(k).close()

    def _open(self, dataset: int, shard: int) -> _ShardReader:
        path = self.path(dataset, shard)
        info = self.indexes[dataset].shards[shard]
        where = storage.join(self.roots[dataset], info.name)
        for _ in range(self._OPEN_ATTEMPTS):
            self.fetch(dataset, shard, prefetch=False)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # evicted between fetch and open
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0:  # evicted before we got the lock
                os.close(fd)
                continue
            try:
                os.utime(path)  # least-recently-used order of eviction
                table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
                reader = _ShardReader(table, self.indexes[dataset].columns, fd, where)
            except BaseException:
                os.close(fd)
                raise
            if reader.num_rows != info.num_samples:
                reader.close()
                raise UserError(f"{where}: {reader.num_rows} rows, index.json says {info.num_samples}")
            return reader
        raise UserError(f"{self.dir}: shard {where} was evicted {self._OPEN_ATTEMPTS} times before it could be "
                        "opened: cache_limit_gb is too small for the processes sharing this cache")

    # -- converting and evicting

    @contextmanager
    def _flock(self, name: str, blocking: bool) -> Iterator[bool]:
        fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _reservation_bytes(self, dataset: int, shard: int) -> int:
        """Disk a conversion may need at its peak: the IPC file (about the parquet size plus
        per-batch metadata) and, for S3, the downloaded parquet file next to it."""
        info = self.indexes[dataset].shards[shard]
        ipc = int(info.num_bytes * 1.02) + (1 << 20)
        return ipc + (info.num_bytes if storage.is_s3(self.roots[dataset]) else 0)

    def fetch(self, dataset: int, shard: int, prefetch: bool, protect: frozenset[str] = frozenset()) -> bool:
        """Make sure the shard is in the cache. ``prefetch``: do not wait for another converter
        and do not exceed the limit (evicting nothing in ``protect``); returns whether it is there.
        Otherwise (a reader needs it now) wait, and exceed the limit if everything else is in use.
        """
        path = self.path(dataset, shard)
        if path.exists():
            return True
        key = self.key(dataset, shard)
        stripe = f".lock-{int(key[:8], 16) % self._STRIPES:02d}"
        with self._flock(stripe, blocking=not prefetch) as locked:
            if not locked:
                return False
            if path.exists():
                return True
            need = self._reservation_bytes(dataset, shard)
            with self._flock(".cache.lock", blocking=True):
                if not self._make_room(need, protect) and prefetch:
                    return False
                tag = f"{os.getpid()}-{threading.get_ident()}-{key}"
                reservation = self.dir / f".reserve-{tag}-{need}"
                reservation.touch()
            try:
                self._convert(dataset, shard, tag, path)
            finally:
                reservation.unlink(missing_ok=True)
        return True

    def usage_bytes(self) -> int:
        """Bytes of complete shards plus reservations of conversions in progress."""
        return self._scan()[0]

    def _scan(self) -> tuple[int, list[tuple[float, int, Path]]]:
        used = 0
        shards = []
        for entry in os.scandir(self.dir):
            name = entry.name
            try:
                if name.endswith(".arrow") and not name.startswith("."):
                    st = entry.stat()
                    used += st.st_size
                    shards.append((st.st_mtime, st.st_size, Path(entry.path)))
                elif name.startswith(".reserve-"):
                    pid, need = int(name.split("-")[1]), int(name.rsplit("-", 1)[1])
                    if storage.pid_alive(pid):
                        used += need
                    else:
                        os.unlink(entry.path)
                elif name.startswith(".tmp-") and not storage.pid_alive(int(name.split("-")[1])):
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue  # removed by another process meanwhile
        return used, shards

    def _make_room(self, need: int, protect: frozenset[str]) -> bool:
        """Evict least recently opened shards not in use (and not protected) until ``need`` more
        bytes fit; called under ``.cache.lock``. Returns whether they fit."""
        used, shards = self._scan()
        for _, size, path in sorted(shards):
            if used + need <= self.limit_bytes:
                break
            if path.stem in protect:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                used -= size
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # open in some process: keep it
            else:
                path.unlink()
                used -= size
            finally:
                os.close(fd)
        return used + need <= self.limit_bytes

    def _convert(self, dataset: int, shard: int, tag: str, dst: Path) -> None:
        """parquet (local, or downloaded from S3) -> uncompressed Arrow IPC, one row group at a
        time (memory: one row group), renamed into place when complete."""
        info: ShardInfo = self.indexes[dataset].shards[shard]
        columns = list(self.indexes[dataset].columns)
        uri = storage.join(self.roots[dataset], info.name)
        tmp_arrow = self.dir / f".tmp-{tag}.arrow"
        tmp_parquet = self.dir / f".tmp-{tag}.parquet"
        try:
            src: str = uri
            if storage.is_s3(uri):
                with storage.open_stream(uri) as body, open(tmp_parquet, "wb") as out:
                    shutil.copyfileobj(body, out, 8 << 20)
                src = str(tmp_parquet)
            elif not os.path.isfile(uri):
                raise UserError(f"{uri}: shard listed in index.json is missing")
            pf = pq.ParquetFile(src, memory_map=True)
            missing = [c for c in columns if c not in pf.schema_arrow.names]
            if missing:
                raise UserError(f"{uri}: columns {missing} of index.json are not in the shard")
            schema = pa.schema([pf.schema_arrow.field(c) for c in columns])
            rows = 0
            with pa.OSFile(str(tmp_arrow), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for g in range(pf.num_row_groups):
                    table = pf.read_row_group(g, columns=columns).select(columns)
                    writer.write_table(table)
                    rows += table.num_rows
            if rows != info.num_samples:
                raise UserError(f"{uri}: {rows} rows, index.json says {info.num_samples}: "
                                "the dataset was changed after it was indexed")
            os.replace(tmp_arrow, dst)
        except pa.ArrowInvalid as e:  # a damaged shard, or one that is not parquet
            raise UserError(f"{uri}: not a readable parquet shard ({str(e).splitlines()[0]}); rerun the "
                            "ingest/encode that wrote it") from None
        finally:
            tmp_arrow.unlink(missing_ok=True)
            tmp_parquet.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Dataset, sampler, loader


class LoaderDataset(Dataset):
    """Map-style dataset over global positions: ``dataset[p]`` is the sample at global position p,
    with ``_position``, ``_dataset`` (index into the config's datasets) and ``_caption_dropped``.

    ``__getitems__`` (used by DataLoader for a whole micro batch) computes the order vectorised
    and gathers each ndarray column into one tensor; the samples' tensors are its rows (views),
    so the default collate's stack is the only other copy.
    """

    def __init__(self, kind: str, columns: dict[str, str], streams: list[order.StreamOrder],
                 mixture: order.Mixture, cache: ShardCache, seed: int, caption_dropout: float,
                 empty_prompts: list[dict[str, np.ndarray]] | None, fingerprint: dict[str, Any]) -> None:
        self.kind = kind
        self.columns = columns
        self.streams = streams
        self.mixture = mixture
        self.cache = cache
        self.seed = seed
        self.caption_dropout = caption_dropout
        self.empty_prompts = empty_prompts
        self.fingerprint = fingerprint
        self._ndarray_columns = {name: parse_ndarray(t) for name, t in columns.items() if t.startswith("ndarray:")}

    @property
    def samples_per_epoch(self) -> int:
        """Sum of the datasets' sizes (with one dataset: one epoch)."""
        return sum(s.num_samples for s in self.streams)

    def __getitem__(self, position: int) -> dict[str, Any]:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        pos = np.asarray(positions, dtype=np.int64)
        n = pos.size
        ds, q = self.mixture.mix_at(pos)
        if self.caption_dropout > 0:
            dropped = order.caption_dropped(self.seed, pos, self.caption_dropout)
        else:
            dropped = np.zeros(n, dtype=bool)
        # ndarray columns are gathered into one tensor per column and handed out as row views
        tensors = {name: torch.empty((n, *shape), dtype=_torch_dtype(dtype))
                   for name, (dtype, shape) in self._ndarray_columns.items()}
        arrays = {name: t.numpy() for name, t in tensors.items()}
        values: dict[str, list] = {name: [None] * n for name in self.columns if name not in tensors}
        for d in np.unique(ds):
            in_d = np.flatnonzero(ds == d)
            stream = self.streams[d]
            loc = stream.sample_at(q[in_d])
            tag = loc.epoch * stream.num_windows + loc.window
            self.cache.release_before(int(d), int(tag.min()))
            shard_tag = {}
            for s, t in zip(loc.shard.tolist(), tag.tolist()):
                shard_tag[s] = max(t, shard_tag.get(s, t))
            for s in sorted(shard_tag):
                sel = loc.shard == s
                self.cache.reader(int(d), s, shard_tag[s]).read_into(loc.row[sel], in_d[sel], arrays, values)
        for i in np.flatnonzero(dropped).tolist():
            if "caption" in values:
                values["caption"][i] = ""
            if self.empty_prompts is not None:
                for name, empty in self.empty_prompts[int(ds[i])].items():
                    arrays[name][i] = empty
        columns = {name: tensors[name].unbind(0) if name in tensors else values[name] for name in self.columns}
        columns["_position"] = pos.tolist()
        columns["_dataset"] = ds.tolist()
        columns["_caption_dropped"] = dropped.tolist()
        return [dict(zip(columns, row)) for row in zip(*columns.values())]

    def prefetch_targets(self, position: int, lookahead: int) -> list[tuple[int, int]]:
        """(dataset, shard) pairs that reading global positions [position, position + lookahead)
        touches, plus the next window of each dataset; the current windows first."""
        per_dataset = []
        for d, stream in enumerate(self.streams):
            lo, hi = self.mixture.stream_range(d, position, position + lookahead)
            first, last = _window_pair(stream, lo, max(lo, hi - 1))
            windows = []
            e, w = first
            while True:
                windows.append(stream.window_shard_ids(e, w))
                if (e, w) == last:
                    break
                e, w = (e, w + 1) if w + 1 < stream.num_windows else (e + 1, 0)
            e, w = (e, w + 1) if w + 1 < stream.num_windows else (e + 1, 0)
            windows.append(stream.window_shard_ids(e, w))
            per_dataset.append([[(d, int(s)) for s in ids] for ids in windows])
        out = []
        for step in itertools.zip_longest(*per_dataset, fillvalue=[]):
            for shards in step:
                out.extend(shards)
        return out


def _window_pair(stream: order.StreamOrder, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    loc = stream.sample_at([lo, hi])
    return (int(loc.epoch[0]), int(loc.window[0])), (int(loc.epoch[1]), int(loc.window[1]))


class RankSampler(Sampler[int]):
    """Global positions ``cursor + rank + world_size * j`` for j = 0, 1, ... (endless)."""

    def __init__(self, cursor: int, rank: int, world_size: int) -> None:
        self.start = cursor + rank
        self.step = world_size

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start, self.step)


class _Prefetcher:
    """A thread of the rank's main process that converts the shards of the current and next
    shuffle windows into the cache ahead of the workers. An error is raised in the training
    thread at the next batch, not swallowed."""

    def __init__(self, dataset: LoaderDataset, lookahead: int) -> None:
        self.dataset = dataset
        self.lookahead = lookahead
        self.error: BaseException | None = None
        self._cursor = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, cursor: int) -> None:
        self._cursor = cursor
        self._stopping = False
        self._wake.set()
        self._thread = threading.Thread(target=self._run, name="latentforge-prefetch", daemon=True)
        self._thread.start()

    def advance(self, cursor: int) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        self._cursor = cursor
        self._wake.set()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None

    def run_once(self) -> None:
        """Convert the missing shards of the windows around the cursor, in reading order."""
        cache = self.dataset.cache
        targets = self.dataset.prefetch_targets(self._cursor, self.lookahead)
        protect = frozenset(cache.key(d, s) for d, s in targets)
        for d, s in targets:
            if self._stopping or not cache.fetch(d, s, prefetch=True, protect=protect):
                return  # no room until the readers move on: retried at the next batch

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                self.run_once()
        except BaseException as e:  # noqa: BLE001 -- handed to the training thread by advance()
            self.error = e


class TrainLoader:
    """Endless iterator of micro batches for one rank; ``cursor`` counts global samples consumed.

    Iterating starts from ``cursor``; each yielded batch advances it by the global batch
    (``world_size * micro_batch_size``). ``load_state_dict`` before iterating resumes; with
    another world size the ranks continue the same global sequence (any cursor works, since
    global batch b is always positions ``[cursor + b*G, cursor + (b+1)*G)``). Starting a new
    iteration or loading a state ends any earlier iterator. Use ``itertools.islice`` for N batches.
    """

    def __init__(self, dataset: LoaderDataset, cfg: LoaderConfig, micro_batch_size: int, rank: int,
                 world_size: int, collate: Callable[[list[dict[str, Any]]], Any]) -> None:
        self.dataset = dataset
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.collate = collate
        self.cursor = 0
        self._generation = 0
        ahead_batches = cfg.num_workers * cfg.prefetch_factor + 1
        self._prefetcher = _Prefetcher(dataset, ahead_batches * self.global_batch_size)

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.micro_batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.dataset.samples_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.cfg.seed, "cursor": self.cursor, "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.cfg.seed:
            raise UserError(f"data loader state: seed {state.get('seed')} in the checkpoint, {self.cfg.seed} in the "
                            "config; resuming with another seed would read another order: set data seed back")
        _check_fingerprint(state.get("fingerprint"), self.dataset.fingerprint)
        cursor = state.get("cursor")
        if not isinstance(cursor, int) or cursor < 0:
            raise UserError(f"data loader state: cursor must be an integer >= 0, got {cursor!r}")
        self.start_at(cursor)

    def start_at(self, cursor: int) -> None:
        """Read on from global position ``cursor`` (a later training phase continues the order where
        the earlier ones stopped; a resume, through ``load_state_dict``). Before iterating."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        self._generation += 1  # an earlier iterator stops at its next step
        self.cursor = cursor

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        generation = self._generation
        self._prefetcher.stop()
        workers = self.cfg.num_workers
        loader = DataLoader(
            self.dataset,
            batch_size=self.micro_batch_size,
            sampler=RankSampler(self.cursor, self.rank, self.world_size),
            num_workers=workers,
            collate_fn=self.collate,
            prefetch_factor=self.cfg.prefetch_factor if workers else None,
            pin_memory=self.cfg.pin_memory,
            worker_init_fn=worker_init(workers),
        )
        return self._batches(loader, generation)

    def _batches(self, loader: DataLoader, generation: int) -> Iterator[Any]:
        batches = iter(loader)  # forks the workers: before the prefetch thread runs (no lock held mid-fork)
        self._prefetcher.start(self.cursor)
        try:
            for batch in batches:
                if generation != self._generation:
                    return
                self.cursor += self.global_batch_size
                self._prefetcher.advance(self.cursor)
                yield batch
        finally:
            if generation == self._generation:
                self._prefetcher.stop()

    def close(self) -> None:
        """Stop the prefetch thread and end any iterator."""
        self._generation += 1
        self._prefetcher.stop()


def worker_init(num_workers: int) -> Callable[[int], None] | None:
    """The ``worker_init_fn`` of a DataLoader made now: its workers ignore the stop signals that this
    process catches (:func:`latentforge.interrupt.ignore_in_worker`); None without workers."""
    return functools.partial(interrupt.ignore_in_worker, interrupt.caught_signals()) if num_workers else None


def _check_fingerprint(saved: Any, current: dict[str, Any]) -> None:
    if saved == current:
        return
    if not isinstance(saved, dict):
        raise UserError(f"data loader state: no valid fingerprint ({saved!r})")
    diffs = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        if k == "datasets" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                diffs += [f"datasets[{i}].{f}: {x.get(f)!r} -> {y.get(f)!r}" for f in sorted(set(x) | set(y))
                          if x.get(f) != y.get(f)]
        elif a != b:
            diffs.append(f"{k}: {a!r} -> {b!r}")
    raise UserError("data loader state: the checkpoint was made with another data order (" + "; ".join(diffs)
                    + "); the cursor would point elsewhere: restore the data config or start a new run")


# ---------------------------------------------------------------------------------------------
# Building


def _dataset_root(path: str) -> str:
    return path.rstrip("/") if storage.is_s3(path) else os.path.abspath(os.path.expanduser(path))


def _content_digest(index: DatasetIndex) -> str:
    data = json.dumps({"columns": index.columns, "shards": [[s.name, s.num_samples] for s in index.shards]},
                      sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype


def _check_columns(root: str, columns: dict[str, str]) -> None:
    for name, coltype in columns.items():
        if coltype.startswith("ndarray:"):
            try:
                _torch_dtype(parse_ndarray(coltype)[0])
            except (TypeError, ValueError):
                raise UserError(f"{root}: column {name!r} has type {coltype!r}, "
                                "not a numpy dtype torch can hold") from None
        elif coltype not in ("str", "int64", "float64", "bytes", "json"):
            raise UserError(f"{root}: column {name!r} has unknown type {coltype!r}")


def load_empty_prompt(path: str, columns: dict[str, str], what: str = "caption_dropout") -> dict[str, np.ndarray]:
    """The empty caption's text outputs of the latent dataset at ``path`` (``what`` needs them:
    named in the error when they are missing), checked against its ``columns``."""
    import safetensors.numpy

    uri = storage.join(_dataset_root(path), EMPTY_PROMPT)
    if not storage.exists(uri):
        raise ConfigError(f"{what}: needs {uri} (the empty caption's text embedding, written by the encode "
                          f"step); re-run encode or set {what}: {'0' if what == 'caption_dropout' else 'false'}")
    out = {}
    for name, arr in safetensors.numpy.load(storage.read_bytes(uri)).items():
        coltype = columns.get(name, "")
        if not coltype.startswith("ndarray:"):
            raise UserError(f"{uri}: tensor {name!r} is not an ndarray column of the dataset")
        dtype, shape = parse_ndarray(coltype)
        if tuple(arr.shape) != shape:
            raise UserError(f"{uri}: tensor {name!r} has shape {tuple(arr.shape)}, column {name!r} is {coltype}")
        out[name] = np.asarray(arr, dtype=dtype)
    if not out:
        raise UserError(f"{uri}: holds no tensors")
    return out


def open_dataset(cfg: LoaderConfig) -> LoaderDataset:
    """Read the datasets' indexes, check they can be read together, and set up order and cache."""
    cfg.validate()
    if not cfg.datasets:
        raise ConfigError("datasets: empty: list at least one dataset directory ({path: ..., weight: ...})")
    roots = [_dataset_root(s.path) for s in cfg.datasets]
    indexes = [read_index(r) for r in roots]
    kind, columns = indexes[0].kind, indexes[0].columns
    for root, idx in zip(roots, indexes):
        if idx.kind != kind or idx.columns != columns:
            raise UserError(f"{root}: kind {idx.kind!r} with columns {idx.columns} cannot be mixed with {roots[0]} "
                            f"(kind {kind!r}, columns {columns}): mix datasets of one kind, made by the same "
                            "encode settings")
        if idx.num_samples == 0:
            raise UserError(f"{root}: the dataset has no samples")
    _check_columns(roots[0], columns)

    weights = [s.weight for s in cfg.datasets]
    mixture = order.Mixture(weights, cfg.mix_block, cfg.seed)
    for i, c in enumerate(mixture.counts):
        if c == 0:
            raise ConfigError(f"mix_block: a block of {cfg.mix_block} positions gives datasets[{i}] (weight "
                              f"{weights[i]}) no sample: raise mix_block or that weight")
    streams = [order.StreamOrder([s.num_samples for s in idx.shards], cfg.seed, stream_id=i, shuffle=cfg.shuffle,
                                 window_shards=cfg.shuffle_window_shards)
               for i, idx in enumerate(indexes)]

    # The current and the next window of every dataset, plus one conversion in flight (an S3
    # download next to its Arrow file); less would evict shards before they are read.
    limit = int(cfg.cache_limit_gb * _GB)
    largest = [max(s.num_bytes for s in idx.shards) for idx in indexes]
    needed = sum(min(2 * cfg.shuffle_window_shards, len(idx.shards)) * b for idx, b in zip(indexes, largest))
    needed += 2 * max(largest)
    if limit < needed:
        raise ConfigError(f"cache_limit_gb: {cfg.cache_limit_gb} cannot hold two shuffle windows of "
                          f"{cfg.shuffle_window_shards} shards (up to {max(largest) / 1e6:.1f} MB each) per dataset; "
                          f"need at least {needed / _GB:.3f}: raise it or lower shuffle_window_shards")
    cache = ShardCache(cfg.resolved_cache_dir(), limit, roots, indexes)

    empty_prompts = None
    if cfg.caption_dropout > 0 and kind == "latent":
        empty_prompts = [load_empty_prompt(r, columns) for r in roots]

    fingerprint = {
        "order_version": ORDER_VERSION,
        "shuffle": cfg.shuffle,
        "shuffle_window_shards": cfg.shuffle_window_shards,
        "mix_block": cfg.mix_block,
        "datasets": [{"weight": w, "num_samples": idx.num_samples, "content": _content_digest(idx)}
                     for w, idx in zip(weights, indexes)],
    }
    return LoaderDataset(kind, columns, streams, mixture, cache, cfg.seed, cfg.caption_dropout, empty_prompts,
                         fingerprint)


def build_loader(cfg: LoaderConfig, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 collate: Callable[[list[dict[str, Any]]], Any] = collate_samples) -> TrainLoader:
    """The training loader of rank ``rank`` of ``world_size`` (see :class:`TrainLoader`)."""
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size: must be >= 1, got {micro_batch_size}")
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is not in [0, world_size={world_size})")
    return TrainLoader(open_dataset(cfg), cfg, micro_batch_size, rank, world_size, collate)
