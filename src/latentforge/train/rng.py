"""Capture and restore every random number generator, as checkpointable plain data.

Exact resume needs the same random numbers after a restart: Python's ``random``, numpy's
global generator, torch's CPU generator, every CUDA device's generator, and the explicit
``torch.Generator`` objects that draw diffusion noise and timesteps. Their states are turned into
tensors, numbers and plain containers, so that ``torch.load(..., weights_only=True)`` reads them
back without unpickling arbitrary objects (numpy's state holds an ``ndarray``, Python's a tuple
of 625 ints: both become int64 tensors).

The states are per process. In multi-process training every rank has its own states; rank 0
writes the checkpoint, so the trainer either gathers the other ranks' states into it or derives
them again from ``(seed, rank, step)``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state", "make_generator", "generator_state", "set_generator_state"]

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """The states of Python ``random``, numpy's global generator, torch CPU and all CUDA devices."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),  # 625 uint32 words
            "gauss_next": gauss_next,
        },
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),  # 624 uint32 words
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states captured by :func:`rng_state` (tensors may sit on any device)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state({
        "bit_generator": npy["bit_generator"],
        "state": {"key": npy["key"].cpu().numpy().astype(np.uint32), "pos": int(npy["pos"])},
        "has_gauss": int(npy["has_gauss"]),
        "gauss": float(npy["gauss"]),
    })
    # load_checkpoint(map_location="cuda") moves these byte tensors; the setters want them on CPU.
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = [s.cpu() for s in state["cuda"]]
    if cuda_states and torch.cuda.is_available():
        num_devices = torch.cuda.device_count()
        if len(cuda_states) != num_devices:
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d: restoring the "
                "first %d, random numbers on the others will differ from the original run",
                len(cuda_states), num_devices, min(len(cuda_states), num_devices),
            )
        for device, s in enumerate(cuda_states[:num_devices]):
            torch.cuda.set_rng_state(s, device)


def make_generator(seed: int, rank: int, device: str | torch.device) -> torch.Generator:
    """A generator for rank ``rank`` whose seed mixes ``(seed, rank)`` with numpy's SeedSequence,
    so that ranks draw independent noise and neighbouring seeds do not give overlapping streams."""
    if seed < 0 or rank < 0:
        raise ValueError(f"seed {seed} and rank {rank} must be >= 0")
    mixed = int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0])
    generator = torch.Generator(device=device)
    generator.manual_seed(mixed)
    return generator


def generator_state(generator: torch.Generator) -> torch.Tensor:
    """The state of ``generator`` as a CPU uint8 tensor (for CUDA generators too)."""
    return generator.get_state()


def set_generator_state(generator: torch.Generator, state: torch.Tensor) -> None:
    """Restore a state from :func:`generator_state` (the tensor may have been loaded onto a GPU)."""
    generator.set_state(state.cpu())
