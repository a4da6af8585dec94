"""Fine-tuning existing weights from a local diffusers pipeline directory.

``train.init_from: DIR`` (or ``latentforge finetune --from DIR``) starts the denoiser from the
pipeline's own model: ``DIR/unet`` of a Stable Diffusion pipeline (its own ``config.json``, so SD
1.x and 2.x layouts both load), or ``DIR/transformer`` of a PixArtAlphaPipeline (what latentforge
exports from a ``train.model: dit`` run). The family is the base's: ``train.model`` must name it,
and the other family's fields are refused (:func:`check_recipe_matches_base`). The difference
between the families is the denoiser's (``models/denoiser.py``: its class, its folder in the
pipeline, its text-width field); nothing here or in the callers branches on it. The noise
schedule, prediction type included (flow matching too), comes from ``DIR/scheduler``. The latent shards must have been
encoded with ``DIR/vae`` and ``DIR/text_encoder`` (``latentforge encode --from DIR``): their
meta records the fingerprints, and :func:`check_data_matches_base` refuses anything else, naming
what differs (latent channels, text width, scale factor, or the weights themselves).

With ``train.lora`` set, the denoiser's base weights are frozen and ``peft`` LoRA adapters are
added to the attention projections (Hu et al. 2021, "LoRA", arXiv:2106.09685); PixArt's
self- and cross-attention use the U-Net's module names (``attn1``/``attn2`` with ``to_q``,
``to_k``, ``to_v``, ``to_out.0``), so the default targets are the same. Only the adapter weights
are trained, checkpointed and averaged by the EMA. A U-Net LoRA run exports either the adapter
file that ``StableDiffusionPipeline.load_lora_weights`` reads or the merged pipeline; a
transformer's exports merged only (diffusers 0.42 has no LoRA loader for PixArt: neither
``PixArtAlphaPipeline.load_lora_weights`` nor ``PixArtTransformer2DModel.load_lora_adapter``).

``peft`` is imported only when a LoRA is asked for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from latentforge.checkpoint import load_weights
from latentforge.diffusion.schedule import NoiseScheduleConfig
from latentforge.errors import ConfigError, Problems, UserError
from latentforge.models.denoiser import BACKBONES, Denoiser, denoiser_from_config
from latentforge.models.pretrained import load_pretrained

log = logging.getLogger(__name__)

__all__ = [
    "LoRAConfig",
    "BasePipeline",
    "open_base",
    "check_recipe_matches_base",
    "check_data_matches_base",
    "base_noise_config",
    "build_finetune_model",
    "add_lora_adapters",
    "merge_lora_adapters",
    "trainable_state_dict",
    "load_trainable_state_dict",
    "model_for_run",
    "lora_state_for_diffusers",
]

# Components besides the denoiser a pipeline directory must hold for fine-tuning.
_COMPONENTS = ("vae", "text_encoder", "tokenizer", "scheduler")
# diffusers scheduler config keys -> NoiseScheduleConfig fields (the rest of the file is sampler settings).
_SCHEDULER_KEYS = {
    "num_train_timesteps": "num_train_timesteps",
    "beta_schedule": "beta_schedule",
    "beta_start": "beta_start",
    "beta_end": "beta_end",
    "prediction_type": "prediction_type",
    "rescale_betas_zero_snr": "rescale_zero_terminal_snr",
    "timestep_spacing": "timestep_spacing",
    "steps_offset": "steps_offset",
}


@dataclass
class LoRAConfig:
    """LoRA adapters on the denoiser (the base weights stay frozen and are never saved)."""

    rank: int = field(default=8, metadata={"help": "rank r of each adapter (A: r x in, B: out x r)"})
    alpha: float = field(default=0.0, metadata={
        "help": "scale numerator: the adapter output is multiplied by alpha / rank; 0 = rank (scale 1)"})
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"], metadata={
        "help": "module name suffixes that get adapters: the attention projections by default"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapter input"})

    def validate(self) -> None:
        problems = Problems()
        if self.rank < 1:
            problems.add(f"rank: must be >= 1, got {self.rank}; 4 to 64 is usual")
        if self.alpha < 0:
            problems.add(f"alpha: must be >= 0, got {self.alpha}; 0 = rank (adapter scale 1)")
        if not self.target_modules:
            problems.add("target_modules: empty; name the modules that get adapters, e.g. [to_q, to_k, to_v, to_out.0]")
        if not 0 <= self.dropout < 1:
            problems.add(f"dropout: must be in [0, 1), got {self.dropout}; 0 = none")
        problems.raise_if_any()

    def peft_config(self) -> Any:
        from peft import LoraConfig

        # "gaussian": A ~ N(0, 1/r), B = 0, so the adapted model starts exactly at the base model.
        return LoraConfig(r=self.rank, lora_alpha=self.alpha or self.rank, lora_dropout=self.dropout,
                          init_lora_weights="gaussian", target_modules=list(self.target_modules))


@dataclass(frozen=True)
class BasePipeline:
    """A local diffusers pipeline directory, checked to hold every component; ``denoiser``: its
    model's family with the model's ``config.json`` (``model_config``)."""

    path: Path
    denoiser: Denoiser
    model_config: dict[str, Any]
    vae_config: dict[str, Any]
    scheduler_config: dict[str, Any]
    pipeline_class: str  # model_index.json's _class_name

    @property
    def model_dir(self) -> Path:
        return self.path / self.denoiser.pipeline_component


def _read_json(path: Path, base: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{base}: not a diffusers pipeline directory: no {path.relative_to(base)} ({what})") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable {what}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: {what} is not a JSON object")
    return data


def open_base(path: str | Path) -> BasePipeline:
    """Check that ``path`` is a local diffusers pipeline of a family latentforge trains (a Stable
    Diffusion pipeline's U-Net or a PixArtAlphaPipeline's transformer) and read its configs."""
    base = Path(path).expanduser()
    if not base.is_dir():
        raise UserError(f"{path}: no such directory (init_from needs a local diffusers pipeline directory)")
    index = _read_json(base / "model_index.json", base, "the pipeline index")
    name = index.get("_class_name")
    folders = {cls.pipeline_component: cls for cls in BACKBONES.values()}
    present = [c for c in folders if isinstance(index.get(c), list) and index[c][-1] is not None]
    if len(present) != 1:
        what = "both a " + " and a ".join(present) if present else "neither a " + " nor a ".join(folders)
        raise UserError(f"{base}: a {name} with {what}: fine-tuning needs a pipeline with one denoiser, a "
                        + " or ".join(f"{cls.pipeline_class}'s {cls.pipeline_component}" for cls in BACKBONES.values()))
    family = folders[present[0]]
    missing = [c for c in _COMPONENTS if not isinstance(index.get(c), list) or index[c][-1] is None]
    if missing:
        raise UserError(f"{base}: model_index.json names no {', '.join(missing)}: fine-tuning needs a pipeline "
                        f"with {family.pipeline_component}, {', '.join(_COMPONENTS)}")
    folder = family.pipeline_component
    config = _read_json(base / folder / "config.json", base, f"the {family.title} config")
    if config.get("_class_name") != family.model_class_name:
        raise UserError(f"{base}/{folder}: holds a {config.get('_class_name')}, not a {family.model_class_name} "
                        f"(the {folder} latentforge fine-tunes)")
    if not list((base / folder).glob("*.safetensors")):
        raise UserError(f"{base}/{folder}: no .safetensors weights (pickled .bin weights are not loaded)")
    vae = _read_json(base / "vae" / "config.json", base, "the VAE config")
    scheduler = _read_json(base / "scheduler" / "scheduler_config.json", base, "the scheduler config")
    return BasePipeline(base, denoiser_from_config(config), config, vae, scheduler, str(name))


def check_recipe_matches_base(base: BasePipeline, train_cfg: Any) -> None:
    """Refuse a recipe of another family than the base's (``train.model``), or one that sets the
    architecture (``train.unet`` / ``train.dit``): the architecture is the base model's."""
    family = base.denoiser
    if train_cfg.model != family.kind:
        raise ConfigError(f"train.model: {train_cfg.model}, but {base.path} is a {base.pipeline_class} whose "
                          f"denoiser is a {family.model_class_name} ({family.title}): set train.model: "
                          f"{family.kind} to fine-tune it")
    for cls in BACKBONES.values():
        if getattr(train_cfg, cls.config_field).overrides():
            raise ConfigError(f"train.{cls.config_field}: with init_from the architecture is the base pipeline's "
                              f"{family.title} ({base.model_dir}): remove train.{cls.config_field}")


