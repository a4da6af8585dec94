"""Tiny latent datasets for trainer tests, built once per test session.

A tiny VAE (2x down-sampling, 4 latent channels) and a tiny BERT (16-d hidden states) from
``tiny_models`` encode small raw datasets into latent shards with ``encode_dataset``, the same
path ``latentforge encode`` takes:

- ``latent16``: 64 samples at 16 px (8x8x4 latents) in 4 shards;
- ``latent32``: 32 samples at 32 px (16x16x4 latents) in 2 shards, encoded with the same VAE and
  text encoder, for a second training phase at a higher resolution;
- ``raw16``: the raw dataset behind ``latent16`` (training on it must be refused);
- ``cache``: a loader shard cache directory for the tests (not the user's ~/.cache).

Use it from a test module with ``from latent_fixtures import latent_data  # noqa: F401``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from latentforge.data.encode import EncodeConfig, encode_dataset
from tiny_models import make_raw_dataset, make_tiny_bert, make_tiny_vae

TEXT_LEN = 8  # tokens per caption: the test captions have 7 words
TEXT_DIM = 16  # hidden size of the tiny BERT


def build_latent_data(root: Path) -> dict[str, Path]:
    """The models, raw datasets and latent datasets described in the module docstring, under ``root``."""
    vae = make_tiny_vae(root / "vae")
    bert = make_tiny_bert(root / "bert")
    cfg = EncodeConfig(vae=str(vae), text_encoder=str(bert), max_length=TEXT_LEN, batch_size=32, device="cpu")
    out = {"vae": vae, "bert": bert, "cache": root / "shard-cache"}
    for name, n, res, shards, seed in (("16", 64, 16, 4, 0), ("32", 32, 32, 2, 1)):
        raw = make_raw_dataset(root / f"raw{name}", n=n, resolution=res, num_shards=shards, seed=seed)
        encode_dataset(str(raw), str(root / f"latent{name}"), cfg, progress=False)
        out[f"raw{name}"] = raw
        out[f"latent{name}"] = root / f"latent{name}"
    return out


@pytest.fixture(scope="session")
def latent_data(tmp_path_factory) -> dict[str, Path]:
    return build_latent_data(tmp_path_factory.mktemp("latent_data"))
