"""Fine-tuning existing Stable Diffusion weights from a local diffusers pipeline directory.

``train.init_from: DIR`` (or ``latentforge finetune --from DIR``) starts the U-Net from
``DIR/unet`` (its own ``config.json``, so SD 1.x and 2.x layouts both load) and takes the noise
schedule, prediction type included, from ``DIR/scheduler``. The latent shards must have been
encoded with ``DIR/vae`` and ``DIR/text_encoder`` (``latentforge encode --from DIR``): their
meta records the fingerprints, and :func:`check_data_matches_base` refuses anything else, naming
what differs (latent channels, text width, scale factor, or the weights themselves).

With ``train.lora`` set, the U-Net's base weights are frozen and ``peft`` LoRA adapters are added
to the attention projections (Hu et al. 2021, "LoRA", arXiv:2106.09685); only the adapter
weights are trained, checkpointed and averaged by the EMA. A LoRA run exports either the
adapter file that ``StableDiffusionPipeline.load_lora_weights`` reads or the merged pipeline.

``peft`` is imported only when a LoRA is asked for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DConditionModel

from latentforge.diffusion.schedule import NoiseScheduleConfig
from latentforge.errors import ConfigError, Problems, UserError

log = logging.getLogger(__name__)

__all__ = [
    "LoRAConfig",
    "BasePipeline",
    "open_base",
    "check_data_matches_base",
    "base_noise_config",
    "build_finetune_unet",
    "trainable_state_dict",
    "load_trainable_state_dict",
    "unet_for_run",
    "lora_state_for_diffusers",
]

# Components a StableDiffusionPipeline directory must hold for fine-tuning.
_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
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
    """LoRA adapters on the U-Net (the base weights stay frozen and are never saved)."""

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

        # "gaussian": A ~ N(0, 1/r), B = 0, so the adapted U-Net starts exactly at the base model.
        return LoraConfig(r=self.rank, lora_alpha=self.alpha or self.rank, lora_dropout=self.dropout,
                          init_lora_weights="gaussian", target_modules=list(self.target_modules))


@dataclass(frozen=True)
class BasePipeline:
    """A local diffusers Stable Diffusion pipeline directory, checked to hold every component."""

    path: Path
    unet_config: dict[str, Any]
    vae_config: dict[str, Any]
    scheduler_config: dict[str, Any]


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
    """Check that ``path`` is a local diffusers Stable Diffusion pipeline and read its configs."""
    base = Path(path).expanduser()
    if not base.is_dir():
        raise UserError(f"{path}: no such directory (init_from needs a local diffusers pipeline directory)")
    index = _read_json(base / "model_index.json", base, "the pipeline index")
    if isinstance(index.get("transformer"), list) and "unet" not in index:
        # e.g. an exported train.model=dit run (PixArtAlphaPipeline): another family than the U-Net's.
        raise UserError(f"{base}: a {index.get('_class_name')} with a {index['transformer'][-1]}: init_from "
                        "fine-tunes the U-Net of a Stable Diffusion pipeline; a transformer is not turned into one")
    missing = [c for c in _COMPONENTS if not isinstance(index.get(c), list) or index[c][0] is None]
    if missing:
        raise UserError(f"{base}: model_index.json names no {', '.join(missing)}: fine-tuning needs a "
                        f"Stable Diffusion pipeline with {', '.join(_COMPONENTS)}")
    unet = _read_json(base / "unet" / "config.json", base, "the U-Net config")
    if unet.get("_class_name") != "UNet2DConditionModel":
        raise UserError(f"{base}/unet: holds a {unet.get('_class_name')}, not a UNet2DConditionModel "
                        "(SD 1.x/2.x pipelines only)")
    if not list((base / "unet").glob("*.safetensors")):
        raise UserError(f"{base}/unet: no .safetensors weights (pickled .bin weights are not loaded)")
    vae = _read_json(base / "vae" / "config.json", base, "the VAE config")
    scheduler = _read_json(base / "scheduler" / "scheduler_config.json", base, "the scheduler config")
    return BasePipeline(base, unet, vae, scheduler)


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
    u = base.unet_config
    if u.get("in_channels") != channels:
        raise UserError(f"{where}: the U-Net takes {u.get('in_channels')} latent channels but the latent shards "
                        f"have {channels}: they were not encoded with this pipeline's VAE (latentforge encode --from)")
    if u.get("cross_attention_dim") != text_dim:
        raise UserError(f"{where}: the U-Net's cross_attention_dim is {u.get('cross_attention_dim')} but the "
                        f"latent shards' text embeddings are {text_dim}-d: encode with this pipeline's text encoder")
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


def build_finetune_unet(base: BasePipeline, lora: LoRAConfig | None,
                        frozen_dtype: torch.dtype = torch.float32) -> UNet2DConditionModel:
    """The U-Net to train: the base weights, plus frozen-base LoRA adapters when ``lora`` is set.

    ``frozen_dtype``: the dtype of the frozen base weights of a LoRA run (bfloat16 halves their
    memory; the adapters stay float32, the master weights the optimizer updates)."""
    from latentforge.models.unet import load_unet

    unet = load_unet(str(base.path), subfolder="unet")
    if lora is None:
        if frozen_dtype != torch.float32:
            raise ConfigError("train.frozen_dtype: only LoRA runs have frozen weights; use float32")
        return unet
    unet.requires_grad_(False)
    if frozen_dtype != torch.float32:
        unet.to(frozen_dtype)
    try:
        unet.add_adapter(lora.peft_config())
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"train.lora.target_modules: {e}") from None
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return unet


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


def unet_for_run(tcfg: Any, tensors: dict[str, torch.Tensor], where: str) -> UNet2DConditionModel:
    """The U-Net of a fine-tuning run with the checkpoint ``tensors`` (one group: model or ema)."""
    base = open_base(tcfg.init_from)
    if tcfg.lora is None:
        unet = UNet2DConditionModel.from_config(base.unet_config)
        unet.load_state_dict(tensors)
        return unet
    unet = build_finetune_unet(base, tcfg.lora)
    load_trainable_state_dict(unet, tensors, where)
    return unet


def lora_state_for_diffusers(unet: UNet2DConditionModel) -> dict[str, torch.Tensor]:
    """The adapter weights in the key layout ``StableDiffusionPipeline.save_lora_weights`` writes
    (and ``load_lora_weights`` reads), as diffusers' own LoRA training script produces them."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
