"""Export a training checkpoint as a diffusers ``StableDiffusionPipeline`` directory.

The directory holds unet (EMA weights by default), vae, text_encoder, tokenizer, scheduler and
model_index.json, all weights in safetensors, and loads offline with
``StableDiffusionPipeline.from_pretrained(DIR)``. Two settings make the pipeline condition on
exactly what training saw: the tokenizer's ``model_max_length`` is the length captions were
encoded at, and the text encoder's config says ``use_attention_mask`` (the pipeline then passes
the padding mask, as the encode step did).

The directory is written under a temporary name next to ``out_dir`` and renamed into place when
complete, so an interrupted export leaves no half-written pipeline under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from latentforge.diffusion.schedule import make_sampler
from latentforge.errors import UserError
from latentforge.inference import load_components, load_run_files, resolve_checkpoint, run_dir_of


def export_pipeline(checkpoint: str | Path, out_dir: str | Path, use_ema: bool = True,
                    scheduler: str = "ddim") -> Path:
    """Write the pipeline of ``checkpoint`` (a checkpoint or run directory) to the new ``out_dir``."""
    from diffusers import StableDiffusionPipeline

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not an empty directory; export writes a new directory")
    path = resolve_checkpoint(checkpoint)
    _, meta = load_run_files(run_dir_of(path))  # checked before loading any model
    if meta["vae"].get("shift_factor"):
        raise UserError("export: the run's VAE has a shift_factor, which StableDiffusionPipeline ignores when "
                        "decoding (it decodes latents / scaling_factor): the pipeline could not reproduce this model")
    comps = load_components(path, use_ema=use_ema)
    comps.text_model.config.use_attention_mask = True
    comps.tokenizer.model_max_length = comps.max_length
    pipe = StableDiffusionPipeline(
        vae=comps.vae, text_encoder=comps.text_model, tokenizer=comps.tokenizer, unet=comps.unet,
        scheduler=make_sampler(scheduler, comps.noise), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    final = out.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # from an earlier failed export of this process
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / "latentforge_export.json").write_text(json.dumps(
            {"checkpoint": str(path), "weights": comps.weights, "scheduler": scheduler}, indent=1))
        if final.exists():
            final.rmdir()  # empty (checked above)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
