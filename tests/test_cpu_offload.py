"""FSDP2 CPU offload on ONE process (gloo): a one-rank process group, offloaded sharded
parameters and optimizer state, training that matches a plain run, exact resume through DCP.

On this CPU-only machine "offloaded" parameters and the compute device are both host memory, so
what is checked is FSDP2's offload path itself (CPUOffloadPolicy on every block and the root, the
AdamW state beside the sharded parameters, the copies and the DCP round trip), not the GPU memory
saved; that needs a CUDA device.

Everything that creates the one-rank process group runs in a forked child: a process that has
had a process group must not fork the 2-rank runs of other test modules later (they hang), so
the pytest process itself never creates one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import yaml

from latentforge import checkpoint as ckpt
from latentforge.cli import main as cli_main
from latentforge.config import from_dict
from latentforge.distributed.dcp import DCP_DIR, is_sharded_checkpoint
from latentforge.distributed.env import close_world, init_world
from latentforge.distributed.parallelize import ParallelConfig, parallelize, resolve_strategy
from latentforge.errors import ConfigError
from latentforge.models.unet import UNetConfig, build_unet
from latentforge.train.optim import OptimConfig, build_optimizer
from latentforge.train.run import RunConfig, train
from latentforge.train.trainer import TrainConfig
from latent_fixtures import latent_data  # noqa: F401  (session fixture)
from test_distributed import STEPS, assert_close_runs, final, metrics, recipe
from test_trainer import kill_before_step

OFFLOAD = {"cpu_offload": True, "reshard_after_forward": True}


@pytest.fixture(autouse=True)
def one_thread_and_clean_env(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    # init_world sets MASTER_ADDR/PORT for the one-rank group; monkeypatch restores them afterwards.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    yield
    torch.set_num_threads(before)
    assert not dist.is_initialized()  # close_world tore the one-rank group down


def in_child(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child process; raises if it fails (ProcessRaisedException with its
    traceback, or ProcessExitedException if it died of a BaseException such as Killed)."""
    import torch.multiprocessing as mp

    def run(_rank: int) -> None:
        torch.set_num_threads(1)
        fn()

    mp.start_processes(run, nprocs=1, start_method="fork")


def train_cli(run_dir: Path, recipe_path: Path) -> None:
    """``latentforge train`` in a forked child; it must succeed."""
    def run() -> None:
        assert cli_main(["train", str(run_dir), "--recipe", str(recipe_path), "--quiet"]) == 0

    in_child(run)


