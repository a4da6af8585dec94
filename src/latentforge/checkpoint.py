"""Checkpoints: save, find the newest complete one, load; atomic, with retention.

A run directory holds::

    RUN/checkpoints/step-00001200/
        model.safetensors   one file per tensor group passed to save_checkpoint ("model", "ema", ...)
        ema.safetensors
        state.pt            optimizer, LR scheduler, RNG states...: tensors and plain containers only,
                            read back with torch.load(weights_only=True), never arbitrary unpickling
        meta.json           step, time, library versions, plus the caller's plain metadata
                            (phase index, data cursor, config fingerprint...)
        COMPLETE            written last: the size and sha256 of every other file

A checkpoint exists only when complete. It is written into ``step-00001200.tmp-<pid>/``, every
file and the directory are fsynced, the ``COMPLETE`` marker is written, and only then is the
directory renamed to its final name (and the parent fsynced). A directory without a valid
marker, and any ``.tmp-`` leftover of a crashed writer, is skipped by :func:`find_latest` with a
warning and never loaded. The step is read from ``meta.json``, never from the directory name.

Checkpoints need a local or shared POSIX filesystem (atomic rename); in multi-process training
only the writer (rank 0) calls :func:`save_checkpoint` with ``is_writer=True``, and the caller
puts a barrier after it before other ranks read.

A sharded checkpoint (FSDP2, ``distributed/dcp.py``) adds a ``dcp/`` sub-directory written by
every rank: the writer creates the temporary directory with :func:`begin_checkpoint`, all ranks
write their shards into it, and the writer then passes it to :func:`save_checkpoint`
(``workdir=``), which adds its own files and the marker, so the marker (listing the shards too)
still comes last and the rename still publishes everything at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import platform
import re
import shutil
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import safetensors
import safetensors.torch
import torch

import latentforge
from latentforge.errors import UserError
from latentforge.storage import pid_alive

__all__ = [
    "Checkpoint",
    "save_checkpoint",
    "find_latest",
    "load_checkpoint",
    "resolve_resume",
    "clean_state_dict_keys",
    "checkpoint_dir_name",
    "begin_checkpoint",
    "load_safetensors",
    "keep_aside",
]

log = logging.getLogger(__name__)

FORMAT = "latentforge-checkpoint"
VERSION = 1
CHECKPOINTS = "checkpoints"  # sub-directory of the run directory
MARKER = "COMPLETE"
META = "meta.json"
STATE = "state.pt"
_RESERVED_META = ("format", "version", "step", "saved_at", "saved_unix", "versions", "tensors")
_GROUP_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_FINAL_RE = re.compile(r"^step-\d{8,}$")
# Names a writer uses while it works: ".tmp-" being written, ".old-" a replaced checkpoint kept
# until the new one is renamed in, ".del-" a checkpoint being deleted by retention.
_WORK_RE = re.compile(r"^(step-\d{8,})\.(tmp|old|del)-(\d+)$")
_HASH_CHUNK = 16 << 20  # bytes read at a time when hashing (sha256: about 1.7 GB/s here)
_KEPT = "kept"  # suffix of a foreign checkpoint moved aside when this run writes the same step

# What this process may delete or replace: the checkpoints it wrote itself, and those of the run
# it resumed (at or before the step it resumed from). Anything else in a run directory (an earlier
# run's checkpoints kept after `--resume none`, an unusable one) is never deleted or overwritten.
_written: set[str] = set()  # resolved paths of the checkpoints saved by this process
_resumed_step: dict[str, int] = {}  # resolved checkpoints root -> step this process resumed from


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, dict[str, torch.Tensor]]  # group name ("model", "ema") -> state dict
    state: dict[str, Any]  # optimizer, scheduler, RNG...: as saved
    meta: dict[str, Any]  # meta.json: "step", "saved_at", "versions" and the caller's keys

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def checkpoint_dir_name(step: int) -> str:
    """``step-00001200``: zero-padded so that names sort by step (the step itself is read from meta.json)."""
    return f"step-{step:08d}"


def clean_state_dict_keys(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the key prefixes added by wrappers: ``_orig_mod.`` (torch.compile, at any depth, since a
    compiled submodule inserts it mid-key) and a leading ``module.`` (DDP), stripped only when every
    key has it so that a real submodule named ``module`` is left alone."""
    keys = [".".join(part for part in k.split(".") if part != "_orig_mod") for k in sd]
    while keys and all(k.startswith("module.") for k in keys):
        keys = [k[len("module."):] for k in keys]
    if len(set(keys)) != len(keys):
        raise ValueError("clean_state_dict_keys: two keys map to the same name after removing wrapper prefixes")
    return dict(zip(keys, sd.values()))


