"""The demo's pipeline: broker, topics, store, streams workers, sink and orchestrator.

:class:`Pipeline` runs them around a simulator and replays its telemetry at a speed-up
(also used by the end-to-end test); :mod:`guard.demo.run` adds progress and the summary.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition
from pydantic import SecretStr

from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.broker import EmbeddedBroker
from guard.config import Settings
from guard.errors import GuardError
from guard.kafka import create_topics, make_consumer, make_producer, produce
from guard.schemas import Flag, GuardMessage, NodeState, SweepResult, decode
from guard.store import connect, migrate
from guard.streams.processing import parse_progress
from guard.streams.sink import ClickHouseSink
from guard.sweeps import DryRunScheduler, KafkaOrchestrator, SimulatedSweepExecutor

__all__ = [
    "DEFAULT_FAULTS",
    "REAL_JOB_S",
    "DemoConfig",
    "FlagReader",
    "Pipeline",
    "StreamsWorkers",
    "worker_env",
]

#: The demo's scenario: four faults of different kinds on random busy nodes, onsets spread
#: out (seed 1: the degraded NIC in job-b, the 6-node job; the other three in job-a).
DEFAULT_FAULTS = (
    ("thermal_throttle", 0.15, 0.15, "steady"),
    ("slow_gpu", 0.25, 0.10, "steady"),
    ("degraded_nic", 0.35, 0.30, None),
    ("xid", 0.45, 0.0, None),
)


#: A real job's mechanics, s: PyTorch's NCCL watchdog (600 s); a checkpoint every 30 min, a
#: 10-min restart, a re-crash 2 min after a restart on a faulty node and a person's drain of
#: a crash-looping node after 2 h (assumed, as in benchmarks/goodput.py).
REAL_JOB_S = {
    "watchdog_s": 600.0,
    "checkpoint_every_s": 1800.0,
    "restart_s": 600.0,
    "recrash_s": 120.0,
    "human_drain_s": 7200.0,
}


@dataclass
class DemoConfig:
    nodes: int = 32
    duration_s: float = 600.0
    seed: int = 1
    speed: float | None = None  # None: what one streams worker keeps up with here
    sample_interval_s: float = 2.0
    workers: int = 1
    engine: str = "native"  # streams transport: native or faust
    faults: list[FaultSpec] | None = None  # None: DEFAULT_FAULTS on random busy nodes
    random_faults: int = 0
    home: Path | None = None
    bootstrap: str | None = None  # None: GUARD_KAFKA_BOOTSTRAP, else an embedded Tansu
    worker_rate: float = 1200.0  # messages/s one worker sustains on a small, busy machine
    # The demo compresses a long job's mechanics into minutes: the NCCL watchdog, the
    # checkpoint interval, the restart, the re-crash and a person's drain are all divided by
    # ``compression`` (REAL_JOB_S), so both runs see the same physics, only faster. Telemetry,
    # detection, the orchestrator and checkpoint saves (20-40 s) are not compressed.
    compression: float = 10.0

    def job_timings(self) -> dict[str, float]:
        """The job's mechanics in simulated seconds (REAL_JOB_S / compression)."""
        if not self.compression > 0:
            raise ValueError(f"compression must be > 0 (got {self.compression})")
        return {k: v / self.compression for k, v in REAL_JOB_S.items()}

    def sim_config(self, start_ts: float) -> SimConfig:
        faults = self.faults
        if faults is None:
            faults = [
                FaultSpec(
                    kind, onset_s=frac * self.duration_s, slowdown=slow or None, pattern=pattern
                )
                for kind, frac, slow, pattern in DEFAULT_FAULTS
            ]
        return SimConfig(
            nodes=self.nodes,
            duration_s=self.duration_s,
            seed=self.seed,
            start_ts=start_ts,
            sample_interval_s=self.sample_interval_s,
            faults=list(faults),
            random_faults=self.random_faults,
            **self.job_timings(),
            fail_stop=True,  # an Xid or DBE kills the job, with Guard and without
        )

    def pick_speed(self, sim: ClusterSimulator) -> float:
        if self.speed:
            return self.speed
        truth = sim.truth()
        ranks = sum(j.ranks for j in truth.jobs)
        step_s = min((j.step_s_nominal for j in truth.jobs), default=2.0)
        gpus = len(truth.nodes) * truth.gpus_per_node
        per_sim_second = 2 * gpus / self.sample_interval_s + 2 * ranks / step_s
        rate = self.worker_rate * (10 if self.engine == "native" else 1)
        return max(1.0, min(20.0, self.workers * rate / per_sim_second))


