"""Ingest: sources (image folders, WebDataset tars, parquet; local or S3) -> raw shards.

The work is cut into units by :func:`sources.plan_units` (a chunk of a folder, a tar, a parquet
file), in a fixed order. Each unit is processed by one worker process and leaves, in
``OUT/parts/``, a shard plus a marker JSON written last (its counts, rejections and the
sha256 of every kept image). A rerun after a crash processes only the units without a marker.
The finalize step then removes exact duplicates across units (the first occurrence in unit
order wins, so the result does not depend on which worker ran first), writes
``shard-NNNNNN.parquet``, ``rejected.jsonl``, ``summary.json`` and, last, ``index.json``.

Every record a source yields is either written or rejected with a reason, so
``seen == written + sum(rejected.values())`` always holds.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from latentforge import __version__, storage
from latentforge.config import save_config, to_dict
from latentforge.data import schema
from latentforge.data.imageproc import (
    FilterConfig,
    ImageConfig,
    Reject,
    bucket_sizes,
    check_caption,
    check_values,
    process_image,
    sha256_hex,
    size_limits,
)
from latentforge.data.sources import SourceConfig, WorkUnit, iter_records, plan_units
from latentforge.errors import Problems, UserError

PARTS = "parts"
PLAN = "ingest_plan.json"


@dataclass
class IngestConfig:
    """Ingest: which samples are kept and how they are stored."""

    source: SourceConfig = field(default_factory=SourceConfig, metadata={"help": "how sources are read"})
    filters: FilterConfig = field(default_factory=FilterConfig, metadata={"help": "which samples are kept"})
    image: ImageConfig = field(default_factory=ImageConfig, metadata={"help": "resize, crop and storage format"})
    num_workers: int = field(default=0, metadata={"help": "worker processes; 0 = one per CPU core"})
    row_group_size: int = field(default=256, metadata={"help": "rows per parquet row group in the shards"})

    def validate(self) -> None:
        problems = Problems()
        if self.num_workers < 0:
            problems.add(f"num_workers: must be >= 0, got {self.num_workers}; 0 = one per CPU core")
        if self.row_group_size < 1:
            problems.add(f"row_group_size: must be >= 1, got {self.row_group_size}; rows per parquet row group")
        problems.raise_if_any()


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- one unit (in a worker process)

_progress_queue = None


def _init_worker(queue) -> None:
    global _progress_queue
    _progress_queue = queue


def _tick(n: int) -> None:
    if _progress_queue is not None and n:
        _progress_queue.put(n)


def process_unit(index: int, unit: WorkUnit, cfg: IngestConfig, parts_dir: str) -> dict:
    """Read, filter and store every record of one unit; write its shard and then its marker."""
    parts = Path(parts_dir)
    shard_path = parts / f"unit-{index:06d}.parquet"
    writer = schema.ShardWriter(shard_path, schema.RAW_COLUMNS, cfg.row_group_size)
    buckets = None
    if cfg.image.crop == "buckets":
        buckets = bucket_sizes(cfg.image.resolution, cfg.image.bucket_step, cfg.image.bucket_max_aspect)
    seen_hashes: dict[str, str] = {}
    rejected: list[dict] = []
    kept: list[list[str]] = []  # [key, sha256, source] of written rows, in row order
    num_seen = 0
    pending_ticks = 0
    try:
        for rec in iter_records(unit, cfg.source):
            # the shards and the ledger hold UTF-8 text: a name that is not UTF-8 is kept, its odd bytes as \xNN
            rec = replace(rec, key=storage.as_utf8(rec.key), source=storage.as_utf8(rec.source))
            num_seen += 1
            pending_ticks += 1
            if pending_ticks >= 16:
                _tick(pending_ticks)
                pending_ticks = 0
            try:
                if rec.error:
                    raise Reject(rec.error, rec.detail)
                if rec.image is None:
                    raise Reject("no_image", rec.detail)
                caption = check_caption(rec.caption, cfg.filters)
                check_values(rec.meta, cfg.filters)
                digest = sha256_hex(rec.image)
                if cfg.filters.dedup and digest in seen_hashes:
                    raise Reject("duplicate", f"same image as {seen_hashes[digest]}")
                img = process_image(rec.image, cfg.image, cfg.filters, buckets)
            except Reject as r:
                rejected.append({"key": rec.key, "source": rec.source, "reason": r.reason, "detail": r.detail})
                continue
            seen_hashes[digest] = rec.key
            writer.write({
                "key": rec.key,
                "image": img.data,
                "image_format": img.format,
                "caption": caption,
                "width": img.width,
                "height": img.height,
                "orig_width": img.orig_width,
                "orig_height": img.orig_height,
                "source": rec.source,
                "license": rec.license or cfg.source.license,
                "sha256": digest,
                "meta": rec.meta,
            })
            kept.append([rec.key, digest, rec.source])
        _tick(pending_ticks)
    except BaseException:
        writer.abort()
        raise
    info = writer.close()
    marker = {
        "unit": unit.unit_id(),
        "seen": num_seen,
        "written": info.num_samples,
        "num_bytes": info.num_bytes,
        "rejected": rejected,
        "kept": kept,
    }
    storage.atomic_write_bytes(parts / f"unit-{index:06d}.json", json.dumps(marker).encode())
    return {"index": index, "seen": num_seen, "written": info.num_samples}


def _process_unit_star(args) -> dict:
    return process_unit(*args)


# ---------------------------------------------------------------- the whole run


def _check_out_dir(out: Path, plan: dict) -> str:
    """'done' (complete, same plan), 'resume' (same plan, unfinished) or 'new'."""
    plan_file = out / PLAN
    if plan_file.exists():
        try:
            old = json.loads(plan_file.read_text())
        except ValueError:
            raise UserError(f"{plan_file}: damaged (not valid JSON); delete {out} and ingest again") from None
        if old.get("fingerprint") != plan["fingerprint"]:
            raise UserError(
                f"{out}: holds an ingest of other sources or settings (plan {old.get('fingerprint')} != "
                f"{plan['fingerprint']}); use another --out or delete it"
            )
        return "done" if (out / schema.INDEX).exists() else "resume"
    if out.exists() and any(p.name != storage.LOCK_FILE for p in out.iterdir()):  # the lock: a run killed at its start
        raise UserError(f"{out}: exists and is not empty; ingest writes into a new or empty directory")
    return "new"


def ingest(sources: list[str], out_dir: str | Path, cfg: IngestConfig, progress: bool = True, lock: str = "") -> dict:
    """Ingest ``sources`` into raw shards in ``out_dir``; returns the summary (also summary.json).
    ``lock``: the command's name (e.g. "latentforge ingest"): ``out_dir``'s lock is held from the
    first write there (:func:`latentforge.storage.directory_lock`), so a second ingest into it stops
    in one line."""
    with storage.lock_at_first_write(lock) as take_lock:
        return _ingest(sources, out_dir, cfg, progress, take_lock)


def _ingest(sources: list[str], out_dir: str | Path, cfg: IngestConfig, progress: bool,
            take_lock: Callable[[Path], None]) -> dict:
    if storage.is_s3(str(out_dir)):
        raise UserError(f"{out_dir}: ingest writes to a local directory (copy it to S3 afterwards)")
    out = Path(out_dir)
    if not sources:
        raise UserError("ingest: no sources given")
    t0 = time.perf_counter()
    units, listing = plan_units(list(sources), cfg.source)
    plan = {
        "sources": list(sources),
        "units": [u.unit_id() for u in units],
        "config": to_dict(cfg),
    }
    plan["config"].pop("num_workers")  # how many workers ran does not change the result
    plan["fingerprint"] = _fingerprint(plan)
    state = _check_out_dir(out, plan)
    take_lock(out)  # the first write (a finished ingest: its leftover parts are removed)
    if state == "done":
        try:  # finished before: its outputs must still be readable, not just present
            schema.read_index(str(out))
            summary = json.loads((out / "summary.json").read_text())
        except (UserError, OSError, ValueError) as e:
            raise UserError(f"{out}: a finished ingest whose index.json or summary.json is damaged ({e}); delete "
                            "it and ingest again") from None
        shutil.rmtree(out / PARTS, ignore_errors=True)  # a crash right after index.json leaves them
        return summary
    parts = out / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    if state == "new":
        storage.atomic_write_bytes(out / PLAN, json.dumps(plan, indent=1).encode())
    save_config(cfg, out / "ingest_config.yaml")

    todo = [i for i in range(len(units)) if not (parts / f"unit-{i:06d}.json").exists()]
    num_workers = cfg.num_workers or os.cpu_count() or 1
    num_workers = max(1, min(num_workers, len(todo)))
    bar = tqdm(total=None, unit="img", desc="ingest", disable=not progress, dynamic_ncols=True)
    bar.set_postfix_str(f"units {len(units) - len(todo)}/{len(units)} done")
    if todo:
        args = [(i, units[i], cfg, str(parts)) for i in todo]
        if num_workers == 1:
            _init_worker(None)
            for done, a in enumerate(args, 1):
                r = process_unit(*a)
                bar.update(r["seen"])
                bar.set_postfix_str(f"units {len(units) - len(todo) + done}/{len(units)} done")
        else:
            _run_pool(args, num_workers, bar, len(units) - len(todo), len(units))
    bar.close()
    summary = _finalize(out, units, listing, cfg, plan, time.perf_counter() - t0)
    return summary


def _run_pool(args: list, num_workers: int, bar, num_done: int, num_units: int) -> None:
    ctx = mp.get_context("spawn")  # no fork: safe with the threads of boto3 and tqdm
    queue = ctx.Queue()
    with ctx.Pool(num_workers, initializer=_init_worker, initargs=(queue,)) as pool:
        results = pool.imap_unordered(_process_unit_star, args)
        remaining = len(args)
        while remaining:
            try:
                results.next(timeout=0.2)
                remaining -= 1
                num_done += 1
                bar.set_postfix_str(f"units {num_done}/{num_units} done")
            except mp.TimeoutError:
                pass
            while not queue.empty():
                bar.update(queue.get())
        while not queue.empty():
            bar.update(queue.get())


def _finalize(out: Path, units: list[WorkUnit], listing: dict, cfg: IngestConfig, plan: dict,
              elapsed: float) -> dict:
    parts = out / PARTS
    first_seen: dict[str, str] = {}
    shards: list[schema.ShardInfo] = []
    rejected_lines: list[str] = []
    counts: dict[str, int] = {}
    num_seen = num_written = 0
    for i in range(len(units)):
        marker = json.loads((parts / f"unit-{i:06d}.json").read_text())
        num_seen += marker["seen"]
        for r in marker["rejected"]:
            counts[r["reason"]] = counts.get(r["reason"], 0) + 1
            rejected_lines.append(json.dumps(r))
        dup_rows = set()
        for row, (key, digest, source) in enumerate(marker["kept"]):
            if cfg.filters.dedup and digest in first_seen:
                dup_rows.add(row)
                counts["duplicate"] = counts.get("duplicate", 0) + 1
                rejected_lines.append(json.dumps({
                    "key": key, "source": source, "reason": "duplicate", "detail": f"same image as {first_seen[digest]}",
                }))
            else:
                first_seen.setdefault(digest, key)
        num_kept = len(marker["kept"]) - len(dup_rows)
        num_written += num_kept
        if num_kept == 0:
            continue
        part, final = parts / f"unit-{i:06d}.parquet", out / f"shard-{i:06d}.parquet"
        if dup_rows:
            table = schema.read_shard(str(part))
            mask = [row not in dup_rows for row in range(table.num_rows)]
            shards.append(schema.write_table(final, table.filter(mask), cfg.row_group_size))
        else:
            final.unlink(missing_ok=True)
            try:
                os.link(part, final)
            except OSError:
                shutil.copyfile(part, final)
            shards.append(schema.ShardInfo(final.name, num_kept, final.stat().st_size))
    num_rejected = sum(counts.values())
    if num_seen != num_written + num_rejected:  # an invariant: a broken one is a bug, never data loss
        raise RuntimeError(f"ingest accounting: seen {num_seen} != written {num_written} + rejected {num_rejected}")
    storage.atomic_write_bytes(out / "rejected.jsonl", ("\n".join(rejected_lines) + "\n" if rejected_lines else "").encode())
    min_side, max_aspect = size_limits(cfg.filters, cfg.image)
    summary = {
        "seen": num_seen,
        "written": num_written,
        "rejected": dict(sorted(counts.items())),
        "num_rejected": num_rejected,
        # The size filters in effect (0 = off) and the settings they come from ("auto" by default).
        "size_filters": {"min_side": min_side, "max_aspect": max_aspect,
                         "settings": {"min_side": cfg.filters.min_side, "max_aspect": cfg.filters.max_aspect}},
        "follow_symlinks": cfg.source.follow_symlinks,
        "num_shards": len(shards),
        "num_units": len(units),
        "listing": listing,
        "sources": plan["sources"],
        "elapsed_s": round(elapsed, 3),
        "img_per_s": round(num_seen / elapsed, 1) if elapsed > 0 else None,
    }
    storage.atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=1).encode())
    index = schema.DatasetIndex(
        kind="raw",
        columns=dict(schema.RAW_COLUMNS),
        shards=shards,
        meta={
            "resolution": cfg.image.resolution,
            "crop": cfg.image.crop,
            "image_format": cfg.image.format,
            "sources": plan["sources"],
            "plan_fingerprint": plan["fingerprint"],
            "created_by": f"latentforge {__version__}",
        },
    )
    schema.write_index(out, index)  # last: the dataset is complete from here on
    shutil.rmtree(parts, ignore_errors=True)
    return summary
