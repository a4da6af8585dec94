"""Data-parallel scaling on this machine: 1 vs 2 processes, DDP vs FSDP2 memory, regional compile.

    python bench/bench_scale.py [--steps 8] [--skip-small] [--skip-compile]

A. Throughput (images/s) of the U-Net training step (forward, backward, gradient sync, clipping,
   fused AdamW, foreach EMA) on random latents, for the `tiny` preset (8x8x4 latents, 16 text
   tokens of width 384) and the `small` preset (16x16x4 latents, 16 tokens of width 1024):
   1 process with 1 and with 2 intra-op threads, and 2 gloo processes of 1 thread each under DDP
   and FSDP2, at the same global batch. The 2 vCPUs of this machine give about one core's
   throughput, so 2 processes cannot be faster than 1 process with 2 threads here; the figures
   show the overhead of the wrappers and of gloo, not a speed-up.
B. Per-rank peak memory (the last column of A; DDP vs FSDP2 matters for `small`): the peak
   resident set size (``ru_maxrss``) of each rank minus its RSS just before the model was built.
   (tracemalloc does not see torch's allocations; on CUDA one would read
   ``torch.cuda.max_memory_allocated``.) The figure covers parameters, gradients, AdamW state,
   the EMA, gathered FSDP parameters, communication buffers and activations, and allocator slack.
C. `tiny` on 1 process of 1 thread: eager vs ``torch.compile`` per U-Net block (regional): cold compile time
   with an empty ``TORCHINDUCTOR_CACHE_DIR``, warm start from that cache, steady step time.

Every configuration runs in fresh processes forked from this one (torch and diffusers are
imported once). Prints figures; asserts nothing about time; steps are timed one by one and
medians reported. The machine may be shared: rerun for stable figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from latentforge.distributed.env import close_world, init_world
from latentforge.distributed.parallelize import ParallelConfig, parallelize
from latentforge.models.unet import UNetConfig, build_unet
from latentforge.train.ema import EMA, EMAConfig
from latentforge.train.optim import OptimConfig, build_optimizer, clip_grad_norm

SHAPES = {"tiny": dict(latent=8, text_dim=384), "small": dict(latent=16, text_dim=1024)}
TEXT_LEN = 16


def _rss_bytes() -> int:
    """Resident set size now (Linux: /proc/self/statm, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world_size: int, port: int, job: dict, out_dir: str) -> None:
    torch.set_num_threads(job["threads"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if job.get("inductor_cache"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = job["inductor_cache"]
    world = init_world("cpu")
    shape = SHAPES[job["preset"]]
    rss_before = _rss_bytes()
    torch.manual_seed(0)
    model = build_unet(UNetConfig(preset=job["preset"], in_channels=4, out_channels=4,
                                  cross_attention_dim=shape["text_dim"], sample_size=shape["latent"]))
    parallel = ParallelConfig(**job["parallel"])
    train_model, _ = parallelize(model, parallel, world, torch.device("cpu"))
    optimizer = build_optimizer(model.parameters(), OptimConfig(lr=1e-4), "cpu")
    ema = EMA(model, EMAConfig(decay=0.999))
    micro = job["global_batch"] // world_size
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(micro, 4, shape["latent"], shape["latent"], generator=g)
    hidden = torch.randn(micro, TEXT_LEN, shape["text_dim"], generator=g)
    t = torch.randint(0, 1000, (micro,), generator=g)
    times = []
    for step in range(job["steps"]):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        pred = train_model(x, t, encoder_hidden_states=hidden, return_dict=False)[0]
        pred.float().square().mean().backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        ema.update(model, step)
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result = {"first_step_s": times[0], "step_s": statistics.median(times[1:]),
              "peak_mib": (peak_rss - rss_before) / 2**20}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    close_world()


def run(job: dict, world_size: int) -> dict:
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(_worker, args=(world_size, port, job, out), nprocs=world_size, start_method="fork")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
    step_s = max(r["step_s"] for r in ranks)  # the slowest rank sets the pace
    return {"img_per_s": job["global_batch"] / step_s, "step_ms": step_s * 1e3,
            "first_step_s": max(r["first_step_s"] for r in ranks),
            "peak_mib_per_rank": max(r["peak_mib"] for r in ranks)}


def throughput(preset: str, global_batch: int, steps: int) -> None:
    print(f"\nA. {preset}: images/s at global batch {global_batch}, fp32 ({steps} steps, median)")
    print(f"{'configuration':52s} {'img/s':>7s} {'ms/step':>8s} {'peak MiB/rank':>14s}")
    configs = [("1 process, 1 thread", 1, 1, {"strategy": "none"}),
               ("1 process, 2 threads", 1, 2, {"strategy": "none"}),
               ("2 processes x 1 thread, DDP", 2, 1, {"strategy": "ddp"}),
               ("2 processes x 1 thread, FSDP2 (ZeRO-2)", 2, 1, {"strategy": "fsdp"}),
               ("2 processes x 1 thread, FSDP2 (ZeRO-3)", 2, 1, {"strategy": "fsdp", "reshard_after_forward": True}),
               ("2 processes x 1 thread, FSDP2 (ZeRO-2), bf16", 2, 1, {"strategy": "fsdp", "mixed_precision": "bf16"}),
               ("1 process, 1 thread, activation checkpointing", 1, 1,
                {"strategy": "none", "activation_checkpointing": True}),
               ("2 processes x 1 thread, FSDP2 (ZeRO-3) + act. ckpt", 2, 1,
                {"strategy": "fsdp", "reshard_after_forward": True, "activation_checkpointing": True})]
    for name, world_size, threads, parallel in configs:
        job = dict(preset=preset, global_batch=global_batch, steps=steps, threads=threads, parallel=parallel)
        r = run(job, world_size)
        print(f"{name:52s} {r['img_per_s']:7.1f} {r['step_ms']:8.0f} {r['peak_mib_per_rank']:14.0f}", flush=True)


def compile_figures(steps: int, cache: str | None) -> None:
    """Eager, then compiled with an empty cache (skipped when ``cache`` is given), then compiled
    again from the cache."""
    print("\nC. tiny, 1 process x 1 thread, global batch 32: eager vs regional torch.compile")
    runs = [("eager", {}, None)]
    if cache is None:
        cache = tempfile.mkdtemp(prefix="inductor-bench-")
        runs.append(("compiled, cold cache", {"compile": True}, cache))
    runs.append(("compiled, warm cache", {"compile": True}, cache))
    base = dict(preset="tiny", global_batch=32, steps=steps, threads=1)
    for name, parallel, inductor_cache in runs:
        r = run({**base, "parallel": {"strategy": "none", **parallel}, "inductor_cache": inductor_cache}, 1)
        print(f"{name:24s} first step {r['first_step_s']:6.1f} s, then {r['step_ms']:6.0f} ms/step "
              f"({r['img_per_s']:.0f} img/s)", flush=True)
    print(f"(TORCHINDUCTOR_CACHE_DIR={cache})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip-small", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--only-compile", action="store_true")
    p.add_argument("--inductor-cache", help="a TORCHINDUCTOR_CACHE_DIR filled by an earlier run: skip the cold compile")
    a = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} vCPUs, load average {os.getloadavg()[0]:.1f}")
    if not a.only_compile:
        throughput("tiny", 32, a.steps)
    if not (a.skip_small or a.only_compile):
        throughput("small", 4, max(3, a.steps // 2))
    if not a.skip_compile:
        compile_figures(a.steps, a.inductor_cache)


if __name__ == "__main__":
    sys.exit(main())
