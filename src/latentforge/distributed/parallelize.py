"""Apply data parallelism and the memory/speed options to a built denoiser, apart from the model code.

The order follows torchtitan's ``parallelize``: attention processor, low-precision norms,
activation checkpointing per block, ``torch.compile`` per block, then DDP around the whole model
or FSDP2 ``fully_shard`` per block (the denoiser's ``blocks``: for the U-Net ``down_blocks[i]``,
``mid_block``, ``up_blocks[i]``; for the transformer each of ``transformer_blocks``) and finally the
root (the U-Net's conv_in, time embedding, conv_out and output norm; the transformer's patch
embedding, adaLN-single, caption projection and output layer).

None of these wrappers renames a parameter: checkpointing and compilation replace the block's
``forward`` attribute instead of wrapping the module (no ``_checkpoint_wrapped_module.`` or
``_orig_mod.`` keys), FSDP2 changes the module's class in place, and DDP is the only extra
module, which the caller never saves (it keeps the plain model handle). Under FSDP2 the plain
model's parameters are sharded ``DTensor``s; its state dict must then be gathered
(``distributed/dcp.py``) before it is written as one file.

Costs, measured on 2 vCPUs with 2 gloo ranks (``docs/distributed.md`` has the figures):

- ``ddp``: every rank holds the full model, gradients and AdamW state (16 bytes/parameter in
  fp32) and all-reduces the gradients once per optimizer step.
- ``fsdp`` with ``reshard_after_forward=false`` (ZeRO-2, ``SHARD_GRAD_OP``): parameters are
  all-gathered once per block in the forward pass and kept until the backward pass; gradients are
  reduce-scattered, optimizer state and master weights are sharded (16/N bytes/parameter plus the
  unsharded parameters of the running step). ``true`` (ZeRO-3, ``FULL_SHARD``) frees them after
  each block's forward and gathers them again in the backward pass: less memory, a second
  all-gather.
- ``mixed_precision=bf16`` (FSDP2 only): parameters are gathered and computed in bf16 (half the
  all-gather bytes), gradients reduced in fp32, master weights and optimizer state stay fp32.
- ``cpu_offload`` (FSDP2 ``CPUOffloadPolicy``, also on one rank): the sharded fp32 parameters,
  their gradients and the optimizer state live in host memory and AdamW steps on the CPU; the device
  holds only the gathered (bf16 with ``mixed_precision=bf16``) parameters of the blocks being
  computed, and each block's gradients until they are copied to the host. Costs a host-to-device
  copy of every block's parameters per forward (and again per backward with
  ``reshard_after_forward=true``), a device-to-host copy of its gradients, and an optimizer step
  at CPU speed.
- ``activation_checkpointing``: each block's forward is run again in the backward pass: one more
  forward pass per step (a forward is about a third of a training step's FLOPs); only the block
  inputs are kept between the passes.
- ``compile``: each block is compiled once per input shape by Inductor (a cold compile takes
  minutes on a CPU; the cache is ``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_$USER``).
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

from latentforge.distributed.env import World
from latentforge.errors import ConfigError, Problems

__all__ = ["ParallelConfig", "parallelize", "resolve_strategy", "unet_blocks", "needs_single_rank_group"]

log = logging.getLogger(__name__)


@dataclass
class ParallelConfig:
    """How the U-Net is spread over the ranks and which memory/speed trade-offs are applied."""

    strategy: Literal["auto", "none", "ddp", "fsdp"] = field(default="auto", metadata={
        "help": "auto = ddp with more than one rank, none with one; fsdp = FSDP2 fully_shard per U-Net "
                "block. ddp and fsdp on a single rank run as none"})
    reshard_after_forward: bool = field(default=False, metadata={
        "help": "fsdp: free each block's gathered parameters after its forward pass (ZeRO-3, full sharding: "
                "least memory, one more all-gather in the backward pass); false = keep them until the "
                "backward pass (ZeRO-2, SHARD_GRAD_OP)"})
    mixed_precision: Literal["fp32", "bf16"] = field(default="fp32", metadata={
        "help": "fsdp: bf16 = gather and compute with bf16 parameters, reduce gradients in fp32; the master "
                "weights and optimizer state stay fp32 (with ddp/none use train.precision=bf16)"})
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "recompute each U-Net block's activations in the backward pass (one more forward pass per step)"})
    cpu_offload: bool = field(default=False, metadata={
        "help": "fsdp: keep the sharded fp32 parameters, gradients and optimizer state in host memory and step "
                "AdamW on the CPU (FSDP2 CPUOffloadPolicy); the device holds only the gathered blocks being "
                "computed. Runs FSDP2 on a single rank too (a one-process group is created). Pair with "
                "reshard_after_forward=true so that only one block's parameters stay gathered"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile each U-Net block separately (regional compilation; cold compile takes minutes "
                "on a CPU, cached in TORCHINDUCTOR_CACHE_DIR)"})
    low_precision_norms: bool = field(default=False, metadata={
        "help": "run GroupNorm/LayerNorm in the autocast dtype (bf16) instead of fp32 under autocast; "
                "without autocast (fp32 training) it changes nothing"})

    def validate(self) -> None:
        # Field names relative to this section (train.parallel); all problems at once.
        problems = Problems()
        if self.strategy != "fsdp" and self.mixed_precision != "fp32":
            problems.add(f"mixed_precision: {self.mixed_precision} is FSDP2's parameter dtype and needs "
                         f"parallel.strategy=fsdp (got {self.strategy}); for ddp or none remove it and set "
                         "train.precision=bf16 (autocast) instead")
        if self.cpu_offload and self.strategy != "fsdp":
            problems.add(f"cpu_offload: is FSDP2's CPU offload and needs parallel.strategy=fsdp "
                         f"(got {self.strategy}); set strategy fsdp (it also runs on a single GPU) or remove it")
        if self.strategy != "fsdp" and self.reshard_after_forward:
            problems.add(f"reshard_after_forward: only applies to parallel.strategy=fsdp "
                         f"(got {self.strategy}); remove it or use fsdp")
        problems.raise_if_any()


def resolve_strategy(cfg: ParallelConfig, world_size: int) -> Literal["none", "ddp", "fsdp"]:
    """The strategy actually used on ``world_size`` ranks (see ``ParallelConfig.strategy``)."""
    try:
        cfg.validate()
    except ConfigError as e:
        raise e.prefixed("train.parallel") from None
    if world_size == 1 and needs_single_rank_group(cfg):
        return "fsdp"  # offloading needs FSDP2 even without peers to shard with
    if world_size == 1:
        if cfg.strategy in ("ddp", "fsdp"):
            log.info("parallel.strategy=%s on a single rank: running without a data-parallel wrapper", cfg.strategy)
        return "none"
    if cfg.strategy == "none":
        raise ConfigError(f"parallel.strategy: none with {world_size} ranks would train {world_size} separate, "
                          "unsynchronised models: use auto, ddp or fsdp")
    return "ddp" if cfg.strategy == "auto" else cfg.strategy


def needs_single_rank_group(cfg: ParallelConfig) -> bool:
    """Whether a single process must still create a (one-rank) process group: FSDP2 with CPU
    offload runs on a device mesh even when there is nothing to shard across."""
    return cfg.strategy == "fsdp" and cfg.cpu_offload


def unet_blocks(model: nn.Module) -> list[nn.Module]:
    """The U-Net's blocks in forward order: the units of checkpointing, compilation and sharding."""
    blocks = list(model.down_blocks)
    if getattr(model, "mid_block", None) is not None:
        blocks.append(model.mid_block)
    return blocks + list(model.up_blocks)


