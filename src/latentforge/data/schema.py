"""The shard format: parquet files plus an ``index.json`` that describes them.

A dataset directory (local or ``s3://``) holds::

    index.json            {"format": "latentforge-shards", "version": 1, "kind": "raw" | "latent",
                           "columns": {"key": "str", "image": "bytes", "latent_mean": "ndarray:float16:4,32,32", ...},
                           "shards": [{"name": "shard-000000.parquet", "num_samples": 812, "num_bytes": 123456}, ...],
                           "num_samples": 812, "meta": {...}}
    shard-000000.parquet  one row per sample
    ...

Column types are written once, here, and read back by the loader: ``str``, ``int64``,
``float64``, ``bytes`` (opaque, e.g. an encoded image), ``json`` (a JSON string) and
``ndarray:<dtype>:<d0,d1,...>`` (a fixed-shape array stored as raw little-endian bytes, so that
it is read with ``np.frombuffer`` and no copy). Parquet is the interchange format (pandas,
DuckDB, Ray Data and img2dataset all read it); ``index.json`` is written last, so a dataset
without one is incomplete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from latentforge import storage
from latentforge.errors import UserError

FORMAT = "latentforge-shards"
VERSION = 1
INDEX = "index.json"
EMPTY_PROMPT = "empty_prompt.safetensors"  # a latent dataset's "" text outputs (caption dropout, CFG)

RAW_COLUMNS: dict[str, str] = {
    "key": "str",  # unique, stable id of the sample: "<source-unit>/<member>"
    "image": "bytes",  # the processed image, encoded (png/jpeg/webp), at the target size
    "image_format": "str",
    "caption": "str",
    "width": "int64",  # of the stored image
    "height": "int64",
    "orig_width": "int64",  # of the source image, after EXIF orientation
    "orig_height": "int64",
    "source": "str",  # address of the source file (and member) it came from
    "license": "str",  # "" when the source did not say
    "sha256": "str",  # of the source image bytes (exact-duplicate detection)
    "meta": "json",  # extra columns of the source (url, aesthetic score, ...)
}


def parse_ndarray(coltype: str) -> tuple[np.dtype, tuple[int, ...]]:
    """``"ndarray:float16:4,32,32"`` -> (dtype('float16'), (4, 32, 32))."""
    parts = coltype.split(":")
    if len(parts) != 3 or parts[0] != "ndarray":
        raise ValueError(f"not an ndarray column type: {coltype!r}")
    shape = tuple(int(d) for d in parts[2].split(",") if d != "")
    return np.dtype(parts[1]).newbyteorder("<"), shape


def ndarray_type(dtype: Any, shape: Sequence[int]) -> str:
    return f"ndarray:{np.dtype(dtype).name}:{','.join(str(int(d)) for d in shape)}"


def arrow_type(coltype: str) -> pa.DataType:
    if coltype in ("str", "json"):
        return pa.string()
    if coltype == "int64":
        return pa.int64()
    if coltype == "float64":
        return pa.float64()
    if coltype == "bytes" or coltype.startswith("ndarray:"):
        return pa.binary()
    raise ValueError(f"unknown column type {coltype!r}")


def encode_value(value: Any, coltype: str) -> Any:
    if coltype == "json":
        return json.dumps(value if value is not None else {}, sort_keys=True)
    if coltype.startswith("ndarray:"):
        dtype, shape = parse_ndarray(coltype)
        arr = np.asarray(value, dtype=dtype)
        if arr.shape != shape:
            raise ValueError(f"array of shape {arr.shape} for column type {coltype}")
        return arr.tobytes()
    return value


def decode_value(value: Any, coltype: str) -> Any:
    """Inverse of :func:`encode_value` (ndarrays are read-only views of ``value``)."""
    if coltype == "json":
        return json.loads(value) if value else {}
    if coltype.startswith("ndarray:"):
        dtype, shape = parse_ndarray(coltype)
        return np.frombuffer(value, dtype=dtype).reshape(shape)
    return value


@dataclass
class ShardInfo:
    name: str
    num_samples: int
    num_bytes: int


@dataclass
class DatasetIndex:
    kind: str
    columns: dict[str, str]
    shards: list[ShardInfo]
    meta: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def to_json(self) -> str:
        d = {
            "format": self.format,
            "version": self.version,
            "kind": self.kind,
            "columns": self.columns,
            "num_samples": self.num_samples,
            "shards": [asdict(s) for s in self.shards],
            "meta": self.meta,
        }
        return json.dumps(d, indent=1, sort_keys=False)


def rows_to_table(rows: Sequence[dict[str, Any]], columns: dict[str, str]) -> pa.Table:
    arrays = {}
    for name, coltype in columns.items():
        arrays[name] = pa.array([encode_value(r.get(name), coltype) for r in rows], type=arrow_type(coltype))
    return pa.table(arrays)


def write_shard(path: str | Path, rows: Sequence[dict[str, Any]], columns: dict[str, str],
                row_group_size: int = 256) -> ShardInfo:
    """Write one parquet shard atomically (temp file, fsync, rename) and describe it.

    No compression: images are already compressed and latents do not compress, and an
    uncompressed file is cheap to map into the loader's cache.
    """
    table = rows_to_table(rows, columns)
    return write_table(path, table, row_group_size)


class ShardWriter:
    """Write a shard incrementally (row groups), so a large shard never sits in memory whole.

    The file appears under its final name only in :meth:`close` (temp file, fsync, rename).
    """

    def __init__(self, path: str | Path, columns: dict[str, str], row_group_size: int = 256):
        self.path = Path(path)
        self.columns = columns
        self.row_group_size = row_group_size
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        schema = pa.schema([(n, arrow_type(t)) for n, t in columns.items()])
        self._writer = pq.ParquetWriter(self._tmp, schema, compression="none", use_dictionary=False)
        self._pending: list[dict[str, Any]] = []
        self.num_samples = 0

    def write(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        self.num_samples += 1
        if len(self._pending) >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(rows_to_table(self._pending, self.columns))
            self._pending = []

    def close(self) -> ShardInfo:
        self._flush()
        self._writer.close()
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self._tmp, self.path)
        return ShardInfo(name=self.path.name, num_samples=self.num_samples, num_bytes=self.path.stat().st_size)

    def abort(self) -> None:
        self._writer.close()
        self._tmp.unlink(missing_ok=True)


def write_table(path: str | Path, table: pa.Table, row_group_size: int = 256) -> ShardInfo:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="none", row_group_size=row_group_size, use_dictionary=False)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return ShardInfo(name=path.name, num_samples=table.num_rows, num_bytes=path.stat().st_size)


def read_shard(uri: str, columns: Sequence[str] | None = None) -> pa.Table:
    """Read a whole shard (local or S3) as an Arrow table; a damaged one is a one-line error."""
    try:
        if storage.is_s3(uri):
            return pq.read_table(pa.BufferReader(storage.read_bytes(uri)), columns=columns)
        return pq.read_table(uri, columns=columns, memory_map=True)
    except pa.ArrowInvalid as e:
        raise UserError(f"{uri}: not a readable parquet shard ({str(e).splitlines()[0]}); rerun the "
                        "ingest/encode that wrote it") from None


def write_index(root: str | Path, index: DatasetIndex) -> None:
    storage.write_bytes(storage.join(str(root), INDEX), index.to_json().encode())


def read_index(root: str) -> DatasetIndex:
    """Read ``index.json`` of a dataset directory; a clear error when it is not one."""
    uri = storage.join(str(root), INDEX)
    if not storage.exists(uri):
        raise UserError(f"{root}: not a latentforge dataset (no {INDEX}; was the ingest/encode finished?)")
    try:
        d = json.loads(storage.read_bytes(uri))
    except json.JSONDecodeError:
        raise UserError(f"{uri}: not valid JSON") from None
    if not isinstance(d, dict):
        raise UserError(f"{uri}: holds a JSON {type(d).__name__}, not a dataset index; rerun the ingest/encode "
                        "that wrote it")
    if d.get("format") != FORMAT:
        raise UserError(f"{uri}: format {d.get('format')!r} is not {FORMAT!r}")
    if not isinstance(d.get("version"), int) or d["version"] > VERSION:
        raise UserError(f"{uri}: version {d.get('version')!r} is not one this latentforge understands (<= {VERSION})")
    try:
        index = DatasetIndex(
            kind=d["kind"],
            columns=dict(d["columns"]),
            shards=[ShardInfo(**s) for s in d["shards"]],
            meta=d.get("meta", {}),
            format=d["format"],
            version=d["version"],
        )
    except (KeyError, TypeError, ValueError) as e:  # a damaged or hand-edited index
        what = f"no {e.args[0]!r} entry" if isinstance(e, KeyError) else f"malformed ({e})"
        raise UserError(f"{uri}: {what}; rerun the ingest/encode that wrote it") from None
    if index.kind not in ("raw", "latent") or not isinstance(index.meta, dict):
        raise UserError(f"{uri}: kind {index.kind!r} is neither 'raw' nor 'latent'")
    return index