@pytest.fixture(scope="module")
def reference(latent_data, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """The plain one-process run and the same recipe with FSDP2 CPU offload on one process."""
    root = tmp_path_factory.mktemp("offload")
    plain = recipe(latent_data, "none")
    train(from_dict(RunConfig, {"train": plain["train"], "data": plain["loader"]}), root / "run-none", progress=False)
    path = root / "offload.yaml"
    path.write_text(yaml.safe_dump(recipe(latent_data, "fsdp", **OFFLOAD)))
    with pytest.MonkeyPatch.context() as m:
        m.delenv("MASTER_ADDR", raising=False)
        m.delenv("MASTER_PORT", raising=False)
        torch.set_num_threads(1)
        train_cli(root / "run-offload", path)
    assert not dist.is_initialized()
    return {"none": root / "run-none", "offload": root / "run-offload", "recipe": path}


def test_offload_on_one_process_matches_the_plain_run(reference):
    """Same losses, grad norms (clipping binds) and final model and EMA within the FSDP tolerances;
    the checkpoints are DCP ones (one shard file) with consolidated weights."""
    assert_close_runs(reference["none"], reference["offload"])
    latest = ckpt.find_latest(reference["offload"])
    assert is_sharded_checkpoint(latest) and final(reference["offload"]).meta["sharded"] is True
    assert sorted(p.name for p in (latest / DCP_DIR).glob("*.distcp")) == ["__0_0.distcp"]
    assert final(reference["offload"]).meta["world_size"] == 1


def test_offload_resume_is_exact(reference, tmp_path, monkeypatch):
    """Killed before step 5 (last checkpoint at 3), rerun: the same log lines and bitwise the same
    final model and EMA as the uninterrupted offloaded run."""
    run = tmp_path / "run"
    import torch.multiprocessing as mp

    with monkeypatch.context() as m:
        kill_before_step(m, 5)  # patched before the fork: the child inherits it
        with pytest.raises(mp.ProcessExitedException):
            train_cli(run, reference["recipe"])
    assert ckpt.find_latest(run).name == "step-00000003"
    train_cli(run, reference["recipe"])
    assert metrics(run) == metrics(reference["offload"])
    a, b = final(reference["offload"]), final(run)
    assert b.step == STEPS
    for group in ("model", "ema"):
        assert a.tensors[group].keys() == b.tensors[group].keys()
        assert all(torch.equal(a.tensors[group][k], t) for k, t in b.tensors[group].items()), group


def test_parameters_and_optimizer_state_are_offloaded():
    in_child(_parameters_and_optimizer_state_are_offloaded)


def _parameters_and_optimizer_state_are_offloaded():
    """Every FSDP2 parameter group of the blocks and the root offloads to the host; the sharded
    parameters, their gradients and the AdamW state are CPU DTensors; clipping works on them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from latentforge.train.optim import clip_grad_norm

    world = init_world("cpu", single_rank_group=True)
    try:
        assert dist.is_initialized() and world.world_size == 1 and world.is_main
        torch.manual_seed(0)
        model = build_unet(UNetConfig(preset="tiny", in_channels=4, out_channels=4, cross_attention_dim=16))
        train_model, _ = parallelize(model, ParallelConfig(strategy="fsdp", mixed_precision="bf16", **OFFLOAD),
                                     world, torch.device("cpu"))
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(groups) == 1 + len(model.down_blocks) + 1 + len(model.up_blocks)  # blocks + root
        assert all(fp.offload_to_cpu for g in groups for fp in g.fsdp_params)
        opt = build_optimizer(model.parameters(), OptimConfig(), "cpu")
        x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 8, 16)
        train_model(x, t, encoder_hidden_states=text).sample.float().pow(2).mean().backward()
        norm = clip_grad_norm(model.parameters(), 0.01)
        assert torch.isfinite(norm) and norm > 0.01
        opt.step()
        for p in model.parameters():
            assert isinstance(p, DTensor) and p.device.type == "cpu" and p.dtype == torch.float32
            assert isinstance(p.grad, DTensor) and p.grad.device.type == "cpu"
            assert all(s.device.type == "cpu" for s in opt.state[p].values())
    finally:
        close_world()


def test_offload_config_checks():
    # validate() names fields relative to the section; loaded from a recipe they are prefixed once.
    with pytest.raises(ConfigError, match="^cpu_offload: .*needs parallel.strategy=fsdp"):
        ParallelConfig(strategy="ddp", cpu_offload=True).validate()
    with pytest.raises(ConfigError, match=r"^train\.parallel\.cpu_offload: .*needs parallel.strategy=fsdp"):
        from_dict(RunConfig, {"train": {"parallel": {"strategy": "ddp", "cpu_offload": True}}})
    assert resolve_strategy(ParallelConfig(strategy="fsdp", cpu_offload=True), 1) == "fsdp"
    assert resolve_strategy(ParallelConfig(strategy="fsdp"), 1) == "none"
    with pytest.raises(ConfigError, match="optim.name: adamw8bit does not run on FSDP2"):
        from_dict(TrainConfig, {"parallel": {"strategy": "fsdp", "cpu_offload": True},
                                "optim": {"name": "adamw8bit"}}).validate()
    # Without a process group (a World built by hand) parallelize says how to get one.
    model = build_unet(UNetConfig(preset="tiny", in_channels=4, out_channels=4, cross_attention_dim=16))
    from latentforge.distributed.env import World

    with pytest.raises(ConfigError, match="needs a process group.*single_rank_group=True"):
        parallelize(model, ParallelConfig(strategy="fsdp", cpu_offload=True), World(), torch.device("cpu"))


def test_adamw8bit_fails_on_offloaded_dtensors_so_the_refusal_is_needed():
    """The refusal above stands for a real failure: bitsandbytes' 8-bit AdamW on FSDP2-offloaded
    DTensor parameters raises (bitsandbytes 0.50)."""
    pytest.importorskip("bitsandbytes")
    in_child(_adamw8bit_fails_on_offloaded_dtensors)


def _adamw8bit_fails_on_offloaded_dtensors():
    import bitsandbytes as bnb

    world = init_world("cpu", single_rank_group=True)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world.world_size,))
        for m in (*model, model):
            fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=1)
        model(torch.randn(2, 64)).pow(2).mean().backward()
        with pytest.raises(Exception, match="mixed torch.Tensor and DTensor"):
            opt.step()
    finally:
        close_world()