def base_noise_config(base: BasePipeline, configured: NoiseScheduleConfig) -> NoiseScheduleConfig:
    """The noise schedule of the base pipeline (prediction type included) as a NoiseScheduleConfig.

    ``configured`` is the recipe's ``train.noise``: left at its defaults it is replaced; set to
    anything else, it must agree with the base (training another objective than the one the
    weights were trained for is a different run, not a fine-tune)."""
    s = base.scheduler_config
    if s.get("trained_betas") is not None:
        raise UserError(f"{base.path}/scheduler: trained_betas (an explicit beta list) is not supported")
    defaults = NoiseScheduleConfig()
    if s.get("_class_name") == "FlowMatchEulerDiscreteScheduler" or s.get("prediction_type") == "flow_prediction":
        # A flow-matching pipeline (latentforge exports one with DPM-Solver on flow sigmas): its
        # objective, with the shift it samples with (a shift that grew with the size is not recorded).
        values = {"prediction_type": "flow_matching", "flow_shift": float(s.get("flow_shift") or s.get("shift") or 1.0)}
    else:
        values = {ours: s[theirs] for theirs, ours in _SCHEDULER_KEYS.items() if s.get(theirs) is not None}
    if values.get("prediction_type") != "flow_matching":
        values.setdefault("timestep_spacing", "leading")  # diffusers' default when the key is absent
        values.setdefault("prediction_type", "epsilon")
    if "num_train_timesteps" in s:
        values["num_train_timesteps"] = s["num_train_timesteps"]
    try:
        noise = replace(defaults, **values)
        noise.validate()
    except (ConfigError, TypeError) as e:
        raise UserError(f"{base.path}/scheduler: unsupported noise schedule: {e}") from None
    if noise.beta_schedule not in ("scaled_linear", "linear", "squaredcos_cap_v2"):
        raise UserError(f"{base.path}/scheduler: beta_schedule {noise.beta_schedule!r} is not supported")
    if configured != defaults and configured != noise:
        diffs = [f"{f.name} {getattr(configured, f.name)!r} vs {getattr(noise, f.name)!r}"
                 for f in fields(noise) if getattr(configured, f.name) != getattr(noise, f.name)]
        raise ConfigError(f"train.noise: differs from {base.path}/scheduler ({'; '.join(diffs)}): with init_from the "
                          "schedule is the base pipeline's: remove train.noise from the recipe")
    return noise


