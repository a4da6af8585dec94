"""The memory planner: its breakdown, its scaling with ranks, a measured step on CPU, and
``micro_batch_size: auto``; ``latentforge bench`` writes what ``plan`` reads."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import latentforge
from latentforge.cli import main
from latentforge.errors import ConfigError
from latentforge.models.unet import UNetConfig, unet_diffusers_config, unet_num_params
from latentforge.train.memory import (GIB, MemoryConfig, device_bytes_needed, estimate_memory, largest_micro_batch,
                                      resolve_auto_micro_batch)
from latentforge.train.trainer import PhaseConfig, TrainConfig, phase_batches
from latent_fixtures import latent_data  # noqa: F401  (session fixture)

PARTS = ("weights", "weight_copies", "gradients", "ddp_buckets", "optimizer", "ema", "activations", "fsdp_gather")
SMALL = UNetConfig(preset="small")


def test_breakdown_sums_and_bytes_per_parameter():
    n = unet_num_params(SMALL)
    fp32 = estimate_memory(MemoryConfig(unet=SMALL, latent_size=16, precision="fp32", micro_batch_size=2))
    assert fp32["total"] == sum(fp32[k] for k in PARTS) and fp32["parameters"] == n
    assert (fp32["weights"], fp32["gradients"], fp32["optimizer"], fp32["ema"]) == (4 * n, 4 * n, 8 * n, 4 * n)
    assert fp32["weight_copies"] == 0 and fp32["activations"] == 2 * fp32["activations_per_sample"]
    bf16 = estimate_memory(MemoryConfig(unet=SMALL, latent_size=16, precision="bf16", micro_batch_size=2))
    assert bf16["weight_copies"] == pytest.approx(2 * n, rel=0.01)  # autocast's bf16 copy of every weight
    assert bf16["activations"] < fp32["activations"]
    pure = estimate_memory(MemoryConfig(unet=SMALL, latent_size=16, precision="bf16-weights", optimizer="adamw8bit",
                                        ema="cpu"))
    assert (pure["weights"], pure["gradients"], pure["optimizer"], pure["ema"]) == (2 * n, 2 * n, 6 * n, 0)
    muon = estimate_memory(MemoryConfig(unet=SMALL, latent_size=16, precision="fp32", micro_batch_size=2,
                                        optimizer="muon"))
    assert muon["optimizer"] == fp32["optimizer"] == 8 * n  # counted as AdamW's: an upper bound
    ckpt = estimate_memory(MemoryConfig(unet=SMALL, latent_size=16, precision="fp32", activation_checkpointing=True))
    assert 0 < ckpt["activations_per_sample"] < 0.6 * fp32["activations_per_sample"]
    # activations grow with the latent area (most of them are full-resolution feature maps)
    big = estimate_memory(MemoryConfig(unet=SMALL, latent_size=32, precision="fp32"))
    assert 3.0 < big["activations_per_sample"] / fp32["activations_per_sample"] < 5.0


def test_fsdp_and_world_size_scaling():
    base = MemoryConfig(unet=SMALL, latent_size=16, precision="fp32", micro_batch_size=4)
    one = estimate_memory(base)
    ddp = estimate_memory(replace(base, world_size=8))
    assert ddp["ddp_buckets"] == ddp["gradients"] == one["gradients"] and ddp["weights"] == one["weights"]
    zero2 = estimate_memory(replace(base, parallel="fsdp-grad-op", world_size=8))
    assert zero2["gradients"] == one["gradients"] // 8 and zero2["optimizer"] == one["optimizer"] // 8
    assert zero2["weights"] == one["weights"] and zero2["ddp_buckets"] == 0
    zero3 = estimate_memory(replace(base, parallel="fsdp-full", world_size=8))
    assert zero3["weights"] == one["weights"] // 8 and zero3["ema"] == one["ema"] // 8
    assert 0 < zero3["fsdp_gather"] < one["weights"]  # two blocks' weights, not the whole model
    assert zero3["activations"] == one["activations"]  # data parallel: activations are per rank
    assert zero3["total"] < zero2["total"] < one["total"] < ddp["total"]


def test_sd2_base_fits_where_expected_and_the_largest_micro_batch():
    sd2 = MemoryConfig(unet=UNetConfig(preset="sd2-base"), latent_size=64, precision="bf16")
    est = estimate_memory(sd2)
    assert 17 * GIB < est["total"] - est["activations"] < 19 * GIB  # 866M params x (4+2+4+8+4) B
    assert device_bytes_needed(est["total"]) < 40 * GIB
    assert device_bytes_needed(est["total"]) > 16 * GIB  # full AdamW + EMA does not fit a 16 GB card
    m80 = largest_micro_batch(sd2, 80 * GIB)
    assert m80 > largest_micro_batch(sd2, 40 * GIB) > 1
    assert device_bytes_needed(estimate_memory(replace(sd2, micro_batch_size=m80))["total"]) <= 80 * GIB
    assert device_bytes_needed(estimate_memory(replace(sd2, micro_batch_size=m80 + 1))["total"]) > 80 * GIB


def test_plan_memory_cli(capsys):
    assert main(["plan", "--memory", "--recipe", "sd2-base", "--resolution", "512", "--micro-batch", "4",
                 "--gpu-memory", "24", "--optimizer", "adamw8bit", "--ema", "cpu", "--activation-checkpointing",
                 "--precision", "bf16", "--chart", ""]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "activations" in out and "fits in 24 GB" in out and "largest micro batch" in out
    assert main(["plan", "--memory", "--recipe", "sd2-base", "--gpu-memory", "8", "--micro-batch", "8"]) == 0
    assert "does NOT fit in 8 GB" in capsys.readouterr().out


def test_auto_micro_batch_keeps_the_global_batch():
    cfg = TrainConfig(unet=UNetConfig(preset="tiny"), micro_batch_size="auto", global_batch_size=32, ema=None,
                      phases=[PhaseConfig(steps=1, datasets=[])])
    cfg.validate()
    mem = MemoryConfig(unet=cfg.unet, latent_size=8, text_len=8, precision="fp32", ema="off")
    # room for a micro batch of 5 but not 6: the largest divisor of 32 below that is 4
    budget = (estimate_memory(replace(mem, micro_batch_size=5))["total"], False, "test budget")
    out = resolve_auto_micro_batch(cfg, [(8, 8)], torch.device("cpu"), 1, budget=budget)
    assert out.phases[0].micro_batch_size == 4 and out.micro_batch_size == 4
    assert phase_batches(out, 1) == [(4, 8, 32)]  # 4 x 8 accumulation x 1 rank = 32
    two_ranks = resolve_auto_micro_batch(cfg, [(8, 8)], torch.device("cpu"), 2, budget=budget)
    (micro, accum, global_), = phase_batches(two_ranks, 2)
    assert micro * accum * 2 == global_ == 32 and micro <= 4  # DDP's gradient buckets need room too
    with pytest.raises(ConfigError,
                       match="micro_batch_size: auto keeps the global batch by accumulation: set global_batch_size"):
        TrainConfig(micro_batch_size="auto", phases=[PhaseConfig(steps=1)]).validate()

    # The run's own set-up is sized: activation checkpointing leaves room for larger micro batches
    # in the same budget, and a fine-tuned pipeline's unet/config.json sizes like the same preset.
    ckpt_cfg = replace(cfg, global_batch_size=64, parallel=replace(cfg.parallel, activation_checkpointing=True))
    plain = resolve_auto_micro_batch(replace(cfg, global_batch_size=64), [(8, 8)], torch.device("cpu"), 1, budget=budget)
    recomputed = resolve_auto_micro_batch(ckpt_cfg, [(8, 8)], torch.device("cpu"), 1, budget=budget)
    assert recomputed.micro_batch_size > plain.micro_batch_size
    as_dict = {"_class_name": "UNet2DConditionModel", **unet_diffusers_config(cfg.unet)}
    from_dir = resolve_auto_micro_batch(cfg, [(8, 8)], torch.device("cpu"), 1, budget=budget, unet=as_dict)
    assert from_dir.micro_batch_size == out.micro_batch_size


def _run(args, cwd):
    src = str(Path(latentforge.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "latentforge", *args], capture_output=True, text=True, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_bench_writes_json_that_plan_reads_and_the_planner_matches_the_measured_memory(tmp_path, monkeypatch, capsys):
    # The tiny preset on 16x16 latents, micro batch 64, fp32, EMA on: a fresh process, so the RSS
    # high-water mark is this run's alone. Its datasets do not exist: bench uses synthetic batches.
    tiny = ["train.unet.block_out_channels=null", "train.unet.attention_head_dim=null",
            "train.unet.norm_num_groups=null", "train.unet.down_block_types=null", "train.unet.up_block_types=null"]
    out = _run(["bench", "--recipe", "tiny-cpu", "--steps", "1", "--warmup", "0", "--out", "bench.json",
                "train.micro_batch_size=64", *tiny], tmp_path)
    assert "synthetic" in out and "MFU" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    row = data["phases"][0]
    assert data["synthetic"] and row["latent_size"] == 16 and row["img_per_s_per_device"] > 0 and row["mfu"] > 0
    pred, allocated, rss = row["predicted_memory_bytes"], row["peak_memory_bytes"], row["peak_rss_bytes"]
    print(f"memory planner vs measured, tiny preset, micro batch 64: predicted {pred / 2**20:.1f} MiB, live tensors "
          f"{allocated / 2**20:.1f} MiB ({100 * (pred / allocated - 1):+.0f}%), RSS {rss / 2**20:.1f} MiB "
          f"({100 * (pred / rss - 1):+.0f}%)")
    assert abs(pred / allocated - 1) < 0.2
    # The RSS adds about 60 MiB of allocator and library buffers the planner does not model: a
    # large share at this size (measured -33%), a small one for the small preset (-2%).
    assert abs(pred / rss - 1) < 0.45
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--recipe", "tiny-cpu", "--throughput", "bench.json", "--gpus", "1,2", "--gpu", "t4",
                 "--chart", "", "train.global_batch_size=64"]) == 0
    plan = capsys.readouterr().out
    assert "measured by bench on cpu" in plan and "shapes-32px" in plan


def test_bench_times_the_step_through_the_recipes_parallel_wrappers(monkeypatch, capsys, tmp_path):
    """bench applies what one process of ``train`` applies (here activation checkpointing: every
    U-Net block's forward replaced), and refuses a setting that needs a process group in one line."""
    from latentforge.distributed import parallelize as par
    from latentforge.plan.bench import run_bench
    from latentforge.recipe import load_recipe

    seen = []

    def spy(model, cfg, world, device):
        out = real(model, cfg, world, device)
        seen.append((cfg.activation_checkpointing, [b.forward.__name__ for b in par.unet_blocks(model)]))
        return out

    real = par.parallelize
    monkeypatch.setattr(par, "parallelize", spy)
    recipe = load_recipe("tiny-cpu", ["train.parallel.activation_checkpointing=true", "train.micro_batch_size=4"])
    row, = run_bench(recipe, steps=1, warmup=0, synthetic=True, progress=False)["phases"]
    assert row["step_seconds"]["median"] > 0
    (checkpointing, forwards), = seen
    assert checkpointing and forwards and set(forwards) == {"run"}, forwards  # _checkpointed's wrapper
    code = main(["bench", "--recipe", "tiny-cpu", "--steps", "1", "train.parallel.strategy=fsdp",
                 "train.parallel.cpu_offload=true"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "needs a process group" in err, err
    # Refused before any step is timed: contradicting flags, an output the result could not be written to.
    # (run 45's probe: --out naming the recipe itself overwrote it with the JSON; a new directory's name was
    # found only after the run, a name too long for the file system was a traceback)
    for args, needle in ((["--synthetic", "--real-data"], "--synthetic and --real-data contradict each other"),
                         (["--out", str(tmp_path)], "is a directory; give a file name"),
                         (["--out", str(tmp_path / "new") + "/"], "is a directory; give a file name"),
                         (["--out", str(tmp_path / "mine.yaml")], "mine.yaml: give a file ending in .json"),
                         (["--out", str(tmp_path / ("x" * 300 + ".json"))], "File name too long"),
                         # were timed as full training of the from-scratch denoiser, without a word
                         (["train.init_from=somewhere"], "does not read train.init_from; leave it out"),
                         (["train.lora={}"], "not LoRA adapters on a frozen one")):
        assert main(["bench", "--recipe", "tiny-cpu", "--steps", "1", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


def test_train_with_auto_micro_batch_accumulates_to_the_global_batch(latent_data, tmp_path, monkeypatch, caplog):
    from latentforge.config import from_dict, load_config
    from latentforge.train import memory
    from latentforge.train.run import TRAIN_CONFIG, RunConfig, train

    text_len = 8  # latent_fixtures.TEXT_LEN
    unet = UNetConfig(preset="tiny", in_channels=4, out_channels=4, cross_attention_dim=16)
    fits_four = estimate_memory(MemoryConfig(unet=unet, latent_size=8, text_len=text_len, micro_batch_size=4,
                                             precision="fp32", ema="off"))["total"]
    monkeypatch.setattr(memory, "device_memory_budget", lambda device: (fits_four, False, "a test budget"))
    cfg = from_dict(RunConfig, {
        "train": {"unet": {"preset": "tiny"}, "ema": None, "micro_batch_size": "auto", "global_batch_size": 16,
                  "phases": [{"datasets": [{"path": str(latent_data["latent16"])}], "steps": 2}],
                  "loggers": [], "log_every": 1},
        "data": {"num_workers": 0, "cache_dir": str(latent_data["cache"])}})
    with caplog.at_level("WARNING", logger="latentforge.train.memory"):
        summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["step"] == 2 and "4 per rank x 4 accumulation x 1 ranks = global batch 16" in caplog.text
    saved = load_config(RunConfig, tmp_path / "run" / TRAIN_CONFIG).train
    assert saved.phases[0].micro_batch_size == 4 and saved.global_batch_size == 16
    samples = [json.loads(line)["samples_seen"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert samples == [16, 32]


def test_cpu_offload_breakdown():
    """Under FSDP2 CPU offload the device keeps gathered blocks, one block's gradients and the
    activations; the fp32 weights, gradients, AdamW state and EMA are host memory."""
    n = unet_num_params(SMALL)
    base = MemoryConfig(unet=SMALL, latent_size=16, precision="bf16-weights", parallel="fsdp-full", cpu_offload=True,
                        activation_checkpointing=True, ema="cpu")
    off = estimate_memory(base)
    assert off["total"] == sum(off[k] for k in PARTS)
    assert off["weights"] == off["optimizer"] == off["ema"] == off["weight_copies"] == 0
    assert 0 < off["fsdp_gather"] < 2 * n  # two bf16 blocks, not the bf16 model
    assert 0 < off["gradients"] < 6 * n  # one block's bf16 gradients and their fp32 copy
    assert (off["host_weights"], off["host_gradients"], off["host_optimizer"], off["host_ema"]) == (4 * n, 4 * n, 8 * n,
                                                                                                    4 * n)
    assert off["host_total"] == 20 * n
    grad_op = estimate_memory(replace(base, parallel="fsdp-grad-op"))
    assert grad_op["weights"] == 2 * n and grad_op["fsdp_gather"] == 0  # every gathered block kept until backward
    on_device = estimate_memory(replace(base, cpu_offload=False))
    assert on_device["optimizer"] == 12 * n and off["total"] < on_device["total"]
    with pytest.raises(ConfigError, match="cpu_offload: is FSDP2's CPU offload"):
        estimate_memory(replace(base, parallel="ddp"))
    with pytest.raises(ConfigError, match="optimizer: adamw8bit does not run on FSDP2"):
        estimate_memory(replace(base, optimizer="adamw8bit"))


def _breakdown(out: str) -> dict[str, float]:
    """The device breakdown lines of ``plan --memory`` (GiB, rounded to 0.01), up to the total."""
    items: dict[str, float] = {}
    for line in out.splitlines()[1:]:
        key, value = line.split()[:2]
        items[key] = float(value)
        if key == "total":
            return items
    raise AssertionError(out)


def test_finetune_8gb_recipe_fits_8gb_only_with_cpu_offload(capsys):
    """The recipe's own train.parallel (fsdp, cpu_offload, bf16, activation checkpointing), micro
    batch, optimizer and EMA are what is planned; it fits 8 GB, and without the offload it does not."""
    from latentforge.plan.report import recipe_memory_setup
    from latentforge.recipe import load_recipe

    recipe = load_recipe("finetune-8gb")
    setup = recipe_memory_setup(recipe)
    assert setup == {"parallel": "fsdp-full", "cpu_offload": True, "activation_checkpointing": True,
                     "precision": "bf16-weights", "optimizer": "adamw", "ema": "off"}
    assert main(["plan", "--memory", "--recipe", "finetune-8gb", "--gpu-memory", "8", "--chart", ""]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert "sd2-base" in head and "latents 64x64" in head and f"micro batch {recipe.train.micro_batch_size}" in head
    assert "CPU offload" in head and "fits in 8 GB" in out and "host_total" in out
    items = _breakdown(out)
    assert {"gradients", "activations", "fsdp_gather"} <= items.keys()
    assert sum(v for k, v in items.items() if k != "total") == pytest.approx(items["total"], abs=0.011 * len(items))
    needs = float(out.split("needs ")[1].split()[0])
    assert needs <= 8.0

    assert main(["plan", "--memory", "--recipe", "finetune-8gb", "--gpu-memory", "8", "--chart", "",
                 "--no-cpu-offload"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit in 8 GB" in out and "CPU offload" not in out.splitlines()[0]
    assert _breakdown(out)["optimizer"] > 6  # 8 B/param of AdamW state on the device


# ------------------------------------------------------------------ LoRA


def _lora_step_peak(unet_cfg: UNetConfig, latent_size: int, micro: int, rank: int) -> int:
    """Peak live tensor bytes of one real CPU training step of a frozen U-Net with LoRA adapters
    (fp32, AdamW on the adapters, its state already made by a first step), counted per storage
    by bench's TensorBytes as every aten op, backward included, creates tensors."""
    from diffusers import UNet2DConditionModel

    from latentforge.plan.bench import TensorBytes
    from latentforge.train.finetune import LoRAConfig

    torch.manual_seed(0)
    kwargs = unet_diffusers_config(unet_cfg)
    model = UNet2DConditionModel(**kwargs)
    model.requires_grad_(False)
    model.add_adapter(LoRAConfig(rank=rank).peft_config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False)
    x = torch.randn(micro, kwargs["in_channels"], latent_size, latent_size)
    text = torch.randn(micro, 77, kwargs["cross_attention_dim"])
    t = torch.randint(0, 1000, (micro,))

    def step() -> None:
        model(x, t, encoder_hidden_states=text).sample.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = TensorBytes()
    for p in model.parameters():
        tracker.add(p)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tracker.add(v)
    with tracker:
        step()
    return tracker.peak


def test_lora_plan_matches_a_measured_cpu_step():
    """The LoRA estimate (frozen base, adapters' gradients and AdamW state, activations measured with
    the base frozen) against the live tensor bytes of a real step; the full fine-tune's estimate of
    the same U-Net is far from it, so the test tells the two apart."""
    tiny = UNetConfig(preset="tiny")
    micro = 8
    measured = _lora_step_peak(tiny, 16, micro, rank=4)
    mem = MemoryConfig(unet=tiny, latent_size=16, text_len=77, micro_batch_size=micro, precision="fp32", ema="off",
                       lora_rank=4)
    lora = estimate_memory(mem)
    full = estimate_memory(replace(mem, lora_rank=0))
    print(f"LoRA step, tiny preset, micro batch {micro}: predicted {lora['total'] / 2**20:.1f} MiB, measured "
          f"{measured / 2**20:.1f} MiB ({100 * (lora['total'] / measured - 1):+.1f}%); as a full fine-tune "
          f"{full['total'] / 2**20:.1f} MiB")
    assert abs(lora["total"] / measured - 1) < 0.1
    assert full["total"] / measured > 1.15
    n, n_lora = lora["parameters"], lora["trained_parameters"]
    assert (lora["weights"], lora["gradients"], lora["optimizer"]) == (4 * n + 4 * n_lora, 4 * n_lora, 8 * n_lora)


def _sd2_lora_parameters(rank: int, targets: tuple[str, ...]) -> int:
    """r x (in + out) per adapted Linear of the sd2-base U-Net, counted on the meta device."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_diffusers_config(UNetConfig(preset="sd2-base")))
    return sum(rank * (m.in_features + m.out_features) for name, m in unet.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name.endswith("." + t) for t in targets))


def test_finetune_lora_8gb_recipe_fits_8gb(capsys):
    """recipes/finetune-lora-8gb.yaml is valid, and the planner prices it as the LoRA run it is
    (adapters trained, frozen bf16 base, activation checkpointing, its micro batch) and fits it in
    the 8 GB its name promises."""
    from latentforge.plan.report import recipe_memory_setup
    from latentforge.recipe import load_recipe

    recipe = load_recipe("finetune-lora-8gb")
    t = recipe.train
    assert t.lora is not None and t.init_from == ""  # finetune --from gives the pipeline
    setup = recipe_memory_setup(recipe)
    assert setup == {"parallel": "ddp", "cpu_offload": False, "activation_checkpointing": True, "precision": "bf16",
                     "optimizer": "adamw", "ema": "same", "lora_rank": t.lora.rank,
                     "lora_target_modules": tuple(t.lora.target_modules), "frozen_dtype": "bfloat16"}
    assert main(["plan", "--memory", "--recipe", "finetune-lora-8gb", "--gpu-memory", "8", "--chart", ""]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    n_lora = _sd2_lora_parameters(t.lora.rank, tuple(t.lora.target_modules))
    assert n_lora == 1_659_904  # the figure docs/finetune.md gives
    assert "sd2-base (865,910,724 parameters)" in head and "latents 64x64" in head
    assert f"micro batch {t.micro_batch_size}" in head and "LoRA rank 8" in head
    assert f"({n_lora:,} trained parameters)" in head and "frozen base bfloat16" in head
    items = _breakdown(out)
    assert sum(v for k, v in items.items() if k != "total") == pytest.approx(items["total"], abs=0.011 * len(items))
    n = 865_910_724
    assert items["weights"] == pytest.approx((2 * n + 4 * n_lora) / GIB, abs=0.006)  # bf16 base + fp32 adapters
    assert items["gradients"] == pytest.approx(4 * n_lora / GIB, abs=0.006)
    assert items["optimizer"] == pytest.approx(8 * n_lora / GIB, abs=0.006)
    assert "fits in 8 GB" in out and float(out.split("needs ")[1].split()[0]) <= 8.0
    largest = int(out.split("largest micro batch that fits: ")[1].split()[0])
    assert largest >= t.micro_batch_size
