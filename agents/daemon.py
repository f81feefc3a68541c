"""The node agent (``guard agent``): sample GPUs and NICs, forward training-client timings.

One process per host. Every ``agent.interval_s`` (default 1 s) it samples the GPU source
(NVML, or dcgm-exporter) and the NICs (sysfs), stamps every sample with the node and the
job, and hands the cycle's messages to the :class:`~guard.agents.publisher.Publisher`
(batched by the producer; spooled on disk while Kafka is away). Between cycles it drains
the training clients' datagrams (:class:`ClientListener`), validates each against the wire
contract, and forwards it.

Job discovery (:class:`JobTracker`), first that applies: an explicit label (``--job`` or
``agent.job``), the Slurm environment (``SLURM_JOB_ID``), the job the training clients on
this node reported in the last five minutes; else null.

Bad input never stops the daemon: an unreadable GPU or NIC counter is left out (and logged
once), a malformed datagram is counted and dropped, a missing NVML library or an unbindable
socket is reported in one line and the agent goes on with what it has.

``--simulate`` publishes a simulated cluster (:mod:`guard.agents.simulator`) through the
same publisher instead, in real time or sped up (``--speed``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import queue
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard.config import Settings, node_name
from guard.errors import GuardError
from guard.metrics import Metrics
from guard.schemas import (
    CollectiveTiming,
    Flag,
    GuardMessage,
    SchemaError,
    StepTiming,
    batch_messages,
    encode,
    parse_message,
    stable_id,
)
from guard.shutdown import stop_on_signals

__all__ = ["AgentDaemon", "ClientListener", "ClockNotices", "JobTracker", "run_agent"]

log = logging.getLogger(__name__)

#: A job reported by the training clients labels this node's telemetry for this long.
CLIENT_JOB_TTL_S = 300.0


class JobTracker:
    """Which job this node's telemetry belongs to (explicit > Slurm > training clients)."""

    def __init__(self, explicit: str | None = None, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.explicit = explicit
        self.slurm = env.get("SLURM_JOB_ID") or None
        self._reported: str | None = None
        self._reported_at = -1e18

    def report(self, job: str, now: float | None = None) -> None:
        self._reported = job
        self._reported_at = time.monotonic() if now is None else now

    def current(self, now: float | None = None) -> str | None:
        if self.explicit:
            return self.explicit
        if self.slurm:
            return self.slurm
        now = time.monotonic() if now is None else now
        if self._reported is not None and now - self._reported_at < CLIENT_JOB_TTL_S:
            return self._reported
        return None


class ClientListener:
    """Receives the training clients' datagrams on a Unix socket, in a daemon thread."""

    def __init__(self, path: str | Path, node: str, max_queue: int = 100_000) -> None:
        self.path = Path(path)
        self.node = node
        self.messages: queue.Queue[GuardMessage] = queue.Queue(maxsize=max_queue)
        self.received = 0
        self.invalid = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._last_error_log = 0.0

    def start(self) -> ClientListener:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a stale socket from an earlier agent
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(self.path))
        sock.settimeout(0.2)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="guard-client-socket", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def handle(self, data: bytes) -> GuardMessage | None:
        """Validate one datagram; the agent's node name is authoritative."""
        try:
            message = parse_message(data)
        except SchemaError as exc:
            self._invalid(f"invalid message from a training client: {exc}")
            return None
        if not isinstance(message, (StepTiming, CollectiveTiming)):
            self._invalid(
                f"training clients send step and collective messages, not {message.kind!r}"
            )
            return None
        if message.node != self.node:
            message = message.model_copy(update={"node": self.node})
        return message

    def _invalid(self, why: str) -> None:
        self.invalid += 1
        now = time.monotonic()
        if now - self._last_error_log > 10:
            self._last_error_log = now
            log.warning("%s (%d invalid so far)", why, self.invalid)

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stop.is_set():
                    log.warning("client socket: %s", exc)
                    self._stop.wait(0.5)
                continue
            self.received += 1
            message = self.handle(data)
            if message is None:
                continue
            try:
                self.messages.put_nowait(message)
            except queue.Full:
                self.dropped += 1


