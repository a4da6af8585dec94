"""Data-parallel training on 2 CPU processes (gloo) against one process at the same global batch.

The 2-rank runs call ``latentforge train`` (the CLI's ``main``) in 2 processes forked from the test
process with torchrun's environment variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT): forking saves
the ~10 s import of torch + diffusers per process. The resume after the crash runs under
``torchrun -m latentforge train`` itself. All runs train the tiny U-Net on the session's tiny
latent dataset, in fp32 with one intra-op thread per process (forked ranks set it first, as
PyTorch's DataLoader workers do: OpenMP thread pools do not survive a fork).

Tolerances (measured here: losses agree to 1e-7 relative, weights to 8e-7 absolute after 8
steps): the same sum of per-sample gradients is reduced in a different order on 2 ranks, so
results are close, not bitwise equal: per-step losses ``rtol=1e-5``, final model and EMA weights
``atol=1e-5`` (the weights are of order 1). A run resumed on the same number of ranks must equal
the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import latentforge
from latentforge import checkpoint as ckpt
from latentforge.cli import main as cli_main
from latentforge.config import from_dict
from latentforge.distributed.dcp import DCP_DIR, is_sharded_checkpoint
from latentforge.distributed.parallelize import (
    ParallelConfig,
    parallelize,
    resolve_strategy,
    use_low_precision_norms,
)
from latentforge.distributed.env import World
from latentforge.errors import ConfigError
from latentforge.models.unet import UNetConfig, build_unet
from latentforge.train.run import RunConfig, train
from latentforge.train.trainer import TrainConfig
from latentforge.train.validation import VAL_LOG
from latent_fixtures import latent_data  # noqa: F401  (session fixture)

STEPS = 8  # checkpoints every 3: at 3, 6 and 8
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def recipe(data: dict[str, Path], strategy: str, **parallel: Any) -> dict[str, Any]:
    """A recipe (train + loader sections) as ``latentforge train --recipe`` reads it: global
    batch 8 (micro 4 x 2 accumulation steps on one rank, micro 4 x 2 ranks), EMA, clipping that
    binds (grad norms are 0.25-0.8), caption dropout."""
    return {
        "train": {
            "seed": 3, "unet": {"preset": "tiny"}, "noise": {"prediction_type": "v_prediction"},
            "min_snr_gamma": 5.0, "offset_noise": 0.1,
            "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 0.3},
            "ema": {"decay": 0.9},
            "phases": [{"datasets": [{"path": str(data["latent16"])}], "steps": STEPS}],
            "micro_batch_size": 4, "global_batch_size": 8, "log_every": 1,
            "checkpoint": {"every_steps": 3, "keep_last": 20}, "loggers": [],
            "parallel": {"strategy": strategy, **parallel},
            # A grid at the end: under FSDP2 rank 0 draws it from the consolidated checkpoint.
            "sampling": {"prompts": ["a red circle"], "num_steps": 2},
            # The validation loss at steps 4 and 8: 7 samples, so that 2 ranks pad their shares.
            "val": {"data": str(data["latent16"]), "every_steps": 4, "num_samples": 7, "num_timesteps": 3,
                    "batch_size": 2},
        },
        "loader": {"seed": 1, "caption_dropout": 0.2, "num_workers": 0, "shuffle_window_shards": 2,
                   "cache_dir": str(data["cache"])},
    }


def write_recipe(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc -m latentforge ARGS``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(latentforge.__file__).parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "latentforge", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _rank_main(rank: int, world_size: int, port: int, args: list[str], crash: bool) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if crash and rank == 0:
        # SIGKILL the checkpoint writer in the middle of its second checkpoint: after every rank's
        # DCP shards and the consolidated model/ema files, before state.pt, meta.json and COMPLETE.
        import safetensors.torch

        save_file, num_files = safetensors.torch.save_file, [0]

        def dying_save_file(*a, **k):
            save_file(*a, **k)
            num_files[0] += 1
            if num_files[0] == 4:  # model + ema of the first checkpoint, model + ema of the second
                os.kill(os.getpid(), signal.SIGKILL)

        safetensors.torch.save_file = dying_save_file
    code = cli_main(args)
    if code:
        sys.exit(code)


def run_ranks(args: list[str], world_size: int = 2, crash: bool = False) -> None:
    """``latentforge ARGS`` on ``world_size`` forked ranks; raises if a rank fails (the others are
    then terminated, as torchrun does)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(world_size, port, args, crash), nprocs=world_size, start_method="fork")