def check_data_matches_base(base: BasePipeline, meta: dict[str, Any]) -> None:
    """Refuse latent shards that ``base``'s VAE and text encoder did not make (one line naming the mismatch).

    Shapes and scale factors are compared first (cheap, and the clearer message); then the
    fingerprints of the VAE and text encoder weights recorded by the encode step."""
    from latentforge.models.autoencoder import load_vae, vae_fingerprint
    from latentforge.models.text import load_text_encoder, text_encoder_fingerprint

    where = base.path
    channels, text_dim = meta["latent_shape"][0], meta["text_shape"][-1]
    family, config = base.denoiser, base.model_config
    if config.get("in_channels") != channels:
        raise UserError(f"{where}: the {family.title} takes {config.get('in_channels')} latent channels but the "
                        f"latent shards have {channels}: they were not encoded with this pipeline's VAE "
                        "(latentforge encode --from)")
    if config.get("out_channels", channels) != channels:
        raise UserError(f"{where}: the {family.title} predicts {config.get('out_channels')} channels (a learned "
                        f"variance), the objective trains the {channels} latent channels only: not fine-tuned here")
    if config.get(family.text_field) != text_dim:
        raise UserError(f"{where}: the {family.title}'s {family.text_field} is {config.get(family.text_field)} but "
                        f"the latent shards' text embeddings are {text_dim}-d: encode with this pipeline's text encoder")
    vae_meta = meta["vae"]
    v = base.vae_config
    if v.get("latent_channels") != channels:
        raise UserError(f"{where}/vae: {v.get('latent_channels')} latent channels, the latent shards {channels}")
    ours, theirs = float(v.get("scaling_factor", 0.18215)), float(vae_meta["scaling_factor"])
    if ours != theirs or (v.get("shift_factor") or 0.0) != (vae_meta.get("shift_factor") or 0.0):
        raise UserError(f"{where}/vae: scaling_factor {ours} (shift {v.get('shift_factor')}) but the latent shards "
                        f"were encoded with scaling_factor {theirs} (shift {vae_meta.get('shift_factor')})")
    factor = 2 ** (len(v.get("block_out_channels", [])) - 1)
    if factor != vae_meta.get("downsample_factor"):
        raise UserError(f"{where}/vae: downsample factor {factor}, the latent shards "
                        f"{vae_meta.get('downsample_factor')}")
    # The fingerprints cost loading both models (about 1.7 GB in fp32 for SD 2's VAE and text encoder).
    vae = load_vae(str(where))
    if vae_fingerprint(vae) != vae_meta.get("fingerprint"):
        raise UserError(f"{where}/vae: the latent shards were encoded with another VAE ({vae_meta.get('path')}, "
                        "different weights): re-encode them with latentforge encode --from "
                        f"{where}")
    del vae
    text_meta = meta["text_encoder"]
    text, tokenizer = load_text_encoder(str(where))
    if text_encoder_fingerprint(text, tokenizer) != text_meta.get("fingerprint"):
        raise UserError(f"{where}/text_encoder: the latent shards were encoded with another text encoder or "
                        f"tokenizer ({text_meta.get('path')}): re-encode them with latentforge encode --from {where}")


