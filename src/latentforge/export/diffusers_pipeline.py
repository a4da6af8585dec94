"""Export a training checkpoint as a diffusers pipeline directory: ``StableDiffusionPipeline`` for a
U-Net, ``PixArtAlphaPipeline`` for the diffusion transformer (the denoiser's ``pipeline_class``).

The directory holds unet (EMA weights by default), vae, text_encoder, tokenizer, scheduler and
model_index.json, all weights in safetensors, and loads offline with
``StableDiffusionPipeline.from_pretrained(DIR)``. Two settings make the pipeline condition on
exactly what training saw: the tokenizer's ``model_max_length`` is the length captions were
encoded at, and the text encoder's config says ``use_attention_mask`` as the encode step ran it
(the pipeline then passes the padding mask, or not, the same way).

A transformer's pipeline is called as ``pipe(prompts, use_resolution_binning=False,
clean_caption=False, max_sequence_length=N)`` to reproduce ``latentforge sample``: its resolution
binning knows only PixArt's own sizes (it refuses other sample sizes), caption cleaning (with
``bs4``/``ftfy`` installed) rewrites prompts the training captions never were, and ``N`` is the
length captions were encoded at (written to ``latentforge_export.json`` as ``call``). It always
passes the padding mask to the text encoder, so a run encoded without it is not exported.

A LoRA fine-tuning run (``train.lora``) exports either this full pipeline with the adapters
merged into the base denoiser, or, for a U-Net, with ``lora_file=True`` only the adapter file
``pytorch_lora_weights.safetensors`` (``StableDiffusionPipeline.save_lora_weights``), which
``StableDiffusionPipeline.from_pretrained(BASE).load_lora_weights(DIR)`` applies to the base pipeline.
diffusers 0.42 has no LoRA loader for PixArt (no ``PixArtAlphaPipeline.load_lora_weights``, no
``load_lora_adapter`` on ``PixArtTransformer2DModel``), so a transformer's adapter file is refused:
nothing could load it.

The directory is written under a temporary name next to ``out_dir`` and renamed into place when
complete, so an interrupted export leaves no half-written pipeline under the final name.

A flow-matching run (``train.noise.prediction_type: flow_matching``) is exported with
DPMSolverMultistepScheduler on flow sigmas (``--scheduler ddim``: first order, the Euler step;
``dpm++``: second order), with the shift of the U-Net's sample size: StableDiffusionPipeline
cannot run FlowMatchEulerDiscreteScheduler (``euler``), which has no ``init_noise_sigma``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from latentforge.diffusion.flow_matching import FLOW_MATCHING
from latentforge.diffusion.schedule import NoiseScheduleConfig, check_scheduler_objective, make_sampler
from latentforge.errors import UserError
from latentforge.inference import load_components, resolve_checkpoint, run_dir_of
from latentforge.train.run_files import load_run_files
from latentforge.models.denoiser import denoiser_for
from latentforge.models.pretrained import no_loading_bars


def check_pipeline_sampler(pipeline_class: str, sampler: str, noise: NoiseScheduleConfig, where: str,
                           use_ddim: str) -> None:
    """Refuse a sampler that the diffusers pipeline cannot run for the run's noise schedule ``noise``
    (a flow_matching model with FlowMatchEulerDiscreteScheduler); ``use_ddim`` says how to ask for ddim."""
    if noise.prediction_type == FLOW_MATCHING and sampler == "euler":
        raise UserError(f"{where}: {pipeline_class} cannot run FlowMatchEulerDiscreteScheduler (it has no "
                        f"init_noise_sigma, diffusers 0.42): {use_ddim} (the same Euler step on DPM-Solver's flow "
                        "sigmas) or dpm++")


def export_pipeline(checkpoint: str | Path, out_dir: str | Path, use_ema: bool = True,
                    scheduler: str = "ddim", lora_file: bool = False) -> Path:
    """Write the pipeline of ``checkpoint`` (a checkpoint or run directory) to the new ``out_dir``;
    ``lora_file``: write only the LoRA adapter file of a LoRA run."""
    import diffusers
    from diffusers import StableDiffusionPipeline

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: is a file; export writes a new directory")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: exists and is not an empty directory; export writes a new directory")
    path = resolve_checkpoint(checkpoint)
    cfg, meta = load_run_files(run_dir_of(path))  # checked before loading any model
    is_lora = cfg.train.lora is not None
    if lora_file and not is_lora:
        raise UserError(f"{path}: not a LoRA run (train.lora is unset): export the full pipeline instead")
    denoiser = denoiser_for(cfg.train)
    pipeline_class = getattr(diffusers, denoiser.pipeline_class)
    if lora_file and not hasattr(pipeline_class, "load_lora_weights"):
        raise UserError(f"export --lora-file: {denoiser.pipeline_class} has no load_lora_weights in diffusers "
                        f"{diffusers.__version__}, so nothing could load a {denoiser.title} adapter file: export the "
                        "merged pipeline (without --lora-file)")
    if meta["vae"].get("shift_factor"):
        raise UserError(f"export: the run's VAE has a shift_factor, which {denoiser.pipeline_class} ignores when "
                        "decoding (it decodes latents / scaling_factor): the pipeline could not reproduce this model")
    check_pipeline_sampler(denoiser.pipeline_class, scheduler, cfg.train.noise, "export",
                           "export this flow_matching model with --scheduler ddim")
    if denoiser.uses_text_mask and not meta["text_encoder"].get("attention_mask", True):
        raise UserError(f"export: the run's captions were encoded without the padding mask, which "
                        f"{denoiser.pipeline_class} always passes to the text encoder: re-encode with it")
    comps = load_components(path, use_ema=use_ema)
    # The pipeline samples at the U-Net's sample_size by default: the flow shift of that latent size.
    sampler = make_sampler(scheduler, comps.noise, comps.unet.config.sample_size)
    check_scheduler_objective(sampler, comps.noise)
    lora_state = None
    if is_lora:
        from latentforge.train.finetune import lora_state_for_diffusers, merge_lora_adapters

        if lora_file:
            lora_state = lora_state_for_diffusers(comps.unet)
            lora_config = comps.unet.peft_config["default"].to_dict()
        merge_lora_adapters(comps.unet)  # W + (alpha / r) B A, then drop the adapter layers
    # comps.text_model.config.use_attention_mask is the encode step's (load_encoders set it): the
    # pipeline passes the padding mask exactly when the training data was encoded with it.
    comps.tokenizer.model_max_length = comps.max_length
    if pipeline_class is StableDiffusionPipeline:
        pipe = StableDiffusionPipeline(
            vae=comps.vae, text_encoder=comps.text_model, tokenizer=comps.tokenizer, unet=comps.unet,
            scheduler=sampler, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )
        call = {}
    else:
        pipe = pipeline_class(vae=comps.vae, text_encoder=comps.text_model, tokenizer=comps.tokenizer,
                              transformer=comps.unet, scheduler=sampler)
        call = {"use_resolution_binning": False, "clean_caption": False, "max_sequence_length": comps.max_length}
    final = out.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # from an earlier failed export of this process
    try:
        record = {"checkpoint": str(path), "weights": comps.weights, "scheduler": scheduler,
                  "pipeline": denoiser.pipeline_class, "call": call}
        if lora_file:
            tmp.mkdir()
            # The adapter config goes into the file's metadata: without it load_lora_weights assumes
            # alpha = rank, a wrong scale whenever train.lora.alpha is set.
            StableDiffusionPipeline.save_lora_weights(tmp, unet_lora_layers=lora_state, safe_serialization=True,
                                                      unet_lora_adapter_metadata=lora_config)
            record.update(kind="lora", base=str(Path(cfg.train.init_from).resolve()))
        else:
            pipe.save_pretrained(tmp, safe_serialization=True)
            record["kind"] = "merged-lora" if is_lora else "pipeline"
        (tmp / "latentforge_export.json").write_text(json.dumps(record, indent=1))
        if final.exists():
            final.rmdir()  # empty (checked above)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def pipeline_call_kwargs(export_dir: str | Path) -> dict:
    """The arguments a pipeline exported here must be called with to reproduce ``latentforge sample``
    (``call`` in ``latentforge_export.json``; none for a Stable Diffusion pipeline or another directory)."""
    record = Path(export_dir) / "latentforge_export.json"
    if not record.is_file():
        return {}
    try:
        return dict(json.loads(record.read_text()).get("call") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


class _DropTextEncoderTypeWarning(logging.Filter):
    """diffusers warns that a BERT-family text encoder (the demo's MiniLM) is not the CLIPTextModel
    its Stable Diffusion pipeline names: harmless, the pipeline only calls the encoder (README)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Expected types for text_encoder")


def load_exported(export_dir: str | Path):
    """The pipeline ``export`` wrote, loaded the way a user loads it (``DiffusionPipeline.from_pretrained``,
    offline), without the loading bars of diffusers and transformers and the text-encoder type warning;
    its own progress bar off."""
    from diffusers import DiffusionPipeline

    logger = logging.getLogger("diffusers.pipelines.pipeline_utils")
    quiet = _DropTextEncoderTypeWarning()
    logger.addFilter(quiet)
    try:
        with no_loading_bars():
            pipe = DiffusionPipeline.from_pretrained(str(export_dir), local_files_only=True)
    except (OSError, ValueError) as e:  # a damaged or incomplete directory: diffusers' chained tracebacks
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"{export_dir}: the exported pipeline does not load ({first}); export it again") from None
    finally:
        logger.removeFilter(quiet)
    pipe.set_progress_bar_config(disable=True)
    return pipe
