"""Whether a hub id can be fetched from here, checked once per process before the first load.

A hub id with the hub unreachable costs ``from_pretrained`` about 25 s of retries (five, with
back-off, each logged) before it fails, and a model already in the local hub cache pays that for
each file it looks for before it loads. When the hub endpoint cannot be connected to within a few
seconds (or ``HF_HUB_OFFLINE`` is set), a hub id is loaded from its snapshot in the local hub
cache: a cached model loads at once and a missing one fails at once, in one line saying why.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import warnings
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

__all__ = ["hub_source", "hub_unreachable", "offline_hint", "quiet_hub_calls"]

CONNECT_TIMEOUT_S = 3.0  # name lookup and TCP connect to the hub endpoint, together
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _probe(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be connected to (None: it can), within ``CONNECT_TIMEOUT_S``."""
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            result.append(None)
        except OSError as e:
            result.append(e.strerror or str(e) or type(e).__name__)

    # The name lookup has no timeout of its own: a thread bounds it (left to finish by itself).
    t = threading.Thread(target=connect, daemon=True, name="latentforge-hub-probe")
    t.start()
    t.join(CONNECT_TIMEOUT_S)
    return result[0] if result else f"no answer in {CONNECT_TIMEOUT_S:g} s"


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from this process (None: it may be). Behind a proxy the
    direct connection says nothing, so the hub is assumed reachable and its own retries apply."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None
    url = urlparse(constants.ENDPOINT)
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    why = _probe(url.hostname, port)
    return None if why is None else f"{url.hostname}:{port} cannot be reached: {why}"


def hub_source(where: str) -> str:
    """Where ``from_pretrained`` should load ``where`` from: as given (an existing local path, or a
    hub id while the hub may be reached), or, with the hub unreachable, the hub id's snapshot in
    the local hub cache (every later lookup is then a local one; FileNotFoundError when it is not
    cached)."""
    if Path(where).expanduser().exists() or hub_unreachable() is None:
        return where
    from huggingface_hub import snapshot_download

    return snapshot_download(where, local_files_only=True)


def offline_hint(path_or_id: str) -> str:
    """The end of a failed hub-id load's message when the hub was not asked (empty otherwise)."""
    if Path(path_or_id).expanduser().exists() or (why := hub_unreachable()) is None:
        return ""
    return (f" (not in the local hub cache, and {why}: download it where the hub is reachable, or give a "
            "local directory)")


@contextlib.contextmanager
def quiet_hub_calls() -> Iterator[None]:
    """diffusers' loaders pass huggingface_hub an argument it no longer takes, which warns on
    every hub-id load: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The `local_dir_use_symlinks` argument is deprecated")
        yield
