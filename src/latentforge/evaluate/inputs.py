"""The inputs of an evaluation: prompts and reference images, from files a user already has.

Prompts: a text file (one per line), a ``.jsonl`` or ``.parquet`` file (a caption column), or a
raw-shard dataset written by ``latentforge ingest`` (its ``caption`` column: typically the
held-out split). Reference images: a raw-shard dataset (its ``image`` column) or an image folder.
Each reference set also has a fingerprint of its image list, which keys the feature cache.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from PIL import Image

from latentforge import storage
from latentforge.data import schema
from latentforge.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def is_raw_dataset(path: str) -> bool:
    return storage.exists(storage.join(str(path), schema.INDEX))


def _raw_column(root: str, column: str) -> list:
    index = schema.read_index(root)
    if column not in index.columns:
        raise UserError(f"{root}: a {index.kind} dataset without a {column!r} column "
                        f"(has {', '.join(index.columns)}); give raw shards written by latentforge ingest")
    values: list = []
    for shard in index.shards:
        values.extend(schema.read_shard(storage.join(root, shard.name), [column]).column(column).to_pylist())
    return values


def load_prompts(source: str, column: str = "caption") -> list[str]:
    """The prompts of ``source`` in file order; an empty source is an error."""
    if not source:
        raise UserError("eval: no prompts (set --prompts / eval.prompts to a file or a raw-shard dataset)")
    p = Path(source)
    if is_raw_dataset(source):
        prompts = [str(c) for c in _raw_column(source, "caption")]
    elif not storage.is_s3(source) and not p.exists():
        raise UserError(f"{source}: prompt file not found")
    elif p.is_dir():
        raise UserError(f"{source}: a directory without index.json: give a prompt file or raw shards from ingest")
    elif p.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{source} line {n}: not valid JSON") from None
            if not isinstance(row, dict) or column not in row:
                raise UserError(f"{source} line {n}: no {column!r} field (set eval.prompt_column)")
            prompts.append(str(row[column]))
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as e:
            raise UserError(f"{source}: not a readable parquet file ({str(e).splitlines()[0][:120]})") from None
        if column not in table.column_names:
            raise UserError(f"{source}: no {column!r} column (has {', '.join(table.column_names)}; set eval.prompt_column)")
        prompts = [str(c) for c in table.column(column).to_pylist() if c is not None]
    else:
        try:
            prompts = [line.strip() for line in p.read_text(encoding="utf-8").splitlines()]
        except UnicodeDecodeError:
            raise UserError(f"{source}: not a UTF-8 text file of prompts") from None
        prompts = [line for line in prompts if line]
    if not prompts:
        raise UserError(f"{source}: no prompts in it (empty file or column)")
    return prompts


@dataclass
class ReferenceSet:
    """A reference image set: its location, ordered item ids and a fingerprint of the image list."""

    root: str
    kind: str  # "raw" or "folder"
    items: list[str]  # raw: "shard-name/row"; folder: relative paths
    fingerprint: str  # sha256 of the image list (and of the files' sizes and times / the dataset index)

    def __len__(self) -> int:
        return len(self.items)

    def iter_images(self) -> Iterator[Image.Image]:
        """The images in order, decoded to RGB."""
        if self.kind == "folder":
            for rel in self.items:
                with Image.open(Path(self.root) / rel) as im:
                    yield im.convert("RGB")
            return
        wanted: dict[str, list[int]] = {}
        for item in self.items:
            shard, row = item.rsplit("/", 1)
            wanted.setdefault(shard, []).append(int(row))
        for shard, rows in wanted.items():  # items are in shard order, so one shard is read at a time
            images = schema.read_shard(storage.join(self.root, shard), ["image"]).column("image")
            for r in rows:
                with Image.open(io.BytesIO(images[r].as_py())) as im:
                    yield im.convert("RGB")


def load_reference(root: str, max_images: int = 0) -> ReferenceSet:
    """The reference set at ``root`` (raw shards or an image folder); the first ``max_images`` (0: all)."""
    if not root:
        raise UserError("eval: FID/KID/FD need reference images (set --reference / eval.reference)")
    h = hashlib.sha256()
    if is_raw_dataset(root):
        index = schema.read_index(root)
        if "image" not in index.columns:
            raise UserError(f"{root}: a {index.kind} dataset without images; give raw shards written by ingest")
        h.update(index.to_json().encode())
        items = [f"{s.name}/{i}" for s in index.shards for i in range(s.num_samples)]
        kind = "raw"
    else:
        p = Path(root)
        if storage.is_s3(root) or not p.is_dir():
            raise UserError(f"{root}: reference images not found (give raw shards from ingest or an image folder)")
        files = sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        items = [str(f.relative_to(p)) for f in files]
        for f, rel in zip(files, items):
            st = f.stat()
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        kind = "folder"
    if max_images:
        items = items[:max_images]
    if not items:
        raise UserError(f"{root}: no reference images in it")
    h.update(f"first {len(items)}".encode())
    return ReferenceSet(root=str(root), kind=kind, items=items, fingerprint=h.hexdigest())
