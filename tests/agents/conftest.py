"""Fixtures of the agents room: a dcgm-exporter serving the recorded exposition."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

DCGM_FIXTURE = Path(__file__).resolve().parent.parent / "data" / "dcgm" / "h100_node.prom"


@pytest.fixture
def exporter() -> Iterator[str]:
    """URL of a local HTTP server answering like dcgm-exporter's ``/metrics``."""
    body = DCGM_FIXTURE.read_bytes()

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
