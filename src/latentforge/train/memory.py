"""Peak device memory of a denoiser (U-Net or transformer) training step, and the largest micro batch that fits.

The peak is the sum of what lives across a step once gradients are being accumulated (the
second micro batch of an accumulating step holds all of it at once)::

    weights + autocast weight copies + gradients (+ DDP buckets) + optimizer + EMA + activations
    (+ one gathered FSDP unit, twice for prefetch)

Bytes per parameter (N parameters, W ranks; FSDP ``grad-op`` = SHARD_GRAD_OP/ZeRO-2 divides
gradients and optimizer state by W, ``full`` = FULL_SHARD/ZeRO-3 also the weights and the EMA):

=============  =======================================  =========================================
precision      weights                                  gradients / optimizer
=============  =======================================  =========================================
fp32           4                                        4 / AdamW 8 (two fp32 moments), 8-bit 2
bf16           4 fp32 + 2 (autocast's bf16 copies,      4 / as fp32
               kept for the backward pass)
bf16-weights   2 (bf16 parameters)                      2 / + 4 for the fp32 master copy
=============  =======================================  =========================================

EMA: 4 B/param on the device (``same``; 8 with bf16 weights, which need an fp32 staging copy),
0 in CPU memory (``cpu``) or without EMA (``off``). DDP with more than one rank keeps its
gradient buckets next to the gradients (``gradient_as_bucket_view=False``, the default): +grads.

Activations are *measured*, not guessed: one forward pass of the U-Net on the meta device (no
memory used) with a ``saved_tensors_hooks`` that adds up the distinct storages autograd keeps
for the backward pass, per image. Two stand-ins make the meta pass behave like a GPU: bf16
autocast is emulated by a ``TorchFunctionMode`` (convolutions, linears and matmuls in bf16;
group/layer norm and softmax in fp32, as autocast's CUDA policy does; weight casts cached once
per step), and attention is counted as a fused kernel (flash / memory-efficient on CUDA, the
flash kernel on CPU): it keeps q, k, v, the output and the log-sum-exp, never the L x L scores.
With activation checkpointing per U-Net block (each down, mid and up block recomputed in the
backward pass) the activations are the block inputs, what lies outside the blocks, and the
largest block's own activations during its recomputation.

With CPU offload (FSDP2 ``CPUOffloadPolicy``, ``train.parallel.cpu_offload``) the fp32 sharded
weights, their gradients, the optimizer state and the EMA live in host memory (reported
separately, 4 + 4 + 8 + 4 B/param divided by W). The device holds the gathered weights in the
compute dtype (bf16 with ``bf16-weights``, FSDP2's bf16 mixed precision; fp32 with ``fp32`` and
``bf16``, where autocast adds bf16 copies of them): all of them with ``fsdp-grad-op`` (kept
from the forward to the backward pass), two blocks' worth with ``fsdp-full`` (the running block
and the prefetched next one); the largest block's gradients in the compute dtype plus their fp32
copy for the reduce-scatter (before they are copied to the host); and the activations (of a
U-Net whose parameters are bf16 with ``bf16-weights``). 8-bit AdamW is refused
under FSDP: bitsandbytes' kernel does not take DTensor parameters.

LoRA (``lora_rank`` > 0, ``train.lora``): the U-Net's base weights are frozen in
``frozen_dtype`` (4 B/param, or 2 with bfloat16) and only the adapters (L parameters, fp32) have
gradients, AdamW state and an EMA: ``N x frozen + L x (4 + 4 + 8 + 4)``. The activations are
measured the same way with the adapters added (peft, on the meta device) and the base frozen, so
that what autograd keeps for a frozen layer (its input only where an adapter or a later trained
weight needs it) is what is counted (adapter dropout, which keeps a mask and a copy of each
adapter input, is not: the profile runs without it). LoRA runs are not sharded (no FSDP, no CPU
offload).

On a GPU the planner adds an allowance it does not model: the caching allocator's fragmentation
(+10% of the above) and 1 GiB for the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers.
Device sizes are the marketing "GB", which are GiB on these cards (an "80 GB" A100 has 80 GiB).
The error measured against real steps on CPU is in docs/planning.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from latentforge.errors import ConfigError, Problems
from latentforge.models.denoiser import as_denoiser, denoiser_for
from latentforge.models.dit import DiTConfig
from latentforge.models.unet import UNetConfig

GIB = 1 << 30
FRAGMENTATION = 0.10  # caching-allocator overhead on CUDA, fraction of the modelled bytes
CUDA_CONTEXT_BYTES = 1 * GIB  # context + library workspaces + NCCL, outside max_memory_allocated


@dataclass
class MemoryConfig:
    """One training set-up whose peak device memory is predicted."""

    unet: UNetConfig | DiTConfig | dict[str, Any] = field(default_factory=lambda: UNetConfig(preset="sd2-base"),
                                                          metadata={
        "help": "the denoiser: a U-Net or transformer preset config, or a pipeline's config.json dict"})
    latent_size: int = field(default=64, metadata={"help": "latent side (image side / VAE factor)"})
    text_len: int = field(default=77, metadata={"help": "caption tokens"})
    micro_batch_size: int = field(default=1, metadata={"help": "samples per rank per forward pass"})
    precision: Literal["fp32", "bf16", "bf16-weights"] = field(default="bf16", metadata={
        "help": "fp32; bf16 = autocast over fp32 weights (train's bf16); bf16-weights = bf16 parameters + fp32 master"})
    parallel: Literal["ddp", "fsdp-grad-op", "fsdp-full"] = field(default="ddp", metadata={
        "help": "ddp (replicated), fsdp-grad-op (grads + optimizer sharded), fsdp-full (weights too)"})
    world_size: int = field(default=1, metadata={"help": "ranks the model is replicated or sharded over"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute each U-Net block"})
    optimizer: Literal["adamw", "adamw8bit", "muon"] = field(default="adamw", metadata={
        "help": "AdamW, 8-bit AdamW or Muon (counted at AdamW's 8 bytes a parameter: an upper bound, its "
                "matrices keep one 4-byte buffer)"})
    ema: Literal["same", "cpu", "off"] = field(default="same", metadata={"help": "where the EMA lives"})
    cpu_offload: bool = field(default=False, metadata={
        "help": "FSDP2 CPU offload: weights, gradients, optimizer state and EMA in host memory"})
    lora_rank: int = field(default=0, metadata={
        "help": "LoRA adapters of this rank on a frozen U-Net (train.lora.rank); 0 = every weight is trained"})
    lora_target_modules: tuple[str, ...] = field(default=("to_q", "to_k", "to_v", "to_out.0"), metadata={
        "help": "module name suffixes that get adapters (train.lora.target_modules)"})
    frozen_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype of a LoRA run's frozen base weights (train.frozen_dtype)"})

    def validate(self) -> None:
        problems = Problems()
        for name in ("latent_size", "text_len", "micro_batch_size", "world_size"):
            if getattr(self, name) < 1:
                problems.add(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.cpu_offload and self.parallel == "ddp":
            problems.add("cpu_offload: is FSDP2's CPU offload: use parallel fsdp-full (one block gathered at a "
                         "time) or fsdp-grad-op, or turn the offload off (--no-cpu-offload)")
        if self.optimizer in ("adamw8bit", "muon") and self.parallel != "ddp":
            problems.add(f"optimizer: {self.optimizer} does not run on FSDP2's sharded parameters ({self.parallel}); "
                         "use adamw")
        if self.lora_rank < 0:
            problems.add(f"lora_rank: must be >= 0, got {self.lora_rank}; 0 = full training")
        if self.lora_rank and self.parallel != "ddp":
            problems.add(f"parallel: {self.parallel}: LoRA runs are not sharded; use ddp")
        if self.lora_rank and self.precision == "bf16-weights":
            problems.add("precision: bf16-weights is FSDP2's bf16 parameters, which a LoRA run does not use; use bf16 "
                         "(autocast) and frozen_dtype bfloat16")
        if self.frozen_dtype != "float32" and not self.lora_rank:
            problems.add(f"frozen_dtype: {self.frozen_dtype} is for a LoRA run's frozen weights; set lora_rank or "
                         "use float32")
        problems.raise_if_any()


class _GPUStandIns(TorchFunctionMode):
    """On the meta device: bf16 autocast as on CUDA (if ``dtype``), and fused attention."""

    LOW = {F.linear, F.conv2d, torch.matmul, torch.bmm, torch.baddbmm, torch.mm, torch.addmm, torch.Tensor.matmul,
           torch.Tensor.__matmul__}
    FP32 = {F.group_norm, F.layer_norm, F.softmax, torch.softmax, torch.Tensor.softmax}

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype = dtype
        self.weight_copies: dict[int, torch.Tensor] = {}  # id(parameter) -> its cached low-precision copy

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == dtype:
            return x
        if isinstance(x, torch.nn.Parameter):
            if id(x) not in self.weight_copies:
                self.weight_copies[id(x)] = x.to(dtype)
            return self.weight_copies[id(x)]
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (self._cast(t, self.dtype) if self.dtype else t for t in args[:3])
            return _FusedAttention.apply(q, k, v)
        if self.dtype is not None and func in self.LOW:
            args = tuple(self._cast(a, self.dtype) for a in args)
            kwargs = {k: self._cast(v, self.dtype) for k, v in kwargs.items()}
        elif self.dtype is not None and func in self.FP32:
            args = tuple(self._cast(a, torch.float32) for a in args)
        return func(*args, **kwargs)


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward pass: q, k, v, out, log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(*q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the pass is on the meta device and only counted
        raise NotImplementedError


def _add_lora(model: torch.nn.Module, lora_json: str) -> None:
    """Freeze ``model`` (its base in the frozen dtype) and add fp32 LoRA adapters, as
    ``train.finetune.build_finetune_model`` does, on the model's (meta) device."""
    from peft import LoraConfig

    from latentforge.train.finetune import add_lora_adapters

    lora = json.loads(lora_json)
    model.requires_grad_(False)
    if lora["frozen_dtype"] == "bfloat16":
        torch.nn.Module.to(model, torch.bfloat16)
    add_lora_adapters(model, LoraConfig(r=lora["rank"], lora_alpha=lora["rank"], init_lora_weights="gaussian",
                                 target_modules=list(lora["target_modules"])))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()


