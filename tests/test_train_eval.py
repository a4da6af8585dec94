"""Evaluation during training (``train.eval.every_steps``) and ``latentforge report``.

A tiny run evaluates its checkpoints with a tiny DINOv2 (Fréchet distance in its features) and a
tiny CLIP (CLIP score). The logged metrics are checked against ``latentforge eval``'s own
function run separately on the same checkpoint; the logged images, GPU-hours and dollars against
the run's batches, its price and its own clock; a resumed run continues the same curve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from latent_fixtures import latent_data  # noqa: F401
from latentforge.config import from_dict
from latentforge.errors import ConfigError
from latentforge.evaluate.curve import budget_end, read_evaluations, run_total_samples, write_quality_report
from latentforge.evaluate.eval import EvalConfig, evaluate
from latentforge.train.run import RunConfig, train
from tiny_models import make_tiny_clip_model, make_tiny_dinov2

PRICE = 3.5


@pytest.fixture(scope="module")
def eval_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train_eval_models")
    return {"dino": make_tiny_dinov2(root / "dinov2-tiny", image_size=16), "clip": make_tiny_clip_model(root / "clip")}


def run_config(latent_data, eval_models, cache: Path, **train_eval) -> RunConfig:  # noqa: F811
    return from_dict(RunConfig, {
        "train": {"unet": {"preset": "tiny"}, "ema": {"decay": 0.5}, "optim": {"lr": 1e-2},
                  "phases": [{"datasets": [{"path": str(latent_data["latent16"])}], "steps": 4}],
                  "micro_batch_size": 4, "device": "cpu", "loggers": [],
                  "checkpoint": {"every_steps": 2, "keep_last": 5},
                  "eval": {"every_steps": 2, "num_images": 5, "price_per_gpu_hour": PRICE, **train_eval}},
        "data": {"num_workers": 0, "cache_dir": str(latent_data["cache"])},
        "eval": {"prompts": str(latent_data["raw16"]), "reference": str(latent_data["raw16"]),
                 "fd_encoders": [str(eval_models["dino"])], "clip": str(eval_models["clip"]),
                 "guidance_scales": [1.0, 3.0], "num_steps": 2, "batch_size": 3, "device": "cpu",
                 "cache_dir": str(cache)},
    })


@pytest.fixture(scope="module")
def evaluated_run(latent_data, eval_models, tmp_path_factory, one_thread):  # noqa: F811
    root = tmp_path_factory.mktemp("train_eval")
    cfg = run_config(latent_data, eval_models, root / "cache")
    assert train(cfg, root / "run", progress=False)["finished"]
    return cfg, root / "run"


def test_checkpoints_are_evaluated_and_logged_against_images_gpu_hours_and_dollars(evaluated_run, tmp_path):
    cfg, run = evaluated_run
    records = read_evaluations(run)
    assert [r["step"] for r in records] == [2, 4]
    assert [r["samples_seen"] for r in records] == [2 * 4, 4 * 4]  # steps x global batch
    for r in records:
        assert r["world_size"] == 1 and r["gpu_hours"] == pytest.approx(r["train_seconds"] / 3600)
        assert r["dollars"] == pytest.approx(r["gpu_hours"] * PRICE)
        assert r["eval_seconds"] > 0 and r["eval_dollars"] == pytest.approx(r["eval_gpu_hours"] * PRICE)
        assert [row["guidance_scale"] for row in r["rows"]] == [1.0, 3.0]
        assert all(row["num_images"] == 5 for row in r["rows"])
    assert 0 < records[0]["train_seconds"] < records[1]["train_seconds"]
    assert records[1]["eval_gpu_hours"] > records[0]["eval_gpu_hours"]  # cumulative
    # The logged metrics are those of `latentforge eval` on the same checkpoint, run on its own.
    again = evaluate(EvalConfig(**{**vars(cfg.eval), "checkpoint": str(run / "checkpoints" / "step-00000004"),
                                   "num_images": 5}), tmp_path / "again", progress=False)
    assert again["rows"] == records[1]["rows"]
    assert set(again["rows"][0]) >= {"fd_dinov2-tiny", "clip_score"}
    # the two checkpoints are different models: their metrics differ
    assert records[0]["rows"][0]["fd_dinov2-tiny"] != records[1]["rows"][0]["fd_dinov2-tiny"]


def test_a_resumed_run_continues_the_same_curve(evaluated_run):
    cfg, run = evaluated_run
    before = read_evaluations(run)
    # The images of step 4 left by the first trajectory must not be reused for the new step-4 checkpoint
    # (spoil one: a reused set would change the metrics).
    spoiled = run / "eval" / "step-00000004" / "images" / "cfg-1" / "000000.png"
    spoiled.write_bytes((run / "eval" / "step-00000004" / "images" / "cfg-3" / "000004.png").read_bytes())
    assert train(cfg, run, resume=str(run / "checkpoints" / "step-00000002"), progress=False)["finished"]
    after = read_evaluations(run)
    assert [r["step"] for r in after] == [2, 4] and after[0] == before[0]  # step 2 kept, step 4 written again
    assert after[1]["rows"] == before[1]["rows"]
    assert after[1]["train_seconds"] > after[0]["train_seconds"]  # the clock continues from the checkpoint's


def test_an_evaluation_lost_to_a_stop_after_its_checkpoint_runs_on_resume(evaluated_run):
    cfg, run = evaluated_run
    log = run / "eval.jsonl"
    lines = log.read_text().splitlines()
    log.write_text(lines[0] + "\n")  # as if the run stopped between the step-4 checkpoint and its evaluation
    train(cfg, run, resume="auto", progress=False)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [2, 4]
    assert json.loads(log.read_text().splitlines()[1])["rows"] == json.loads(lines[1])["rows"]


def test_report_draws_each_metric_and_where_the_budget_ends(evaluated_run, tmp_path):
    _, run = evaluated_run
    assert run_total_samples(run) == 16
    path = write_quality_report(run, run_total_samples(run), out=tmp_path / "report")
    text = path.read_text()
    assert text.count("| 2 | 8 |") == 2 and text.count("| 4 | 16 |") == 2  # one table row per step and scale
    for metric in ("fd_dinov2-tiny", "clip_score"):
        assert (tmp_path / "report" / f"{metric}.png").stat().st_size > 1000
        assert f"![{metric}]({metric}.png)" in text
    records = read_evaluations(run)
    end = budget_end(records, 32)  # twice the run's images: twice its GPU-hours at the measured rate
    assert end["gpu_hours"] == pytest.approx(2 * records[-1]["gpu_hours"])
    assert end["dollars"] == pytest.approx(2 * records[-1]["gpu_hours"] * PRICE)


def test_evaluation_without_a_metric_model_fails_before_training(latent_data, eval_models, tmp_path):  # noqa: F811
    cfg = run_config(latent_data, eval_models, tmp_path / "cache")
    cfg.eval.fd_encoders, cfg.eval.clip = [], ""
    with pytest.raises(ConfigError, match="train.eval.every_steps: the recipe's eval section names no metric model"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_report_command_writes_the_report_and_refuses_a_run_without_evaluations(evaluated_run, tmp_path, capsys):
    from latentforge.cli import main

    _, run = evaluated_run
    assert main(["report", str(run)]) == 0
    assert f"-> {run / 'report' / 'quality.md'}" in capsys.readouterr().out
    assert "| 4 | 16 |" in (run / "report" / "quality.md").read_text()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"latentforge: error: {tmp_path}: not a latentforge training run (no train_config.yaml / "
                   "data_meta.json)"]
    for name in ("train_config.yaml", "data_meta.json"):  # a run that evaluated nothing
        shutil.copy(run / name, tmp_path / name)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"latentforge: error: {tmp_path}: no eval.jsonl; evaluations are written during training when "
                   "train.eval.every_steps is set (and the recipe's eval section names the metric models)"]
    assert main(["report", str(run), "--gpus", "8", "--price", "3"]) == 2  # a plan's flags without its recipe
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["latentforge: error: report: --gpus, --price are only used with --recipe (the plan they describe)"]
    for bad in ("[1, 2, 3]", '{"step": "x"}'):  # a damaged log: one line, not a traceback
        (tmp_path / "eval.jsonl").write_text(bad + "\n")
        assert main(["report", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"latentforge: error: {tmp_path / 'eval.jsonl'}: line 1 is not a record of the trainer (no "
                       "integer step and samples_seen)"]
