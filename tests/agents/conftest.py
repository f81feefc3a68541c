"""Fixtures of the agents room: dcgm-exporters serving the recorded expositions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

DCGM_DATA = Path(__file__).resolve().parent.parent / "data" / "dcgm"
DCGM_FIXTURE = DCGM_DATA / "h100_node.prom"
#: dcgm-exporter as a Kubernetes DaemonSet: its Hostname label is its pod's name
DCGM_POD_FIXTURE = DCGM_DATA / "h100_k8s_pod.prom"


def _serve(body: bytes) -> Iterator[str]:
    """URL of a local HTTP server answering like dcgm-exporter's ``/metrics`` with ``body``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


@pytest.fixture
def exporter() -> Iterator[str]:
    """dcgm-exporter on a host (Hostname: the node's own name, h100-07)."""
    yield from _serve(DCGM_FIXTURE.read_bytes())


@pytest.fixture
def pod_exporter() -> Iterator[str]:
    """dcgm-exporter as a Kubernetes DaemonSet pod (Hostname: nvidia-dcgm-exporter-cwbcm)."""
    yield from _serve(DCGM_POD_FIXTURE.read_bytes())
