"""train-vae and the command line: help texts, one-line errors, the data synth command."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from latentforge.cli import main
from latentforge.errors import ConfigError, UserError
from latentforge.data.loader import LoaderConfig, StreamConfig
from latentforge.models.autoencoder import load_vae
from latentforge.train.vae import VAETrainConfig, check_trained_as, is_complete, psnr, train_vae

from tiny_models import make_raw_dataset

COMMANDS = [["data", "synth"], ["ingest"], ["train-vae"], ["encode"], ["train"], ["sample"], ["export"], ["demo"],
            ["config", "show"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_every_command_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    assert "--recipe" in capsys.readouterr().out


def test_python_dash_m_and_bare_command():
    out = subprocess.run([sys.executable, "-m", "latentforge", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "ingest" in out.stdout and "train-vae" in out.stdout
    bare = subprocess.run([sys.executable, "-m", "latentforge"], capture_output=True, text=True)
    assert bare.returncode == 2 and "usage" in bare.stdout  # the help of the top level; no command is a usage error


def test_synth_command_and_bad_input(tmp_path, capsys):
    assert main(["data", "synth", "--out", str(tmp_path / "s"), "--num", "40", "--seed", "1", "--size", "32",
                 "--quiet", "synth.num_heldout=6"]) == 0
    info = json.loads((tmp_path / "s" / "synth.json").read_text())
    assert len(list((tmp_path / "s" / "train").glob("*.png"))) == 40
    assert info["config"]["seed"] == 1
    s = tmp_path / "s"
    assert capsys.readouterr().out.strip() == (
        f"synth: 40 training images in {s}/train, 6 held-out images in {s}/heldout "
        f"({len(info['heldout_combos'])} colour/shape combinations never in train); ingest {s}/train alone to train")
    assert len(list((s / "heldout").glob("*.png"))) == 6
    assert main(["data", "synth", "--out", str(tmp_path / "t"), "synth.image_size=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("latentforge: error: synth.image_size")
    assert main(["config", "show", "--recipe", "no-such-recipe"]) == 2
    assert "file not found" in capsys.readouterr().err


def test_train_vae_measures_its_scale_factor(tmp_path):
    raw = make_raw_dataset(tmp_path / "raw", 48, 16, num_shards=2)
    held = make_raw_dataset(tmp_path / "held", 8, 16, num_shards=1, seed=1)
    cfg = VAETrainConfig(data=LoaderConfig(datasets=[StreamConfig(path=str(raw))], num_workers=0,
                                           cache_dir=str(tmp_path / "cache")),
                         eval_dataset=str(held), steps=6, batch_size=8, warmup_steps=2, scale_samples=32, log_every=2)
    cfg.model.block_out_channels = (8, 16)
    cfg.model.norm_num_groups = 4
    cfg.model.sample_size = 16
    metrics = train_vae(cfg, tmp_path / "vae", progress=False)
    vae = load_vae(str(tmp_path / "vae"))
    assert vae.config.scaling_factor == pytest.approx(1 / metrics["latent_std"])
    assert metrics["steps"] == 6 and metrics["num_heldout"] == 8 and metrics["heldout_psnr"] > 0
    assert (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").exists()
    assert (tmp_path / "vae" / "train_vae_config.yaml").exists()
    with pytest.raises(UserError, match="already holds a VAE; choose another --out"):
        train_vae(cfg, tmp_path / "vae", progress=False)
    # metrics.json is the mark of a complete VAE, written last: the demo reuses such a VAE only for the same settings
    assert is_complete(tmp_path / "vae")
    check_trained_as(tmp_path / "vae", cfg)
    with pytest.raises(UserError, match=r"vae: holds a VAE trained with another lr, steps \(train_vae_config.yaml\)"):
        check_trained_as(tmp_path / "vae", replace(cfg, steps=7, lr=1e-3))
    # killed after the weights, before the mark: not complete, and a rerun trains it again (no checkpoint at 6 steps)
    (tmp_path / "vae" / "metrics.json").unlink()
    assert not is_complete(tmp_path / "vae")
    assert train_vae(cfg, tmp_path / "vae", progress=False)["latent_std"] == metrics["latent_std"]
    assert is_complete(tmp_path / "vae")
    (tmp_path / "vae" / "train_vae_config.yaml").unlink()
    with pytest.raises(UserError, match="holds a VAE without its train_vae_config.yaml"):
        check_trained_as(tmp_path / "vae", cfg)
    # a mismatched image size is refused before training
    cfg.model.sample_size = 32
    with pytest.raises(ConfigError, match=r"^vae\.model\.sample_size: 32 != the dataset's resolution 16"):
        train_vae(cfg, tmp_path / "vae2", progress=False)
    # held-out images that are not raw shards: named as the training data is (was a parquet column error)
    latent = tmp_path / "latent"
    latent.mkdir()
    index = json.loads((held / "index.json").read_text())
    (latent / "index.json").write_text(json.dumps({**index, "kind": "latent"}))
    with pytest.raises(UserError, match=rf"^{latent}: train-vae evaluates on raw shards \(from ingest\), not 'latent'"):
        train_vae(replace(cfg, eval_dataset=str(latent), model=replace(cfg.model, sample_size=16)), tmp_path / "vae3",
                  progress=False)
    assert not (tmp_path / "vae2").exists() and not (tmp_path / "vae3").exists()


def test_psnr_of_known_error():
    x = torch.zeros(2, 3, 4, 4)
    y = torch.full_like(x, 0.2)  # error 0.1 on the [0, 1] scale
    assert psnr(x, y).tolist() == pytest.approx([20.0, 20.0], abs=1e-4)


def test_config_show_prints_the_resolved_recipe(capsys):
    import yaml

    from latentforge.config import from_dict
    from latentforge.recipe import Recipe

    assert main(["config", "show", "--recipe", "tiny-cpu", "train.optim.lr=0.25", "loader.num_workers=0"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["name"] == "tiny-cpu"
    assert shown["train"]["optim"]["lr"] == 0.25 and shown["loader"]["num_workers"] == 0
    # what is printed is a complete recipe: it loads back into the schema with the overrides kept
    again = from_dict(Recipe, shown)
    assert again.train.optim.lr == 0.25 and again.loader.num_workers == 0


def test_train_vae_command_writes_a_vae_and_reports_it(tmp_path, capsys):
    raw = make_raw_dataset(tmp_path / "raw", 16, 16, num_shards=1)
    held = make_raw_dataset(tmp_path / "held", 4, 16, num_shards=1, seed=1)
    out = tmp_path / "vae"
    assert main(["train-vae", str(raw), "--out", str(out), "--eval", str(held), "--steps", "2", "--quiet",
                 "vae.batch_size=4", "vae.warmup_steps=1", "vae.scale_samples=16",
                 "vae.model.block_out_channels=[8,16]",
                 "vae.model.norm_num_groups=4", "vae.model.sample_size=16", "vae.device=cpu",
                 "vae.data.num_workers=0", f"vae.data.cache_dir={tmp_path / 'cache'}"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    metrics = json.loads((out / "metrics.json").read_text())
    vae = load_vae(str(out))
    assert metrics["steps"] == 2 and metrics["num_heldout"] == 4
    assert line == (f"train-vae: 2 steps in {metrics['train_seconds']} s, "
                    f"held-out PSNR {metrics['heldout_psnr']:.2f} dB, "
                    f"scaling_factor {vae.config.scaling_factor:.4f} -> {out}")
    assert vae.config.block_out_channels == [8, 16] and vae.config.sample_size == 16
    # Into the raw dataset's own directory: refused in one line, the dataset untouched.
    before = sorted(p.name for p in raw.iterdir())
    assert main(["train-vae", str(raw), "--out", str(raw), "--steps", "2", "--quiet", "vae.model.sample_size=16",
                 "vae.model.block_out_channels=[8,16]", "vae.model.norm_num_groups=4", "vae.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err == (f"latentforge: error: {raw}: exists, is not empty and holds no VAE training "
                   "(no train_vae_config.yaml): use a new or empty directory\n")
    assert sorted(p.name for p in raw.iterdir()) == before