def add_lora_adapters(model: torch.nn.Module, peft_config: Any) -> None:
    """Add ``peft_config``'s adapters (named ``default``) to ``model`` in place: through diffusers'
    ``add_adapter`` where the class has it (the U-Net), else with peft's ``inject_adapter_in_model``
    (PixArtTransformer2DModel has no adapter mixin in diffusers 0.42); the parameter names are the same."""
    if hasattr(model, "add_adapter"):
        model.add_adapter(peft_config)
        return
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config, model, adapter_name="default")
    model.peft_config = {"default": peft_config}


def merge_lora_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """Merge every adapter into its base layer (W + (alpha / r) B A) and put the base layer back in
    its place, so that ``model`` has exactly the base model's modules and state-dict keys."""
    if hasattr(model, "fuse_lora"):
        model.fuse_lora()
        model.unload_lora()
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [(name, m) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    for name, module in adapted:
        module.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    vars(model).pop("peft_config", None)
    return model


def build_finetune_model(base: BasePipeline, lora: LoRAConfig | None,
                         frozen_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The denoiser to train: the base weights, plus frozen-base LoRA adapters when ``lora`` is set.

    ``frozen_dtype``: the dtype of the frozen base weights of a LoRA run (bfloat16 halves their
    memory; the adapters stay float32, the master weights the optimizer updates)."""
    model = _load_base_model(base)
    if lora is None:
        if frozen_dtype != torch.float32:
            raise ConfigError("train.frozen_dtype: only LoRA runs have frozen weights; use float32")
        return model
    model.requires_grad_(False)
    if frozen_dtype != torch.float32:
        model.to(frozen_dtype)
    try:
        add_lora_adapters(model, lora.peft_config())
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"train.lora.target_modules: {e}") from None
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def _load_base_model(base: BasePipeline) -> torch.nn.Module:
    """The base pipeline's denoiser with its weights (safetensors only)."""
    return load_pretrained(base.denoiser.model_class(), str(base.path), base.denoiser.pipeline_component,
                           label=str(base.model_dir))


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters being trained, by name: what a run with a frozen base checkpoints."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state_dict(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Load :func:`trainable_state_dict` tensors into ``model`` (its frozen weights untouched)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != names:
        missing, unexpected = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise UserError(f"{where}: the checkpoint's trained weights do not match the model's adapters "
                        f"(missing {missing[:2]}, unexpected {unexpected[:2]}): was train.lora changed?")
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys


def model_for_run(tcfg: Any, tensors: dict[str, torch.Tensor], where: str) -> torch.nn.Module:
    """The denoiser of a fine-tuning run with the checkpoint ``tensors`` (one group: model or ema)."""
    base = open_base(tcfg.init_from)
    if tcfg.lora is None:
        model = base.denoiser.build()
        load_weights(model, tensors, where, f"the denoiser of the base {tcfg.init_from}",
                     "fine-tune from the base this checkpoint was trained on")
        return model
    model = build_finetune_model(base, tcfg.lora)
    load_trainable_state_dict(model, tensors, where)
    return model


def lora_state_for_diffusers(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights in the key layout ``StableDiffusionPipeline.save_lora_weights`` writes
    (and ``load_lora_weights`` reads), as diffusers' own LoRA training script produces them."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