def train_cmd(run_dir: Path, recipe_path: Path) -> list[str]:
    return ["train", str(run_dir), "--recipe", str(recipe_path), "--quiet"]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    timed = ("img_per_s", "mfu")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timed} for line in lines]


def validations(run_dir: Path) -> list[dict[str, Any]]:
    timed = ("seconds", "train_seconds")
    lines = (run_dir / VAL_LOG).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timed} for line in lines]


def final(run_dir: Path) -> ckpt.Checkpoint:
    return ckpt.load_checkpoint(ckpt.find_latest(run_dir))


def assert_close_runs(ref: Path, other: Path) -> None:
    """Same steps, cursor and LR; losses and grad norms within LOSS_RTOL; final weights within WEIGHT_ATOL."""
    ma, mb = metrics(ref), metrics(other)
    assert [r["step"] for r in mb] == [r["step"] for r in ma] == list(range(1, STEPS + 1))
    for ra, rb in zip(ma, mb):
        assert rb["samples_seen"] == ra["samples_seen"] and rb["lr"] == ra["lr"], (ra, rb)
        for key in ("loss", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=LOSS_RTOL), (key, ra, rb)
    a, b = final(ref), final(other)
    assert a.step == b.step == STEPS
    for group in ("model", "ema"):
        assert a.tensors[group].keys() == b.tensors[group].keys()
        for k, t in a.tensors[group].items():
            torch.testing.assert_close(b.tensors[group][k], t, atol=WEIGHT_ATOL, rtol=0, msg=f"{group} {k}")