@lru_cache(maxsize=64)
def _activation_profile(model_json: str, latent_size: int, text_len: int, precision: str,
                        lora_json: str = "") -> dict[str, int]:
    """Saved-activation bytes of one image through the denoiser (see the module docstring);
    ``lora_json``: the frozen base and adapters of a LoRA run (:func:`_add_lora`), "" = none."""
    from latentforge.models.denoiser import denoiser_from_config

    den = denoiser_from_config(json.loads(model_json))
    param_dtype = torch.bfloat16 if precision == "bf16-weights" else torch.float32
    with torch.device("meta"):
        model = den.build()
        if param_dtype != torch.float32:
            torch.nn.Module.to(model, param_dtype)  # diffusers' own .to warns about fp32 modules it has none of
        if lora_json:
            _add_lora(model, lora_json)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        saved: dict[int, int] = {}
        mode = _GPUStandIns(torch.bfloat16 if precision == "bf16" else None)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in params and key not in saved:
                saved[key] = t.untyped_storage().nbytes()
            return t

        blocks = den.blocks(model)
        block_keys: list[list[int]] = []
        inputs: dict[int, int] = {}
        marks: list[int] = []

        def pre(_module, args, kwargs):
            marks.append(len(saved))
            for t in [*args, *kwargs.values()]:
                for x in (t if isinstance(t, tuple) else (t,)):
                    if isinstance(x, torch.Tensor):
                        inputs.setdefault(x.untyped_storage()._cdata, x.untyped_storage().nbytes())

        def post(_module, _args, _kwargs, _out):
            block_keys.append(list(saved)[marks.pop():])  # saved keeps insertion order

        handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre, with_kwargs=True),
                                               b.register_forward_hook(post, with_kwargs=True))]
        x = torch.empty(1, model.config.in_channels, latent_size, latent_size)
        hidden = torch.empty(1, text_len, den.text_dim)
        mask = torch.ones(1, text_len) if den.uses_text_mask else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            out = den.forward(model, x.to(param_dtype), torch.tensor([1]), hidden.to(param_dtype), mask)
        for h in handles:
            h.remove()
        copies = {c.untyped_storage()._cdata: c.untyped_storage().nbytes() for c in mode.weight_copies.values()}
        total = sum(v for k, v in saved.items() if k not in copies)
        block_bytes = [sum(saved[k] for k in keys if k not in copies) for keys in block_keys]
        outside = total - sum(block_bytes)
        checkpointed = outside + sum(v for k, v in inputs.items() if k not in copies) + max(block_bytes)
        del out
    return {"activations": total, "activations_checkpointed": min(total, checkpointed),
            "weight_copies": sum(copies.values())}


