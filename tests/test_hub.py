"""Hub ids with the hub unreachable: a model in the local hub cache loads at once, a missing one
fails at once in one line (not after huggingface_hub's ~25 s of logged retries)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub.constants
import pytest

from latentforge.errors import UserError
from latentforge.models import hub
from latentforge.models.autoencoder import load_vae
from latentforge.models.text import load_text_encoder
from latentforge.models.unet import load_unet
from tiny_models import make_tiny_bert, make_tiny_vae


@pytest.fixture
def probe(monkeypatch):
    """hub_unreachable() computed afresh (it is cached per process), with no proxy set."""
    for var in hub._PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.hub_unreachable.cache_clear()
    yield monkeypatch
    hub.hub_unreachable.cache_clear()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connect is refused at once
    return port


def test_unreachable_endpoint_is_named_with_its_reason(probe):
    port = _closed_port()
    probe.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    why = hub.hub_unreachable()
    assert why is not None and why.startswith(f"127.0.0.1:{port} cannot be reached: ")
    with pytest.raises(FileNotFoundError):  # not in the local hub cache
        hub.hub_source("org/model")
    here = str(Path(__file__).parent)
    assert hub.hub_source(here) == here  # an existing local path: never the hub's business


def test_reachable_endpoint_proxy_and_offline_setting(probe):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        probe.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub.hub_unreachable() is None and hub.hub_source("org/model") == "org/model"
    finally:
        server.close()
    # Behind a proxy a direct connect says nothing: the hub's own handling applies.
    probe.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    probe.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    hub.hub_unreachable.cache_clear()
    assert hub.hub_unreachable() is None
    probe.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub.hub_unreachable.cache_clear()
    assert hub.hub_unreachable() == "HF_HUB_OFFLINE is set"


@pytest.mark.parametrize("load", [load_vae, load_text_encoder, load_unet])
def test_missing_hub_id_with_the_hub_unreachable_is_one_line(probe, load):
    probe.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(UserError) as e:
        load("some-org/not-cached")
    message = str(e.value)
    assert "\n" not in message and "not in the local hub cache, and 127.0.0.1:" in message
    assert "download it where the hub is reachable, or give a local directory" in message


def _cache_entry(cache: Path, repo: str, build) -> None:
    """``repo`` as huggingface_hub's cache holds a downloaded snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    build(folder / "snapshots" / ("0" * 40))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)


def test_cached_hub_ids_load_without_retries_when_the_hub_is_unreachable(tmp_path):
    """In a fresh process whose hub endpoint refuses connections: the VAE and text encoder of the
    local hub cache load, and huggingface_hub never logs a retry."""
    cache = tmp_path / "hub"
    _cache_entry(cache, "org/tiny-vae", make_tiny_vae)
    _cache_entry(cache, "org/tiny-bert", make_tiny_bert)
    env = {k: v for k, v in os.environ.items() if k not in hub._PROXY_VARS and k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(cache), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
               PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p))
    code = textwrap.dedent("""
        from latentforge.models.autoencoder import load_vae
        from latentforge.models.hub import hub_unreachable
        from latentforge.models.text import load_text_encoder
        vae = load_vae("org/tiny-vae")
        model, tok = load_text_encoder("org/tiny-bert")
        print(type(vae).__name__, type(model).__name__, len(tok), hub_unreachable() is not None)
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["AutoencoderKL", "BertModel", str(len(load_text_encoder(str(make_tiny_bert(
        tmp_path / "bert")))[1])), "True"]
    assert "Retrying" not in out.stderr and "cannot be reached" not in out.stderr, out.stderr[-2000:]