class ClockNotices:
    """A node whose telemetry the broker refuses for its timestamps is flagged, not silent.

    The broker refuses every record of a host whose clock runs more than
    ``log.message.timestamp.after.max.ms`` (1 h) ahead, so the node's telemetry stops and
    nothing would judge it. Instead a warning ``anomaly`` flag (detector ``agent_clock``,
    evidence ``telemetry_refused``) goes to the remediation topic, its Kafka timestamp taken
    from the newest record the broker accepted from this agent (else a day back), which the
    broker accepts whatever this host's clock says. Again every ``every_s`` while refusals go on.
    """

    DETECTOR = "agent_clock"

    def __init__(self, node: str, every_s: float = 600.0) -> None:
        self.node = node
        self.every_s = every_s
        self.reported = 0  # refusals covered by the last flag
        self.last_flag = 0.0
        self.flags = 0

    def check(self, publisher: Any) -> Flag | None:
        stats = getattr(publisher, "stats", {})
        refused = int(stats.get("refused_timestamp", 0)) + int(stats.get("refused_invalid", 0))
        now = time.time()
        if refused <= self.reported or now - self.last_flag < self.every_s:
            return None
        ahead = getattr(publisher, "refused_ahead_s", None)
        flag = Flag(
            id=stable_id(self.DETECTOR, self.node, int(now // self.every_s)),
            ts=now,
            node=self.node,
            detector=self.DETECTOR,
            category="anomaly",
            severity="warning",
            score=float(refused),
            evidence={
                "telemetry_refused": refused,
                "refused_for_timestamp": int(stats.get("refused_timestamp", 0)),
                "reason": "the broker refuses this node's records for their timestamps: its "
                "clock is more than log.message.timestamp.after.max.ms (1 h) ahead",
                "record_ahead_of_host_clock_s": round(ahead, 3) if ahead is not None else None,
            },
        )
        accepted = getattr(publisher, "last_accepted_ms", None)
        stamp = accepted if accepted else int((now - 86400) * 1000)
        publisher.publish(flag, timestamp_ms=stamp)
        self.reported, self.last_flag = refused, now
        self.flags += 1
        log.warning("%s: %d records refused by the broker; flagged", self.node, refused)
        return flag


class AgentDaemon:
    """Sampling loop: collectors → publisher, plus the training clients' messages."""

    def __init__(
        self,
        node: str,
        publisher: Any,
        collectors: list[Callable[[float, str | None], list[GuardMessage]]],
        jobs: JobTracker,
        listener: ClientListener | None = None,
        interval_s: float = 1.0,
        batch: bool = False,
    ) -> None:
        self.node = node
        #: send a cycle's samples as batch records (contract 1.1): one per node and kind
        self.batch = batch
        self.publisher = publisher
        self.collectors = collectors
        self.jobs = jobs
        self.listener = listener
        self.interval_s = interval_s
        self.cycles = 0
        self.collector_errors = 0
        self.kinds: collections.Counter[str] = collections.Counter()  # published, by kind
        self.metrics: Metrics | None = None
        self.clock_notices = ClockNotices(node)

    def cycle(self, ts: float | None = None) -> int:
        """One sampling cycle; returns the number of messages published."""
        ts = time.time() if ts is None else ts
        job = self.jobs.current()
        count = 0
        for collect in self.collectors:
            try:
                samples = collect(ts, job)
            except Exception:  # a collector bug must not stop the agent
                self.collector_errors += 1
                log.exception(
                    "collector %s failed this cycle", getattr(collect, "__qualname__", collect)
                )
                continue
            for message in batch_messages(samples) if self.batch else samples:
                self.publisher.publish(message)
                self.kinds[message.kind] += 1
                count += 1
        self.cycles += 1
        if self.metrics is not None:
            self.metrics.beat()
        count += self.forward_clients()
        self.publisher.poll()
        self.clock_notices.check(self.publisher)
        return count

    def forward_clients(self) -> int:
        if self.listener is None:
            return 0
        count = 0
        while True:
            try:
                message = self.listener.messages.get_nowait()
            except queue.Empty:
                return count
            if message.job:
                self.jobs.report(message.job)
            self.publisher.publish(message)
            self.kinds[message.kind] += 1
            count += 1

    def run(self, stop: threading.Event) -> None:
        next_at = time.monotonic()
        last_report = time.monotonic()
        while not stop.is_set():
            self.cycle()
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # fell behind (a slow collector): skip, do not burst
                next_at = now + self.interval_s
            while not stop.is_set() and time.monotonic() < next_at:
                self.forward_clients()
                self.publisher.poll()
                stop.wait(min(0.1, max(0.0, next_at - time.monotonic())))
            if time.monotonic() - last_report > 60:
                last_report = time.monotonic()
                log.info("agent: %s", self.status())

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "cycles": self.cycles,
            "collector_errors": self.collector_errors,
            "clock_flags": self.clock_notices.flags,
        }
        status.update(getattr(self.publisher, "stats", {}))
        if hasattr(self.publisher, "spool"):
            status["spool_pending"] = len(self.publisher.spool)
            status["spool_dropped"] = self.publisher.dropped
            status["state"] = self.publisher.state
        if self.listener is not None:
            status.update(
                client_received=self.listener.received,
                client_invalid=self.listener.invalid,
                client_dropped=self.listener.dropped,
            )
        return status


class PrintPublisher:
    """``--dry-run``: one JSON line per message on stdout instead of Kafka."""

    def __init__(self, out: Any = None) -> None:
        self.out = out or sys.stdout.buffer
        self.stats = {"published": 0}

    def publish(self, message: GuardMessage) -> None:
        self.out.write(encode(message) + b"\n")
        self.stats["published"] += 1

    def poll(self) -> None:
        self.out.flush()

    def flush(self, timeout_s: float = 0.0) -> None:
        self.out.flush()

    def close(self, timeout_s: float = 0.0) -> None:
        self.out.flush()


# --- command --------------------------------------------------------------------------------


def _collectors(settings: Settings, node: str) -> tuple[list[Any], list[Any]]:
    """The sampling functions and the objects to close, given the configuration."""
    agent = settings.agent
    collectors: list[Any] = []
    closers: list[Any] = []
    source = agent.gpu_source
    if source == "nvml":
        try:
            from .nvml import NvmlCollector

            nvml = NvmlCollector(node)
            collectors.append(nvml.sample)
            closers.append(nvml)
            log.info("NVML: %d GPUs", nvml.gpu_count)
        except Exception as exc:  # no driver, no library: run without GPUs, say why
            log.error(
                "NVML is not available (%s); no GPU samples. Use --gpu-source dcgm or none", exc
            )
    elif source == "dcgm":
        from .dcgm import DcgmCollector

        collectors.append(DcgmCollector(agent.dcgm_url, node).sample)
    from .nic import NicCollector

    nic = NicCollector(node, agent.sysfs_root)
    log.info("NICs: %d ports", len(nic.ports))
    collectors.append(nic.sample)
    closers.append(nic)
    return collectors, closers


def run_agent(args: argparse.Namespace, settings: Settings) -> int:
    level = getattr(args, "log_level", None) or "info"
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    agent = settings.agent
    node = node_name(agent.node)
    interval = agent.interval_s
    publisher: Any
    if getattr(args, "dry_run", False):
        publisher = PrintPublisher()
    else:
        from .publisher import Publisher

        try:
            publisher = Publisher(settings)
        except OSError as exc:
            raise GuardError(
                f"agent: cannot use the spool directory ({exc}); set agent.spool_dir "
                "(GUARD_AGENT_SPOOL_DIR) to a writable directory"
            ) from None
    with stop_on_signals() as stop, contextlib.closing(publisher):
        if getattr(args, "simulate", False):
            return run_simulated(args, settings, publisher, stop)
        jobs = JobTracker(agent.job)
        collectors, closers = _collectors(settings, node)
        listener = None
        socket_path = agent.socket_path
        try:
            listener = ClientListener(socket_path, node, agent.client_queue_max).start()
        except OSError as exc:
            log.error(
                "cannot listen for training clients on %s (%s); set agent.socket_path "
                "(GUARD_AGENT_SOCKET_PATH) to a writable place. Sampling goes on.",
                socket_path,
                exc,
            )
        daemon = AgentDaemon(
            node, publisher, collectors, jobs, listener, interval, agent.batch_records
        )
        server = None if getattr(args, "once", False) else _serve_metrics(daemon, settings)
        try:
            if getattr(args, "once", False):
                daemon.cycle()
            else:
                daemon.run(stop)
        finally:
            if server is not None:
                server.close()
            if listener is not None:
                listener.stop()
            for closer in closers:
                closer.close()
        log.info("agent stopping: %s", daemon.status())
        return 0


def _serve_metrics(daemon: AgentDaemon, settings: Settings) -> Any:
    from .metrics import observe_agent

    daemon.metrics = Metrics("agent", stale_s=max(settings.metrics.stale_s, 3 * daemon.interval_s))
    observe_agent(daemon.metrics, daemon)
    m = settings.metrics
    return daemon.metrics.serve(m.agent_port, m.host, "metrics.agent_port")


def run_simulated(
    args: argparse.Namespace, settings: Settings, publisher: Any, stop: threading.Event
) -> int:
    """Publish a simulated cluster through ``publisher``, paced at ``--speed`` x real time."""
    from .simulator import ClusterSimulator, SimConfig

    speed = float(getattr(args, "speed", 1.0) or 0.0)
    start_ts = float(int(time.time()))
    sim = ClusterSimulator(
        SimConfig(nodes=args.nodes, duration_s=args.duration, seed=args.seed, start_ts=start_ts)
    )
    started = time.monotonic()
    count = records = 0
    for batch in sim.batches():
        if stop.is_set():
            break
        if speed > 0:
            due = started + (batch[0].ts - start_ts) / speed
            while not stop.is_set() and time.monotonic() < due:
                publisher.poll()
                stop.wait(min(0.1, max(0.0, due - time.monotonic())))
        for message in batch_messages(batch) if settings.agent.batch_records else batch:
            publisher.publish(message)
            records += 1
        count += len(batch)  # samples, however many records carried them
        publisher.poll()
    publisher.flush(30.0)
    if getattr(args, "truth", None):
        sim.truth().save(args.truth)
    stats = getattr(publisher, "stats", {})
    print(
        f"guard agent --simulate: {count} messages in {records} records from {args.nodes} "
        "simulated nodes "
        f"({args.duration:g} s at {speed:g}x) in {time.monotonic() - started:.1f} s; {stats}",
        file=sys.stderr,
    )
    return 0
