"""Connecting to a Ray cluster or starting a local Ray instance: what the Ray data stages
(``distributed/ray_data.py``) and the Ray training launcher (``distributed/ray_launch.py``) share.

On one machine with no ``address``, a local Ray instance is started with ``num_cpus`` = the
machine's cores, a capped object store, and its temporary directory under the run directory
(or under /tmp when that path is too long for Ray's unix sockets), and is shut down afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from latentforge.errors import Problems, UserError

log = logging.getLogger(__name__)

# Ray names its unix sockets <temp dir>/session_<date>_<time>_<pid>/sockets/plasma_store (about 70
# characters below the temp dir); Linux caps a socket path at 107 bytes.
_MAX_TEMP_DIR_CHARS = 36


@dataclass
class RayConfig:
    """Where and how Ray runs: an existing cluster or a local instance, and the worker group."""

    address: str = field(default="", metadata={
        "help": "Ray cluster address (ray://host:10001 or host:6379, or auto); empty = start a local instance"})
    num_workers: int = field(default=1, metadata={"help": "training processes (ranks)"})
    gpus_per_worker: float | None = field(default=None, metadata={
        "help": "GPUs per worker; None = 1 if the cluster has GPUs, else 0"})
    cpus_per_worker: float | None = field(default=None, metadata={
        "help": "CPUs per worker; None = 1 on a cluster, on a local instance the cores shared out "
                "with a quarter core left for Ray's own actors (fractions keep 2 cores from deadlocking)"})
    max_failures: int = field(default=2, metadata={
        "help": "worker-group restarts after a worker failure (each resumes from the newest checkpoint)"})
    storage: str = field(default="", metadata={
        "help": "Ray Train storage path: a shared directory or s3://bucket/prefix; empty = RUN_DIR/ray"})
    object_store_gb: float = field(default=1.0, metadata={
        "help": "object store size of a local instance in GB (1e9 bytes); Ray's default is 30% of RAM"})

    def validate(self) -> None:
        problems = Problems()
        if self.num_workers < 1:
            problems.add(f"num_workers: must be >= 1, got {self.num_workers}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            problems.add(f"gpus_per_worker: must be >= 0, got {self.gpus_per_worker}")
        if self.cpus_per_worker is not None and not self.cpus_per_worker > 0:
            problems.add(f"cpus_per_worker: must be > 0, got {self.cpus_per_worker}")
        if self.max_failures < -1:
            problems.add(f"max_failures: must be >= 0 (or -1 = without limit), got {self.max_failures}")
        if not self.object_store_gb >= 0.1:
            problems.add(f"object_store_gb: must be >= 0.1 (Ray needs about 75 MB), got {self.object_store_gb}")
        problems.raise_if_any()


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'latentforge[ray]' (ray[default]>=2.40)") from None
    return ray


def local_temp_dir(run_dir: Path) -> tuple[Path, bool]:
    """Ray's temp dir for a local instance: ``RUN_DIR/ray-tmp`` if short enough for Ray's unix
    socket paths, else a new directory under /tmp. Returns (dir, is_fallback)."""
    preferred = run_dir / "ray-tmp"
    if len(str(preferred)) <= _MAX_TEMP_DIR_CHARS:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred, False
    return Path(tempfile.mkdtemp(prefix="lf-ray-", dir="/tmp")), True


@contextmanager
def ray_session(cfg: RayConfig, run_dir: Path, quiet: bool = False) -> Iterator[Any]:
    """Connect to ``cfg.address`` or start a local Ray instance (see the module docstring); the
    instance is shut down on exit. Yields the ``ray`` module."""
    ray = import_ray()
    if ray.is_initialized():  # e.g. a caller that started Ray itself: use it, leave it running
        yield ray
        return
    fallback = None
    # Ray's workers inherit this process's environment on a local instance; the usage-stats ping
    # would only time out on machines without internet.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cfg.address:
        ray.init(address=cfg.address, log_to_driver=not quiet)
    else:
        temp, is_fallback = local_temp_dir(run_dir)
        if is_fallback:
            fallback = temp
            log.warning("Ray's temp dir %s: %s/ray-tmp is too long for Ray's unix socket paths", temp, run_dir)
        ray.init(num_cpus=os.cpu_count() or 1, object_store_memory=int(cfg.object_store_gb * 1e9),
                 _temp_dir=str(temp), log_to_driver=not quiet)  # the dashboard serves Ray Train's state API
    try:
        yield ray
    finally:
        ray.shutdown()
        if fallback is not None:
            shutil.rmtree(fallback, ignore_errors=True)
