"""``latentforge bench``: time the real training step of a recipe on this machine.

For each phase of the recipe: build its U-Net, run ``warmup`` + ``steps`` steps of
``Trainer.train_step`` (noise, forward, backward, clipping, AdamW) plus the EMA update, one
micro batch per optimizer step, through the wrappers of the recipe's ``train.parallel`` that one
process applies (``compile``, ``activation_checkpointing``, ``low_precision_norms``; a cold compile
falls in the warm-up steps, so give ``--warmup`` enough of them), and report the median step time with its spread, images per
second per device, MFU and peak memory. A run that accumulates gradients steps the optimizer
less often, so its throughput is up to a few percent higher than measured here.

Data: the phase's latent datasets through the real loader (read time included) when they all
exist; otherwise (or with ``synthetic=True``) random latents and text states of the recipe's
shapes (:mod:`latentforge.plan.shapes`), made outside the timing: the output says which.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` from just before the model is built. On
CPU two figures: the peak of live tensor bytes during one extra, untimed step (every aten op's
outputs counted per storage until freed, weights, optimizer state and EMA included: what
``max_memory_allocated`` measures on CUDA), and the resident-set high-water mark (``VmHWM``,
reset by writing 5 to ``/proc/self/clear_refs``) minus the resident set just before the model is
built, which adds allocator overhead and library scratch buffers. Memory freed by an earlier
phase and kept by the allocator is reused without showing up in the RSS figure, so run one phase
per process for a clean RSS figure of a later phase. The memory planner's prediction is printed
beside both.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import tempfile
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from latentforge import storage
from latentforge.errors import UserError
from latentforge.plan.flops import device_peak_flops, train_flops_per_image
from latentforge.train.memory import GIB, MemoryConfig, estimate_memory
from latentforge.plan.shapes import phase_shapes, unet_for


def _read_proc(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


class PeakMemory:
    """Peak memory since ``start()``, as described in the module docstring (None if unavailable)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0
        self.method = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                       else "live tensor bytes of one extra step; RSS: high-water mark (VmHWM) minus RSS before "
                            "the model was built")

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self.base = _read_proc("VmRSS")
        except OSError:
            self.base = -1

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        if self.base < 0:
            return None
        return _read_proc("VmHWM") - self.base