def load_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], where: str, fits: str,
                 remedy: str) -> None:
    """``model.load_state_dict(tensors)``, strict. Weights of another architecture stop with one line,
    ``WHERE: its weights do not fit FITS (the first difference); REMEDY``, instead of torch's list of
    every missing, unexpected and resized tensor. The first difference is torch's first line of them:
    its first two missing (or unexpected) names and how many there are, or the first resized tensor."""
    try:
        model.load_state_dict(tensors)
    except RuntimeError as e:
        first = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), str(e).strip()).rstrip(".")
        head, _, names = first.partition(": ")
        listed = names.split(", ")
        if head.startswith(("Missing key(s)", "Unexpected key(s)")) and len(listed) > 2:
            first = f"{head}: {', '.join(listed[:2])}, ... ({len(listed)} in all)"
        raise UserError(f"{where}: its weights do not fit {fits} ({first}); {remedy}") from None


# ---------------------------------------------------------------------------------------- writing


def _fsync_path(path: Path) -> None:
    """fsync a file or directory by path (Linux flushes an inode's data through any descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _prepare_tensors(group: str, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors for safetensors. Tensors sharing storage with an earlier one (tied
    weights, views) are cloned: safetensors refuses overlapping storage, and each key is kept."""
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[tuple[torch.device, int]] = set()
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_checkpoint: tensors[{group!r}][{key!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach()
        storage = (t.device, t.untyped_storage().data_ptr())
        shared = storage in seen_storages and t.numel() > 0
        seen_storages.add(storage)
        t = t.cpu().contiguous()  # no copy for a contiguous CPU tensor
        out[key] = t.clone() if shared else t
    return out


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Fail at save time on anything ``torch.load(weights_only=True)`` would refuse at resume.
    Types are compared exactly: numpy scalars subclass float, and namedtuples tuple, yet both
    would be pickled as objects that weights_only loading refuses."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN or isinstance(value, (torch.dtype, torch.Size)):
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            if type(k) not in _PLAIN:
                raise TypeError(f"save_checkpoint: {where} has a key of type {type(k).__name__}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"save_checkpoint: {where} is a {type(value).__module__}.{type(value).__name__}; state may only hold "
        "tensors, numbers, strings, None, lists, tuples and dicts (loaded with weights_only=True)"
    )


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "latentforge": latentforge.__version__,
    }


def _clean_leftovers(root: Path) -> None:
    """Remove what crashed writers on this host left behind: ``.tmp-`` and ``.del-`` directories are
    deleted; an ``.old-`` directory (a complete checkpoint being replaced) is renamed back when the
    replacement never arrived. Directories of live processes are left alone."""
    for entry in sorted(root.iterdir()):
        m = _WORK_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        final_name, kind, pid = m.group(1), m.group(2), int(m.group(3))
        if pid == os.getpid() or pid_alive(pid):
            continue
        if kind == "old" and not (root / final_name).exists():
            log.warning("restoring %s: its writer died while replacing it", root / final_name)
            os.rename(entry, root / final_name)
        else:
            log.info("removing %s left by a dead writer (pid %d)", entry, pid)
            shutil.rmtree(entry)
    _fsync_path(root)


def _delete(root: Path, path: Path) -> None:
    """Rename then delete, so that a crash mid-delete leaves a ``.del-`` leftover, not a
    half-deleted checkpoint under its final name."""
    doomed = root / f"{path.name}.del-{os.getpid()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def _owned(root: Path, step: int, path: Path) -> bool:
    """Whether this process wrote the checkpoint ``path`` or resumed from it or a later one."""
    resumed = _resumed_step.get(str(root.resolve()))
    return str(path.resolve()) in _written or (resumed is not None and step <= resumed)


def _apply_retention(root: Path, step: int, keep_last: int, keep_every: int) -> None:
    """Keep the checkpoint of ``step``, the ``keep_last - 1`` newest older checkpoints and the milestones
    (step % keep_every == 0); delete the other older ones. Checkpoints with a later step (from a
    run that was resumed from an earlier checkpoint) are never deleted."""
    complete = _complete_checkpoints(root, warn=False)
    later = sorted(p.name for s, p in complete if s > step)
    if later:
        log.warning(
            "checkpoints from a later step exist in %s (%s): resume=auto will pick them over step %d",
            root, ", ".join(later), step,
        )
    if keep_last <= 0:
        return
    older = sorted(((s, p) for s, p in complete if s < step), reverse=True)
    for i, (s, path) in enumerate(older):
        if i < keep_last - 1 or (keep_every > 0 and s % keep_every == 0):
            continue
        if not _owned(root, s, path):
            continue  # another run's checkpoint (e.g. before `--resume none`): never deleted
        log.info("retention: deleting %s (keep_last=%d, keep_every=%d)", path, keep_last, keep_every)
        _delete(root, path)
    _fsync_path(root)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    state: Mapping[str, Any],
    meta: Mapping[str, Any],
    keep_last: int,
    keep_every: int = 0,
    is_writer: bool = True,
    workdir: Path | None = None,
) -> Path:
    """Write ``RUN/checkpoints/step-<step>/`` atomically and return its path.

    ``tensors`` maps a group name to a state dict, each written as ``<group>.safetensors``;
    ``state`` is torch-saved (tensors and plain containers only); ``meta`` must be JSON-serialisable.
    ``keep_last`` (0 keeps all) and ``keep_every`` (0: no milestones) prune older checkpoints once
    the new one is complete. With ``is_writer=False`` nothing is written and the path is returned.
    An existing checkpoint of the same step (from a run resumed from an earlier one) is replaced.
    ``workdir``: the directory from :func:`begin_checkpoint` that other ranks already wrote into
    (it is completed and renamed, or deleted on failure).
    """
    if str(run_dir).startswith("s3://"):
        raise UserError(f"{run_dir}: checkpoints need a local or shared filesystem (atomic rename), not S3")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    if keep_last < 0 or keep_every < 0:
        raise ValueError(f"save_checkpoint: keep_last ({keep_last}) and keep_every ({keep_every}) must be >= 0")
    root = Path(run_dir) / CHECKPOINTS
    final = root / checkpoint_dir_name(step)
    if not is_writer:
        return final

    # Everything that can fail on bad input fails here, before anything is written.
    for group in tensors:
        try:
            _check_group_name(group)
        except ValueError as e:
            raise ValueError(f"save_checkpoint: {e}") from None
    reserved = sorted(set(meta) & set(_RESERVED_META))
    if reserved:
        raise ValueError(f"save_checkpoint: meta keys {reserved} are reserved (written by save_checkpoint)")
    _check_plain(dict(state), "state")
    now = time.time()
    full_meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "saved_unix": now,
        "versions": _versions(),
        "tensors": sorted(tensors),
        **meta,
    }
    meta_text = json.dumps(full_meta, indent=2, allow_nan=False) + "\n"
    prepared = {group: _prepare_tensors(group, sd) for group, sd in tensors.items()}

    tmp = workdir if workdir is not None else begin_checkpoint(run_dir, step)
    started = time.perf_counter()
    old = None
    try:
        for group, sd in prepared.items():
            safetensors.torch.save_file(sd, tmp / f"{group}.safetensors", metadata={"format": "pt"})
            _fsync_path(tmp / f"{group}.safetensors")
        with open(tmp / STATE, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / META, "w") as f:
            f.write(meta_text)
            f.flush()
            os.fsync(f.fileno())
        # Hashing re-reads the files just written, normally from the page cache.
        files = {
            p.relative_to(tmp).as_posix(): {"num_bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        marker = {"format": FORMAT, "version": VERSION, "step": step, "files": files}
        with open(tmp / MARKER, "w") as f:
            f.write(json.dumps(marker, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        foreign = final.exists() and not _owned(root, step, final)
        if final.exists():
            log.warning("replacing existing checkpoint %s", final)
            old = root / f"{final.name}.old-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.rename(old, final)
        raise
    _written.add(str(final.resolve()))
    if old is not None and foreign:
        kept = keep_aside(old, final.name)
        log.warning("%s was not written by this run: kept as %s", final, kept)
    elif old is not None:
        shutil.rmtree(old)
    num_bytes = sum(f["num_bytes"] for f in files.values())
    log.info("saved checkpoint %s (%.1f MB in %.1f s)", final, num_bytes / 1e6, time.perf_counter() - started)
    _apply_retention(root, step, keep_last, keep_every)
    return final


def keep_aside(path: Path, name: str | None = None) -> Path:
    """Rename the checkpoint directory ``path`` to ``<name>.kept-<time>-<pid>`` beside it (``name``:
    its final name, default its own): out of the way of a new checkpoint of the same step, ignored
    by :func:`find_latest` and retention, and never deleted by latentforge."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = path.parent / f"{name or path.name}.{_KEPT}-{stamp}-{os.getpid()}"
    os.rename(path, kept)
    _fsync_path(path.parent)
    return kept


def begin_checkpoint(run_dir: str | os.PathLike, step: int) -> Path:
    """Create the empty temporary directory ``step-<step>.tmp-<pid>`` of the writer (after removing
    what dead writers left behind) and return it."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    tmp = root / f"{checkpoint_dir_name(step)}.tmp-{os.getpid()}"
    if tmp.exists():  # from an earlier failed save in this process
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


# ---------------------------------------------------------------------------------------- reading


def _read_marker(path: Path) -> dict[str, Any]:
    """The parsed ``COMPLETE`` marker; raises ValueError saying why the checkpoint is incomplete."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        raise ValueError(f"no {MARKER} marker (interrupted while writing?)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable {MARKER} marker ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        raise ValueError(f"{MARKER} is not a {FORMAT} marker")
    files = marker["files"]
    for name in files:
        _check_file_name(name)
    for name in (META, STATE):
        if name not in files:
            raise ValueError(f"{MARKER} does not list {name}")
    for name, info in files.items():
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{name} is missing") from None
        if size != info.get("num_bytes"):
            raise ValueError(f"{name} has {size} bytes, {MARKER} says {info.get('num_bytes')}")
    return marker


def _check_file_name(name: Any) -> None:
    """A file name listed in the marker: a relative path inside the checkpoint (``dcp/__0_0.distcp``),
    never absolute and never through ``..``, so that reading it cannot leave the directory."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or "\\" in name or any(p in ("", ".", "..") for p in parts) or ":" in parts[0]:
        raise ValueError(f"{MARKER} lists the file name {name!r}, which is not a plain path inside the checkpoint")


def _check_group_name(group: Any) -> None:
    """The rule for tensor group names, on save and on load: ``<group>.safetensors`` stays inside
    the checkpoint and cannot be confused with the state or meta files."""
    if not isinstance(group, str) or not _GROUP_RE.match(group) or group in ("state", "meta"):
        raise ValueError(f"tensor group name {group!r} must match [A-Za-z0-9_-]+ and not be 'state' or 'meta'")


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable {META} ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise ValueError(f"{META} has no integer step")
    groups = meta.get("tensors")
    if not isinstance(groups, list):
        raise ValueError(f"{META} has no list of tensor groups")
    for group in groups:
        try:
            _check_group_name(group)
        except ValueError as e:
            raise ValueError(f"{META}: {e}") from None
    return meta


def _complete_checkpoints(root: Path, warn: bool) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``; the step comes from meta.json."""
    found = []
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if _WORK_RE.match(entry.name):
            if warn:
                log.warning("ignoring %s: a checkpoint being written, or left by a crashed writer", entry)
            continue
        if not _FINAL_RE.match(entry.name):
            continue
        try:
            _read_marker(entry)
            found.append((_read_meta(entry)["step"], entry))
        except ValueError as e:
            if warn:
                log.warning("ignoring incomplete checkpoint %s: %s", entry, e)
    return found


def find_latest(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step (from meta.json) under ``RUN/checkpoints``, or
    None. Incomplete directories and writers' leftovers are skipped with a warning."""
    found = _complete_checkpoints(Path(run_dir) / CHECKPOINTS, warn=True)
    if not found:
        return None
    return max(found, key=lambda sp: (sp[0], sp[1].name))[1]


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", verify: bool = True,
    groups: tuple[str, ...] | None = None,
) -> Checkpoint:
    """Load a complete checkpoint. ``verify`` checks every file's sha256 against the marker (one
    extra read of the checkpoint); ``groups``: the tensor groups to read (None = all; a sharded
    resume reads none of the consolidated files). The state is read with ``weights_only=True``: a file holding
    anything but tensors and plain containers is refused, never executed."""
    path = Path(path)
    try:
        marker = _read_marker(path)
        meta = _read_meta(path)
        unlisted = [g for g in meta["tensors"] if f"{g}.safetensors" not in marker["files"]]
        if unlisted:
            raise ValueError(f"{META} names the tensor group {unlisted[0]!r} but {MARKER} does not list "
                             f"{unlisted[0]}.safetensors")
    except ValueError as e:
        raise UserError(f"{path}: not a complete checkpoint: {e}") from None
    if verify:
        for name, info in marker["files"].items():
            if _sha256(path / name) != info.get("sha256"):
                raise UserError(f"{path / name}: sha256 does not match {MARKER}: the file is corrupted or was modified")
    tensors = {g: load_safetensors(path / f"{g}.safetensors", device=str(map_location)) for g in meta["tensors"]
               if groups is None or g in groups}
    try:
        with warnings.catch_warnings():  # a plain pickle in its place: torch warns about its protocol first
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            state = torch.load(path / STATE, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{path / STATE}: refusing to load: it holds objects other than tensors and plain containers "
            f"({_first_line(e)})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:  # not a torch.save archive (truncated, another format)
        raise UserError(f"{path / STATE}: not a readable torch state file ({_first_line(e)})") from None
    return Checkpoint(path=path, tensors=tensors, state=state, meta=meta)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_safetensors(path: str | os.PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; :class:`UserError` naming the file when it is not one
    (a pickle, a truncated file): safetensors parses only a JSON header and raw bytes, so a file
    of another format is refused, never executed."""
    try:
        return safetensors.torch.load_file(path, device=device)
    except (safetensors.SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None


def resolve_resume(run_dir: str | os.PathLike, resume: str | os.PathLike) -> Path | None:
    """Which checkpoint to resume from: ``"auto"`` = the newest complete one under ``run_dir`` (None
    when there is none), ``"none"`` = None, anything else = that checkpoint directory, which must
    be complete."""
    if resume == "none":
        _note_resume(run_dir, None)
        return None
    if resume == "auto":
        latest = find_latest(run_dir)
        if latest is None:
            _refuse_unusable(Path(run_dir) / CHECKPOINTS)
        _note_resume(run_dir, latest)
        return latest
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"resume {path}: no such checkpoint directory (use auto, none or a step-NNNNNNNN directory)")
    if (path / CHECKPOINTS).is_dir() or path.name == CHECKPOINTS:
        raise UserError(f"resume {path}: a run's directory, not one checkpoint: give one of its "
                        f"{CHECKPOINTS}/step-NNNNNNNN directories, or auto (the newest)")
    try:
        _read_marker(path)
        _read_meta(path)
    except ValueError as e:
        raise UserError(f"resume {path}: not a complete checkpoint: {e}") from None
    _note_resume(run_dir, path)
    return path


def _note_resume(run_dir: str | os.PathLike, path: Path | None) -> None:
    """Remember which checkpoints of ``run_dir`` belong to the run this process continues: those
    up to the one it resumes from (retention may prune them); none when it starts afresh."""
    root = str((Path(run_dir) / CHECKPOINTS).resolve())
    if path is not None and Path(path).resolve().parent == Path(root):
        _resumed_step[root] = _read_meta(Path(path))["step"]
    else:
        _resumed_step.pop(root, None)


def _refuse_unusable(root: Path) -> None:
    """``--resume auto`` found no usable checkpoint: if the run directory holds checkpoints anyway,
    stop rather than silently train from step 0 beside (and later over) them."""
    if not root.is_dir():
        return
    bad = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and _FINAL_RE.match(entry.name):
            try:
                _read_marker(entry)
                _read_meta(entry)
            except ValueError as e:
                bad.append(f"{entry.name}: {e}")
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise UserError(
            f"{root}: holds {len(bad)} checkpoint(s), none usable ({bad[-1]}{more}); to resume, pass "
            "--resume PATH of a checkpoint you trust; to start over from step 0, pass --resume none "
            "(the unusable checkpoints are kept)")