def _secured(s: Settings) -> dict[str, str]:
    """The Kafka security and the streams state key of ``s``, as a worker's environment."""
    k = s.kafka
    values: dict[str, Any] = {
        "GUARD_KAFKA_SECURITY_PROTOCOL": k.security_protocol,
        "GUARD_KAFKA_SASL_MECHANISM": k.sasl_mechanism,
        "GUARD_KAFKA_SASL_USERNAME": k.sasl_username,
        "GUARD_KAFKA_SASL_PASSWORD": k.sasl_password,
        "GUARD_KAFKA_SSL_CA_LOCATION": k.ssl_ca_location,
        "GUARD_KAFKA_SSL_CERTIFICATE_LOCATION": k.ssl_certificate_location,
        "GUARD_KAFKA_SSL_KEY_LOCATION": k.ssl_key_location,
        "GUARD_KAFKA_SSL_KEY_PASSWORD": k.ssl_key_password,
        "GUARD_STREAMS_STATE_KEY": s.streams.state_key,
    }
    return {
        name: v.get_secret_value() if isinstance(v, SecretStr) else str(v)
        for name, v in values.items()
        if v is not None
    }


def worker_env(settings: Settings, **overrides: str) -> dict[str, str]:
    """Environment of a ``guard streams`` subprocess that shares ``settings``."""
    s = settings
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("GUARD_")},
        "GUARD_KAFKA_BOOTSTRAP": s.kafka.bootstrap,
        "GUARD_KAFKA_TOPIC_PREFIX": s.kafka.topic_prefix,
        "GUARD_KAFKA_TELEMETRY_PARTITIONS": str(s.kafka.telemetry_partitions),
        "GUARD_KAFKA_CONTROL_PARTITIONS": str(s.kafka.control_partitions),
        "GUARD_HOME": str(s.home),
        "GUARD_STREAMS_APP_ID": s.streams.app_id,
        "GUARD_STREAMS_PROGRESS_S": str(s.streams.progress_s),
        "GUARD_STREAMS_CHECKPOINT_S": str(s.streams.checkpoint_s),
        "GUARD_STREAMS_ENGINE": s.streams.engine,
        # Several workers on one host: a shared metrics port would fail for all but the first.
        "GUARD_STREAMS_WEB_PORT": "0",
        **_secured(s),
        # the [detectors] section, as JSON values (lists and tables need it)
        **{
            f"GUARD_DETECTORS_{k.upper()}": json.dumps(v)
            for k, v in s.detectors.model_dump().items()
        },
        **overrides,
    }


class StreamsWorkers:
    """``guard streams`` subprocesses, with their progress lines parsed."""

    def __init__(self, settings: Settings, count: int, log_dir: Path) -> None:
        self.settings = settings
        self.count = count
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[str]] = []
        self.progress: dict[int, dict[str, Any]] = {}  # each worker's latest report

    def start(self) -> None:
        for i in range(self.count):
            self._start_one(i)

    def _start_one(self, i: int) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "guard.cli", "streams"],
            env=worker_env(self.settings, GUARD_STREAMS_PROGRESS_S="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)
        threading.Thread(target=self._read, args=(i, proc), daemon=True).start()

    def _read(self, i: int, proc: subprocess.Popen[str]) -> None:
        with open(self.log_dir / f"streams-{i}.log", "a") as log:
            assert proc.stderr is not None
            for line in proc.stderr:
                log.write(line)
                report = parse_progress(line)
                if report is not None:
                    self.progress[i] = report

    @property
    def telemetry(self) -> int:
        return sum(int(p["telemetry"]) for p in self.progress.values())

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                tail = (self.log_dir / f"streams-{i}.log").read_text(errors="replace")[-2000:]
                raise GuardError(f"streams worker {i} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class FlagReader(threading.Thread):
    """Collects every flag on the remediation topic (no consumer group: assign + offsets)."""

    def __init__(self, settings: Settings, on_flag: Callable[[Flag], None] | None = None):
        super().__init__(name="guard-demo-flags", daemon=True)
        self.settings = settings
        self.flags: list[Flag] = []
        self.on_flag = on_flag
        self.last_flag_at = time.monotonic()
        self.stop_event = threading.Event()

    def run(self) -> None:
        topic = self.settings.topic("remediation")
        consumer = make_consumer(self.settings, "guard-demo-flags")
        try:
            parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, 0) for p in parts])
            while not self.stop_event.is_set():
                record = consumer.poll(0.2)
                if record is None or record.error():
                    continue
                flag = decode(record.value(), "flag")
                assert isinstance(flag, Flag)
                self.flags.append(flag)
                self.last_flag_at = time.monotonic()
                if self.on_flag is not None:
                    self.on_flag(flag)
        finally:
            consumer.close()


