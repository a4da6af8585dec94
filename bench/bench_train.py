"""Training throughput and model-FLOPs utilisation on this machine, and ours vs the usual way.

    python bench/bench_train.py [--steps 15] [--warmup 3] [--skip-baseline | --only-baseline]

A. The real training step (loader + Trainer.train_step: noise, U-Net forward/backward, AdamW,
   foreach EMA) of the `tiny` and `small` U-Net presets on latent shards, fp32, eager. MFU uses
   the analytic model FLOPs per image (3x forward, counted on the meta device) and the
   measured fp32 matmul peak of this CPU.
B. The demo's model and data trained our way (precomputed latents and text embeddings from
   latent shards, foreach EMA) against the way the diffusers text_to_image example does it:
   decode the images, run the VAE encoder and the text encoder on every step, and a Python loop
   over parameters for the EMA. Same U-Net, batch and data, measured in the same run.

C. The step overhead (``--overhead``): the trainer's whole step (a real ``train()`` run: loader,
   noise draw, U-Net forward/backward, gradient clipping, AdamW, EMA, logging, checkpoint check,
   stop-flag agreement), timed between its log lines, against the U-Net forward + backward +
   optimizer step alone (the same model, optimizer and batch on tensors already in memory).
   The two are run in alternation, ``--rounds`` times, in one process; medians.

Prints figures; asserts nothing about time. Steps are timed one by one; medians are reported.
Run with OMP_NUM_THREADS=1 on a shared machine.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from latentforge.data import schema
from latentforge.data.loader import LoaderConfig, StreamConfig, build_loader
from latentforge.models.unet import UNetConfig, build_unet
from latentforge.plan.flops import measured_cpu_peak_flops, train_flops_per_image
from latentforge.train.ema import EMAConfig
from latentforge.train.trainer import PhaseConfig, Trainer, TrainConfig


def write_latent_dataset(root: Path, num: int, latent: tuple[int, int, int], text: tuple[int, int]) -> dict:
    rng = np.random.default_rng(0)
    columns = {"key": "str", "caption": "str",
               "latent_mean": schema.ndarray_type("float16", latent),
               "latent_std": schema.ndarray_type("float16", latent),
               "text_hidden": schema.ndarray_type("float16", text)}
    rows = [{"key": str(i), "caption": "x", "latent_mean": rng.standard_normal(latent).astype(np.float16),
             "latent_std": np.full(latent, 0.1, np.float16), "text_hidden": rng.standard_normal(text).astype(np.float16)}
            for i in range(num)]
    shards = [schema.write_shard(root / f"shard-{i:06d}.parquet", rows[i::4], columns) for i in range(4)]
    meta = {"vae": {"scaling_factor": 1.0, "fingerprint": "bench"}, "text_encoder": {"fingerprint": "bench"},
            "resolution": latent[1] * 8}
    schema.write_index(root, schema.DatasetIndex("latent", columns, shards, meta))
    return meta


def time_trainer(unet_cfg: UNetConfig, data: Path, meta: dict, batch: int, steps: int, warmup: int,
                 run_dir: Path) -> list[float]:
    """Seconds per step of the real trainer step, batches read from the loader inside the timing."""
    cfg = TrainConfig(unet=unet_cfg, micro_batch_size=batch, ema=EMAConfig(decay=0.999),
                      phases=[PhaseConfig(steps=steps + warmup, datasets=[StreamConfig(path=str(data))])],
                      loggers=[])
    torch.manual_seed(0)
    model = build_unet(unet_cfg)
    loader_cfg = LoaderConfig(datasets=[StreamConfig(path=str(data))], num_workers=0, cache_dir=str(run_dir / "cache"))
    trainer = Trainer(cfg, model, lambda i, m: build_loader(loader_cfg, m), run_dir, meta, progress=False)
    it = iter(trainer.make_loader(0, batch))
    times = []
    for step in range(steps + warmup):
        t0 = time.perf_counter()
        trainer.train_step([next(it)])
        trainer.ema.update(model, step)
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def part_a(args, tmp: Path) -> None:
    peak = measured_cpu_peak_flops()
    print(f"\nA. training step of the presets (fp32, eager, batch as shown); CPU fp32 matmul peak measured "
          f"{peak / 1e9:.0f} GFLOP/s")
    print(f"{'preset':8s} {'params':>11s} {'latent':>9s} {'batch':>5s} {'ms/step':>9s} {'img/s':>8s} "
          f"{'GFLOP/img':>10s} {'MFU':>6s}")
    for preset, latent, batch in (("tiny", (4, 16, 16), 32), ("small", (4, 32, 32), 4)):
        text = (77, 384)
        ucfg = UNetConfig(preset=preset, in_channels=latent[0], out_channels=latent[0], sample_size=latent[1],
                          cross_attention_dim=text[1])
        data = tmp / f"lat-{preset}"
        meta = write_latent_dataset(data, batch * (args.steps + args.warmup) + batch, latent, text)
        times = time_trainer(ucfg, data, meta, batch, args.steps, args.warmup, tmp / f"run-{preset}")
        med = statistics.median(times)
        flops = train_flops_per_image(ucfg, latent[1], text[0])
        rate = batch / med
        params = sum(p.numel() for p in build_unet(ucfg).parameters())
        print(f"{preset:8s} {params:11,d} {'x'.join(map(str, latent)):>9s} {batch:5d} {med * 1e3:9.0f} {rate:8.1f} "
              f"{flops / 1e9:10.3f} {rate * flops / peak:6.1%}   (spread {min(times) * 1e3:.0f}-{max(times) * 1e3:.0f} ms)")


def part_b(args, tmp: Path) -> None:
    from latentforge.data.encode import encode_dataset
    from latentforge.data.ingest import ingest
    from latentforge.data.synth import generate
    from latentforge.demo import builtin_text_encoder
    from latentforge.models.autoencoder import build_vae
    from latentforge.models.text import encode_text, load_text_encoder
    from latentforge.recipe import load_recipe
    from measured_unet import RUN13_UNET

    recipe = load_recipe("tiny-cpu", RUN13_UNET)
    batch = recipe.train.micro_batch_size
    num = batch * (args.steps + args.warmup + 1)
    generate(tmp / "synth", replace(recipe.synth, num=num, num_heldout=0), progress=False)
    ingest([str(tmp / "synth" / "train")], tmp / "raw", replace(recipe.ingest, num_workers=1), progress=False)
    vae = build_vae(recipe.vae.model)  # untrained weights: the cost is what is measured
    vae.register_to_config(scaling_factor=0.5)
    vae.save_pretrained(tmp / "vae")
    text_dir = builtin_text_encoder()
    enc = replace(recipe.encode, vae=str(tmp / "vae"), text_encoder=text_dir)
    encode_dataset(str(tmp / "raw"), str(tmp / "latents"), enc, progress=False)
    index = schema.read_index(str(tmp / "latents"))
    latent_shape = schema.parse_ndarray(index.columns["latent_mean"])[1]
    ucfg = replace(recipe.train.unet, in_channels=latent_shape[0], out_channels=latent_shape[0],
                   sample_size=latent_shape[1], cross_attention_dim=384)
    ours = time_trainer(ucfg, tmp / "latents", index.meta, batch, args.steps, args.warmup, tmp / "run-ours")

    # The usual way: everything on the fly, Python-loop EMA.
    torch.manual_seed(0)
    unet = build_unet(ucfg)
    ema = [p.detach().clone() for p in unet.parameters()]
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    text_model, tokenizer = load_text_encoder(text_dir)
    vae.eval().requires_grad_(False)
    rows = schema.read_shard(str(tmp / "raw" / schema.read_index(str(tmp / "raw")).shards[0].name)).to_pylist()
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    theirs = []
    for step in range(args.steps + args.warmup):
        t0 = time.perf_counter()
        sel = [rows[(step * batch + i) % len(rows)] for i in range(batch)]
        pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(io.BytesIO(r["image"])).convert("RGB")).copy())
                              for r in sel]).permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.no_grad():
            latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
            hidden = encode_text(text_model, tokenizer, [r["caption"] for r in sel], enc.max_length)["text_hidden"].clone()
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (batch,))
        pred = unet(sched.add_noise(latents, noise, t), t, encoder_hidden_states=hidden).sample
        loss = torch.nn.functional.mse_loss(pred, noise)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema, unet.parameters()):  # the Python-loop EMA
                e.mul_(0.999).add_(p.detach(), alpha=0.001)
        theirs.append(time.perf_counter() - t0)
    theirs = theirs[args.warmup:]
    o, t = batch / statistics.median(ours), batch / statistics.median(theirs)
    print(f"\nB. the demo's model ({sum(p.numel() for p in unet.parameters()):,} params, latents "
          f"{'x'.join(map(str, latent_shape))}, MiniLM text, batch {batch}), fp32 eager, same run")
    print(f"   latentforge (precomputed latents + text, foreach EMA): {o:7.1f} img/s")
    print(f"   on-the-fly VAE + text encoder, Python-loop EMA:        {t:7.1f} img/s")
    print(f"   ratio ours/theirs: {o / t:.2f}x")


def part_c(args, tmp: Path) -> None:
    import json

    from latentforge.config import from_dict, to_dict
    from latentforge.train.optim import build_optimizer
    from latentforge.train.run import RunConfig, train

    batch, latent, text = 32, (4, 16, 16), (77, 384)
    ucfg = UNetConfig(preset="tiny", in_channels=latent[0], out_channels=latent[0], sample_size=latent[1],
                      cross_attention_dim=text[1])
    log_every, steps = 10, args.overhead_steps
    data = tmp / "lat-overhead"
    write_latent_dataset(data, batch * steps, latent, text)
    tcfg = TrainConfig(unet=ucfg, micro_batch_size=batch, ema=EMAConfig(decay=0.999), log_every=log_every,
                       phases=[PhaseConfig(steps=steps, datasets=[StreamConfig(path=str(data))])], loggers=[])
    params = sum(p.numel() for p in build_unet(ucfg).parameters())

    def trainer_ms(r: int) -> list[float]:
        cfg = from_dict(RunConfig, {"train": to_dict(tcfg), "data": {"num_workers": 0, "cache_dir": str(tmp / "c")}})
        cfg.train.sampling.prompts, cfg.train.eval.every_steps = [], 0
        run = tmp / f"run-overhead-{r}"
        train(cfg, run, progress=False)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [1e3 * batch / x["img_per_s"] for x in lines[1:]]  # each over log_every steps; the first warms up

    def bare_ms() -> list[float]:
        torch.manual_seed(0)
        model = build_unet(ucfg).train()
        opt = build_optimizer(model.parameters(), tcfg.optim, "cpu")
        x = torch.randn(batch, *latent)
        hidden = torch.randn(batch, *text)
        t = torch.randint(0, 1000, (batch,))
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x, t, encoder_hidden_states=hidden).sample, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(1e3 * (time.perf_counter() - t0))
        return out[log_every:]

    print(f"\nC. step overhead: tiny U-Net ({params:,} params), latents {'x'.join(map(str, latent))}, text "
          f"{text[0]}x{text[1]}, batch {batch}, fp32, {torch.get_num_threads()} thread(s); the trainer timed over "
          f"windows of {log_every} steps (its log lines), the bare step one by one")
    whole, bare = [], []
    for r in range(args.rounds):
        whole += trainer_ms(r)
        bare += bare_ms()
        w, b = statistics.median(whole), statistics.median(bare)
        print(f"   after round {r}: trainer step {w:.1f} ms, bare U-Net fwd+bwd+AdamW {b:.1f} ms")
    w, b = statistics.median(whole), statistics.median(bare)
    print(f"C. trainer's whole step {w:.1f} ms, U-Net forward+backward+optimizer alone {b:.1f} ms: "
          f"overhead {w - b:.1f} ms = {(w - b) / w:.1%} of the step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-baseline", action="store_true", help="only part A")
    ap.add_argument("--only-baseline", action="store_true", help="only part B")
    ap.add_argument("--overhead", action="store_true", help="only part C, the step overhead")
    ap.add_argument("--overhead-steps", type=int, default=60, help="steps per run of part C")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of part C")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        if args.overhead:
            part_c(args, Path(tmp))
            return
        if not args.only_baseline:
            part_a(args, Path(tmp))
        if not args.skip_baseline:
            part_b(args, Path(tmp))


if __name__ == "__main__":
    main()
