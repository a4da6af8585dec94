"""Where bytes live: a local path or ``s3://bucket/prefix``, behind a handful of functions.

S3 goes through boto3. The endpoint comes from boto3's own configuration (``AWS_ENDPOINT_URL``
or ``AWS_ENDPOINT_URL_S3`` for S3-compatible servers, credentials from the usual chain), so
nothing here is specific to one provider. Local writes are atomic (temp file + fsync + rename).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from latentforge.errors import UserError

log = logging.getLogger(__name__)

_S3 = "s3://"
_local = threading.local()


@dataclass(frozen=True)
class FileEntry:
    uri: str
    size: int


def is_s3(uri: str) -> bool:
    return str(uri).startswith(_S3)


def split_s3(uri: str) -> tuple[str, str]:
    rest = str(uri)[len(_S3):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UserError(f"{uri}: an S3 address needs a bucket (s3://bucket/prefix)")
    return bucket, key


def as_utf8(name: str) -> str:
    """``name`` as UTF-8 text: bytes that are not UTF-8 (which Python keeps as surrogate escapes, in a
    file name or an argument) written as ``\\xNN``; a lone surrogate from elsewhere (a JSON escape) as
    ``\\udNNN``. Text that is UTF-8 already comes back as it is."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


LOCK_FILE = ".latentforge.lock"


@contextmanager
def directory_lock(out: str | Path, what: str) -> Iterator[None]:
    """Hold ``out``'s lock while a ``what`` (e.g. "latentforge demo") works in it: a second process
    that asks for it meanwhile stops with one line naming the holder's command and process instead of
    writing the same files. An exclusive
    ``flock`` on ``out/.latentforge.lock``, so it goes with the process: a killed run leaves none behind."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the holder wrote "PID COMMAND" (a demo holds the directories of its stages too)
            pid, _, holder = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
            raise UserError(f"{out}: another {holder or what} is working in this directory"
                            + (f" (process {pid})" if pid.isdigit() else "")
                            + "; wait for it to end, or use another directory") from None
        except OSError as e:  # a filesystem without flock (e.g. Lustre mounted without -o flock)
            log.warning("%s: cannot lock it (%s): going on without the check that no other %s works here",
                        out, e.strerror, what)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def lock_at_first_write(what: str) -> Iterator[Callable[[str | Path], None]]:
    """For a command whose checks come before its first write: yields ``take(dir)``, which takes
    ``dir``'s :func:`directory_lock` for ``what`` until the block ends. Called at the first write,
    it leaves a directory that a check refuses untouched. ``what`` empty: ``take`` does nothing
    (a caller that holds the lock already, or a launcher that restarts its own workers)."""
    with ExitStack() as held:
        yield (lambda d: held.enter_context(directory_lock(d, what))) if what else (lambda d: None)


def refuse_foreign_dir(out: str | Path, marks: Iterable[str], what: str) -> None:
    """A local output directory that is not empty and holds none of ``marks`` (the files by which
    a ``what`` is known) is refused: writing into it would mix the two."""
    out, marks = Path(out), list(marks)
    if out.is_dir() and not any((out / m).exists() for m in marks) and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise UserError(f"{out}: exists, is not empty and holds no {what} (no {marks[0]}): use a new or empty "
                        "directory")


def s3_client():
    """One boto3 client per process and thread (boto3 clients are not fork-safe)."""
    key = os.getpid()
    client = getattr(_local, "clients", {}).get(key)
    if client is None:
        import boto3
        from botocore.config import Config

        client = boto3.session.Session().client(
            "s3", config=Config(retries={"max_attempts": 5, "mode": "standard"})
        )
        _local.clients = {key: client}
    return client


def join(base: str, *parts: str) -> str:
    if is_s3(base):
        out = str(base).rstrip("/")
        for p in parts:
            out += "/" + str(p).strip("/")
        return out
    return str(Path(base, *parts))


def basename(uri: str) -> str:
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


def exists(uri: str) -> bool:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        from botocore.exceptions import ClientError

        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError:
            return False
    return Path(uri).exists()


def list_files(uri: str, suffixes: Iterable[str] | None = None, recursive: bool = True) -> list[FileEntry]:
    """Files under a directory or prefix (or the single file ``uri``), sorted by address."""
    sfx = tuple(s.lower() for s in suffixes) if suffixes else None
    out: list[FileEntry] = []
    if is_s3(uri):
        bucket, key = split_s3(uri)
        client = s3_client()
        if key and not key.endswith("/"):
            from botocore.exceptions import ClientError

            try:  # a single object
                return [FileEntry(uri, client.head_object(Bucket=bucket, Key=key)["ContentLength"])]
            except ClientError:
                pass  # not an object: a prefix
        prefix = key.rstrip("/") + "/" if key else ""
        kwargs = {"Bucket": bucket, "Prefix": prefix}
        if not recursive:
            kwargs["Delimiter"] = "/"
        for page in client.get_paginator("list_objects_v2").paginate(**kwargs):
            for obj in page.get("Contents", []):
                name = obj["Key"]
                if sfx is None or name.lower().endswith(sfx):
                    out.append(FileEntry(f"s3://{bucket}/{name}", obj["Size"]))
    else:
        p = Path(uri)
        if p.is_file():
            return [FileEntry(str(p), p.stat().st_size)]
        if not p.is_dir():
            raise UserError(f"{uri}: no such file or directory")
        it = p.rglob("*") if recursive else p.iterdir()
        for f in it:
            if f.is_file() and (sfx is None or f.name.lower().endswith(sfx)):
                out.append(FileEntry(str(f), f.stat().st_size))
    out.sort(key=lambda e: e.uri)
    return out


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return Path(uri).read_bytes()


def open_stream(uri: str) -> BinaryIO:
    """A readable binary stream (S3 objects are streamed, not loaded whole)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"]
    return open(uri, "rb")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a local file so that it exists either whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_bytes(uri: str, data: bytes) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)  # S3 puts are atomic
    else:
        atomic_write_bytes(uri, data)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (for telling a dead writer's leftovers from a live one's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def fsync_dir(path: str | Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
