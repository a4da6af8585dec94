"""`latentforge demo` with bad input: refused in one line (exit code 2) before its first stage,
nothing of the user's touched. Each case was a traceback, a run that failed minutes in, a silent
success on nonsense, or lost files (run 45's probe of the demo and bench commands)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from latentforge.cli import main
from latentforge.config import save_config
from latentforge.recipe import load_recipe


def _one_error_line(capsys, *words: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("latentforge: error: "), err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


@pytest.mark.parametrize("setting, words", [
    ("demo.num_steps=0", "num_steps: must be at least 1, got 0"),  # was a ZeroDivisionError in the sampler
    ("demo.num_steps=-1", "num_steps: must be at least 1, got -1"),  # was scored: 0% everywhere, exit 0
    ("demo.seed=-1", "seed: must be 0 or more, got -1"),  # was numpy's ValueError
    ("demo.num_seen_combos=-1", "num_seen_combos: must be at least 1, got -1"),
    ("demo.guidance_scale=-1", "guidance_scale: must be a number above 0, got -1"),
    ("demo.guidance_scale=.nan", "demo.guidance_scale: expected a finite number, got nan"),
    ("demo.judge.lr=-1", "lr: must be > 0, got -1"),  # these four went on into the VAE's training
    ("demo.judge.noise_std=-5", "noise_std: must be >= 0 (0 = no added noise), got -5"),
    ("train.phases=[]", "train.phases: empty; the demo trains at least one phase"),
    ("demo.pinned_judge=nowhere/judge", "demo.pinned_judge: no judge in nowhere/judge"),  # was found at stage 5
])
def test_bad_settings_are_refused_before_the_first_stage(tmp_path, capsys, setting, words, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--quiet", "--out", "out", setting]) == 2
    _one_error_line(capsys, words)
    assert not (tmp_path / "out").exists()


def test_a_recipe_that_is_not_a_demo_recipe_is_refused(tmp_path, capsys):
    """sd2-base trains on datasets of its own: the demo ran its synth, ingest and VAE stages, then
    failed on those datasets. finetune-8gb failed after the synth (below)."""
    assert main(["demo", "--quiet", "--recipe", "sd2-base", "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "train.phases.0.datasets: the demo trains on the latents it encodes itself")
    assert not (tmp_path / "out").exists()
    # finetune-8gb ingests at 512 px: every 64 px render was rejected after the synth stage
    assert main(["demo", "--quiet", "--recipe", "finetune-8gb", "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "ingest.image.resolution: 512 px (ingest.filters.min_side auto: half) keeps images of "
                    "at least 256 px, and the demo renders its own at synth.image_size=64")
    assert main(["demo", "--quiet", "--out", str(tmp_path / "out"), "ingest.filters.min_side=100"]) == 2
    _one_error_line(capsys, "ingest.filters.min_side: 100 px keeps images of at least 100 px")
    assert main(["demo", "--quiet", "--out", str(tmp_path / "out"), "train.init_from=somewhere"]) == 2
    _one_error_line(capsys, "train.init_from / train.lora: the demo trains its denoiser from scratch")
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_empty_a_file_or_holds_something_else_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--quiet", "--out", ""]) == 2  # was the working directory
    _one_error_line(capsys, "demo --out: empty; give a directory")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["demo", "--quiet", "--out", str(mine)]) == 2  # the demo began its stages in it
    _one_error_line(capsys, f"{mine}: exists, is not empty and holds no latentforge demo")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    (tmp_path / "afile").write_text("keep")
    assert main(["demo", "--quiet", "--out", "afile"]) == 2
    _one_error_line(capsys, "afile: is a file; --out names the demo's directory")
    assert (tmp_path / "afile").read_text() == "keep"


def test_pin_judge_refuses_a_directory_of_other_files_a_file_and_object_storage(tmp_path, capsys):
    """--pin-judge into a folder of the user's trained the judge, then deleted the folder to write it."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep")
    assert main(["demo", "--quiet", "--pin-judge", str(mine)]) == 2
    _one_error_line(capsys, f"--pin-judge {mine}: holds notes.txt, not a judge's file; use a new or empty directory")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "sub"]
    (mine / "judge.json").write_text("{}")  # a judge beside them: replaced whole, so refused too
    assert main(["demo", "--quiet", "--pin-judge", str(mine)]) == 2
    _one_error_line(capsys, f"--pin-judge {mine}: holds notes.txt")
    afile = tmp_path / "afile.txt"
    afile.write_text("keep")
    assert main(["demo", "--quiet", "--pin-judge", str(afile)]) == 2  # trained first, then failed on afile.txt.tmp
    _one_error_line(capsys, f"--pin-judge {afile}: is a file; give a directory for the judge")
    assert afile.read_text() == "keep"
    assert main(["demo", "--quiet", "--pin-judge", "s3://bucket/judge"]) == 2  # wrote a local folder s3:
    _one_error_line(capsys, "--pin-judge s3://bucket/judge: this command writes to a local path")
    assert main(["demo", "--quiet", "--pin-judge", " "]) == 2
    _one_error_line(capsys, "demo --pin-judge: empty; give a directory")


