"""Loading a diffusers model that ``save_pretrained`` wrote: safetensors weights only.

One loader for every denoiser class (the U-Net, the transformer) and every caller (``load_unet``,
fine-tuning's base pipeline): a local directory or a hub id, never a pickled ``.bin``; what goes
wrong is one line naming the place.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from latentforge.errors import UserError
from latentforge.models.hub import hub_source, offline_hint, quiet_hub_calls

__all__ = ["load_pretrained", "no_loading_bars"]


def load_pretrained(model_class: type, path_or_id: str, subfolder: str | None = None,
                    label: str | None = None) -> torch.nn.Module:
    """``model_class.from_pretrained(path_or_id, subfolder)`` with safetensors weights only.

    ``label`` prefixes the error messages (default: the place); a path that looks local (absolute,
    or starting with "." or "~") and does not exist is refused before any hub lookup."""
    local = Path(path_or_id).expanduser()
    where = f"{path_or_id}/{subfolder}" if subfolder else path_or_id
    label = label or where
    if not local.exists() and (local.is_absolute() or path_or_id.startswith((".", "~"))):
        raise UserError(f"{label}: no such directory")
    try:
        # accelerate is not a dependency; without it diffusers loads this way anyway (and warns).
        with quiet_hub_calls():
            return model_class.from_pretrained(str(local) if local.exists() else hub_source(path_or_id),
                                               subfolder=subfolder, use_safetensors=True, low_cpu_mem_usage=False)
    except (OSError, ValueError) as e:
        raise UserError(f"{label}: cannot load a diffusers {model_class.__name__} with safetensors weights "
                        f"there{offline_hint(path_or_id) or f' ({e})'}") from e


@contextlib.contextmanager
def no_loading_bars() -> Iterator[None]:
    """diffusers' and transformers' per-file loading bars off (a line of output for each model
    loaded, however small), each restored as it was."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    bars = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for m, _ in bars:
        m.disable_progress_bar()
    try:
        yield
    finally:
        for m, was in bars:
            if was:
                m.enable_progress_bar()
