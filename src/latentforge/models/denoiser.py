"""One interface to every denoiser backbone: build, fill from the data, call, count.

``train.model`` picks the backbone (``unet``: ``train.unet``, a ``UNet2DConditionModel``;
``dit``: ``train.dit``, a ``PixArtTransformer2DModel``). The trainer, the sampler,
``inference.py``, export, bench and the planners go through a :class:`Denoiser` and never
branch on the backbone themselves:

- :func:`denoiser_for` (a ``TrainConfig``), :func:`denoiser_from_config` (a diffusers
  ``config.json`` dict, e.g. a fine-tuned pipeline's) and :func:`denoiser_of` (a built model)
  give the backbone's :class:`Denoiser`;
- ``build()`` / ``num_params()`` / ``forward_flops()`` make the model or count it (on the meta
  device for the counts);
- ``with_data(latent_channels, latent_size, text_dim)`` fills the data-determined fields and
  checks the rest against the data (one ``ConfigError`` line naming the field);
- ``forward(model, latents, timesteps, text_states, text_mask)`` is the prediction, whatever the
  backbone's keyword names; ``model`` may be a DDP/FSDP/compiled wrapper of the plain model;
- ``forward_tokens(model, ..., keep, mixer_blocks)`` (the transformer only: ``masks_patches``) is the
  prediction of a subset of the patch tokens, computed on those tokens only (patch masking in
  training, ``train/masking.py``), through the same wrappers as ``forward``;
- ``blocks(model)`` are the units of activation checkpointing, compilation and FSDP2 sharding;
- ``pipeline_class`` is the diffusers pipeline an exported run loads as.

The models themselves stay plain diffusers modules: their state dicts and ``config.json`` are
diffusers', so checkpoints, EMA, LoRA and ``save_pretrained`` need no adapter.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from latentforge.errors import ConfigError, UserError
from latentforge.models.dit import DiTConfig, check_patch_size, dit_diffusers_config, dit_forward_tokens
from latentforge.models.unet import UNetConfig, unet_diffusers_config

__all__ = ["Denoiser", "UNetDenoiser", "DiTDenoiser", "BACKBONES", "denoiser_for", "denoiser_from_config",
           "denoiser_of"]


class Denoiser:
    """A backbone: its config (a typed preset config, or a diffusers ``config.json`` dict) and
    how models of it are built and called. Subclasses set the class attributes."""

    kind: ClassVar[str]  # the train.model value
    model_class_name: ClassVar[str]  # the diffusers class
    pipeline_class: ClassVar[str]  # the diffusers pipeline an export loads as
    pipeline_component: ClassVar[str]  # the model's folder (and model_index.json key) in that pipeline
    title: ClassVar[str]  # what messages call it
    uses_text_mask: ClassVar[bool]  # whether the forward pass takes the caption padding mask
    config_field: ClassVar[str]  # train.<field> holding the typed config
    text_field: ClassVar[str]  # the config field holding the text encoder's hidden size
    # Whether the pipeline keeps the scheduler's x0 prediction (``step(...)[1]``) when sampling in one step.
    single_step_returns_x0: ClassVar[bool] = False
    # Whether the model works on patch tokens that training can mask (forward_tokens, num_tokens).
    masks_patches: ClassVar[bool] = False
    # The modules that read the latents in and write the prediction out (an optimizer treats them apart).
    edge_layers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Any):
        self.cfg = cfg

    # ------------------------------------------------------------------ building and counting

    @classmethod
    def model_class(cls) -> type[nn.Module]:
        import diffusers

        return getattr(diffusers, cls.model_class_name)

    def diffusers_config(self) -> dict[str, Any]:
        """The model's complete constructor arguments (its ``config.json`` without the ``_`` keys)."""
        if isinstance(self.cfg, dict):
            import inspect

            accepted = inspect.signature(self.model_class().__init__).parameters
            return {k: v for k, v in self.cfg.items() if k in accepted}
        return self._typed_config()

    def _typed_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def build(self) -> nn.Module:
        """A freshly initialised model on the current default device (under ``torch.device("meta")``
        nothing is allocated)."""
        return self.model_class()(**self.diffusers_config())

    def num_params(self) -> int:
        with torch.device("meta"):
            model = self.build()
        return sum(p.numel() for p in model.parameters())

    def forward_flops(self, latent_size: int, text_len: int, num_kept: int = 0, mixer_blocks: int = 0) -> int:
        """Forward FLOPs of one image (``latent_size`` square latents, ``text_len`` caption tokens),
        counted by ``torch.utils.flop_counter`` on the meta device; ``num_kept`` > 0: a patch-masked
        training forward that keeps that many tokens after ``mixer_blocks`` blocks (``forward_tokens``)."""
        from torch.utils.flop_counter import FlopCounterMode

        with torch.device("meta"):
            model = self.build()
            c = model.config
            x = torch.empty(1, c.in_channels, latent_size, latent_size)
            hidden = torch.empty(1, text_len, self.text_dim)
            mask = torch.ones(1, text_len) if self.uses_text_mask else None
            counter = FlopCounterMode(display=False)
            with counter:
                if num_kept:
                    self.forward_tokens(model, x, torch.tensor([1]), hidden, mask, torch.arange(num_kept)[None],
                                        mixer_blocks)
                else:
                    self.forward(model, x, torch.tensor([1]), hidden, mask)
        return int(counter.get_total_flops())

    def num_tokens(self, latent_size: int) -> int:
        """Patch tokens of a ``latent_size`` square latent (backbones with ``masks_patches``)."""
        return (latent_size // self.patch_size()) ** 2

    # ------------------------------------------------------------------ the data's shapes

    @property
    def latent_channels(self) -> int:
        return int(self.diffusers_config()["in_channels"])

    @property
    def text_dim(self) -> int:
        return int(self.diffusers_config()[self.text_field])

    def with_data(self, latent_channels: int, latent_size: int, text_dim: int) -> "Denoiser":
        """This backbone with its data-determined fields (those left unset) filled in from the
        latents and the text encoder, checked against them."""
        raise NotImplementedError

    def _filled(self, latent_channels: int, latent_size: int, text_dim: int) -> Any:
        """The typed config with the fields left unset taken from the latents and the text encoder."""
        cfg = self.cfg
        return replace(cfg, in_channels=cfg.in_channels or latent_channels,
                       out_channels=cfg.out_channels or latent_channels,
                       sample_size=cfg.sample_size or latent_size,
                       **{self.text_field: getattr(cfg, self.text_field) or text_dim})

    def check_latent_size(self, latent_size: int, where: str) -> None:
        """Refuse a latent side the backbone cannot take (``where``: what the size is, for the message)."""

    # ------------------------------------------------------------------ calling

    def forward(self, model: nn.Module, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prediction for ``latents`` (B, C, H, W) at ``timesteps`` (B,) or a scalar, with text
        states (B, L, D) and their padding mask (B, L), 1 = a token (used by backbones that take it)."""
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def patch_size(self) -> int:
        """Latent pixels per patch side (backbones with ``masks_patches``)."""
        raise NotImplementedError(f"{self.kind} has no patch tokens")

    def forward_tokens(self, model: nn.Module, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                       text_mask: torch.Tensor | None, keep: torch.Tensor | None, mixer_blocks: int = 0
                       ) -> torch.Tensor:
        """The prediction of the patch tokens ``keep`` (B, K) only, (B, K, values per patch) in
        ``models.dit.patchify``'s layout (backbones with ``masks_patches``)."""
        raise NotImplementedError(f"{self.kind} has no patch tokens")


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    """``module.forward`` is ``forward`` for the duration: calling ``module`` (or a DDP wrapper of it)
    then runs the module's hooks (FSDP2's gathering of the root parameters, DDP's gradient
    bookkeeping) around ``forward``, as they run around the module's own forward."""
    previous = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


class UNetDenoiser(Denoiser):
    """The SD 1.x/2.x U-Net (``models/unet.py``)."""

    kind = "unet"
    model_class_name = "UNet2DConditionModel"
    pipeline_class = "StableDiffusionPipeline"
    pipeline_component = "unet"
    title = "U-Net"
    uses_text_mask = False  # StableDiffusionPipeline does not pass it; the U-Net trains without it
    config_field = "unet"
    text_field = "cross_attention_dim"
    edge_layers = ("conv_in", "conv_out")

    def _typed_config(self) -> dict[str, Any]:
        return unet_diffusers_config(self.cfg)

    def with_data(self, latent_channels: int, latent_size: int, text_dim: int) -> "UNetDenoiser":
        filled = self._filled(latent_channels, latent_size, text_dim)
        resolved = unet_diffusers_config(filled)
        if resolved["in_channels"] != latent_channels or resolved["out_channels"] != latent_channels:
            raise ConfigError(f"train.unet.in_channels: the latents have {latent_channels} channels, the U-Net "
                              f"{resolved['in_channels']} in / {resolved['out_channels']} out")
        if resolved["cross_attention_dim"] != text_dim:
            raise ConfigError(f"train.unet.cross_attention_dim: {resolved['cross_attention_dim']} but the text "
                              f"encoder's hidden size is {text_dim}")
        out = UNetDenoiser(filled)
        out.check_latent_size(latent_size, "latent side")
        return out

    def check_latent_size(self, latent_size: int, where: str) -> None:
        levels = len(self.diffusers_config()["block_out_channels"])
        if latent_size % (2 ** (levels - 1)):
            raise ConfigError(f"train.unet.block_out_channels: {levels} levels need latents divisible by "
                              f"{2 ** (levels - 1)}, got {latent_size}")

    def forward(self, model, latents, timesteps, text, text_mask=None):
        mask = {} if text_mask is None else {"encoder_attention_mask": text_mask}
        return model(latents, timesteps, encoder_hidden_states=text, return_dict=False, **mask)[0]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The U-Net's blocks in forward order."""
        blocks = list(model.down_blocks)
        if getattr(model, "mid_block", None) is not None:
            blocks.append(model.mid_block)
        return blocks + list(model.up_blocks)


class DiTDenoiser(Denoiser):
    """The PixArt-alpha diffusion transformer (``models/dit.py``)."""

    kind = "dit"
    model_class_name = "PixArtTransformer2DModel"
    pipeline_class = "PixArtAlphaPipeline"
    pipeline_component = "transformer"
    title = "transformer"
    uses_text_mask = True  # PixArtAlphaPipeline passes the caption mask to the cross-attention
    config_field = "dit"
    text_field = "caption_channels"
    single_step_returns_x0 = True  # PixArtAlphaPipeline.__call__ with num_inference_steps == 1
    masks_patches = True
    edge_layers = ("pos_embed.proj", "proj_out")  # the patch embedding and the un-patching projection

    def _typed_config(self) -> dict[str, Any]:
        return dit_diffusers_config(self.cfg)

    def with_data(self, latent_channels: int, latent_size: int, text_dim: int) -> "DiTDenoiser":
        filled = self._filled(latent_channels, latent_size, text_dim)
        patch_size = dit_diffusers_config(filled, validate=False)["patch_size"]
        if patch_size >= 1:  # the data's latent side first: the sample size may only be its copy
            DiTDenoiser(filled).check_latent_size(latent_size, "latent side", validate=False)
        try:
            resolved = dit_diffusers_config(filled)
        except ConfigError as e:
            raise ConfigError(f"train.dit.{e}") from None
        if resolved["in_channels"] != latent_channels:
            raise ConfigError(f"train.dit.in_channels: the latents have {latent_channels} channels, the transformer "
                              f"takes {resolved['in_channels']}")
        if resolved["out_channels"] != latent_channels:
            raise ConfigError(f"train.dit.out_channels: {resolved['out_channels']} but the objective predicts the "
                              f"{latent_channels} latent channels (a learned variance is not trained): remove it")
        if resolved["caption_channels"] != text_dim:
            raise ConfigError(f"train.dit.caption_channels: {resolved['caption_channels']} but the text encoder's "
                              f"hidden size is {text_dim}")
        return DiTDenoiser(filled)

    def check_latent_size(self, latent_size: int, where: str, validate: bool = True) -> None:
        config = self.diffusers_config() if validate else dit_diffusers_config(self.cfg, validate=False)
        try:
            check_patch_size(int(config["patch_size"]), latent_size, where)
        except ConfigError as e:
            raise ConfigError(f"train.dit.{e}") from None

    def forward(self, model, latents, timesteps, text, text_mask=None):
        # PixArt embeds one timestep per sample; PixArtAlphaPipeline expands a scalar the same way.
        t = timesteps.reshape(-1).expand(latents.shape[0]) if timesteps.numel() == 1 else timesteps
        return model(latents, encoder_hidden_states=text, encoder_attention_mask=text_mask, timestep=t,
                     added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks in forward order."""
        return list(model.transformer_blocks)

    def patch_size(self) -> int:
        return int(self.diffusers_config()["patch_size"])

    def forward_tokens(self, model, latents, timesteps, text, text_mask, keep, mixer_blocks=0):
        t = timesteps.reshape(-1).expand(latents.shape[0]) if timesteps.numel() == 1 else timesteps
        plain = getattr(model, "module", model)  # a DDP wrapper calls its module
        with _forward_replaced(plain, functools.partial(dit_forward_tokens, plain)):
            return model(latents, t, text, text_mask, keep, mixer_blocks)


BACKBONES: dict[str, type[Denoiser]] = {"unet": UNetDenoiser, "dit": DiTDenoiser}


def denoiser_for(train_cfg: Any) -> Denoiser:
    """The backbone ``train.model`` selects, with its typed config (``train.unet`` or ``train.dit``)."""
    cls = BACKBONES[getattr(train_cfg, "model", "unet")]
    return cls(getattr(train_cfg, cls.config_field))


def denoiser_from_config(config: dict[str, Any]) -> Denoiser:
    """The backbone of a diffusers ``config.json`` dict (its ``_class_name``; U-Net when absent)."""
    name = config.get("_class_name", UNetDenoiser.model_class_name)
    for cls in BACKBONES.values():
        if cls.model_class_name == name:
            return cls(dict(config))
    raise UserError(f"{name}: not a denoiser latentforge trains (one of "
                    f"{', '.join(c.model_class_name for c in BACKBONES.values())})")


def as_denoiser(cfg: UNetConfig | DiTConfig | dict | Denoiser) -> Denoiser:
    """A denoiser from a typed config, a diffusers ``config.json`` dict (its ``_class_name``;
    a U-Net without one) or a denoiser itself."""
    if isinstance(cfg, Denoiser):
        return cfg
    if isinstance(cfg, UNetConfig):
        return UNetDenoiser(cfg)
    if isinstance(cfg, DiTConfig):
        return DiTDenoiser(cfg)
    return denoiser_from_config(cfg)


def denoiser_of(model: nn.Module) -> Denoiser:
    """The backbone of a built model (the plain one, or a DDP wrapper of it). Any other module is
    taken to be called as a U-Net is (``model(x, t, encoder_hidden_states=...)``), as the trainer
    always called it."""
    plain = getattr(model, "module", model)
    for cls in BACKBONES.values():
        if isinstance(plain, cls.model_class()):
            return cls({"_class_name": cls.model_class_name, **dict(plain.config)})
    return UNetDenoiser(dict(getattr(plain, "config", None) or {}))
