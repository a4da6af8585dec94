"""The cost planner reproduces published training runs; bad input is one line and exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import latentforge
from latentforge.cli import main
from latentforge.plan.flops import GPU_PEAK_FLOPS
from latentforge.errors import UserError
from latentforge.plan.cost import PlanConfig, Phase, parse_pairs, plan_run, scaling_efficiency
from latentforge.plan.shapes import recipe_phases
from latentforge.recipe import load_recipe


def test_mosaicml_readme_table_from_its_throughputs():
    # MosaicML diffusion README: 128 x A100, 11,600 img/s at 256 px and 4,590 img/s at 512 px,
    # 550k + 850k steps at batch 2048: 5.51 days and $33,874 at $2/GPU-hour.
    phases = recipe_phases(load_recipe("sd2-base"), with_flops=False)
    assert [p.samples for p in phases] == [550_000 * 2048, 850_000 * 2048]
    cfg = PlanConfig(gpu="a100-80g", price_per_gpu_hour=2.0,
                     img_per_s_per_gpu={"256": 11_600 / 128, "512": 4_590 / 128})
    plan = plan_run(phases, cfg, 128)
    assert plan["train"]["days"] == pytest.approx(5.51, rel=0.01)
    assert plan["train"]["cost"] == pytest.approx(33_874, rel=0.01)
    assert plan["phases"][0]["cluster_img_per_s"] == pytest.approx(11_600)


def test_anyscale_table_from_its_throughputs():
    # Anyscale: 32 x A100, 5,908 img/s (256) and 1,349 img/s (512) over 1,126,400,000 +
    # 1,740,800,000 samples: 13,165 A100-hours, $39,511 at about $3.00/hour.
    phases = [Phase("256", 256, 1_126_400_000), Phase("512", 512, 1_740_800_000)]
    cfg = PlanConfig(price_per_gpu_hour=3.0, img_per_s_per_gpu={"256": 5_908 / 32, "512": 1_349 / 32})
    plan = plan_run(phases, cfg, 32)
    assert plan["train"]["gpu_hours"] == pytest.approx(13_165, rel=0.01)
    assert plan["train"]["cost"] == pytest.approx(39_511, rel=0.01)
    recipe = load_recipe("sd2-base-anyscale")
    assert [p.samples for p in recipe_phases(recipe, with_flops=False)] == [p.samples for p in phases]


def test_efficiency_goodput_and_precompute_enter_the_formula():
    phases = [Phase("a", 256, 3_600_000)]
    base = PlanConfig(price_per_gpu_hour=1.0, img_per_s_per_gpu={"256": 100.0})
    assert plan_run(phases, base, 10)["train"]["gpu_hours"] == pytest.approx(10.0)
    slower = PlanConfig(price_per_gpu_hour=1.0, img_per_s_per_gpu={"256": 100.0}, goodput=0.5,
                        scaling_efficiency={"8": 1.0, "32": 0.8}, num_images=360_000, encode_img_per_s_per_gpu=10.0)
    plan = plan_run(phases, slower, 16)
    assert plan["scaling_efficiency"] == pytest.approx(0.9)  # half-way between 8 and 32 in log2
    assert plan["train"]["gpu_hours"] == pytest.approx(10.0 / (0.9 * 0.5))
    assert plan["precompute"]["gpu_hours"] == pytest.approx(10.0)
    assert plan["total"]["days"] == pytest.approx((10.0 / 0.45 + 10.0) / 16 / 24)
    assert scaling_efficiency({8: 1.0, 128: 0.9}, 4) == 1.0 and scaling_efficiency({8: 1.0, 128: 0.9}, 512) == 0.9
    assert parse_pairs("256:137.5, 512:36.3", "x") == {"256": 137.5, "512": 36.3}


def test_plan_cli_prints_the_table_and_writes_the_chart(tmp_path, capsys):
    chart = tmp_path / "plan.png"
    assert main(["plan", "--recipe", "sd2-base", "--gpus", "64,128", "--gpu", "a100-80g", "--price", "2.0",
                 "--img-per-sec-per-gpu", "256:90.625,512:35.859375", "--chart", str(chart),
                 "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "33,875" in out and "5.51" in out and "precompute" in out and "MFU" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plans = json.loads((tmp_path / "plan.json").read_text())["plans"]
    assert [p["gpus"] for p in plans] == [64, 128]


@pytest.mark.parametrize("args, needle", [
    (["--gpu", "a200"], "unknown GPU 'a200'"),
    (["--img-per-sec-per-gpu", "256:0,512:3"], "must be > 0"),
    (["--img-per-sec-per-gpu", "256:-1,512:3"], "must be > 0"),
    (["--scaling-efficiency", "1.2"], "(0, 1]"),
    (["--scaling-efficiency", "8:1.0,64:0"], "(0, 1]"),
    (["--goodput", "0"], "(0, 1]"),
    (["--img-per-sec-per-gpu", "256:fast"], "KEY:VALUE"),
    (["--img-per-sec-per-gpu", "256:90"], "no throughput is given for it"),
    (["--throughput", "missing.json"], "no such file"),
    (["--throughput", "zero.json"], "img_per_s_per_gpu must map resolutions to positive images a second, got {\"256\": 0}"),
    (["--throughput", "words.json"], 'got {"256": "abc"}'),
    (["--mfu", "1.5"], "mfu: must be in (0, 1]"),
    (["--mfu", "0.4", "--img-per-sec-per-gpu", "256:90,512:30"], "give one of"),
    (["--resolution", "512"], "plan: --resolution is only used with --memory"),
    (["--memory", "--mfu", "0.4"], "plan --memory: --mfu is only used with the cost plan"),
    (["--memory", "--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--chart", "plan.txt"], "--chart plan.txt: give a file ending in .png or .pdf or .svg"),
    (["--chart", "."], "--chart .: is a directory"),
    (["--json", "nodir/plan.json"], "--json nodir/plan.json: no directory nodir"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero.json").write_text('{"img_per_s_per_gpu": {"256": 0}}')  # the key is there, its value is not usable
    (tmp_path / "words.json").write_text('{"img_per_s_per_gpu": {"256": "abc"}}')
    assert main(["plan", "--recipe", "sd2-base", "--chart", "", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("latentforge: error:") and needle in err[0], err


def test_bad_input_exit_code_of_the_command(tmp_path):
    src = str(Path(latentforge.__file__).parents[1])
    r = subprocess.run([sys.executable, "-m", "latentforge", "plan", "--recipe", "sd2-base", "--gpu", "a200"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": src})
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("latentforge")]  # not third-party import noise
    assert r.returncode == 2 and "Traceback" not in r.stderr and ours == [
        f"latentforge: error: unknown GPU 'a200': choose one of {', '.join(GPU_PEAK_FLOPS)}"], r.stderr


def test_train_with_the_sd2_recipe_fails_on_the_missing_dataset(tmp_path, capsys):
    assert main(["train", str(tmp_path / "run"), "--recipe", "sd2-base"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data/latents-256" in err[0] and "not a latentforge dataset" in err[0]


def test_an_assumed_mfu_gives_each_phase_its_own_throughput():
    """Two phases at one resolution (a patch-masked one and its unmasked finish): with an MFU the
    throughput follows each phase's FLOPs, which one img/s per resolution cannot."""
    masked, unmasked = Phase("masked", 256, 7_200_000, 3.0e11), Phase("finish", 256, 3_600_000, 9.0e11)
    cfg = PlanConfig(gpu="h100-sxm", mfu=0.4)
    plan = plan_run([masked, unmasked], cfg, 8)
    per_gpu = [0.4 * 989e12 / 3.0e11, 0.4 * 989e12 / 9.0e11]  # the H100 SXM's dense bf16 data-sheet peak
    assert [r["img_per_s_per_gpu"] for r in plan["phases"]] == pytest.approx(per_gpu)
    assert [r["mfu"] for r in plan["phases"]] == pytest.approx([0.4, 0.4])
    assert plan["train"]["gpu_hours"] == pytest.approx(7_200_000 / 3600 / per_gpu[0] + 3_600_000 / 3600 / per_gpu[1])
    with pytest.raises(UserError, match="FLOPs per image"):
        plan_run([Phase("unknown", 256, 100)], cfg, 8)


@pytest.mark.slow  # ~26 s: the FLOPs of the 0.6B transformer counted on the meta device for four phases
def test_plan_cli_prices_the_masked_transformer_recipe_from_an_mfu(tmp_path, capsys):
    assert main(["plan", "--recipe", "microdit-xl", "--gpu", "h100-sxm", "--gpus", "8", "--mfu", "0.4",
                 "--chart", "", "--quiet", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "assumed MFU of 40% of the h100-sxm bf16 peak" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    flops = {p["name"]: p["flops_per_image"] for p in data["phases"]}
    rows = {r["phase"]: r for r in data["plans"][0]["phases"]}
    assert flops["256px-masked"] < 0.5 * flops["256px-unmasked"]  # 75% of the patches dropped after the mixer
    for name, r in rows.items():
        assert r["img_per_s_per_gpu"] == pytest.approx(0.4 * 989e12 / flops[name]) and r["mfu"] == pytest.approx(0.4)
