"""The sources of the ingest: image folders, WebDataset tars and parquet files, local or on S3.

:func:`plan_units` lists the sources and cuts them into :class:`WorkUnit` s (a chunk of a folder,
one tar, one parquet file or a run of its row groups) in a fixed order; :func:`iter_records`
reads one unit and yields a :class:`SourceRecord` per sample, with the raw image bytes (never
decoded here). Every sample a unit holds is yielded exactly once, either with its data or with
an ``error`` the ingest counts as a rejection:

- ``missing_file``: a metadata row or a parquet path names a file that does not exist
- ``outside_source``: a path that leaves the source the user named (see below); never read
- ``symlink``: a symbolic link, unless ``follow_symlinks`` is set; never read
- ``unsafe_path``: a tar member with an absolute path, a ``..`` component, or a link/device; never read
- ``caption_decode_error``: a caption file that is not valid UTF-8
- ``meta_decode_error``: a tar ``.json`` member that is not a UTF-8 JSON object
- ``no_image``: a tar sample or parquet row without image data
- ``empty_file``: a zero-byte image
- ``download_failed``: an img2dataset row whose ``status`` is not ``success``
- ``source_error``: the file could not be read (truncated or corrupt archive, I/O error)

Kinds of source (each a local path or ``s3://bucket/prefix``):

- a ``.tar`` / ``.tar.gz`` / ``.tgz`` file, or a directory holding any: WebDataset shards, one unit each;
- else a ``.parquet`` file, or a directory holding any (and no tar): one unit per file, or per
  ``parquet_unit_rows`` rows;
- else an image folder (recursive), cut into units of ``folder_chunk`` images in sorted order.

A directory is read as one kind only (tar before parquet before images), because its other files
are usually side files of that kind: img2dataset writes a metadata ``.parquet`` next to each
``.tar``, and a parquet with a path column names images that sit beside it. The files not read
are counted in the listing (``ignored_files``) with a note; pass them as a source of their own to
ingest them. Files and directories whose name starts with ``.`` are ignored too (``._x.jpg`` is
macOS metadata, not an image).

Paths never escape the source a user named. :func:`confine` is the one rule every read of a file
goes through (folder images and their captions, metadata.jsonl/csv ``file_name``, parquet path
columns, the tars and parquets of a directory; local or S3): the path is resolved and must lie
under the source root (the directory named, or the folder of a named file; for S3 the bucket and
prefix, and a key with a ``..`` component is refused), and on a local disk no part of it below the
root may be a symbolic link unless ``follow_symlinks`` is set (then links are followed wherever
they point: the user vouches for them). Links to directories are never descended while listing.
A refused path becomes a rejected record (``outside_source`` or ``symlink``) with its reason.

Keys are ``<source name>/<path within the source>``: ``imgs/a/x.jpg`` for a folder image,
``laion/00000/000000012`` for a tar sample, ``coyo/part-0/17`` (row 17) for a parquet row. The
source name is the basename of the source argument (``-2``, ``-3`` appended if two sources share
one), so keys are unique within a run and stable as long as the sources are given in the same
order. Sources that overlap (the same file in two of them) are refused.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import posixpath
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

from latentforge import storage
from latentforge.errors import Problems, UserError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TAR_EXTS = (".tar", ".tar.gz", ".tgz")
PARQUET_EXTS = (".parquet",)
METADATA_FILES = ("metadata.jsonl", "metadata.csv")  # Hugging Face imagefolder convention

# Column names tried in order when SourceConfig.image_column / caption_column is None.
IMAGE_BYTES_COLUMNS = ("jpg", "jpeg", "png", "webp", "image")  # img2dataset writes "jpg"; HF "image"
IMAGE_PATH_COLUMNS = ("path", "file_name", "image_path")
CAPTION_COLUMNS = ("caption", "txt", "text")  # matched case-insensitively (LAION writes "TEXT")
# Image members of a WebDataset sample, in order of preference.
TAR_IMAGE_EXTS = tuple(e[1:] for e in IMAGE_EXTS)

MAX_META_CHARS = 1000  # longer meta values (EXIF blobs, embeddings) are left out of the shards
PARQUET_BATCH_ROWS = 64  # rows decoded to Python at a time: bounds memory to a few images
TAR_TAIL_BYTES = 64 << 10  # how much of the tar stream is kept to check its end (tarfile reads 10 KiB ahead)


@dataclass
class SourceConfig:
    """How the ingest reads its sources."""

    image_column: str | None = field(default=None, metadata={
        "help": "parquet column with the image bytes (binary or {bytes, path} struct) or path; "
                "None = first of jpg, jpeg, png, webp, image, path, file_name, image_path"})
    caption_column: str | None = field(default=None, metadata={
        "help": "parquet / metadata.jsonl|csv column with the caption; None = first of caption, txt, text"})
    license: str = field(default="", metadata={
        "help": "license of samples whose source does not name one, e.g. CC-BY-4.0"})
    folder_chunk: int = field(default=1000, metadata={"help": "images per work unit of an image folder"})
    parquet_unit_rows: int = field(default=10000, metadata={
        "help": "split a parquet file into units of about this many rows (whole row groups); 0 = one unit per file"})
    caption_ext: str = field(default=".txt", metadata={
        "help": "extension of the caption file next to an image (a/x.jpg + a/x.txt), and of the caption member of a tar sample"})
    follow_symlinks: bool = field(default=False, metadata={
        "help": "read files reached through symbolic links (wherever they point); false = reject them as 'symlink'. "
                "Paths outside the source (../x, /etc/x, another bucket) are rejected either way"})

    def validate(self) -> None:
        problems = Problems()
        for name in ("image_column", "caption_column"):
            if getattr(self, name) == "":
                problems.add(f"{name}: empty; give a column name or null to detect it")
        if self.folder_chunk < 1:
            problems.add(f"folder_chunk: must be >= 1, got {self.folder_chunk}")
        if self.parquet_unit_rows < 0:
            problems.add(f"parquet_unit_rows: must be >= 0, got {self.parquet_unit_rows}; 0 = one unit per file")
        ext = self.caption_ext.lower()
        if not re.fullmatch(r"\.[a-z0-9_]+", ext) or ext in IMAGE_EXTS or ext == ".json":
            problems.add(f"caption_ext: {self.caption_ext!r} is not a plain extension; use one like .txt")
        problems.raise_if_any()


@dataclass(frozen=True)
class WorkUnit:
    """One piece of work for one worker; picklable, and named by :meth:`unit_id` in the ledger."""

    kind: str  # "files" | "tar" | "parquet" | "refused" (a file the path rule refuses: one rejected record)
    uri: str  # the tar or parquet file, or the folder of "files"
    name: str  # key prefix of its records, unique within the run
    items: tuple = ()  # "files": (image_uri, caption_uri | None, metadata_row_json | None) per image;
    #                    "refused": (reason, detail)
    row_groups: tuple = ()  # "parquet": the row groups of this unit; () = all
    part: int = 0  # "files": index of this chunk of the folder
    root: str = ""  # the source root that paths read by this unit must stay under

    def unit_id(self) -> str:
        if self.kind == "files":
            # The digest makes a changed folder a different plan, so a resume never mixes listings.
            digest = hashlib.sha1(json.dumps(self.items).encode()).hexdigest()[:8]
            return f"files:{self.uri}#{self.part}@{digest}"
        if self.kind == "parquet" and self.row_groups:
            return f"parquet:{self.uri}#rg={self.row_groups[0]}-{self.row_groups[-1]}"
        return f"{self.kind}:{self.uri}"


@dataclass
class SourceRecord:
    source: str  # address of the sample: image uri, "tar_uri#member", "parquet_uri#row=12"
    key: str  # unique within the run
    image: bytes | None
    caption: Any  # a str; None: no caption found; a number, list or mapping is rejected (caption_not_text)
    license: str
    meta: dict
    error: str | None = None  # a rejection found while reading (see the module docstring)
    detail: str = ""


# ---------------------------------------------------------------- small helpers


def _has_ext(name: str, exts: tuple[str, ...]) -> bool:
    return name.lower().endswith(exts)


def _strip_ext(name: str, exts: tuple[str, ...]) -> str:
    low = name.lower()
    for e in sorted(exts, key=len, reverse=True):
        if low.endswith(e):
            return name[: -len(e)]
    return name


def _normalize_source(source: str) -> str:
    if storage.is_s3(source):
        storage.split_s3(source)  # refuses "s3://" without a bucket
        return source.rstrip("/")
    return os.path.abspath(source)


def _rel(uri: str, root: str) -> str:
    """Path of ``uri`` under the directory ``root``, with ``/`` separators."""
    if storage.is_s3(root):
        return uri[len(root.rstrip("/")) + 1:]
    return os.path.relpath(uri, root).replace(os.sep, "/")


def _parent(uri: str) -> str:
    return uri.rsplit("/", 1)[0] if storage.is_s3(uri) else os.path.dirname(uri)


def _meta_value(value: Any) -> tuple[bool, Any]:
    """(keep, value) for one meta field: scalars and short strings/structures are kept as JSON data."""
    if value is None or isinstance(value, (bool, int)):
        return True, value
    if isinstance(value, float):
        return True, value if math.isfinite(value) else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return False, None
    if isinstance(value, str):
        return len(value) <= MAX_META_CHARS, value
    text = json.dumps(value, default=str)  # lists, dicts, dates, decimals
    return len(text) <= MAX_META_CHARS, json.loads(text)


def _meta(row: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if k not in skip:
            keep, val = _meta_value(v)
            if keep:
                out[k] = val
    return out


def _license(value: Any, cfg: SourceConfig) -> str:
    return str(value) if value not in (None, "") else cfg.license


def _find_column(names: list[str], candidates: tuple[str, ...]) -> str | None:
    """First of ``candidates`` among ``names``, an exact match first, then case-insensitively."""
    for cand in candidates:
        if cand in names:
            return cand
        for n in names:
            if n.lower() == cand:
                return n
    return None


def _is_not_found(exc: Exception) -> bool:
    if isinstance(exc, FileNotFoundError):
        return True
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("NoSuchKey", "404", "NotFound")


def _read_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this file could not be read" (bad data or I/O), never a code bug."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (OSError, EOFError, tarfile.TarError, zlib.error, BotoCoreError, ClientError)


def _read_file(uri: str) -> tuple[bytes | None, str | None, str]:
    """(bytes, error, detail) of one image file."""
    try:
        data = storage.read_bytes(uri)
    except _read_errors() as e:
        if _is_not_found(e):
            return None, "missing_file", uri
        return None, "source_error", f"{uri}: {type(e).__name__}: {e}"
    if not data:
        return None, "empty_file", uri
    return data, None, ""


def confine(uri: str, root: str, follow_symlinks: bool) -> tuple[str | None, str]:
    """``(None, "")`` when ``uri`` may be read as part of the source ``root``, else ``(reason,
    detail)``: ``outside_source`` when it resolves outside the root (or is on another store or
    bucket, or an S3 key has a ``..`` component), ``symlink`` when a local path goes through a
    symbolic link below the root and ``follow_symlinks`` is off. The root itself (the path the
    user named) may be or lie under a link."""
    if storage.is_s3(root):
        if not storage.is_s3(uri):
            return "outside_source", f"{uri}: a local path named in the S3 source {root}"
        bucket, key = storage.split_s3(uri)
        root_bucket, prefix = storage.split_s3(root)
        prefix = prefix.strip("/")
        if ".." in key.split("/"):
            return "outside_source", f"{uri}: the key has a '..' component"
        if bucket != root_bucket or (prefix and not key.startswith(prefix + "/")):
            return "outside_source", f"{uri}: outside the source {root}"
        return None, ""
    if storage.is_s3(uri):
        return "outside_source", f"{uri}: an S3 address named in the local source {root}"
    rel = os.path.relpath(os.path.abspath(uri), os.path.abspath(root))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return "outside_source", f"{uri}: outside the source {root}"
    real_root = os.path.realpath(root)
    lexical = os.path.normpath(os.path.join(real_root, rel))
    real = os.path.realpath(lexical)
    if real != lexical and not follow_symlinks:
        return "symlink", (f"{uri}: a symbolic link (to {real}); set ingest.source.follow_symlinks=true "
                           "to read links")
    return None, ""


def _read_confined(uri: str, root: str, cfg: SourceConfig) -> tuple[bytes | None, str | None, str]:
    """:func:`_read_file` of a path that :func:`confine` allows; else its refusal."""
    reason, detail = confine(uri, root, cfg.follow_symlinks)
    if reason:
        return None, reason, detail
    return _read_file(uri)


def _key_part(uri: str, root: str) -> str:
    """The path of ``uri`` relative to ``root`` for a record key (``../x.png`` for a local path
    outside it), or ``uri`` itself when that is not a path under the same root."""
    if storage.is_s3(root):
        return _rel(uri, root) if uri.startswith(root.rstrip("/") + "/") else uri
    return uri if storage.is_s3(uri) else _rel(uri, root)


# ---------------------------------------------------------------- planning


@dataclass
class _Listing:
    """Counts of one planning pass, returned as plain data by :func:`plan_units`."""

    files: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("image", "caption", "metadata", "tar", "parquet"), 0))
    metadata_rows: int = 0
    missing_files: int = 0  # metadata rows whose file does not exist (yielded as missing_file)
    parquet_rows: int = 0
    ignored_files: int = 0
    ignored_by_ext: dict[str, int] = field(default_factory=dict)
    ignored_examples: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)

    def ignore(self, uri: str, hidden: bool = False) -> None:
        ext = "(hidden)" if hidden else (os.path.splitext(storage.basename(uri))[1].lower() or "(none)")
        self.ignored_files += 1
        self.ignored_by_ext[ext] = self.ignored_by_ext.get(ext, 0) + 1
        if len(self.ignored_examples) < 5:
            self.ignored_examples.append(uri)


def _list(source: str) -> list[storage.FileEntry]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        entries = storage.list_files(source)
    except (BotoCoreError, ClientError) as e:
        raise UserError(f"{source}: cannot list it: {e}") from None
    if not entries:
        raise UserError(f"{source}: no such file, directory or S3 prefix (or it is empty)")
    return entries


def _hidden(rel: str) -> bool:
    """``.DS_Store``, ``._x.jpg``, ``.git/``; not an S3 key's ``..`` component (refused by :func:`confine`)."""
    return any(part.startswith(".") and part not in (".", "..") for part in rel.split("/"))


