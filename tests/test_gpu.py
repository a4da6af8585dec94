"""The CUDA paths, which the CPU suite cannot reach: the nccl process group, FSDP2 bf16 mixed
precision on GPUs, the bench's CUDA timing and the memory planner against the measured CUDA peak.

Run them on a machine with a GPU: ``pytest -m gpu`` (a few minutes; the 2-rank tests need two
GPUs and are skipped with one). Without a GPU every test here is skipped with the reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import latentforge
from latentforge import checkpoint as ckpt
from latent_fixtures import latent_data  # noqa: F401  (session fixture)

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NUM_GPUS == 0, reason="no CUDA device: these tests check the CUDA paths (nccl, FSDP2 bf16 "
                                             "mixed precision, bench timing, memory planner); run pytest -m gpu on a "
                                             "machine with a GPU"),
]
two_gpus = pytest.mark.skipif(NUM_GPUS < 2, reason=f"needs 2 CUDA devices, found {NUM_GPUS}")
STEPS = 4


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(latentforge.__file__).parents[1])}


def _python(code: str, nproc: int = 0) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, or under ``torchrun --nproc_per_node nproc`` when nproc > 0."""
    if nproc:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"latentforge-gpu-test-{os.getpid()}.py"
        path.write_text(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(path)]
    else:
        cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


# ----------------------------------------------------------------------------- nccl


NCCL_CHECK = """
import torch, torch.distributed as dist
from latentforge.distributed.env import close_world, init_world
world = init_world("cuda", single_rank_group=True)
rank = dist.get_rank()
assert dist.get_backend() == "nccl", dist.get_backend()
assert torch.cuda.current_device() == rank % torch.cuda.device_count()
x = torch.full((3,), float(rank + 1), device="cuda")
dist.all_reduce(x)
n = dist.get_world_size()
assert x.tolist() == [n * (n + 1) / 2] * 3, x.tolist()
if n > 1:
    assert world.all_reduce_mean(torch.tensor(float(rank), device="cuda")).item() == (n - 1) / 2
close_world()
assert not dist.is_initialized()
print("ok", n)
"""


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
def test_nccl_process_group_and_all_reduce(nproc):
    r = _python(NCCL_CHECK, nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(f"ok {nproc}") == nproc


# ----------------------------------------------------------------------------- FSDP2 bf16 mixed precision


def _recipe(data: dict[str, Path], parallel: dict, precision: str) -> dict:
    return {
        "train": {"seed": 3, "unet": {"preset": "tiny"}, "device": "cuda", "precision": precision,
                  "optim": {"lr": 1e-3, "warmup_steps": 1}, "ema": {"decay": 0.9},
                  "phases": [{"datasets": [{"path": str(data["latent16"])}], "steps": STEPS}],
                  "micro_batch_size": 4, "global_batch_size": 8, "log_every": 1,
                  "checkpoint": {"every_steps": STEPS, "keep_last": 2}, "loggers": [], "parallel": parallel},
        "loader": {"seed": 1, "num_workers": 0, "shuffle_window_shards": 2, "cache_dir": str(data["cache"])},
    }


def _train(data, run_dir: Path, parallel: dict, precision: str, nproc: int) -> list[dict]:
    recipe = run_dir.parent / f"{run_dir.name}.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(data, parallel, precision)))
    args = ["-m", "latentforge", "train", str(run_dir), "--recipe", str(recipe), "--quiet"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    else:
        cmd = [sys.executable, *args]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("nproc, parallel", [
    # one GPU: FSDP2 runs on a one-rank group only with CPU offload
    (1, {"strategy": "fsdp", "mixed_precision": "bf16", "cpu_offload": True, "reshard_after_forward": True}),
    pytest.param(2, {"strategy": "fsdp", "mixed_precision": "bf16"}, marks=two_gpus),
], ids=["1gpu-offload", "2gpu"])
def test_fsdp2_bf16_mixed_precision_tracks_fp32(latent_data, tmp_path, nproc, parallel):
    """FSDP2 with bf16 parameters in compute (fp32 master weights and gradient reduction) against
    the same global batch in plain fp32 on one GPU: every logged loss within bf16 rounding (3%),
    and the checkpoint holds fp32 master weights that moved from their start."""
    reference = _train(latent_data, tmp_path / "fp32", {"strategy": "none"}, "fp32", 1)
    mixed = _train(latent_data, tmp_path / "fsdp", parallel, "fp32", nproc)
    assert [r["step"] for r in mixed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in mixed] == pytest.approx([r["loss"] for r in reference], rel=0.03)
    assert [r["loss"] for r in mixed] != [r["loss"] for r in reference], "bf16 compute changed nothing: not in use?"
    final = ckpt.load_checkpoint(ckpt.find_latest(tmp_path / "fsdp"))
    ref_final = ckpt.load_checkpoint(ckpt.find_latest(tmp_path / "fp32"))
    assert {t.dtype for t in final.tensors["model"].values()} == {torch.float32}
    for name, t in ref_final.tensors["model"].items():
        torch.testing.assert_close(final.tensors["model"][name], t, rtol=0.05, atol=5e-3)


# ----------------------------------------------------------------------------- bench and the memory planner


def test_bench_times_cuda_and_the_planner_matches_the_measured_peak(tmp_path):
    """``latentforge bench`` on the GPU (synthetic batches of the tiny-cpu recipe's shapes, fp32,
    micro batch 64): step times come from synchronised CUDA timing, the peak from
    torch.cuda.max_memory_allocated, and the memory planner's prediction is within 30% of it."""
    tiny = ["train.unet.block_out_channels=null", "train.unet.attention_head_dim=null",
            "train.unet.norm_num_groups=null", "train.unet.down_block_types=null", "train.unet.up_block_types=null"]
    r = subprocess.run([sys.executable, "-m", "latentforge", "bench", "--recipe", "tiny-cpu", "--steps", "3",
                        "--warmup", "1", "--out", "bench.json", "train.device=cuda", "train.precision=fp32",
                        "train.micro_batch_size=64", *tiny], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["device"] == "cuda" and data["memory_method"] == "torch.cuda.max_memory_allocated"
    assert data["device_name"] == torch.cuda.get_device_name(0)
    row = data["phases"][0]
    times = row["step_seconds"]
    assert all(math.isfinite(times[k]) and times[k] > 0 for k in ("median", "min", "max"))
    assert times["min"] <= times["median"] <= times["max"]
    assert row["img_per_s_per_device"] == pytest.approx(64 / times["median"])
    assert row["peak_rss_bytes"] is None
    pred, peak = row["predicted_memory_bytes"], row["peak_memory_bytes"]
    print(f"memory planner vs torch.cuda.max_memory_allocated on {data['device_name']}: predicted "
          f"{pred / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB ({100 * (pred / peak - 1):+.0f}%)")
    assert abs(pred / peak - 1) < 0.3


def test_memory_planner_budget_is_the_device_memory():
    from latentforge.train.memory import device_memory_budget

    total, cuda_allowance, how = device_memory_budget(torch.device("cuda", 0))
    _, whole = torch.cuda.mem_get_info(0)
    assert total == whole and cuda_allowance and "CUDA device total memory" in how