class TensorBytes(TorchDispatchMode):
    """Live tensor bytes and their peak, counted per storage as every aten op (backward included)
    creates tensors, and released when a storage is freed: on CPU, the figure CUDA's
    ``max_memory_allocated`` gives (library scratch space and allocator overhead excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        size = storage.nbytes()
        self._live.add(key)
        self.current += size
        self.peak = max(self.peak, self.current)

        def release(key: int = key, size: int = size) -> None:
            self.current -= size
            self._live.discard(key)

        weakref.finalize(storage, release)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.add(t)
        return out


def _tracked_step(trainer, batch, step: int) -> int:
    """Peak live tensor bytes of one more training step (weights, optimizer state and EMA included)."""
    tracker = TensorBytes()
    for t in [*trainer.model.parameters(), *(v for st in trainer.optimizer.state.values() for v in st.values()
                                             if isinstance(v, torch.Tensor)),
              *(trainer.ema.shadow if trainer.ema is not None else [])]:
        tracker.add(t)
    with tracker:
        trainer.train_step([batch])
        if trainer.ema is not None:
            trainer.ema.update(trainer.model, step)
    return tracker.peak


def _datasets_exist(recipe) -> bool:
    return all(storage.exists(storage.join(ds.path, "index.json"))
               for p in recipe.train.phases for ds in p.datasets) and all(p.datasets for p in recipe.train.phases)


def _synthetic_batches(shapes, micro: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    latent = (micro, shapes.latent_channels, shapes.latent_size, shapes.latent_size)
    position = 0
    while True:
        yield {"latent_mean": torch.randn(latent, generator=g), "latent_std": torch.full(latent, 0.1),
               "text_hidden": torch.randn((micro, shapes.text_len, shapes.text_dim), generator=g),
               "text_mask": torch.ones((micro, shapes.text_len), dtype=torch.uint8),
               "_position": list(range(position, position + micro))}
        position += micro


def run_bench(recipe, steps: int = 10, warmup: int = 2, synthetic: bool | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Time every phase of ``recipe`` (see the module docstring); returns what ``bench`` writes."""
    from latentforge.distributed.env import World
    from latentforge.distributed.parallelize import parallelize, resolve_strategy
    from latentforge.models.denoiser import denoiser_for
    from latentforge.train.run import latent_meta, pick_device, resolve_model_config
    from latentforge.train.trainer import Trainer

    if steps < 1 or warmup < 0:
        raise UserError(f"bench: --steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if resolve_strategy(recipe.train.parallel, 1) != "none":
        raise UserError("bench: times one process; train.parallel asks for FSDP2 with CPU offload, which needs a "
                        "process group: time it with `latentforge train` under torchrun instead")
    if recipe.train.lora is not None:  # was timed as a full training step of the from-scratch denoiser
        raise UserError("bench: times full training steps of the recipe's denoiser, not LoRA adapters on a frozen one; "
                        "leave train.lora out, or read a LoRA run's steps a second from `latentforge finetune`")
    if recipe.train.init_from:
        raise UserError("bench: times the recipe's denoiser shape with random weights and does not read "
                        "train.init_from; leave it out (a full fine-tune's step costs the same when the recipe's "
                        "unet.preset is the pipeline's shape)")
    have_data = _datasets_exist(recipe)
    if synthetic is None:
        synthetic = not have_data
    elif not synthetic and not have_data:
        raise UserError("bench: the recipe's datasets do not exist (no index.json): drop --real-data to use "
                        "synthetic batches")
    train = recipe.train
    if train.micro_batch_size == "auto" and any(not p.micro_batch_size for p in train.phases):
        raise UserError("bench: train.micro_batch_size is auto: give one, e.g. train.micro_batch_size=8")
    device = pick_device(train.device)
    autocast = train.precision == "bf16" or (train.precision == "auto" and device.type == "cuda")
    precision = "bf16" if autocast else "fp32"
    peak_flops, peak_how = device_peak_flops(device, precision)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = latent_meta(train) if not synthetic else {"vae": {"scaling_factor": 1.0}}
    results = []
    for i, (phase, shapes) in enumerate(zip(train.phases, phase_shapes(recipe))):
        micro = phase.micro_batch_size or train.micro_batch_size
        if synthetic:
            unet_cfg = unet_for(recipe, shapes)
        else:
            from latentforge.data.loader import build_loader
            from latentforge.data.schema import parse_ndarray, read_index

            unet_cfg = denoiser_for(resolve_model_config(train, meta)).cfg
            index = read_index(phase.datasets[0].path)
            _, size, _ = parse_ndarray(index.columns["latent_mean"])[1]
            shapes = replace(shapes, latent_size=size,
                             text_len=parse_ndarray(index.columns["text_hidden"])[1][0])
        # A constant LR: the schedule's shape costs nothing, and a short bench cannot hold its warmup.
        optim = replace(train.optim, schedule="constant", warmup_steps=0)
        one = replace(train, **{denoiser_for(train).config_field: unet_cfg}, micro_batch_size=micro, global_batch_size=0, loggers=[], optim=optim,
                      phases=[replace(phase, steps=steps + warmup, samples=0, micro_batch_size=micro,
                                      global_batch_size=0)])
        memory = PeakMemory(device)
        memory.start()
        torch.manual_seed(train.seed)
        model = build_model(unet_cfg, device)
        # The wrappers one process trains with (compile, activation checkpointing, low-precision norms):
        # the step timed is the step `train` runs.
        train_model, _ = parallelize(model, train.parallel, World(), device)
        with tempfile.TemporaryDirectory(prefix="latentforge-bench-") as tmp:
            loader = None
            if synthetic:
                batches = _synthetic_batches(shapes, micro, train.seed)
            else:
                loader_cfg = replace(recipe.loader, datasets=phase.datasets)
                loader = build_loader(loader_cfg, micro)
                batches = iter(loader)
            trainer = Trainer(one, model, lambda *_: loader, tmp, meta, device=device, progress=False,
                              train_model=train_model)
            times = []
            try:
                for step in range(warmup + steps):
                    t0 = time.perf_counter()
                    trainer.train_step([next(batches)])
                    if trainer.ema is not None:
                        trainer.ema.update(model, step)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - t0)
                peak_mem = memory.peak()
                # CPU: one more step, untimed, counting live tensor bytes (slow: a Python hook per op).
                tensor_peak = _tracked_step(trainer, next(batches), warmup + steps) if device.type == "cpu" else None
            finally:
                if loader is not None:
                    loader.close()
        del trainer, model
        timed = times[warmup:]
        median = statistics.median(timed)
        img_s = micro / median
        flops = float(train_flops_per_image(unet_cfg, shapes.latent_size, shapes.text_len, train.masking_ratio_of(i),
                                            train.masking.mixer_blocks))
        predicted = estimate_memory(MemoryConfig(
            unet=unet_cfg, latent_size=shapes.latent_size, text_len=shapes.text_len, micro_batch_size=micro,
            precision=precision, ema="off" if train.ema is None else train.ema.device))["total"]
        row = {
            "phase": shapes.name, "resolution": shapes.resolution, "latent_size": shapes.latent_size,
            "text_len": shapes.text_len, "micro_batch_size": micro, "steps": steps, "warmup": warmup,
            "step_seconds": {"median": median, "min": min(timed), "max": max(timed),
                             "spread": (max(timed) - min(timed)) / median},
            "img_per_s_per_device": img_s, "flops_per_image": flops, "mfu": img_s * flops / peak_flops,
            "peak_memory_bytes": peak_mem if device.type == "cuda" else tensor_peak,
            "peak_rss_bytes": peak_mem if device.type == "cpu" else None, "predicted_memory_bytes": predicted,
        }
        results.append(row)
        if progress:
            print(format_row(row))
        gc.collect()
    return {
        "recipe": recipe.name, "device": device.type, "device_name": device_name, "precision": precision,
        "synthetic": synthetic, "peak_flops": peak_flops, "peak_flops_source": peak_how,
        "memory_method": PeakMemory(device).method, "phases": results,
        # What ``latentforge plan --throughput`` reads: images per second per device by resolution.
        "img_per_s_per_gpu": {str(r["resolution"]): r["img_per_s_per_device"] for r in results},
    }


