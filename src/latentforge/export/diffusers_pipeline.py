"""Export a training checkpoint as a diffusers ``StableDiffusionPipeline`` directory.

The directory holds unet (EMA weights by default), vae, text_encoder, tokenizer, scheduler and
model_index.json, all weights in safetensors, and loads offline with
``StableDiffusionPipeline.from_pretrained(DIR)``. Two settings make the pipeline condition on
exactly what training saw: the tokenizer's ``model_max_length`` is the length captions were
encoded at, and the text encoder's config says ``use_attention_mask`` (the pipeline then passes
the padding mask, as the encode step did).
"""

from __future__ import annotations

import json
from pathlib import Path

from latentforge.diffusion.schedule import make_sampler
from latentforge.errors import UserError
from latentforge.inference import load_components, resolve_checkpoint


def export_pipeline(checkpoint: str | Path, out_dir: str | Path, use_ema: bool = True,
                    scheduler: str = "ddim") -> Path:
    from diffusers import StableDiffusionPipeline

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: exists and is not empty; export writes a new directory")
    path = resolve_checkpoint(checkpoint)
    comps = load_components(path, use_ema=use_ema)
    if comps.vae.config.get("shift_factor"):
        raise UserError("export: the VAE has a shift_factor, which StableDiffusionPipeline ignores when decoding")
    comps.text_model.config.use_attention_mask = True
    comps.tokenizer.model_max_length = comps.max_length
    pipe = StableDiffusionPipeline(
        vae=comps.vae, text_encoder=comps.text_model, tokenizer=comps.tokenizer, unet=comps.unet,
        scheduler=make_sampler(scheduler, comps.noise), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "latentforge_export.json").write_text(json.dumps(
        {"checkpoint": str(path), "weights": "ema" if use_ema else "model", "scheduler": scheduler}, indent=1))
    return out