def unet_kwargs(unet: UNetConfig | DiTConfig | dict[str, Any]) -> dict[str, Any]:
    """The denoiser's constructor arguments: from a preset config, or a pipeline's ``config.json``."""
    return as_denoiser(unet).diffusers_config()


def _model_json(model: UNetConfig | DiTConfig | dict[str, Any]) -> str:
    """The denoiser's class and constructor arguments as one JSON string (the caches' key)."""
    den = as_denoiser(model)
    return json.dumps({"_class_name": den.model_class_name, **den.diffusers_config()}, sort_keys=True)


def activation_profile(unet: UNetConfig | DiTConfig | dict[str, Any], latent_size: int, text_len: int,
                       precision: str, lora_json: str = "") -> dict[str, int]:
    return _activation_profile(_model_json(unet), latent_size, text_len, precision, lora_json)


def _lora_json(cfg: MemoryConfig) -> str:
    if not cfg.lora_rank:
        return ""
    return json.dumps({"rank": cfg.lora_rank, "target_modules": list(cfg.lora_target_modules),
                       "frozen_dtype": cfg.frozen_dtype}, sort_keys=True)


@lru_cache(maxsize=64)
def _lora_parameter_count(model_json: str, lora_json: str) -> int:
    """Parameters of the LoRA adapters of a denoiser (what a LoRA run trains), on the meta device."""
    from latentforge.models.denoiser import denoiser_from_config

    with torch.device("meta"):
        model = denoiser_from_config(json.loads(model_json)).build()
        _add_lora(model, lora_json)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_parameter_count(cfg: MemoryConfig) -> int:
    """The trained (adapter) parameters of ``cfg``'s LoRA set-up; 0 without LoRA."""
    lora_json = _lora_json(cfg)
    return _lora_parameter_count(_model_json(cfg.unet), lora_json) if lora_json else 0