def _use_sdpa(model: nn.Module) -> None:
    """Every attention layer on ``AttnProcessor2_0`` (``F.scaled_dot_product_attention``: flash or
    memory-efficient kernels on CUDA, no materialised attention matrix). It is diffusers' default
    for torch >= 2; set explicitly so that a loaded model with other processors is changed too."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    if hasattr(model, "set_attn_processor"):
        model.set_attn_processor(AttnProcessor2_0())


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _lp_group_norm(self: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    dtype = _autocast_dtype(x.device.type)
    if dtype is None:
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
    with torch.autocast(x.device.type, enabled=False):
        return F.group_norm(x.to(dtype), self.num_groups, _cast(self.weight, dtype), _cast(self.bias, dtype), self.eps)


def _lp_layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    dtype = _autocast_dtype(x.device.type)
    if dtype is None:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    with torch.autocast(x.device.type, enabled=False):
        return F.layer_norm(x.to(dtype), self.normalized_shape, _cast(self.weight, dtype), _cast(self.bias, dtype),
                            self.eps)


def use_low_precision_norms(model: nn.Module) -> int:
    """Make every GroupNorm/LayerNorm of ``model`` run in the autocast dtype (MosaicML's
    ``LPGroupNorm``/``LPLayerNorm``, used in their SD2 training). Autocast normally runs norms in
    fp32, which costs a cast of the activations to fp32 and back per norm; here input, weight and
    bias are cast to bf16 and the output stays bf16. Outside autocast the norm is unchanged (fp32
    training on CPU: no effect). Under FSDP2 ``mixed_precision=bf16`` the parameters and inputs
    already are bf16, so the norms run in bf16 with or without this. Returns how many norms changed."""
    count = 0
    for m in model.modules():
        if type(m) is nn.GroupNorm:
            m.forward = types.MethodType(_lp_group_norm, m)
            count += 1
        elif type(m) is nn.LayerNorm:
            m.forward = types.MethodType(_lp_layer_norm, m)
            count += 1
    return count


def _checkpointed(forward: Callable) -> Callable:
    """``forward`` whose activations are recomputed in the backward pass (non-reentrant
    checkpointing: keyword arguments and tuple outputs work, the RNG state is replayed)."""

    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def parallelize(model: nn.Module, cfg: ParallelConfig, world: World, device: torch.device
                ) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager] | None]:
    """Apply ``cfg`` to ``model`` (already on ``device``) in place; returns the module to call in
    training and the context manager that skips the gradient synchronisation on accumulation
    micro batches (None on one rank). Keep using ``model`` itself for state dicts and the optimizer:
    its parameter names never change (under FSDP2 its parameters become sharded DTensors)."""
    strategy = resolve_strategy(cfg, world.world_size)
    _use_sdpa(model)
    if cfg.low_precision_norms:
        log.info("low-precision norms: %d GroupNorm/LayerNorm layers run in the autocast dtype",
                 use_low_precision_norms(model))
    from latentforge.models.denoiser import denoiser_of

    blocks = denoiser_of(model).blocks(model)
    for block in blocks:
        if cfg.activation_checkpointing:
            block.forward = _checkpointed(block.forward)
        if cfg.compile:
            # The block's forward (and its checkpointing) is compiled; module hooks, FSDP2's
            # all-gather/reduce-scatter among them, stay outside the compiled region.
            block.forward = torch.compile(block.forward, dynamic=False)
    if strategy == "none":
        return model, None
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, ddp.no_sync

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise ConfigError("parallel.strategy: fsdp needs a process group, also on one rank with cpu_offload: "
                          "create the World with latentforge.distributed.env.init_world(single_rank_group=True)")
    mesh = init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("dp_shard",))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.mixed_precision == "bf16" else MixedPrecisionPolicy())
    # Pinned host memory makes the host<->GPU copies asynchronous; pinning needs a CUDA device.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    # The root's own parameters are small (input/output layers, time embedding); its gathered parameters are
    # needed right at the start of the backward pass, so it keeps them (as torchtitan does).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        # Gradients accumulate unsharded on each rank (one more full-size gradient in memory) and
        # are reduce-scattered on the last micro batch only.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    # With CPU offload every micro batch reduce-scatters: its gradients then go to the host and
    # accumulate there, sharded, instead of a full unsharded gradient accumulating on the device
    # (more reduce-scatters per step on several ranks, a local copy on one).
    return model, None if cfg.cpu_offload else no_sync