def _unique_name(base: str, used: set[str]) -> str:
    name, n = base or "source", 1
    while name in used:
        n += 1
        name = f"{base}-{n}"
    used.add(name)
    return name


def plan_units(sources: list[str], cfg: SourceConfig) -> tuple[list[WorkUnit], dict]:
    """The work units of ``sources`` in a fixed order, and the listing counts (JSON data).

    Raises :class:`UserError` for a source that does not exist, holds nothing usable, overlaps
    another source, or has a malformed metadata file or parquet schema.
    """
    cfg.validate()
    listing = _Listing()
    units: list[WorkUnit] = []
    used_names: set[str] = set()
    owner: dict[str, str] = {}  # file uri -> the source that listed it
    for raw in sources:
        source = _normalize_source(raw)
        entries = _list(source)
        for e in entries:
            if e.uri in owner:
                raise UserError(f"sources overlap: {e.uri} is in both {owner[e.uri]} and {raw}; give each file once")
            owner[e.uri] = raw
        single = len(entries) == 1 and entries[0].uri == source
        if single:
            base = storage.basename(source)
            if _has_ext(base, TAR_EXTS):
                name = _unique_name(_strip_ext(base, TAR_EXTS), used_names)
                new = [WorkUnit("tar", source, name, root=_parent(source))]
                listing.files["tar"] += 1
            elif _has_ext(base, PARQUET_EXTS):
                name = _unique_name(_strip_ext(base, PARQUET_EXTS), used_names)
                new = _plan_parquet(source, name, cfg, listing, _parent(source))
            else:
                raise UserError(f"{raw}: not a .tar, .tar.gz, .tgz or .parquet file, nor a directory of images")
        else:
            name = _unique_name(storage.basename(source).rstrip("/"), used_names)
            new = _plan_directory(source, raw, name, entries, cfg, listing)
        kinds = [u.kind for u in new if u.kind != "refused"] or ["refused"]
        kind = {"files": "folder"}.get(kinds[0], kinds[0])
        listing.sources.append({"source": raw, "kind": kind, "name": name, "num_units": len(new)})
        units.extend(new)
    stats = {
        "num_units": len(units),
        "sources": listing.sources,
        "files": listing.files,
        "metadata_rows": listing.metadata_rows,
        "missing_files": listing.missing_files,
        "parquet_rows": listing.parquet_rows,
        # Records the units will yield, when known before reading (a tar's sample count is not).
        "expected_records": None if listing.files["tar"] else (
            sum(len(u.items) for u in units if u.kind in ("files", "refused")) + listing.parquet_rows),
        "ignored_files": listing.ignored_files,
        "ignored_by_ext": dict(sorted(listing.ignored_by_ext.items())),
        "ignored_examples": listing.ignored_examples,
        "notes": listing.notes,
    }
    return units, stats