@lru_cache(maxsize=64)
def _param_counts(model_json: str) -> tuple[int, int]:
    """(parameters, parameters of the largest block) of a denoiser, on the meta device."""
    from latentforge.models.denoiser import denoiser_from_config

    den = denoiser_from_config(json.loads(model_json))
    with torch.device("meta"):
        model = den.build()
    return (sum(p.numel() for p in model.parameters()),
            max(sum(p.numel() for p in b.parameters()) for b in den.blocks(model)))


def estimate_memory(cfg: MemoryConfig) -> dict[str, Any]:
    """The peak memory breakdown of ``cfg`` in bytes (see the module docstring); ``total`` is their
    sum, what ``torch.cuda.max_memory_allocated`` would show."""
    cfg.validate()
    n, largest_block = _param_counts(_model_json(cfg.unet))
    if cfg.cpu_offload:
        return _estimate_offloaded(cfg, n, largest_block)
    if cfg.lora_rank:
        return _estimate_lora(cfg, n)
    w = cfg.world_size
    shard_grads = cfg.parallel in ("fsdp-grad-op", "fsdp-full") and w > 1
    shard_params = cfg.parallel == "fsdp-full" and w > 1
    param_bytes = 2 if cfg.precision == "bf16-weights" else 4
    grad_bytes = param_bytes
    opt_bytes = (2 if cfg.optimizer == "adamw8bit" else 8) + (4 if cfg.precision == "bf16-weights" else 0)
    ema_bytes = {"same": 4 + (4 if cfg.precision == "bf16-weights" else 0), "cpu": 0, "off": 0}[cfg.ema]
    prof = activation_profile(cfg.unet, cfg.latent_size, cfg.text_len, cfg.precision)
    act = prof["activations_checkpointed" if cfg.activation_checkpointing else "activations"]
    out = {
        "weights": n * param_bytes / (w if shard_params else 1),
        "weight_copies": prof["weight_copies"] / (w if shard_params else 1),
        "gradients": n * grad_bytes / (w if shard_grads else 1),
        "ddp_buckets": n * grad_bytes if cfg.parallel == "ddp" and w > 1 else 0,
        "optimizer": n * opt_bytes / (w if shard_grads else 1),
        "ema": n * ema_bytes / (w if shard_params else 1),
        "activations": act * cfg.micro_batch_size,
        # FULL_SHARD gathers one block's full weights at a time, and prefetches the next.
        "fsdp_gather": 2 * largest_block * param_bytes if shard_params else 0,
    }
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    out["parameters"] = out["trained_parameters"] = n
    out["activations_per_sample"] = act
    return out