def build_model(model_cfg, device: torch.device) -> torch.nn.Module:
    from latentforge.models.denoiser import as_denoiser

    model = as_denoiser(model_cfg).build().to(device)
    model.train()
    return model


def format_row(r: dict[str, Any]) -> str:
    s = r["step_seconds"]
    pred = r["predicted_memory_bytes"]

    def vs(measured: int) -> str:
        return f"{measured / GIB:.3f} GiB (planner {pred / GIB:.3f}, error {100 * (pred / measured - 1):+.0f}%)"

    mem = f"peak memory {vs(r['peak_memory_bytes'])}"
    if r["peak_rss_bytes"]:
        mem += f", peak RSS {vs(r['peak_rss_bytes'])}"
    return (f"bench {r['phase']} ({r['resolution']} px, {r['latent_size']}x{r['latent_size']} latents, micro batch "
            f"{r['micro_batch_size']}): {1000 * s['median']:.1f} ms/step median over {r['steps']} steps "
            f"(min {1000 * s['min']:.1f}, max {1000 * s['max']:.1f}), {r['img_per_s_per_device']:.2f} img/s per "
            f"device, MFU {100 * r['mfu']:.2f}%; {mem}")


def load_bench_throughput(path: str) -> tuple[dict[str, float], str]:
    """(img/s per GPU by resolution, a description) from a JSON written by ``latentforge bench``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        measured = data["img_per_s_per_gpu"]
    except FileNotFoundError:
        raise UserError(f"--throughput {path}: no such file") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"--throughput {path}: not a JSON written by latentforge bench (no img_per_s_per_gpu)") from None
    try:
        table = {str(int(k)): float(v) for k, v in measured.items()}
    except (TypeError, ValueError, AttributeError):
        table = {}
    if not table or not all(math.isfinite(v) and v > 0 for v in table.values()):
        raise UserError(f"--throughput {path}: img_per_s_per_gpu must map resolutions to positive images a second, "
                        f"got {json.dumps(measured)[:80]}")
    return table, f"measured by bench on {data.get('device_name', '?')} ({data.get('precision', '?')})"