@pytest.fixture(scope="module")
def runs(latent_data, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """The reference (one process, in this process) and the DDP and FSDP2 runs (torchrun, 2 ranks)."""
    root = tmp_path_factory.mktemp("dist")
    out = {"root": root}
    for strategy in ("none", "ddp", "fsdp"):
        cfg = recipe(latent_data, strategy)
        out[f"{strategy}.yaml"] = write_recipe(root / f"{strategy}.yaml", cfg)
        out[strategy] = root / f"run-{strategy}"
        if strategy == "none":
            train(from_dict(RunConfig, {"train": cfg["train"], "data": cfg["loader"]}), out[strategy], progress=False)
        else:
            run_ranks(train_cmd(out[strategy], out[f"{strategy}.yaml"]))
    return out


def test_ddp_matches_one_process(runs):
    assert_close_runs(runs["none"], runs["ddp"])
    assert not is_sharded_checkpoint(ckpt.find_latest(runs["ddp"]))  # DDP keeps the single-file format


def test_fsdp_matches_one_process(runs):
    assert_close_runs(runs["none"], runs["fsdp"])
    latest = ckpt.find_latest(runs["fsdp"])
    assert is_sharded_checkpoint(latest)
    assert sorted(p.name for p in (latest / DCP_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert final(runs["fsdp"]).meta["sharded"] is True
    grids = sorted(p.name for p in (runs["fsdp"] / "samples").iterdir())
    assert grids == [f"step-{STEPS:08d}.png"]


def test_validation_loss_under_ddp_and_fsdp_matches_one_process(runs):
    """Each rank denoises its share of the 7 held-out samples (4 and 3, the short one padded);
    the all-reduced figures are the one-process run's."""
    ref = validations(runs["none"])
    assert [r["step"] for r in ref] == [4, 8] and all(r["num_samples"] == 7 and r["ema"] for r in ref)
    for strategy in ("ddp", "fsdp"):
        other = validations(runs[strategy])
        assert [r["step"] for r in other] == [4, 8]
        for a, b in zip(ref, other):
            for key in ("loss_by_t", "loss_uncond_by_t"):
                assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL), (strategy, key)


def test_fsdp_consolidated_weights_equal_the_shards(runs):
    """model.safetensors / ema.safetensors of an FSDP checkpoint hold exactly the values of the
    DCP shards, load into a plain U-Net, and the sample path loads them."""
    import torch.distributed.checkpoint as dcp

    from latentforge.inference import load_components

    c = final(runs["fsdp"])
    cfg = from_dict(RunConfig, yaml.safe_load((runs["fsdp"] / "train_config.yaml").read_text()))
    plain = build_unet(cfg.train.unet)
    plain.load_state_dict(c.tensors["model"])  # strict: same keys, no wrapper prefixes
    shards = {f"{g}.{k}": torch.empty_like(t) for g in ("model", "ema") for k, t in c.tensors[g].items()}
    dcp.load(shards, storage_reader=dcp.FileSystemReader(c.path / DCP_DIR))
    for g in ("model", "ema"):
        for k, t in c.tensors[g].items():
            assert torch.equal(shards[f"{g}.{k}"], t), f"{g} {k}"
    assert not torch.equal(c.tensors["model"]["conv_in.weight"], c.tensors["ema"]["conv_in.weight"])
    comps = load_components(runs["fsdp"])
    assert comps.weights == "ema"
    assert torch.equal(comps.unet.state_dict()["conv_in.weight"], c.tensors["ema"]["conv_in.weight"])


def test_fsdp_crash_mid_checkpoint_then_resume(runs, tmp_path):
    """Rank 0 is SIGKILLed while writing the step-6 checkpoint: only a .tmp leftover remains, the
    newest complete checkpoint is step 3, and rerunning under torchrun with --resume auto finishes
    a run equal, bit for bit, to the uninterrupted one. A copy of the crashed run resumed on ONE
    process (DCP re-shards the 2-rank checkpoint into a plain model) equals the one-process run
    within the tolerances."""
    import torch.multiprocessing as mp

    run = tmp_path / "run"
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        run_ranks(train_cmd(run, runs["fsdp.yaml"]), crash=True)
    root = run / ckpt.CHECKPOINTS
    assert sorted(d.name for d in root.iterdir() if ".tmp-" not in d.name) == ["step-00000003"]
    leftovers = [d for d in root.iterdir() if ".tmp-" in d.name]
    assert len(leftovers) == 1 and (leftovers[0] / "ema.safetensors").exists()  # half-written, ignored
    assert (leftovers[0] / DCP_DIR / ".metadata").exists() and not (leftovers[0] / ckpt.MARKER).exists()
    assert ckpt.find_latest(run).name == "step-00000003"
    one_rank = tmp_path / "run-1rank"
    shutil.copytree(run, one_rank)

    p = torchrun(train_cmd(run, runs["fsdp.yaml"]) + ["--resume", "auto"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("train: finished") == 1, p.stdout  # only rank 0 prints
    assert metrics(run) == metrics(runs["fsdp"])
    assert validations(run) == validations(runs["fsdp"])  # step 4's, logged before the crash, dropped and redone
    a, b = final(runs["fsdp"]), final(run)
    assert b.step == STEPS and b.meta["loader"] == a.meta["loader"]
    for group in ("model", "ema"):
        assert all(torch.equal(a.tensors[group][k], t) for k, t in b.tensors[group].items()), group
    assert not [d for d in root.iterdir() if "." in d.name]  # the dead writer's leftover was removed

    cfg = yaml.safe_load(runs["fsdp.yaml"].read_text())
    train(from_dict(RunConfig, {"train": cfg["train"], "data": cfg["loader"]}), one_rank, progress=False)
    assert_close_runs(runs["none"], one_rank)


def test_single_file_checkpoint_refused_by_sharded_load(runs):
    """A DDP (single-file) checkpoint cannot seed an FSDP2 resume: its optimizer state is keyed by
    parameter index. The error names the way out."""
    from latentforge.distributed.dcp import load_sharded
    from latentforge.errors import UserError
    from latentforge.train.optim import OptimConfig, build_optimizer

    model = build_unet(UNetConfig(preset="tiny", in_channels=4, out_channels=4, cross_attention_dim=16))
    optimizer = build_optimizer(model.parameters(), OptimConfig(), "cpu")
    with pytest.raises(UserError, match="has no dcp/.*parallel.strategy=ddp"):
        load_sharded(ckpt.find_latest(runs["ddp"]), model, optimizer, None)


@pytest.mark.parametrize("parallel, world_size, match", [
    ({"strategy": "zero3"}, 1, "parallel.strategy: must be one of"),
    ({"strategy": "ddp", "mixed_precision": "bf16"}, 2, "parallel.mixed_precision: .*train.precision=bf16"),
    ({"strategy": "auto", "reshard_after_forward": True}, 2, "parallel.reshard_after_forward"),
    ({"strategy": "none"}, 2, "parallel.strategy: none with 2 ranks"),
])
def test_bad_parallel_config(parallel, world_size, match):
    with pytest.raises(ConfigError, match=match):
        cfg = from_dict(TrainConfig, {"parallel": parallel})
        cfg.validate()
        resolve_strategy(cfg.parallel, world_size)


def test_bad_parallel_config_on_the_command_line(runs, tmp_path, capsys):
    code = cli_main(train_cmd(tmp_path / "run", runs["none.yaml"]) + ["train.parallel.mixed_precision=bf16"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.mixed_precision" in err[0]
    assert not (tmp_path / "run").exists()


def test_fsdp_sample_grids_need_checkpoint_steps(latent_data, tmp_path):  # noqa: F811
    """Under FSDP2 grids come from checkpoints: a grid step without a checkpoint fails up front
    (checked before any process group is needed, so a World of 2 without one suffices)."""
    cfg = recipe(latent_data, "fsdp")
    cfg["train"]["sampling"]["every_steps"] = 2  # checkpoints every 3
    with pytest.raises(ConfigError, match="train.sampling.every_steps: 2 is not a multiple"):
        train(from_dict(RunConfig, {"train": cfg["train"], "data": cfg["loader"]}), tmp_path / "run",
              world=World(rank=0, world_size=2), progress=False)
    assert not (tmp_path / "run").exists()


def test_strategy_resolution():
    assert resolve_strategy(ParallelConfig(), 1) == "none"
    assert resolve_strategy(ParallelConfig(), 4) == "ddp"
    assert resolve_strategy(ParallelConfig(strategy="fsdp"), 1) == "none"  # nothing to shard over
    assert resolve_strategy(ParallelConfig(strategy="fsdp", mixed_precision="bf16"), 2) == "fsdp"


def _tiny_unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_unet(UNetConfig(preset="tiny", in_channels=4, out_channels=4, cross_attention_dim=16))


def _loss_and_grads(model, train_model):
    g = torch.Generator().manual_seed(1)
    x, hidden = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 8, 16, generator=g)
    t = torch.tensor([10, 500])
    loss = train_model(x, t, encoder_hidden_states=hidden, return_dict=False)[0].square().mean()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_activation_checkpointing_keeps_keys_loss_and_gradients():
    """Checkpointed blocks recompute their activations: the same loss and gradients (bitwise), the
    same parameter names, and SDPA attention processors."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    ref = _tiny_unet()
    loss_ref, grads_ref = _loss_and_grads(ref, ref)
    model = _tiny_unet()
    keys = list(model.state_dict())
    train_model, no_sync = parallelize(model, ParallelConfig(activation_checkpointing=True), World(),
                                       torch.device("cpu"))
    assert train_model is model and no_sync is None
    assert list(model.state_dict()) == keys
    assert all(isinstance(p, AttnProcessor2_0) for p in model.attn_processors.values())
    loss, grads = _loss_and_grads(model, train_model)
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(grads[k], g) for k, g in grads_ref.items())


def test_low_precision_norms():
    """Under bf16 autocast the norms run in bf16 (autocast alone gives fp32 outputs); without
    autocast they are the unchanged fp32 norms."""
    torch.manual_seed(0)
    norms = torch.nn.Sequential(torch.nn.GroupNorm(4, 16), torch.nn.LayerNorm(8))
    x = torch.randn(2, 16, 8, 8)
    fp32 = norms(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norms(x).dtype == torch.float32
    assert use_low_precision_norms(norms) == 2
    assert torch.equal(norms(x), fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = norms(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), fp32, atol=0.05, rtol=0.02)