def _estimate_lora(cfg: MemoryConfig, n: int) -> dict[str, Any]:
    """:func:`estimate_memory` of a LoRA run (see the module docstring): the frozen base, and the
    gradients, optimizer state and EMA of the adapters only; never sharded."""
    n_lora = lora_parameter_count(cfg)
    frozen_bytes = 2 if cfg.frozen_dtype == "bfloat16" else 4
    # autocast's bf16 copies of the fp32 weights (frozen fp32 base and adapters), measured in the profile
    prof = activation_profile(cfg.unet, cfg.latent_size, cfg.text_len, cfg.precision, _lora_json(cfg))
    act = prof["activations_checkpointed" if cfg.activation_checkpointing else "activations"]
    out = {
        "weights": n * frozen_bytes + n_lora * 4,
        "weight_copies": prof["weight_copies"],
        "gradients": n_lora * 4,
        "ddp_buckets": n_lora * 4 if cfg.world_size > 1 else 0,
        "optimizer": n_lora * (2 if cfg.optimizer == "adamw8bit" else 8),
        "ema": n_lora * 4 if cfg.ema == "same" else 0,
        "activations": act * cfg.micro_batch_size,
        "fsdp_gather": 0,
    }
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    out["parameters"] = n
    out["trained_parameters"] = n_lora
    out["activations_per_sample"] = act
    return out


HOST_PARTS = ("host_weights", "host_gradients", "host_optimizer", "host_ema")


def _estimate_offloaded(cfg: MemoryConfig, n: int, largest_block: int) -> dict[str, Any]:
    """:func:`estimate_memory` under FSDP2 CPU offload (see the module docstring)."""
    # bf16-weights = FSDP2's bf16 MixedPrecisionPolicy: blocks are gathered in bf16. fp32 and bf16
    # (autocast) gather fp32 weights; autocast then adds a bf16 copy of each gathered weight.
    gathered = 2 if cfg.precision == "bf16-weights" else 4
    prof = activation_profile(cfg.unet, cfg.latent_size, cfg.text_len, cfg.precision)
    act = prof["activations_checkpointed" if cfg.activation_checkpointing else "activations"]
    full = cfg.parallel == "fsdp-full"
    resident = 2 * largest_block if full else n  # parameters gathered on the device at the peak
    out = {
        "weights": 0 if full else n * gathered,
        "weight_copies": resident * 2 if cfg.precision == "bf16" else 0,
        # one block's gradients as computed, plus their fp32 copy for the reduce-scatter
        "gradients": largest_block * (gathered + (4 if gathered != 4 else 0)),
        "ddp_buckets": 0,
        "optimizer": 0,
        "ema": 0,
        "activations": act * cfg.micro_batch_size,
        "fsdp_gather": resident * gathered if full else 0,
    }
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    out["parameters"] = n
    out["activations_per_sample"] = act
    w = cfg.world_size
    host = {"host_weights": 4 * n / w, "host_gradients": 4 * n / w, "host_optimizer": 8 * n / w,
            "host_ema": 0 if cfg.ema == "off" else 4 * n / w}
    out.update({k: int(v) for k, v in host.items()})
    out["host_total"] = sum(out[k] for k in HOST_PARTS)
    out["trained_parameters"] = n
    return out