def _fake_finished_demo(out: Path) -> Path:
    """The files by which --rescore knows a finished demo (no model: the checks come first)."""
    save_config(load_recipe("tiny-cpu"), out / "recipe.yaml")
    (out / "export").mkdir()
    (out / "export" / "model_index.json").write_text("{}")
    (out / "export" / "latentforge_export.json").write_text('{"scheduler": "ddim"}')
    (out / "synth").mkdir()
    (out / "synth" / "labels.jsonl").write_text("")
    return out


@pytest.mark.parametrize("scales", ["inf", "1e400", "nan", "0", "-1", ",", "2,,3", "2,2", "3,"])
def test_rescore_refuses_scales_that_are_not_finite_and_positive(tmp_path, capsys, scales):
    """inf was scored: NaN images, every figure 0%, exit 0; "2,,3" dropped its empty item and "2,2" listed 2 twice."""
    out = _fake_finished_demo(tmp_path / "demo")
    assert main(["demo", "--quiet", "--out", str(out), "--rescore", scales]) == 2
    _one_error_line(capsys, "--rescore: ")
    assert not (out / "rescore").exists()


def test_rescore_of_a_demo_without_its_export_record_is_refused(tmp_path, capsys):
    """Was a FileNotFoundError traceback from reading export/latentforge_export.json."""
    out = _fake_finished_demo(tmp_path / "demo")
    (out / "export" / "latentforge_export.json").unlink()
    assert main(["demo", "--quiet", "--out", str(out), "--rescore", "2"]) == 2
    _one_error_line(capsys, f"{out}: the demo has not finished (no exported pipeline)")



def test_rescore_refuses_an_empty_recipe_record_and_a_pinned_judge_that_is_not_there(tmp_path, capsys):
    """An empty OUT/recipe.yaml read as the default recipe (another model's settings); a
    demo.pinned_judge named on the command line that does not exist was passed over in silence."""
    out = _fake_finished_demo(tmp_path / "demo")
    assert main(["demo", "--quiet", "--out", str(out), "--rescore", "2", "demo.pinned_judge=nowhere/judge"]) == 2
    _one_error_line(capsys, "demo.pinned_judge: no judge in nowhere/judge")
    (out / "recipe.yaml").write_text("")
    assert main(["demo", "--quiet", "--out", str(out), "--rescore", "2"]) == 2
    _one_error_line(capsys, f"{out}/recipe.yaml: empty, so it would read as the default recipe")
    assert not (out / "rescore").exists()


def test_a_damaged_kept_rescore_is_scored_again_not_trusted(tmp_path):
    """A truncated OUT/rescore/.../evaluation.json was a JSONDecodeError traceback, and one with the right
    settings but no figures a KeyError; both are now scored again (tests/test_golden.py checks a kept one
    is used)."""
    from latentforge.demo import _kept_scoring
    from latentforge.evaluate.alignment import SCORING

    cached, key = tmp_path / "evaluation.json", {"guidance_scale": 2.0}
    assert _kept_scoring(cached, key, 2.0) is None  # none yet
    for damaged in ("{", "[]", json.dumps({"demo": key, "scoring": SCORING, "evaluation": {}, "seconds": 1.0}),
                    json.dumps({"demo": key, "scoring": SCORING})):
        cached.write_text(damaged)
        assert _kept_scoring(cached, key, 2.0) is None, damaged