def _plan_directory(root: str, raw: str, name: str, entries: list[storage.FileEntry], cfg: SourceConfig,
                    listing: _Listing) -> list[WorkUnit]:
    visible = [e for e in entries if not _hidden(_rel(e.uri, root))]
    for e in entries:
        if _hidden(_rel(e.uri, root)):
            listing.ignore(e.uri, hidden=True)
    tars = [e for e in visible if _has_ext(e.uri, TAR_EXTS)]
    parquets = [e for e in visible if _has_ext(e.uri, PARQUET_EXTS)]
    if tars or parquets:
        kind, chosen = ("tar", tars) if tars else ("parquet", parquets)
        chosen_uris = {e.uri for e in chosen}
        others = [e for e in visible if e.uri not in chosen_uris]
        for e in others:
            listing.ignore(e.uri)
        if others:
            why = ("img2dataset writes a metadata .parquet next to each .tar" if kind == "tar"
                   else "a parquet path column may name them")
            listing.notes.append(
                f"{raw}: read as {kind} files only; {len(others)} other files not read ({why}); "
                "give them as a source of their own to ingest them")
        units: list[WorkUnit] = []
        for e in chosen:
            unit_name = f"{name}/{_strip_ext(_rel(e.uri, root), TAR_EXTS + PARQUET_EXTS)}"
            if kind == "tar":
                listing.files["tar"] += 1
            reason, detail = confine(e.uri, root, cfg.follow_symlinks)
            if reason:  # never opened: one rejected record stands for the whole file
                units.append(WorkUnit("refused", e.uri, unit_name, items=((reason, detail),), root=root))
            elif kind == "tar":
                units.append(WorkUnit("tar", e.uri, unit_name, root=root))
            else:
                units.extend(_plan_parquet(e.uri, unit_name, cfg, listing, root))
        return units
    return _plan_folder(root, raw, name, visible, cfg, listing)


