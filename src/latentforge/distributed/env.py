"""The one place that reads RANK / WORLD_SIZE / LOCAL_RANK and sets up the process group.

Every launcher ends here: a plain process (world size 1, no process group unless FSDP2 CPU
offload asks for a one-rank group), ``torchrun``
(the variables come from the elastic agent), SLURM through ``torchrun``, or Ray Train (whose
``TorchTrainer`` has already created the process group: it is reused, never created twice).
The trainer only sees the resulting :class:`World`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from latentforge.errors import UserError


@dataclass
class World:
    """Where this process stands: rank, world size, and how to talk to the other ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    all_reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None  # for logged scalars
    barrier: Callable[[], None] | None = None
    # Skips the gradient all-reduce on accumulation micro batches; set by the parallel wrapper
    # (DDP's no_sync, FSDP2's set_requires_gradient_sync), not here.
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    # True on every rank if ``flag`` is True on any rank (one all-reduce of one number): the ranks
    # agree to stop after the same step when a signal reached only some of them.
    any_rank: Callable[[bool], bool] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class LaunchEnv:
    """The launcher's variables (torchrun / SLURM-through-torchrun / Ray Train set them)."""

    rank: int
    world_size: int
    local_rank: int


def read_env() -> LaunchEnv:
    """RANK, WORLD_SIZE and LOCAL_RANK; a plain process is rank 0 of 1."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise UserError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    return LaunchEnv(rank, world_size, local_rank)


def backend_for(device_type: str) -> str:
    """nccl for CUDA ranks, gloo for CPU ranks."""
    return "nccl" if device_type == "cuda" else "gloo"


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(device: str = "auto", timeout_minutes: float = 30.0, single_rank_group: bool = False) -> World:
    """The :class:`World` of this process, creating the process group if the launcher asked for
    more than one rank and nobody created it yet. ``device``: "auto" | "cpu" | "cuda" (as
    ``train.device``); on CUDA each rank takes the GPU ``LOCAL_RANK``. ``single_rank_group``: a
    plain process (world size 1) still creates a one-rank group, on 127.0.0.1 and a free port
    unless MASTER_ADDR / MASTER_PORT are set (FSDP2 with CPU offload on one GPU needs a device mesh)."""
    env = read_env()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        if env.world_size == 1 and not single_rank_group:
            return World(local_rank=env.local_rank)
        if env.world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend=backend_for("cuda" if use_cuda else "cpu"), rank=env.rank,
                                world_size=env.world_size, timeout=datetime.timedelta(minutes=timeout_minutes))
        global _created_here
        _created_here = True
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return World(local_rank=env.local_rank)
    flag_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    return World(rank=rank, world_size=world_size, local_rank=env.local_rank,
                 all_reduce_mean=_all_reduce_mean, barrier=dist.barrier, any_rank=_any_rank(flag_device))


_created_here = False  # Ray Train owns the group it created; only ours is destroyed by close_world


def _all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


def _any_rank(device: torch.device | None) -> Callable[[bool], bool]:
    """The OR of a flag over all ranks; ``device``: where the backend reduces (CUDA for NCCL)."""

    def any_rank(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())  # host sync (on CUDA), one int32

    return any_rank


def close_world() -> None:
    """Tear the process group down if :func:`init_world` created it (a launcher's group is left alone)."""
    global _created_here
    if _created_here and dist.is_initialized():
        dist.destroy_process_group()
    _created_here = False