def device_bytes_needed(total: int) -> int:
    """What a CUDA device must have free for a step whose modelled peak is ``total`` bytes."""
    return int(total * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES


def largest_micro_batch(cfg: MemoryConfig, device_bytes: int, divides: int = 0, limit: int = 4096,
                        allowance: bool = True) -> int:
    """The largest micro batch whose predicted peak fits in ``device_bytes`` (0 if none does);
    with ``divides`` > 0 only micro batches dividing it (the per-rank share of the global batch)."""
    best = 0
    for m in range(1, (divides or limit) + 1):
        if divides and divides % m:
            continue
        total = estimate_memory(replace(cfg, micro_batch_size=m))["total"]
        if (device_bytes_needed(total) if allowance else total) > device_bytes:
            break
        best = m
    return best


def device_memory_budget(device: torch.device) -> tuple[int, bool, str]:
    """(bytes the training step may use, whether the CUDA allowance applies, how it was found).
    CUDA: the device's total memory. CPU: half of MemAvailable, leaving the rest to the loader
    workers, the page cache and other processes."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, True, f"CUDA device total memory {total / GIB:.1f} GiB"
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not available:
        from latentforge.errors import UserError

        raise UserError("train.micro_batch_size: auto cannot read the available memory (/proc/meminfo) on this "
                        "CPU: set a number")
    return available // 2, False, f"half of the available RAM ({available / GIB:.1f} GiB)"


def train_memory_setup(t, cpu_offload: bool | None = None, autocast: bool = True) -> dict:
    """The MemoryConfig fields a TrainConfig ``t`` determines: ``parallel`` (strategy and
    reshard_after_forward), CPU offload (``cpu_offload`` overrides it), activation checkpointing,
    precision (``autocast``: whether the run computes in bf16), optimizer and EMA placement."""
    par = replace(t.parallel, cpu_offload=t.parallel.cpu_offload if cpu_offload is None else cpu_offload)
    if t.lora is not None:  # replicated, autocast over the frozen base (validation refuses FSDP2 for LoRA)
        return {"parallel": "ddp", "cpu_offload": False, "activation_checkpointing": par.activation_checkpointing,
                "precision": "bf16" if autocast else "fp32", "optimizer": t.optim.name,
                "ema": "off" if t.ema is None else t.ema.device, "lora_rank": t.lora.rank,
                "lora_target_modules": tuple(t.lora.target_modules), "frozen_dtype": t.frozen_dtype}
    if par.strategy == "fsdp":
        parallel = "fsdp-full" if par.reshard_after_forward else "fsdp-grad-op"
    else:
        parallel = "ddp"
    if par.cpu_offload and par.mixed_precision == "bf16":
        precision = "bf16-weights"  # blocks gathered in bf16 on the device; the fp32 master is on the host
    else:  # FSDP's bf16 gather without offload costs what autocast's copies do: fp32 weights + bf16 copies
        precision = "fp32" if not autocast and par.mixed_precision == "fp32" else "bf16"
    return {"parallel": parallel, "cpu_offload": par.cpu_offload,
            "activation_checkpointing": par.activation_checkpointing, "precision": precision,
            "optimizer": t.optim.name, "ema": "off" if t.ema is None else t.ema.device}


def resolve_auto_micro_batch(cfg, latent_shapes: list[tuple[int, int]], device: torch.device, world_size: int,
                             budget: tuple[int, bool, str] | None = None,
                             unet: UNetConfig | DiTConfig | dict[str, Any] | None = None):
    """``cfg`` (a TrainConfig with ``micro_batch_size: auto``) with each phase's micro batch set to
    the largest that fits ``budget`` (default :func:`device_memory_budget`) and divides the
    phase's per-rank global batch, so the global batch is kept by gradient accumulation.
    ``latent_shapes``: (latent side, caption tokens) per phase; ``unet``: the denoiser's shape when it
    is not the one ``cfg.model`` selects (a fine-tuned pipeline's U-Net). The set-up (parallelism, CPU offload, activation
    checkpointing, optimizer, EMA) is the run's own."""
    import logging

    from latentforge.errors import UserError

    device_bytes, allowance, how = budget or device_memory_budget(device)
    autocast = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    setup = train_memory_setup(cfg, autocast=autocast)
    if unet is None:
        unet = denoiser_for(cfg).cfg
    phases = []
    for i, (p, (size, text_len)) in enumerate(zip(cfg.phases, latent_shapes)):
        if p.micro_batch_size:
            phases.append(p)
            continue
        global_ = p.global_batch_size or cfg.global_batch_size
        if global_ % world_size:
            raise ConfigError(f"train.global_batch_size: {global_} is not divisible by the world size {world_size}")
        mem = MemoryConfig(unet=unet, latent_size=size, text_len=text_len, world_size=world_size, **setup)
        micro = largest_micro_batch(mem, device_bytes, divides=global_ // world_size, allowance=allowance)
        if not micro:
            raise UserError(f"train.micro_batch_size: auto: not even a micro batch of 1 fits in {how} for phase {i} "
                            f"({size}x{size} latents); see latentforge plan --memory")
        peak = estimate_memory(replace(mem, micro_batch_size=micro))["total"]
        logging.getLogger(__name__).warning(
            "micro_batch_size auto, phase %d: %d per rank x %d accumulation x %d ranks = global batch %d "
            "(predicted peak %.2f GiB of %s)", i, micro, global_ // world_size // micro, world_size, global_,
            peak / GIB, how)
        phases.append(replace(p, micro_batch_size=micro))
    return replace(cfg, phases=phases, micro_batch_size=min(p.micro_batch_size for p in phases))