# ---------------------------------------------------------------- image folders


def _read_metadata(uri: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of a metadata.jsonl / metadata.csv; UserError when malformed."""
    try:
        text = storage.read_bytes(uri).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{uri}: not valid UTF-8 ({e})") from None
    rows: list[tuple[int, dict[str, Any]]] = []
    if uri.lower().endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{uri} line {n}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise UserError(f"{uri} line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append((n, row))
    else:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        for row in reader:
            if None in row:
                raise UserError(f"{uri} line {reader.line_num}: more fields than the header has")
            rows.append((reader.line_num, row))
    return rows


def _csv_value(text: str | None) -> Any:
    """A CSV cell as a number when it is one (so numeric filters work), None when empty."""
    if text is None or text == "":
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _plan_folder(root: str, raw: str, name: str, entries: list[storage.FileEntry], cfg: SourceConfig,
                 listing: _Listing) -> list[WorkUnit]:
    cap_ext = cfg.caption_ext.lower()
    images: dict[str, str] = {}  # rel path -> uri
    captions: dict[str, str] = {}  # rel path without extension -> caption uri
    metadata: list[str] = []
    for e in entries:
        rel = _rel(e.uri, root)
        base = rel.rsplit("/", 1)[-1].lower()
        if base in METADATA_FILES:
            metadata.append(e.uri)
        elif _has_ext(rel, IMAGE_EXTS):
            images[rel] = e.uri
        elif rel.lower().endswith(cap_ext):
            captions[rel[: -len(cap_ext)]] = e.uri
        else:
            listing.ignore(e.uri)
    rows: dict[str, tuple[str, dict[str, Any], str]] = {}  # rel path -> (where described, row, image uri)
    meta_dirs: dict[str, str] = {}
    for meta_uri in metadata:
        listing.files["metadata"] += 1
        reason, detail = confine(meta_uri, root, cfg.follow_symlinks)
        if reason:  # it would describe the whole folder: stop rather than guess without it
            raise UserError(f"{detail} (a metadata file of {raw}); move it into the source or set its images apart")
        meta_dir = posixpath.dirname(_rel(meta_uri, root))
        if meta_dir in meta_dirs:
            raise UserError(f"{meta_uri}: {meta_dirs[meta_dir]} is in the same directory; keep one metadata file")
        meta_dirs[meta_dir] = meta_uri
        for line, row in _read_metadata(meta_uri):
            where = f"{meta_uri} line {line}"
            file_name = row.pop("file_name", None)
            if not isinstance(file_name, str) or not file_name:
                raise UserError(f"{where}: " + ("no file_name" if file_name in (None, "") else
                                                f"file_name {file_name!r} is not a path string")
                                + " (the image path relative to the metadata file)")
            if storage.is_s3(file_name) or file_name.startswith("/") or os.path.isabs(file_name):
                uri = file_name  # an absolute address: allowed only inside the source (confine, when read)
                rel = _key_part(uri if storage.is_s3(uri) else os.path.normpath(uri), root)
            else:  # relative to the metadata file; a ../ that leaves the source is refused when read
                rel = posixpath.normpath(posixpath.join(meta_dir, file_name))
                uri = storage.join(root, rel) if storage.is_s3(root) else os.path.join(root, rel)
            if rel in rows:
                raise UserError(f"{where}: {file_name!r} is already described in {rows[rel][0]}")
            if meta_uri.lower().endswith(".csv"):
                row = {k: (v if k in ("text", "caption", cfg.caption_column) else _csv_value(v)) for k, v in row.items()}
            rows[rel] = (where, row, uri)
    listing.metadata_rows += len(rows)
    for rel, (_, _, uri) in rows.items():
        if rel not in images and confine(uri, root, cfg.follow_symlinks)[0] is None:
            listing.missing_files += 1
    all_rels = sorted(set(images) | set(rows))
    if not all_rels:
        raise UserError(
            f"{raw}: no images ({', '.join(IMAGE_EXTS)}), .tar or .parquet files found "
            f"({len(entries)} other files)")
    listing.files["image"] += len(images)
    used_captions: set[str] = set()
    items = []
    for rel in all_rels:
        stem = os.path.splitext(rel)[0]
        cap = captions.get(stem)
        if cap is not None:
            used_captions.add(stem)
        row = rows.get(rel)
        image_uri = images.get(rel) or row[2]
        items.append((image_uri, cap, json.dumps(row[1], sort_keys=True) if row else None))
    listing.files["caption"] += len(used_captions)
    for stem, uri in captions.items():
        if stem not in used_captions:
            listing.ignore(uri)
    n = cfg.folder_chunk
    return [WorkUnit("files", root, name, tuple(items[i: i + n]), part=i // n, root=root)
            for i in range(0, len(items), n)]


def _iter_files(unit: WorkUnit, cfg: SourceConfig) -> Iterator[SourceRecord]:
    for image_uri, caption_uri, row_json in unit.items:
        key = f"{unit.name}/{_key_part(image_uri, unit.uri)}"
        row = json.loads(row_json) if row_json else {}
        caption_col = cfg.caption_column or _find_column(list(row), ("text", "caption"))
        license_col = _find_column(list(row), ("license",))
        caption = row.get(caption_col) if caption_col else None
        lic = _license(row.get(license_col) if license_col else None, cfg)
        meta = _meta(row, {caption_col, license_col})
        error, detail = None, ""
        if caption is None and caption_uri is not None:
            data, error, detail = _read_confined(caption_uri, unit.uri, cfg)
            if data is not None:
                try:
                    caption = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    error, detail = "caption_decode_error", f"{caption_uri}: {e}"
            elif error == "empty_file":
                caption, error, detail = "", None, ""  # an empty caption file is a blank caption
        image = None
        if error is None:
            image, error, detail = _read_confined(image_uri, unit.uri, cfg)
        if error:
            caption = None  # a rejected record carries no data
        yield SourceRecord(image_uri, key, image, caption, lic, meta, error, detail)


# ---------------------------------------------------------------- WebDataset tars


class _TailReader(io.RawIOBase):
    """Passes a stream through and keeps its last bytes, to check how a tar archive ended."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.pos = 0  # bytes passed through
        self.eof = False
        self.tail = bytearray()  # the last TAR_TAIL_BYTES bytes, ending at self.pos

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self.raw.read(len(buf))
        if not data:
            self.eof = True
            return 0
        n = len(data)
        buf[:n] = data
        self.pos += n
        self.tail += data
        del self.tail[:-TAR_TAIL_BYTES]
        return n

    def block(self, offset: int, size: int) -> bytes | None:
        """Bytes [offset, offset+size) if they passed through and are still kept."""
        while self.pos < offset + size and not self.eof:
            self.read(offset + size - self.pos)
        start = offset - (self.pos - len(self.tail))
        if start < 0 or self.pos < offset + size:
            return None
        return bytes(self.tail[start: start + size])


def _unsafe_member(m: tarfile.TarInfo) -> str | None:
    """Why a member is refused, or None. Members are never extracted; their names still become keys."""
    name = m.name
    parts = re.split(r"[/\\]", name)
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        return f"member path {name!r} is absolute or leaves the archive"
    if not m.isfile():
        return f"member {name!r} is a link or device, not a file"
    return None


def _split_member(name: str) -> tuple[str, str]:
    """WebDataset key and extension: ``a/b/x.seg.jpg`` -> (``a/b/x``, ``seg.jpg``)."""
    while name.startswith("./"):
        name = name[2:]
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def _iter_tar(unit: WorkUnit, cfg: SourceConfig) -> Iterator[SourceRecord]:
    caption_ext = cfg.caption_ext.lower().lstrip(".")
    keys: set[str] = set()

    def unique(key: str) -> str:
        out, n = key, 1
        while out in keys:  # a key repeated later in the archive is another sample
            n += 1
            out = f"{key}~{n}"
        keys.add(out)
        return out

    def sample(group_key: str, members: dict[str, bytes], names: dict[str, str], error: str | None = None,
               detail: str = "") -> SourceRecord:
        image_ext = next((e for e in TAR_IMAGE_EXTS if e in members), None)
        source = f"{unit.uri}#{names[image_ext] if image_ext else group_key}"
        meta: dict[str, Any] = {}
        caption = lic = None
        if "json" in members:
            try:
                obj = json.loads(members["json"].decode("utf-8"))
                if not isinstance(obj, dict):
                    raise ValueError(f"a JSON {type(obj).__name__}, not an object")
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                error, detail = error or "meta_decode_error", detail or f"{names['json']}: {e}"
                obj = {}
            cap_field = _find_column(list(obj), ("caption", "text"))
            caption = obj.get(cap_field) if cap_field else None
            lic_field = _find_column(list(obj), ("license",))
            lic = obj.get(lic_field) if lic_field else None
            meta = _meta(obj, {cap_field, lic_field})
        if caption_ext in members:
            try:
                caption = members[caption_ext].decode("utf-8")
            except UnicodeDecodeError as e:
                error, detail = error or "caption_decode_error", detail or f"{names[caption_ext]}: {e}"
        unused = sorted(names[e] for e in members if e not in (image_ext, caption_ext, "json"))
        if unused:
            meta["ignored_members"] = unused
        image = members.get(image_ext) if image_ext else None
        if error is None and image is None:
            error, detail = "no_image", f"members: {', '.join(sorted(names.values()))}"
        elif error is None and not image:
            error, detail = "empty_file", names[image_ext]
        if error:
            image = caption = None
        return SourceRecord(source, unique(f"{unit.name}/{group_key}"), image,
                            caption, _license(lic, cfg), meta, error, detail)

    group_key: str | None = None
    members: dict[str, bytes] = {}
    names: dict[str, str] = {}
    stream = None
    try:
        stream = storage.open_stream(unit.uri)
        raw: BinaryIO = stream
        if _has_ext(unit.uri, (".tar.gz", ".tgz")):
            import gzip

            raw = gzip.GzipFile(fileobj=stream, mode="rb")  # streamed: never the whole archive in memory
        tail = _TailReader(raw)
        with tarfile.open(fileobj=tail, mode="r|") as tf:
            for m in tf:
                if m.isdir():
                    continue
                why = _unsafe_member(m)
                if why:
                    yield SourceRecord(f"{unit.uri}#{m.name}", unique(f"{unit.name}/{m.name}"), None, None,
                                       cfg.license, {}, "unsafe_path", why)
                    continue
                key, ext = _split_member(m.name)
                if key != group_key:
                    if group_key is not None:
                        yield sample(group_key, members, names)
                    group_key, members, names = key, {}, {}
                names.setdefault(ext, m.name)
                if ext in TAR_IMAGE_EXTS or ext in (caption_ext, "json"):
                    f = tf.extractfile(m)
                    members.setdefault(ext, f.read() if f else b"")
                else:
                    members.setdefault(ext, b"")  # not read: only listed in meta["ignored_members"]
            # tarfile stops quietly at a truncated or garbled header after the first member:
            # a complete archive ends with a zero block where the next header would be.
            end = tail.block(tf.offset, tarfile.BLOCKSIZE)
            if end is None or end.count(0) != tarfile.BLOCKSIZE:
                raise tarfile.ReadError(
                    f"archive ends without its end-of-archive block at byte {tf.offset} (truncated?)"
                    if end is None else f"invalid member header at byte {tf.offset}")
    except _read_errors() as e:
        detail = f"{unit.uri}: {type(e).__name__}: {e}"
        if group_key is not None:  # the sample being read when the archive broke may be incomplete
            yield sample(group_key, members, names, "source_error", detail)
        else:
            yield SourceRecord(unit.uri, unique(f"{unit.name}/#source_error"), None, None, cfg.license, {},
                               "source_error", detail)
        return
    finally:
        if stream is not None:
            stream.close()
    if group_key is not None:
        yield sample(group_key, members, names)


# ---------------------------------------------------------------- parquet


class _S3RangeFile(io.RawIOBase):
    """A seekable read-only S3 object: each read is one ranged GET, so parquet reads only the
    footer and the row groups it needs instead of downloading the file."""

    def __init__(self, uri: str):
        self.bucket, self.key = storage.split_s3(uri)
        self.client = storage.s3_client()
        self.size = self.client.head_object(Bucket=self.bucket, Key=self.key)["ContentLength"]
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        body = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-{self.pos + n - 1}")
        data = body["Body"].read()
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _open_parquet(uri: str):
    import pyarrow.parquet as pq

    if storage.is_s3(uri):
        return pq.ParquetFile(io.BufferedReader(_S3RangeFile(uri), buffer_size=1 << 20))
    return pq.ParquetFile(uri)


@dataclass(frozen=True)
class _Columns:
    image: str
    image_kind: str  # "bytes" | "struct" (HF {bytes, path}) | "path"
    caption: str
    license: str | None
    status: str | None
    error_message: str | None

    def special(self) -> set[str]:
        return {c for c in (self.image, self.caption, self.license, self.status, self.error_message) if c}


def _parquet_columns(schema, cfg: SourceConfig, uri: str) -> _Columns:
    """Which columns hold the image, caption, license and img2dataset status; UserError if none fits."""
    import pyarrow as pa

    names = list(schema.names)

    def kind(col: str) -> str | None:
        t = schema.field(col).type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
            return "bytes"
        if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
            return "struct"
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return "path"
        return None

    if cfg.image_column:
        if cfg.image_column not in names:
            raise UserError(f"{uri}: no column {cfg.image_column!r} (image_column); columns: {', '.join(names)}")
        image = cfg.image_column
    else:
        image = next((c for c in IMAGE_BYTES_COLUMNS if c in names and kind(c) in ("bytes", "struct")), None)
        image = image or next((c for c in IMAGE_PATH_COLUMNS if c in names and kind(c) == "path"), None)
        if image is None:
            raise UserError(f"{uri}: no image column (bytes in {', '.join(IMAGE_BYTES_COLUMNS)} or a path in "
                            f"{', '.join(IMAGE_PATH_COLUMNS)}); set image_column. Columns: {', '.join(names)}")
    image_kind = kind(image)
    if image_kind is None:
        raise UserError(f"{uri}: column {image!r} has type {schema.field(image).type}: "
                        "neither image bytes, a {bytes, path} struct nor a path")
    if cfg.caption_column:
        if cfg.caption_column not in names:
            raise UserError(f"{uri}: no column {cfg.caption_column!r} (caption_column); columns: {', '.join(names)}")
        caption = cfg.caption_column
    else:
        caption = _find_column(names, CAPTION_COLUMNS)
        if caption is None:
            raise UserError(f"{uri}: no caption column ({', '.join(CAPTION_COLUMNS)}); set caption_column. "
                            f"Columns: {', '.join(names)}")
    return _Columns(image, image_kind, caption, _find_column(names, ("license",)),
                    "status" if "status" in names else None,
                    "error_message" if "error_message" in names else None)


def _plan_parquet(uri: str, name: str, cfg: SourceConfig, listing: _Listing, root: str) -> list[WorkUnit]:
    from botocore.exceptions import BotoCoreError, ClientError
    import pyarrow as pa

    try:
        with _open_parquet(uri) as pf:
            _parquet_columns(pf.schema_arrow, cfg, uri)
            md = pf.metadata
            rows_per_group = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
    except (OSError, pa.ArrowException, BotoCoreError, ClientError) as e:
        raise UserError(f"{uri}: not a readable parquet file ({type(e).__name__}: {e})") from None
    listing.files["parquet"] += 1
    listing.parquet_rows += sum(rows_per_group)
    if not cfg.parquet_unit_rows or sum(rows_per_group) <= cfg.parquet_unit_rows:
        return [WorkUnit("parquet", uri, name, root=root)]
    units, groups, rows = [], [], 0
    for i, n in enumerate(rows_per_group):
        groups.append(i)
        rows += n
        if rows >= cfg.parquet_unit_rows or i == len(rows_per_group) - 1:
            units.append(WorkUnit("parquet", uri, name, row_groups=tuple(groups), root=root))
            groups, rows = [], 0
    return units


def _parquet_image(value: Any, cols: _Columns, base: str, root: str,
                   cfg: SourceConfig) -> tuple[bytes | None, str | None, str]:
    """(bytes, error, detail) of one row's image cell; a path is relative to the parquet's folder
    ``base`` and must stay inside the source ``root``."""
    path = None
    if cols.image_kind == "bytes":
        data = value
    elif cols.image_kind == "struct":
        data, path = (value or {}).get("bytes"), (value or {}).get("path")
    else:
        data, path = None, value
    if data is None and path:
        if storage.is_s3(path) or os.path.isabs(path):
            uri = path
        else:
            rel = posixpath.normpath(path)  # as a local path resolves, also on S3
            uri = f"{base.rstrip('/')}/{rel}" if storage.is_s3(base) else os.path.join(base, rel)
        return _read_confined(uri, root, cfg)
    if data is None:
        return None, "no_image", f"column {cols.image!r} is empty"
    if not data:
        return None, "empty_file", f"column {cols.image!r} holds 0 bytes"
    return bytes(data), None, ""


def _iter_parquet(unit: WorkUnit, cfg: SourceConfig) -> Iterator[SourceRecord]:
    import pyarrow as pa

    base = _parent(unit.uri)
    errors = _read_errors() + (pa.ArrowException,)
    todo: list[tuple[int, int]] = []  # (row group, first row index in the file), not read yet
    row = 0
    pf = None
    try:
        pf = _open_parquet(unit.uri)
        md = pf.metadata
        if any(g >= md.num_row_groups for g in unit.row_groups):
            raise UserError(f"has {md.num_row_groups} row groups: it changed since the units were planned")
        starts = [0]
        for i in range(md.num_row_groups):
            starts.append(starts[-1] + md.row_group(i).num_rows)
        todo = [(g, starts[g]) for g in (unit.row_groups or range(md.num_row_groups))]
        cols = _parquet_columns(pf.schema_arrow, cfg, unit.uri)
        skip = cols.special()
        while todo:
            group, row = todo[0]
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], use_threads=False):
                data = batch.to_pydict()
                for i in range(batch.num_rows):
                    r = {k: v[i] for k, v in data.items()}
                    yield _parquet_record(unit, r, row, cols, skip, base, cfg)
                    row += 1
            todo.pop(0)
    except (UserError,) + errors as e:  # UserError: the file changed since planning
        detail = f"{unit.uri}: {type(e).__name__}: {e}"
        if not todo:  # the file could not even be opened: its rows are unknown
            yield SourceRecord(unit.uri, f"{unit.name}/#source_error", None, None, cfg.license, {}, "source_error", detail)
            return
        # Every row not yielded yet gets its own record, so the counts stay exact.
        ends = {g: s + pf.metadata.row_group(g).num_rows for g, s in todo}
        for n, (group, start) in enumerate(todo):
            for i in range(row if n == 0 else start, ends[group]):
                yield SourceRecord(f"{unit.uri}#row={i}", f"{unit.name}/{i}", None, None, cfg.license, {},
                                   "source_error", detail)
    finally:
        if pf is not None:
            pf.close()


