"""A real local S3 endpoint for tests: moto's threaded HTTP server on a free port.

Use ``start_moto()`` once per session and :func:`use_endpoint` per test, e.g.::

    @pytest.fixture(scope="session")
    def moto_endpoint():
        url, stop = start_moto()
        yield url
        stop()

    @pytest.fixture
    def s3_endpoint(moto_endpoint, monkeypatch):
        return use_endpoint(moto_endpoint, monkeypatch)

Buckets persist for the whole session: give each test its own bucket (:func:`new_bucket`).
"""

from __future__ import annotations

import logging
import socket
import uuid
from typing import Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[str, Callable[[], None]]:
    """Start moto's S3 server on 127.0.0.1; returns (endpoint_url, stop)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return f"http://127.0.0.1:{port}", server.stop


def use_endpoint(endpoint_url: str, monkeypatch) -> str:
    """Point boto3 (and so ``latentforge.storage``) at ``endpoint_url`` for one test."""
    from latentforge import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    # storage caches one client per process and thread, built from the environment it saw first.
    monkeypatch.setattr(storage._local, "clients", {}, raising=False)
    return endpoint_url


def new_bucket() -> str:
    """Create a bucket with a unique name on the current endpoint and return the name."""
    from latentforge import storage

    name = f"test-{uuid.uuid4().hex[:12]}"
    storage.s3_client().create_bucket(Bucket=name)
    return name
