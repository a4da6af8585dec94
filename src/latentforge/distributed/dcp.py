"""Sharded checkpoints of FSDP2 runs: torch.distributed.checkpoint (DCP) plus consolidated weights.

A sharded checkpoint is the usual atomic ``step-XXXXXXXX/`` directory (``checkpoint.py``) with::

    dcp/                 DCP: every rank writes its shards of the model, the AdamW state and the
        __0_0.distcp     EMA (``__<rank>_0.distcp``); the coordinator writes ``.metadata``
        .metadata
    model.safetensors    the full model and EMA, gathered to rank 0 at save time: what
    ema.safetensors      ``latentforge sample`` / ``export`` read, unchanged from a DDP run
    state.pt, meta.json  LR schedule, RNG states, loader cursor, ``"sharded": true``
    COMPLETE             written by rank 0 after every rank's DCP write returned

Why consolidate at save time rather than in a separate step afterwards: a finished (or crashed)
run is then directly usable by sample/export/demo, and the consolidated files are covered by the
same marker and sha256 list. The cost is an all-gather of the model and EMA into rank 0's CPU
memory per checkpoint (8 bytes/parameter in fp32: 7 GB for sd2-base's 865M parameters) and that
much more disk; resuming reads only ``dcp/``.

Resume reads ``dcp/`` through DCP, which re-shards on load: a checkpoint written by N ranks loads
on M ranks under FSDP2, and into a plain (unsharded) model on one rank or under DDP, since DCP
fills whatever tensors the target state dict holds. The reverse, a single-file checkpoint of a
DDP or single-process run resumed under FSDP2, is refused (its optimizer state is keyed by
parameter index, not name).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from latentforge import checkpoint as ckpt
from latentforge.distributed.env import World
from latentforge.errors import UserError
from latentforge.train.ema import EMA

__all__ = ["DCP_DIR", "save_sharded", "load_sharded", "is_sharded_checkpoint", "full_model_state_dict"]

DCP_DIR = "dcp"


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model state dict on rank 0's CPU (empty on the other ranks); a collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None) -> dict[str, Any]:
    """What DCP writes and reads: each rank's shards (plain tensors for an unsharded model).
    ``get_optimizer_state_dict`` creates the AdamW state first if it does not exist yet (a fresh
    optimizer on resume), so that DCP has tensors to load into."""
    state: dict[str, Any] = {"model": get_model_state_dict(model),
                             "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema.state_dict()["params"]
    return state


def save_sharded(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 ema: EMA | None, state: Mapping[str, Any], meta: Mapping[str, Any], world: World,
                 keep_last: int, keep_every: int) -> Path:
    """Write the sharded checkpoint of ``step``; every rank calls it. ``state``/``meta``: the plain
    state and metadata (rank 0's are written). Returns the final path once it is complete."""
    tensors = {"model": full_model_state_dict(model)}
    if ema is not None:
        full_ema = ema.full_state_dict()
        if world.is_main:
            tensors["ema"] = full_ema
        del full_ema
    workdir = [str(ckpt.begin_checkpoint(run_dir, step)) if world.is_main else None]
    dist.broadcast_object_list(workdir, src=0)
    tmp = Path(workdir[0])
    try:
        # Collective: returns on every rank after all shards and the coordinator's .metadata are
        # written (FileSystemWriter fsyncs each file).
        dcp.save(_sharded_state(model, optimizer, ema), storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR))
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    path = ckpt.save_checkpoint(run_dir, step, tensors, state, {**meta, "sharded": True},
                                keep_last=keep_last, keep_every=keep_every, is_writer=world.is_main,
                                workdir=tmp if world.is_main else None)
    return path


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None) -> None:
    """Load the ``dcp/`` part of a sharded checkpoint into ``model``, ``optimizer`` and ``ema``,
    re-sharded to their current layout (FSDP2 on any number of ranks, or plain tensors)."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise UserError(f"{path}: has no {DCP_DIR}/ (it was written by a DDP or single-process run); resume it "
                        "with parallel.strategy=ddp or auto, or start a new run directory for fsdp")
    target = _sharded_state(model, optimizer, ema)
    saved = set(dcp.FileSystemReader(path / DCP_DIR).read_metadata().state_dict_metadata)
    if ema is not None and not any(k.startswith("ema.") for k in saved):
        raise UserError(f"{path}: has no EMA weights but train.ema is set")
    with warnings.catch_warnings():
        # Without a process group (resuming on one rank) DCP warns that it loads in one process: intended.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=dcp.FileSystemReader(path / DCP_DIR))
    set_model_state_dict(model, target["model"])
    set_optimizer_state_dict(model, optimizer, target["optimizer"])
    if ema is not None:
        ema.load_state_dict({"params": target["ema"], "num_updates": ema.num_updates})
