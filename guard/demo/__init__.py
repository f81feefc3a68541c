"""``guard demo``: the whole pipeline on a simulated cluster, under one command.

An embedded Tansu broker (or the broker ``GUARD_KAFKA_BOOTSTRAP`` names), chDB in this
process, a simulated cluster with injected faults and confounders replayed at a speed-up
through the same producer path as a node agent, ``guard streams`` workers (subprocesses),
the ClickHouse sink and the sweep orchestrator. When the orchestrator cordons a node the
simulator swaps a spare in (the job restarts from its checkpoint), so the run shows the
effect of remediation against a counterfactual run of the same seed without it.

:class:`Pipeline` is the reusable part (also used by the end-to-end test); :func:`run_demo`
adds progress and the summary.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.broker import EmbeddedBroker
from guard.config import Settings
from guard.evaluation.scoring import evaluate
from guard.kafka import create_topics, make_consumer, make_producer, produce
from guard.schemas import Flag, GuardMessage, NodeState, SweepResult, decode
from guard.store import connect, migrate
from guard.streams.sink import ClickHouseSink
from guard.sweeps import DryRunScheduler, KafkaOrchestrator, SimulatedClock, SimulatedSweepExecutor

__all__ = ["DEFAULT_FAULTS", "DemoConfig", "Pipeline", "run_demo", "worker_env"]

#: The demo's scenario: four faults of different kinds in the big job, onsets spread out.
DEFAULT_FAULTS = (
    ("thermal_throttle", 0.15, 0.15, "steady"),
    ("slow_gpu", 0.25, 0.10, "steady"),
    ("degraded_nic", 0.35, 0.30, None),
    ("xid", 0.45, 0.0, None),
)

PROGRESS = re.compile(
    r"guard streams: (\d+) telemetry messages, (\d+) findings, (\d+) flags, (\d+) dead letters"
)


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
    # A job restart after a cordon (checkpoint reload, spare swap-in), in simulated seconds:
    # shorter than a real one because the demo compresses a long job into minutes.
    restart_s: float = 20.0

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
            restart_s=self.restart_s,
        )

    def pick_speed(self, sim: ClusterSimulator) -> float:
        if self.speed:
            return self.speed
        truth = sim.truth()
        ranks = sum(int(j.get("ranks", 0)) for j in truth["jobs"])
        step_s = min((float(j["step_s_nominal"]) for j in truth["jobs"]), default=2.0)
        gpus = len(truth["nodes"]) * int(truth.get("gpus_per_node", 8))
        per_sim_second = 2 * gpus / self.sample_interval_s + 2 * ranks / step_s
        rate = self.worker_rate * (10 if self.engine == "native" else 1)
        return max(1.0, min(20.0, self.workers * rate / per_sim_second))


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
        **overrides,
    }


class StreamsWorkers:
    """``guard streams`` subprocesses, with their progress lines parsed."""

    def __init__(self, settings: Settings, count: int, log_dir: Path) -> None:
        self.settings = settings
        self.count = count
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[str]] = []
        self.progress: dict[int, tuple[int, int, int, int]] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.count):
            self.start_one(i)

    def start_one(self, i: int) -> None:
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
        thread = threading.Thread(target=self._read, args=(i, proc), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read(self, i: int, proc: subprocess.Popen[str]) -> None:
        with open(self.log_dir / f"streams-{i}.log", "a") as log:
            assert proc.stderr is not None
            for line in proc.stderr:
                log.write(line)
                match = PROGRESS.search(line)
                if match:
                    self.progress[i] = tuple(int(g) for g in match.groups())  # type: ignore[assignment]

    @property
    def telemetry(self) -> int:
        return sum(p[0] for p in self.progress.values())

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                tail = (self.log_dir / f"streams-{i}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"streams worker {i} exited with {proc.returncode}:\n{tail}")

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
        self.arrivals: list[float] = []  # wall time (epoch) each flag was read
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
                self.arrivals.append(time.time())
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
    sweeps: list[SweepResult] = field(default_factory=list)
    published: int = 0
    done_publishing: bool = False

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
        truth = self.sim.truth()
        nodes = list(truth["nodes"])
        self.workers = StreamsWorkers(s, cfg.workers, s.home)
        self.workers.start()
        self.sink = ClickHouseSink(s, self.client, group_id="guard-demo-sink")
        self.flag_reader = FlagReader(s, on_flag=self._on_flag)
        self.flag_reader.start()
        self.wall_start = time.monotonic() + 1.0
        self.orchestrator = self._new_orchestrator(truth, nodes)
        self._spawn(self._run_sink, "guard-demo-sink")

    def _new_orchestrator(self, truth: dict[str, Any], nodes: list[str]) -> KafkaOrchestrator:
        clock = SimulatedClock(self.start_ts, self.speed, wall_start=self._wall_epoch())
        orch = KafkaOrchestrator(
            self.settings,
            scheduler=DryRunScheduler(nodes),
            executor=SimulatedSweepExecutor.from_truth(truth, duration_s=0.0),
            clock=clock,
            nodes=nodes,
            listeners=[self._on_orchestrator_message],
        ).start()
        if not orch.ready.wait(60) or orch.error is not None:
            raise RuntimeError(f"the orchestrator did not start: {orch.error}")
        return orch

    def restart_orchestrator(self) -> None:
        """Stop the orchestrator and start a new one that recovers from the topic."""
        assert self.orchestrator is not None and self.sim is not None
        self.orchestrator.stop()
        truth = self.sim.truth()
        self.orchestrator = self._new_orchestrator(truth, list(truth["nodes"]))
        self.events.append("orchestrator restarted; state recovered from the node-state topic")

    def _wall_epoch(self) -> float:
        # SimulatedClock takes an epoch wall time; our pacing uses the monotonic clock.
        return time.time() + (self.wall_start - time.monotonic())

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
        if not hasattr(self, "_messages"):
            self._messages = self.sim.messages()
            self._producer = make_producer(self.settings)
            self._pending: GuardMessage | None = None
        producer = self._producer
        limit = None if until_sim_s is None else self.start_ts + until_sim_s
        while not self._stop.is_set():
            message = self._pending or next(self._messages, None)
            self._pending = None
            if message is None:
                self.done_publishing = True
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
        producer.flush(60)
        if self.error is not None:
            raise RuntimeError(f"a pipeline part failed: {self.error}") from self.error

    def wall_epoch_of(self, ts: float) -> float:
        """When (epoch wall time) the message of event time ``ts`` was due to be published."""
        return self._wall_epoch() + (ts - self.start_ts) / self.speed

    def sim_now(self) -> float:
        return (time.monotonic() - self.wall_start) * self.speed

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
        if flag.severity != "info":
            where = flag.node + (f" gpu{flag.gpu}" if flag.gpu is not None else "")
            where += f" {flag.device}" if flag.device else ""
            self.events.append(
                f"t+{flag.ts - self.start_ts:5.0f}s flag {flag.severity} {flag.category}: {where}"
            )

    def _on_orchestrator_message(self, message: GuardMessage) -> None:
        if isinstance(message, NodeState):
            self.states[message.node] = message.state
            self.events.append(
                f"t+{self.sim_now():5.0f}s {message.node}: {message.prev} → {message.state}"
            )
            if message.state == "cordoned" and self.sim is not None:
                self.sim.remediate(message.node)  # a spare takes over the node's ranks
        elif isinstance(message, SweepResult):
            self.sweeps.append(message)

    # -- tear-down -------------------------------------------------------------------------

    def stop(self) -> None:
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
        if self.client is not None and self.client is not self.client_override:
            self.client.close()
        if self.broker is not None:
            self.broker.stop()


def step_stats(step_log: list[tuple[float, float]], after_ts: float) -> dict[str, float | int]:
    values = [s for ts, s in step_log if ts >= after_ts]
    if len(values) < 2:
        return {"steps": len(values), "mean_s": values[0] if values else 0.0, "cv": 0.0}
    mean = statistics.fmean(values)
    return {"steps": len(values), "mean_s": mean, "cv": statistics.pstdev(values) / mean}


def summarize(pipe: Pipeline, wall_s: float) -> dict[str, Any]:
    """Everything the demo reports, as plain data."""
    assert pipe.sim is not None and pipe.flag_reader is not None and pipe.orchestrator is not None
    truth = pipe.sim.truth()
    flags = [f.model_dump() for f in pipe.flag_reader.flags]
    ev = evaluate(truth, flags)
    snapshot = pipe.orchestrator.core.snapshot()
    faults = []
    for fault in truth["faults"]:
        hit = ev.first_hit.get(fault["id"])
        node_state = snapshot.get(fault["node"])
        faults.append(
            {
                "id": fault["id"],
                "node": fault["node"],
                "kind": fault["kind"],
                "category": fault["category"],
                "onset_s": round(fault["onset"] - truth["start_ts"], 1),
                "slowdown": fault["slowdown"],
                "detected": hit is not None,
                "time_to_detect_s": None
                if hit is None
                else round(max(0.0, hit - fault["onset"]), 1),
                "final_state": getattr(node_state, "state", "healthy"),
            }
        )
    swept = sorted({s.node for s in pipe.sweeps})
    final = {node: getattr(v, "state", str(v)) for node, v in snapshot.items()}
    released = sorted(n for n in swept if final.get(n) == "healthy")
    repair = sorted(n for n, st in final.items() if st == "repair")
    first_onset = min((f["onset"] for f in truth["faults"]), default=truth["start_ts"])

    # The counterfactual: the same seed and scenario, nobody remediates.
    counterfactual = ClusterSimulator(pipe.config.sim_config(pipe.start_ts))
    for _ in counterfactual.messages():
        pass
    step_time = {}
    for job in truth["jobs"]:
        name = job["job"]
        step_time[name] = {
            "with_guard": step_stats(pipe.sim.step_times(name), first_onset),
            "without_guard": step_stats(counterfactual.step_times(name), first_onset),
            # restarts after a cordon cost steps: goodput is the honest bottom line
            "steps_total_with": len(pipe.sim.step_times(name)),
            "steps_total_without": len(counterfactual.step_times(name)),
        }
    rows = {}
    db = pipe.settings.clickhouse.database
    for table in (
        "gpu_samples",
        "nic_samples",
        "step_timings",
        "collective_timings",
        "flags",
        "sweeps",
        "node_states",
    ):
        rows[table] = int(
            pipe.client.query(f"SELECT count() FROM `{db}`.`{table}`").result_rows[0][0]
        )
    claims = [f for f in flags if f["severity"] != "info" and f.get("node")]
    return {
        "cluster": {
            "nodes": len(truth["nodes"]),
            "gpus": len(truth["nodes"]) * truth["gpus_per_node"],
            "jobs": {j["job"]: len(j["nodes"]) for j in truth["jobs"]},
            "simulated_s": pipe.config.duration_s,
            "speed": round(pipe.speed, 2),
        },
        "messages_published": pipe.published,
        "faults_injected": len(truth["faults"]),
        "faults_detected": sum(f["detected"] for f in faults),
        "faults": faults,
        "confounders": dict(Counter(c["kind"] for c in truth["confounders"])),
        "flags": {
            "claims": len(claims),
            "info": len(flags) - len(claims),
            "false_claims": len(ev.false_claims),
            "false_claim_examples": ev.false_claims[:5],
        },
        "precision": ev.precision,
        "recall": ev.rows["all"].recall,
        "nodes": {
            "swept": swept,
            "released": released,
            "repair": repair,
            "sweeps_run": len(pipe.sweeps),
        },
        "step_time": step_time,
        "clickhouse_rows": rows,
        "wall_s": round(wall_s, 1),
    }


def _print_summary(summary: dict[str, Any], out: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out)
    c = summary["cluster"]
    console.rule("[bold]Guard demo: summary")
    console.print(
        f"{c['nodes']} nodes / {c['gpus']} GPUs, jobs {c['jobs']}, {c['simulated_s']:.0f} s "
        f"simulated at {c['speed']}x in {summary['wall_s']} s; "
        f"{summary['messages_published']:,} telemetry messages through Kafka"
    )
    table = Table("fault", "node", "onset", "slowdown", "detected", "time to detect", "outcome")
    for f in summary["faults"]:
        table.add_row(
            f"{f['kind']} ({f['category']})",
            f["node"],
            f"t+{f['onset_s']:.0f}s",
            f"{f['slowdown']:.0%}",
            "yes" if f["detected"] else "[red]no",
            "-" if f["time_to_detect_s"] is None else f"{f['time_to_detect_s']:.0f} s",
            f["final_state"],
        )
    console.print(table)
    fl = summary["flags"]
    console.print(
        f"faults detected {summary['faults_detected']}/{summary['faults_injected']}; "
        f"claims {fl['claims']} (false {fl['false_claims']}), observations {fl['info']}; "
        f"confounders injected: {summary['confounders']}"
    )
    n = summary["nodes"]
    console.print(
        f"sweeps run {n['sweeps_run']}: swept {n['swept'] or '-'}, released "
        f"{n['released'] or '-'}, sent to repair {n['repair'] or '-'}"
    )
    steps = Table(
        "job", "mean step, with Guard", "CV", "without", "CV", "steps done (with / without)"
    )
    for job, st in summary["step_time"].items():
        w, wo = st["with_guard"], st["without_guard"]
        steps.add_row(
            job,
            f"{w['mean_s']:.3f} s",
            f"{w['cv']:.1%}",
            f"{wo['mean_s']:.3f} s",
            f"{wo['cv']:.1%}",
            f"{st['steps_total_with']} / {st['steps_total_without']}",
        )
    console.print("step time after the first fault, same seed, with and without remediation:")
    console.print(steps)
    console.print(f"ClickHouse rows: {summary['clickhouse_rows']}")
    console.print(
        f"peak memory: demo {summary['peak_rss_mb']['demo']} MB, "
        f"largest worker {summary['peak_rss_mb']['largest_worker']} MB"
    )


def run_demo(settings: Settings, config: DemoConfig, as_json: bool = False) -> dict[str, Any]:
    """Run the demo end to end and return (and print) its summary."""
    import json

    home = config.home or Path(tempfile.mkdtemp(prefix="guard-demo-"))
    settings.home = home
    settings.clickhouse.dsn = f"chdb://{home / 'chdb'}"
    settings.streams.app_id = "guard-demo-streams"
    settings.kafka.telemetry_partitions = min(settings.kafka.telemetry_partitions, 4)
    settings.clickhouse.batch_seconds = 1.0
    out = sys.stderr
    pipe = Pipeline(settings, config)
    started = time.monotonic()
    print(
        f"guard demo: starting broker, store, streams worker(s), sink and orchestrator "
        f"(data in {home})",
        file=out,
        flush=True,
    )
    try:
        pipe.start()
        print(
            f"guard demo: {config.nodes} simulated nodes, {config.duration_s:.0f} s at "
            f"{pipe.speed:.1f}x",
            file=out,
            flush=True,
        )
        _with_progress(pipe, out, live=not as_json and out.isatty())
        drained = pipe.drain()
        if not drained:
            print("guard demo: warning: the pipeline did not drain in time", file=out)
        pipe.finish_sink()
        summary = summarize(pipe, time.monotonic() - started)
    finally:
        pipe.stop()
    summary["peak_rss_mb"] = {
        "demo": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "largest_worker": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
    }
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_summary(summary, sys.stdout)
    return summary


def _with_progress(pipe: Pipeline, out: Any, live: bool) -> None:
    publisher = threading.Thread(target=pipe.publish, name="guard-demo-publish", daemon=True)
    publisher.start()
    duration = pipe.config.duration_s
    if live:
        from rich.live import Live
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        def render() -> Panel:
            grid = Table.grid(padding=(0, 2))
            sim_s = min(duration, max(0.0, pipe.sim_now()))
            grid.add_row(
                ProgressBar(total=duration, completed=sim_s, width=40),
                f"t+{sim_s:.0f}/{duration:.0f} s simulated",
            )
            assert pipe.workers is not None and pipe.flag_reader is not None
            grid.add_row(
                "messages",
                f"{pipe.published:,} published, "
                f"{pipe.workers.telemetry:,} processed by the streams",
            )
            claims = sum(1 for f in pipe.flag_reader.flags if f.severity != "info")
            grid.add_row(
                "flags", f"{claims} claims, {len(pipe.flag_reader.flags) - claims} observations"
            )
            states = Counter(pipe.states.values())
            grid.add_row("nodes", ", ".join(f"{k} {v}" for k, v in sorted(states.items())) or "-")
            grid.add_row("events", "\n".join(pipe.events[-8:]) or "-")
            return Panel(grid, title="guard demo")

        with Live(render(), refresh_per_second=4, console=None, transient=False) as view:
            while publisher.is_alive():
                publisher.join(0.25)
                view.update(render())
    else:
        last = 0.0
        shown = 0
        while publisher.is_alive():
            publisher.join(0.5)
            for line in pipe.events[shown:]:
                print(f"  {line}", file=out, flush=True)
            shown = len(pipe.events)
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                assert pipe.workers is not None
                print(
                    f"guard demo: t+{min(duration, pipe.sim_now()):.0f}/{duration:.0f} s, "
                    f"{pipe.published:,} published, {pipe.workers.telemetry:,} processed",
                    file=out,
                    flush=True,
                )
    if pipe.error is not None:
        raise RuntimeError(f"a pipeline part failed: {pipe.error}") from pipe.error