def _parquet_record(unit: WorkUnit, r: dict[str, Any], row: int, cols: _Columns, skip: set[str], base: str,
                    cfg: SourceConfig) -> SourceRecord:
    source, key = f"{unit.uri}#row={row}", f"{unit.name}/{row}"
    caption = r.get(cols.caption)
    lic = _license(r.get(cols.license) if cols.license else None, cfg)
    meta = _meta(r, skip)
    status = r.get(cols.status) if cols.status else "success"
    if status != "success":
        detail = str(r.get(cols.error_message) or f"status {status!r}") if cols.error_message else f"status {status!r}"
        return SourceRecord(source, key, None, None, lic, meta, "download_failed", detail)
    if isinstance(caption, (bytes, bytearray)):
        try:
            caption = bytes(caption).decode("utf-8")
        except UnicodeDecodeError as e:
            return SourceRecord(source, key, None, None, lic, meta, "caption_decode_error", str(e))
    image, error, detail = _parquet_image(r.get(cols.image), cols, base, unit.root or base, cfg)
    return SourceRecord(source, key, image, None if error else caption, lic, meta, error, detail)


# ---------------------------------------------------------------- reading


def iter_records(unit: WorkUnit, cfg: SourceConfig) -> Iterator[SourceRecord]:
    """The records of one unit, in a fixed order. Bad data becomes records with ``error`` set;
    this raises only for a programming error."""
    if unit.kind == "files":
        return _iter_files(unit, cfg)
    if unit.kind == "tar":
        return _iter_tar(unit, cfg)
    if unit.kind == "parquet":
        return _iter_parquet(unit, cfg)
    if unit.kind == "refused":
        (reason, detail), = unit.items
        return iter([SourceRecord(unit.uri, unit.name, None, None, cfg.license, {}, reason, detail)])
    raise ValueError(f"unknown work unit kind {unit.kind!r}")