@dataclass
class Pipeline:
    """Broker, topics, store, streams workers, sink and orchestrator around a simulator."""

    settings: Settings
    config: DemoConfig
    events: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)
    state_log: list[NodeState] = field(default_factory=list)  # every transition, in order
    sweeps: list[SweepResult] = field(default_factory=list)
    published: int = 0
    published_ts: float = 0.0
    # per node: its first claim's event time, and the event time published and the wall
    # clock when that claim came back from the streams (what a cordon's lag is made of)
    first_claim: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    cordon_wall: dict[str, float] = field(default_factory=dict)  # first cordon, monotonic

    def __post_init__(self) -> None:
        self.broker: EmbeddedBroker | None = None
        self.client: Any = None
        self.client_override: Any = None  # a caller's open chDB client (one engine per process)
        self.workers: StreamsWorkers | None = None
        self.sink: ClickHouseSink | None = None
        self.orchestrator: KafkaOrchestrator | None = None
        self.flag_reader: FlagReader | None = None
        self._stop = threading.Event()
        self._sink_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.sim: ClusterSimulator | None = None
        self.speed = 1.0
        self.wall_start = 0.0
        self.start_ts = 0.0
        self.error: BaseException | None = None
        self._messages: Iterator[GuardMessage] = iter(())
        self._producer: Any = None  # the publisher's, made on the first publish()
        self._pending: GuardMessage | None = None

    # -- set-up ----------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        s = self.settings
        s.home.mkdir(parents=True, exist_ok=True)
        s.streams.engine = cfg.engine  # type: ignore[assignment]
        bootstrap = cfg.bootstrap or os.environ.get("GUARD_KAFKA_BOOTSTRAP")
        if not bootstrap:
            self.broker = EmbeddedBroker(log_path=s.home / "tansu.log").start()
            bootstrap = self.broker.bootstrap
        s.kafka.bootstrap = bootstrap
        create_topics(s)
        self.client = self.client_override or connect(s)
        migrate(self.client, s)
        self.start_ts = float(int(time.time()))
        self.sim = ClusterSimulator(cfg.sim_config(self.start_ts))
        self.speed = cfg.pick_speed(self.sim)
        self.workers = StreamsWorkers(s, cfg.workers, s.home)
        self.workers.start()
        self.sink = ClickHouseSink(s, self.client, group_id="guard-demo-sink")
        self.flag_reader = FlagReader(s, on_flag=self._on_flag)
        self.flag_reader.start()
        self.orchestrator = self._new_orchestrator()
        self._spawn(self._run_sink, "guard-demo-sink")
        self._wait_for_workers()
        self.wall_start = time.monotonic() + 1.0

    def _wait_for_workers(self, timeout_s: float = 90.0) -> None:
        """Start the replay once every worker runs its loop (its first progress report): a
        cold start (imports, joining the group) would otherwise be a backlog, and at the
        replay's speed-up each wall second of it delays every flag by ``speed`` simulated s."""
        assert self.workers is not None
        deadline = time.monotonic() + timeout_s
        while len(self.workers.progress) < self.workers.count:
            self.workers.check_alive()
            if time.monotonic() > deadline:
                raise GuardError(f"the streams workers did not start within {timeout_s:g} s")
            time.sleep(0.1)

    def _new_orchestrator(self) -> KafkaOrchestrator:
        assert self.sim is not None
        truth = self.sim.truth()
        nodes = list(truth.nodes)
        # Event time of what has been published: when the publisher falls behind ``speed``
        # (a busy machine), a wall-clock clock would run ahead of the flags and stamp
        # node states, and the cordons the simulator applies, late.
        orch = KafkaOrchestrator(
            self.settings,
            scheduler=DryRunScheduler(nodes),
            executor=SimulatedSweepExecutor.from_truth(truth, duration_s=0.0),
            clock=self.published_clock,
            nodes=nodes,
            listeners=[self._on_orchestrator_message],
        ).start()
        if not orch.ready.wait(60) or orch.error is not None:
            raise GuardError(f"the orchestrator did not start: {orch.error}")
        return orch

    def restart_orchestrator(self) -> None:
        """Stop the orchestrator and start a new one that recovers from the topic."""
        assert self.orchestrator is not None and self.sim is not None
        self.orchestrator.stop()
        self.orchestrator = self._new_orchestrator()
        self.events.append("orchestrator restarted; state recovered from the node-state topic")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:
                self.error = exc
                self._stop.set()
                self._sink_stop.set()

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- running ---------------------------------------------------------------------------

    def publish(self, until_sim_s: float | None = None) -> None:
        """Replay the simulator into Kafka at ``speed``, up to ``until_sim_s`` (or the end)."""
        assert self.sim is not None
        if self._producer is None:
            self._messages = self.sim.messages()
            self._producer = make_producer(self.settings)
        producer = self._producer
        limit = None if until_sim_s is None else self.start_ts + until_sim_s
        while not self._stop.is_set():
            message = self._pending or next(self._messages, None)
            self._pending = None
            if message is None:
                break
            if limit is not None and message.ts > limit:
                self._pending = message
                break
            wait = self.wall_start + (message.ts - self.start_ts) / self.speed - time.monotonic()
            if wait > 0.005:
                producer.poll(0)
                time.sleep(min(wait, 0.5))
            produce(producer, self.settings, message)
            self.published += 1
            self.published_ts = max(self.published_ts, message.ts)
        producer.flush(60)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise GuardError(f"a pipeline part failed: {self.error}") from self.error

    def sim_now(self) -> float:
        """Simulated seconds published so far."""
        return max(0.0, self.published_ts - self.start_ts)

    def published_clock(self) -> float:
        """The orchestrator's clock: the event time of the latest published message."""
        return max(self.published_ts, self.start_ts)

    def drain(self, timeout_s: float = 120.0, quiet_s: float = 4.0) -> bool:
        """Wait until the workers have read everything published and flags stopped coming."""
        assert self.workers is not None and self.flag_reader is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.workers.check_alive()
            caught_up = self.workers.telemetry >= self.published
            if caught_up and time.monotonic() - self.flag_reader.last_flag_at >= quiet_s:
                return True
            time.sleep(0.5)
        return False

    def _run_sink(self) -> None:
        assert self.sink is not None
        self.sink.run(self._sink_stop)

    def finish_sink(self, timeout_s: float = 30.0) -> None:
        """Stop the sink after it stored what it holds (its own thread drains and closes)."""
        self._sink_stop.set()
        for thread in self._threads:
            if thread.name == "guard-demo-sink":
                thread.join(timeout_s)

    def _on_flag(self, flag: Flag) -> None:
        if flag.severity != "info" and flag.node:
            self.first_claim.setdefault(
                flag.node, (flag.ts, self.published_clock(), time.monotonic())
            )
        if flag.severity != "info":
            where = flag.node + (f" gpu{flag.gpu}" if flag.gpu is not None else "")
            where += f" {flag.device}" if flag.device else ""
            self.events.append(
                f"t+{flag.ts - self.start_ts:5.0f}s flag {flag.severity} {flag.category}: {where}"
            )

    def _on_orchestrator_message(self, message: GuardMessage) -> None:
        if isinstance(message, NodeState):
            self.states[message.node] = message.state
            self.state_log.append(message)
            self.events.append(
                f"t+{self.sim_now():5.0f}s {message.node}: {message.prev} → {message.state}"
            )
            if message.state == "cordoned":
                self.cordon_wall.setdefault(message.node, time.monotonic())
            if message.state == "cordoned" and self.sim is not None:
                self.sim.remediate(message.node)  # a spare takes over the node's ranks
        elif isinstance(message, SweepResult):
            self.sweeps.append(message)

    # -- tear-down -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every part, Kafka clients before the broker: none is left to log its loss."""
        self._stop.set()
        self._sink_stop.set()
        if self.flag_reader is not None:
            self.flag_reader.stop_event.set()
            self.flag_reader.join(10)
        if self.orchestrator is not None:
            self.orchestrator.stop()
        for thread in self._threads:
            thread.join(30)
        if self.workers is not None:
            self.workers.stop()
        if self._producer is not None:
            self._producer.flush(10)
            self._producer.close()
            self._producer = None
        if self.client is not None and self.client is not self.client_override:
            self.client.close()
        # The orchestrator's producer goes when its object does; the object sits in a cycle
        # (core -> publish -> orchestrator), so collect it now, before the broker goes.
        self.orchestrator = None
        gc.collect()
        if self.broker is not None:
            self.broker.stop()
