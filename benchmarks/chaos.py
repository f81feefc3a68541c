"""Chaos scenarios against a live `guard streams` worker on a real broker, with figures.

Each scenario is bounded in time (``--timeout``) and prints what it measured. The claims
of the undisturbed pipeline are the backtest's over the same telemetry (same detector code):
``(node, category)`` of every warning/critical flag.

* ``hostile`` — N hostile messages interleaved with a simulated cluster's telemetry (with
  faults) into one live worker: garbage, non-UTF-8, deep nesting, huge strings, NaN, wrong
  types, missing fields (all invalid: each must be a dead letter with a reason), plus
  schema-valid abuse (counters going backwards, times in the far past and future) under
  node names of their own. Figures: worker alive, dead letters vs invalid messages sent, DLQ
  records without a reason, claims on the real nodes vs the backtest's, worker peak RSS.
* ``broker_stop`` — a broker of the run's own (``deploy/kafka/kafka.sh`` in a folder of its
  own) is halted mid-stream for ``--outage`` s and resumed with its data, while a simulated
  cluster publishes through the agent's real publisher (delivery timeout 5 s, so records go
  through the on-disk spool) and a live worker consumes. Figures: records published vs on
  the topics (lost, duplicated), records spooled, worker alive, claims vs the backtest's,
  broker-up-to-spool-replayed and broker-up-to-worker-caught-up times.
* ``store_down`` — ``guard sink`` stores into chDB on a filesystem of its own that is
  filled up for ``--store-outage`` s (every insert raises ``NOT_ENOUGH_SPACE``, what an
  embedded ClickHouse really meets) while telemetry keeps coming. Figures: rows per table vs
  produced (missing, duplicated: physical rows without ``FINAL``), insert failures, sink
  alive, free-to-caught-up time. Needs root (mounts a tmpfs).
* ``sigkill`` — the worker is SIGKILLed half-way and a new one started: figures are the keys
  it resumed from checkpoints, the age bound of that state (``checkpoint_s``), the claims
  vs the backtest's, and the restart-to-first-progress time.
* ``flag_storm`` — half of a ``--storm-nodes`` cluster flagged within ``--storm-s`` into a
  live ``guard orchestrator`` (simulated executor): the most nodes out of the pool at once
  (from the node-state history, and sampled from ``/metrics``) vs the cordon cap, the
  longest ``/metrics`` answer, how soon a flag sent mid-storm is answered, what the cap
  held back (gauge, reasons, the warning), time until every node is back.
* ``orch_sigkill`` — the orchestrator SIGKILLed mid-sweep and restarted (the run of
  ``tests/sweeps/live.py``, shared with its test): the sweep resumes, the node's states.
* ``names`` — ``--names`` distinct node names at ``--names-rate`` through a live worker with
  ``streams.key_idle_s = --key-idle-s``: RSS and keys held at 10/50/100 % of the names,
  then every key expired.

Each result line is JSON with ``ok`` (every must-hold figure held); the exit status is 1 if
one did not. ``--short`` runs seconds-long versions (tests/test_chaos.py runs those in CI).

Uses $GUARD_KAFKA_BOOTSTRAP (real Apache Kafka:
``export GUARD_KAFKA_BOOTSTRAP=$(deploy/kafka/kafka.sh start)``), else an embedded Tansu broker;
``broker_stop`` always starts a broker of its own (Java and Maven, as kafka.sh needs).

    .venv/bin/python benchmarks/chaos.py [--scenarios broker_stop,hostile] [--short]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from guard.agents.publisher import Publisher
from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.broker import free_port
from guard.config import Settings, load_settings
from guard.demo import worker_env
from guard.detectors.core import MessageFeed
from guard.kafka import (
    TELEMETRY_TOPICS,
    create_topics,
    make_consumer,
    make_producer,
    produce,
    produce_raw,
    to_record,
)
from guard.schemas import GpuSample, GuardMessage, NodeState, decode
from guard.schemas.tables import rows_by_table
from guard.streams.processing import parse_progress
from guard.sweeps.policy import SweepPolicy
from guard.sweeps.service import read_node_states

ROOT = Path(__file__).resolve().parents[1]
# tests.sweeps.live: the live orchestrator, shared with its test. The checkout's root stays on
# the path only for these imports: on it, its room folders (schemas/, detectors/ …) would be
# importable outside the guard namespace.
_ROOT_ADDED = str(ROOT) not in sys.path
if _ROOT_ADDED:
    sys.path.insert(0, str(ROOT))

from tests.sweeps.helpers import flag, wait_until  # noqa: E402
from tests.sweeps.live import (  # noqa: E402
    kill_mid_sweep,
    send,
    start_orchestrator,
    states_on_topic,
    write_truth,
)

if _ROOT_ADDED:
    sys.path.remove(str(ROOT))

Claims = set[tuple[str, str]]


def scenario_messages(nodes: int, duration: float) -> list[GuardMessage]:
    start = float(int(time.time() - duration - 60))
    sim = ClusterSimulator(
        SimConfig(
            nodes=nodes,
            duration_s=duration,
            seed=4,
            start_ts=start,
            random_faults=0,
            faults=[
                FaultSpec("thermal_throttle", node="node-002", onset_s=40, slowdown=0.15),
                FaultSpec("xid", node="node-005", onset_s=90),
                FaultSpec("degraded_nic", node="node-006", onset_s=120, slowdown=0.3),
            ],
        )
    )
    return list(sim.messages())


def backtest_claims(messages: list[GuardMessage]) -> Claims:
    engine = MessageFeed()
    flags = [f for m in messages for f in engine.update(m)] + engine.flush()
    return {(f.node, f.category) for f in flags if f.severity != "info" and f.node}


def _gpu_json(node: str, gpu: int, ts: float) -> bytes:
    return json.dumps({"kind": "gpu", "v": 1, "ts": ts, "node": node, "gpu": gpu}).encode()


def hostile_records(n: int, seed: int = 7) -> Iterator[tuple[str, bytes, bytes, bool]]:
    """(topic name, key, value, invalid?) of ``n`` hostile messages."""
    rng = random.Random(seed)
    now = time.time()
    huge = "x" * 100_000
    invalid: list[tuple[float, Callable[[int], tuple[str, bytes]]]] = [
        (10, lambda i: ("gpu", rng.randbytes(rng.randint(1, 200)))),
        (10, lambda i: ("nic", b"\xff\xfe\x00" + rng.randbytes(20))),
        (5, lambda i: ("steps", b"[" * 3000)),
        (
            0.1,
            lambda i: (
                "gpu",
                json.dumps({"kind": "gpu", "ts": now, "node": huge, "gpu": 0}).encode(),
            ),
        ),
        (10, lambda i: ("gpu", b'{"kind":"gpu","v":1,"ts":NaN,"node":"h","gpu":0}')),
        (
            10,
            lambda i: (
                "gpu",
                json.dumps({"kind": "gpu", "ts": "soon", "node": "h", "gpu": "0"}).encode(),
            ),
        ),
        (10, lambda i: ("collectives", b'{"kind":"collective","ts":1.0}')),
        (
            10,
            lambda i: (
                "nic",
                json.dumps({"kind": "nic", "ts": now, "node": "h", "counters": [1]}).encode(),
            ),
        ),
    ]
    valid: list[tuple[float, Callable[[int], tuple[str, bytes]]]] = [
        (
            1,
            lambda i: (
                "nic",
                json.dumps(
                    {
                        "kind": "nic",
                        "v": 1,
                        "ts": now + i * 1e-3,
                        "node": f"hostile-{i % 50}",
                        "device": "mlx5_0",
                        "port": 1,
                        "counters": {"port_xmit_data": 10**12 - i, "symbol_error": 0},
                    }
                ).encode(),
            ),
        ),
        (1, lambda i: ("gpu", _gpu_json(f"hostile-{i % 50}", 0, 1.0))),  # the far past
        (1, lambda i: ("gpu", _gpu_json(f"hostile-{i % 50}", 1, now + 10 * 365 * 86400.0))),
    ]
    for i in range(n):
        bad = rng.random() < 0.8
        pool = invalid if bad else valid
        [make] = rng.choices([f for _, f in pool], weights=[w for w, _ in pool])
        topic, value = make(i)
        yield topic, (b"hostile" if bad else f"hostile-{i % 50}".encode()), value, bad


class Worker:
    """One ``guard streams`` subprocess; its progress lines and peak RSS are followed."""

    def __init__(
        self,
        settings: Settings,
        app_id: str,
        log: Path,
        checkpoint_s: float,
        command: str = "streams",
        **env_overrides: str,
    ) -> None:
        env = worker_env(
            settings,
            GUARD_STREAMS_APP_ID=app_id,
            GUARD_STREAMS_PROGRESS_S="1",
            GUARD_STREAMS_CHECKPOINT_S=str(checkpoint_s),
            **env_overrides,
        )
        self.log = log
        self.out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "guard.cli", command],
            env=env,
            stdout=self.out,
            stderr=self.out,
        )
        self.peak_rss_mb = 0.0

    def progress(self) -> dict[str, Any]:
        status = Path(f"/proc/{self.proc.pid}/status")
        if status.exists():
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)
        lines = self.log.read_text(errors="replace").splitlines()
        reports = [r for r in map(parse_progress, lines) if r is not None]
        return reports[-1] if reports else {}

    def rss_mb(self) -> float:
        """Resident memory now (the peak is ``peak_rss_mb``, updated by :meth:`progress`)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def wait(self, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}); log {self.log}")
            if check(self.progress()):
                return time.monotonic()
            time.sleep(0.5)
        raise TimeoutError(f"worker did not get there in {timeout_s:.0f} s; log {self.log}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)
        self.out.close()


def read_topic(settings: Settings, *names: str, timeout_s: float = 60) -> list[Any]:
    """Every record of Guard topics ``names`` up to their ends as of now (high watermarks)."""
    consumer = make_consumer(settings, f"chaos-{uuid.uuid4().hex[:8]}")
    ends: dict[tuple[str, int], int] = {}
    for topic in map(settings.topic, names):
        for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[(topic, p)] = high
    consumer.assign([TopicPartition(t, p, 0) for t, p in ends])
    records, deadline = [], time.monotonic() + timeout_s
    while ends and time.monotonic() < deadline:
        r = consumer.poll(0.5)
        if r is None or r.error():
            continue
        records.append(r)
        where = (r.topic(), r.partition())
        if where in ends and r.offset() + 1 >= ends[where]:
            del ends[where]
    # then on until a quiet second: Tansu (the embedded broker) answered high watermarks of 1
    # for partitions holding ~500 records here, so its ends are a floor only; Apache Kafka's
    # are exact and this costs one empty poll
    while not ends and time.monotonic() < deadline:
        r = consumer.poll(1.0)
        if r is None:
            break
        if not r.error():
            records.append(r)
    consumer.close()
    if ends:
        raise TimeoutError(f"could not read {sorted(ends)} to their ends in {timeout_s:.0f} s")
    return records


def claims_on(settings: Settings, nodes: set[str]) -> Claims:
    flags = [decode(r.value(), "flag") for r in read_topic(settings, "remediation")]
    return {(f.node, f.category) for f in flags if f.severity != "info" and f.node in nodes}  # type: ignore[attr-defined]


def _settings(bootstrap: str, home: Path, **sections: Any) -> Settings:
    s = load_settings(
        home=home,
        **sections,
        kafka={"bootstrap": bootstrap, "topic_prefix": f"chaos{uuid.uuid4().hex[:8]}.",
               "telemetry_partitions": 3},
    )  # fmt: skip
    home.mkdir(parents=True, exist_ok=True)
    create_topics(s)
    return s


KAFKA_SH = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "kafka.sh"


class OwnBroker:
    """An Apache Kafka of this run's own (``deploy/kafka/kafka.sh`` in a folder of its own),
    so that a scenario may stop and restart it without touching anybody else's broker."""

    def __init__(self, work: Path) -> None:
        shared_lib = Path(os.environ.get("GUARD_CI_KAFKA_DIR", KAFKA_SH.parent / ".run")) / "lib"
        self.env = {
            **os.environ,
            "GUARD_CI_KAFKA_DIR": str(work),
            "GUARD_CI_KAFKA_LIB": os.environ.get("GUARD_CI_KAFKA_LIB", str(shared_lib)),
        }
        for name in ("GUARD_CI_KAFKA_PORT", "GUARD_CI_KAFKA_SASL_PORT"):
            self.env.pop(name, None)  # free ports of its own
        self.bootstrap = ""

    def _sh(self, command: str) -> str:
        done = subprocess.run(
            [str(KAFKA_SH), command],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"kafka.sh {command} failed: {done.stderr[-2000:]}")
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def start(self) -> OwnBroker:
        self.bootstrap = self._sh("start")
        return self

    def halt(self) -> None:
        self._sh("halt")

    def resume(self) -> None:
        if self._sh("resume") != self.bootstrap:
            raise RuntimeError("the resumed broker answers at another address")

    def stop(self) -> None:
        self._sh("stop")


def _topic_values(settings: Settings, names: Iterable[str]) -> list[bytes]:
    return [r.value() for r in read_topic(settings, *names)]


def run_broker_stop(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Agents publish through their real spool path; the broker is away ``--outage`` s."""
    broker = OwnBroker(home / "kafka").start()
    try:
        return _broker_stop(broker, home, args)
    finally:
        broker.stop()


def _publish_paced(publisher: Publisher, messages: list[GuardMessage], over_s: float) -> None:
    chunks = max(1, int(over_s * 4))
    size = -(-len(messages) // chunks)
    t0 = time.monotonic()
    for i in range(chunks):
        for m in messages[i * size : (i + 1) * size]:
            publisher.publish(m)
        publisher.poll()
        while time.monotonic() < t0 + (i + 1) * over_s / chunks:
            publisher.poll()
            time.sleep(0.05)


def _broker_stop(broker: OwnBroker, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = _settings(broker.bootstrap, home, agent={"delivery_timeout_s": 5.0})
    messages = scenario_messages(args.nodes, args.duration)
    expected = backtest_claims(messages)
    third = len(messages) // 3
    publisher = Publisher(s, spool_dir=home / "spool", probe_s=1.0)
    # librdkafka says every failed reconnect while the broker is away: that is the scenario
    logging.getLogger("guard.kafka.librdkafka").setLevel(logging.CRITICAL)
    worker = Worker(s, f"chaos-{uuid.uuid4().hex[:6]}", home / "broker-stop-worker.log", 5)
    try:
        worker.wait(lambda p: "telemetry" in p, args.timeout)
        _publish_paced(publisher, messages[:third], args.phase_s)
        publisher.flush(30)
        worker.wait(lambda p: int(p.get("telemetry", 0)) >= third, args.timeout)
        halting = time.monotonic()
        broker.halt()
        stopped_at = time.monotonic()  # the broker's process is gone
        _publish_paced(publisher, messages[third : 2 * third], max(0.0, args.outage - 1))
        while time.monotonic() < stopped_at + args.outage:
            publisher.poll()
            time.sleep(0.1)
        spooled_while_down = len(publisher.spool)
        resuming = time.monotonic()
        broker.resume()
        up_at = time.monotonic()
        _publish_paced(publisher, messages[2 * third :], args.phase_s)
        while publisher.state != "online" or len(publisher.spool):
            if time.monotonic() > up_at + args.timeout:
                raise TimeoutError(f"the agent did not replay its spool: {publisher.stats}")
            publisher.poll()
            time.sleep(0.05)
        replayed_at = time.monotonic()
        publisher.flush(30)
        caught_up = worker.wait(lambda p: int(p.get("telemetry", 0)) >= len(messages), args.timeout)
        time.sleep(5)  # the last findings through fusion
        alive = worker.proc.poll() is None
    finally:
        publisher.close()
        worker.stop()
    sent = [to_record(s, m).value for m in messages]
    on_topic = _topic_values(s, TELEMETRY_TOPICS)
    got = claims_on(s, {m.node for m in messages})
    return {
        "scenario": "broker_stop",
        "records_produced": len(sent),
        "records_on_topic": len(on_topic),
        "records_lost": len(set(sent) - set(on_topic)),
        "nothing_lost": not set(sent) - set(on_topic),
        "duplicates_on_topic": len(on_topic) - len(set(on_topic)),
        "spooled_while_down": spooled_while_down,
        "agent_stats": publisher.stats,
        "worker_alive_after": alive,
        "outage_s": round(up_at - stopped_at, 1),  # process gone to answering again
        "halt_s": round(stopped_at - halting, 1),
        "restart_s": round(up_at - resuming, 1),
        "up_to_spool_replayed_s": round(replayed_at - up_at, 1),
        "up_to_worker_caught_up_s": round(caught_up - up_at, 1),
        "claims_expected": sorted(expected),
        "claims_got": sorted(got),
        "claims_equal": got == expected,
    }


class FullDisk:
    """The store's own size-limited filesystem (a tmpfs), filled up on demand: what an
    embedded ClickHouse (chDB) really meets when its disk is gone — every insert raises
    ``NOT_ENOUGH_SPACE`` until space is freed. Needs root (``mount``)."""

    def __init__(self, path: Path, size_mb: int) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("store_down mounts a size-limited tmpfs for the store: run as root")
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                       check=True)  # fmt: skip
        self.path, self.ballast = path, path / "ballast"

    def fill(self) -> None:
        with open(self.ballast, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", str(self.path)], check=False)


def run_store_down(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``guard sink`` into chDB whose disk is full for ``--store-outage`` s."""
    disk = FullDisk(home / "store", 1024)
    try:
        return _store_down(bootstrap, disk, home, args)
    finally:
        disk.unmount()


def _store_down(
    bootstrap: str, disk: FullDisk, home: Path, args: argparse.Namespace
) -> dict[str, Any]:
    dsn = f"chdb://{disk.path / 'db'}"
    s = _settings(bootstrap, home, clickhouse={"dsn": dsn, "batch_rows": 5000})
    messages = scenario_messages(args.nodes, args.duration)
    third = len(messages) // 3
    producer = make_producer(s)
    sink = Worker(s, "sink", home / "sink.log", 5, "sink", GUARD_CLICKHOUSE_DSN=dsn)
    try:
        for m in messages[:third]:
            produce(producer, s, m)
        producer.flush(60)
        sink.wait(lambda p: int(p.get("stored", 0)) >= third, args.timeout)
        disk.fill()
        filled_at = time.monotonic()
        for chunk in range(10):  # the second third while the store is away
            for m in messages[third + chunk * third // 10 : third + (chunk + 1) * third // 10]:
                produce(producer, s, m)
            producer.poll(0)
            time.sleep(args.store_outage / 10)
        producer.flush(60)
        during = sink.progress()
        disk.free()
        freed_at = time.monotonic()
        for m in messages[2 * third :]:
            produce(producer, s, m)
        producer.flush(60)
        caught_up = sink.wait(lambda p: int(p.get("stored", 0)) >= len(messages), args.timeout)
        time.sleep(3)
        final = sink.progress()
        alive = sink.proc.poll() is None
    finally:
        sink.stop()
    return {
        "scenario": "store_down",
        "messages_produced": len(messages),
        "store_outage_s": round(freed_at - filled_at, 1),
        "stored_during_outage": int(during.get("stored", 0)) - third,
        "insert_failures": int(final.get("insert_failures", 0)),
        "sink_alive_after": alive,
        "free_to_caught_up_s": round(caught_up - freed_at, 1),
        **rows_landed(dsn, s, messages),
    }


def rows_landed(dsn: str, settings: Settings, messages: list[GuardMessage]) -> dict[str, Any]:
    """Rows per table in the store vs the rows of ``messages``: physical rows (no FINAL, so a
    duplicate shows until a merge) and distinct natural keys (the tables' ORDER BY)."""
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=dsn)
    db = settings.clickhouse.database
    per_table, lost, extra = {}, 0, 0
    for table, rows in rows_by_table(messages).items():
        key = table.order_by
        [(physical, distinct)] = client.query(
            f"SELECT count(), uniqExact({key}) FROM `{db}`.`{table.name}`"
        ).result_rows
        per_table[table.name] = {"expected": len(rows), "rows": physical, "distinct_keys": distinct}
        lost += len(rows) - distinct
        extra += physical - distinct
    client.close()
    return {"rows_by_table": per_table, "rows_missing": lost, "rows_duplicated": extra,
            "exactly_once": lost == 0 and extra == 0}  # fmt: skip


def _metrics(port: int) -> tuple[float, dict[str, float]]:
    """(seconds the answer took, gauge values) of an orchestrator's ``/metrics``."""
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and "{" not in name:
            values[name] = float(value)
    return time.monotonic() - t0, values


def max_out_of_pool(history: Iterable[NodeState], policy: SweepPolicy) -> int:
    """Most nodes out of the pool at once over the node-state history of every node."""
    state: dict[str, str] = {}
    most = 0
    for change in sorted(history, key=lambda h: h.ts):
        state[change.node] = change.state
        most = max(most, sum(policy.counts_against_cap(v) for v in state.values()))
    return most


def run_flag_storm(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Half of a simulated cluster flagged within ``--storm-s`` into a live orchestrator."""
    s = _settings(bootstrap, home)
    nodes = [f"node-{i:03d}" for i in range(args.storm_nodes)]
    storm, probe = nodes[: len(nodes) // 2], nodes[-1]
    now = time.time()
    truth = write_truth(home / "truth.json", nodes, [], now)
    port = free_port()
    out = open(home / "orchestrator.log", "wb")  # noqa: SIM115 - closed below
    proc = start_orchestrator(
        s, truth, args.sweep_delay, home, stdout=out, GUARD_METRICS_ORCHESTRATOR_PORT=str(port)
    )
    samples: list[tuple[float, dict[str, float]]] = []
    try:
        wait_until(lambda: _reachable(port), timeout_s=60)
        t0 = time.monotonic()
        for i, node in enumerate(storm):
            send(s, flag(node, f"storm-{node}", time.time() - 1))
            samples.append(_metrics(port))
            if i == len(storm) // 2:  # mid-storm: a new flag, how soon is it handled?
                sent = time.monotonic()
                send(s, flag(probe, f"probe-{probe}", time.time() - 1))
                wait_until(lambda: states_on_topic(s).get(probe), timeout_s=args.timeout)
                probe_s = time.monotonic() - sent
            while time.monotonic() < t0 + (i + 1) * args.storm_s / len(storm):
                samples.append(_metrics(port))
                time.sleep(0.2)
        storm_s = time.monotonic() - t0
        flagged = [*storm, probe]

        def all_back() -> bool:
            samples.append(_metrics(port))
            states = states_on_topic(s)
            return all(states.get(n) == "healthy" for n in flagged)

        wait_until(all_back, timeout_s=args.timeout)
        drained_s = time.monotonic() - t0
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        out.close()
    views = read_node_states(s, keep_history=True)
    history = [h for v in views.values() for h in v.history]
    cap = int(samples[0][1]["guard_cordon_cap"])
    most_out = max_out_of_pool(history, SweepPolicy.from_settings(s.orchestrator))
    log_text = (home / "orchestrator.log").read_text(errors="replace")
    return {
        "scenario": "flag_storm",
        "cluster_nodes": len(nodes),
        "nodes_flagged": len(flagged),
        "storm_s": round(storm_s, 1),
        "cordon_cap": cap,
        "max_out_of_pool_history": max_out_of_pool(
            history, SweepPolicy.from_settings(s.orchestrator)
        ),
        "max_out_of_pool_sampled": int(max(v.get("guard_cordoned_nodes", 0) for _, v in samples)),
        "cap_held": most_out <= cap,
        "max_held_back_sampled": int(max(v.get("guard_cordons_held_back", 0) for _, v in samples)),
        "nodes_told_cap_reached": sum(
            any("cap of" in h.reason for h in v.history) for v in views.values()
        ),
        "held_back_warning": "holding back" in log_text,
        "metrics_answer_max_s": round(max(t for t, _ in samples), 3),
        "metrics_answers": len(samples),
        "probe_flag_to_state_s": round(probe_s, 1),
        "all_swept_and_back_s": round(drained_s, 1),
        "orchestrator_alive_after": alive,
    }


def _reachable(port: int) -> bool:
    try:
        _metrics(port)
    except OSError:
        return False
    return True


def run_orch_sigkill(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The orchestrator SIGKILLed mid-sweep (tests/sweeps/live.py, shared with the test)."""
    s = _settings(bootstrap, home)
    killed = kill_mid_sweep(s, home)
    states = [h.state for h in killed.history]
    expected = ["suspect", "cordoned", "sweeping", "sweeping", "failed", "repair"]
    return {
        "scenario": "orch_sigkill",
        "node": killed.node,
        "states": states,
        "sweep_resumed": states == expected
        and "restarted after an orchestrator restart" in killed.history[3].reason,
        "restart_to_repair_s": round(killed.restart_to_done_s, 1),
        "second_life_exit": killed.returncode,
    }


def run_names(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``--names`` distinct node names through a live worker whose keys expire after
    ``--key-idle-s``: its memory at 10 %, 50 % and 100 % of the names, keys held."""
    s = _settings(bootstrap, home)
    worker = Worker(s, f"chaos-{uuid.uuid4().hex[:6]}", home / "names-worker.log", 5,
                    GUARD_STREAMS_KEY_IDLE_S=str(args.key_idle_s))  # fmt: skip
    producer = make_producer(s)
    marks = sorted({max(1, args.names // 10), max(1, args.names // 2), args.names})
    figures: dict[str, Any] = {}
    sent, t0 = 0, time.monotonic()
    try:
        worker.wait(lambda p: "telemetry" in p, args.timeout)
        start_rss = worker.rss_mb()
        for mark in marks:
            while sent < mark:
                batch = range(sent, min(mark, sent + 500))
                for i in batch:
                    ts = time.time()
                    produce(producer, s, GpuSample(ts=ts, node=f"name-{i:07d}", gpu=0, temp_c=50))
                sent += len(batch)
                producer.poll(0)
                time.sleep(max(0.0, t0 + sent / args.names_rate - time.monotonic()))
            producer.flush(60)
            worker.wait(lambda p, n=sent: int(p.get("telemetry", 0)) >= n, args.timeout)
            progress = worker.progress()
            figures[f"at_{mark}"] = {
                "rss_mb": round(worker.rss_mb(), 1),
                "peak_rss_mb": round(worker.peak_rss_mb, 1),
                "keys_held": int(progress.get("keys", -1)),
            }
        names_s = time.monotonic() - t0
        # every name idle now: all of them must go
        worker.wait(lambda p: int(p.get("keys", -1)) == 0, args.key_idle_s + 60)
        keys_after = int(worker.progress()["keys"])
        idle_rss = worker.rss_mb()
        alive = worker.proc.poll() is None
    finally:
        worker.stop()
    return {
        "scenario": "names",
        "names": args.names,
        "names_per_s": round(args.names / names_s),
        "key_idle_s": args.key_idle_s,
        "rss_at_start_mb": round(start_rss, 1),
        **figures,
        "keys_held_after_idle": keys_after,
        "rss_after_idle_mb": round(idle_rss, 1),
        "worker_peak_rss_mb": round(worker.peak_rss_mb, 1),
        "worker_alive_after": alive,
    }


def run_hostile(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = _settings(bootstrap, home)
    messages = scenario_messages(args.nodes, args.duration)
    real_nodes = {m.node for m in messages}
    expected = backtest_claims(messages)
    producer = make_producer(s)
    invalid = sent = 0
    per_message = args.hostile / max(1, len(messages))  # hostile messages between real ones
    owed = 0.0
    hostile = hostile_records(args.hostile)
    t0 = time.monotonic()
    for m in [*messages, None]:
        if m is not None:
            produce(producer, s, m)
        owed += per_message if m is not None else float("inf")
        while owed >= 1:
            item = next(hostile, None)
            if item is None:
                break
            topic, key, value, bad = item
            produce_raw(producer, s.topic(topic), value, key)
            invalid, sent, owed = invalid + bad, sent + 1, owed - 1
    producer.flush(300)
    produced_s = time.monotonic() - t0
    total = len(messages) + sent
    worker = Worker(s, f"chaos-{uuid.uuid4().hex[:6]}", home / "hostile-worker.log", 30)
    try:
        t1 = time.monotonic()
        worker.wait(lambda p: int(p.get("telemetry", 0)) >= total, args.timeout)
        handled_s = time.monotonic() - t1
        time.sleep(5)  # the last findings through fusion
        progress = worker.progress()
        alive = worker.proc.poll() is None
    finally:
        worker.stop()
    dlq = read_topic(s, "dlq")
    no_reason = sum(1 for r in dlq if not dict(r.headers() or []).get("guard-error"))
    got = claims_on(s, real_nodes)
    return {
        "scenario": "hostile",
        "real_messages": len(messages),
        "hostile_sent": sent,
        "hostile_invalid": invalid,
        "worker_alive_after": alive,
        "dead_letters_counted": int(progress.get("dead_letters", 0)),
        "dlq_records": len(dlq),
        "dlq_without_reason": no_reason,
        "claims_expected": sorted(expected),
        "claims_got": sorted(got),
        "claims_equal": got == expected,
        "worker_peak_rss_mb": round(worker.peak_rss_mb, 1),
        "produce_s": round(produced_s, 1),
        "worker_start_to_done_s": round(handled_s, 1),  # start-up and group join included
        "msgs_per_s_incl_start_up": round(total / max(handled_s, 1e-6)),
    }


def run_sigkill(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = _settings(bootstrap, home)
    messages = scenario_messages(args.nodes, args.duration)
    expected = backtest_claims(messages)
    half, touch = len(messages) // 2, len(messages) // 2 + len(messages) // 20
    producer = make_producer(s)
    for m in messages[:half]:
        produce(producer, s, m)
    producer.flush(120)
    app_id = f"chaos-{uuid.uuid4().hex[:6]}"
    first = Worker(s, app_id, home / "sigkill-first.log", args.checkpoint_s)
    try:
        first.wait(lambda p: int(p.get("telemetry", 0)) >= half, args.timeout)
        time.sleep(args.checkpoint_s + 1)  # every key is due: the next batch saves it
        for m in messages[half:touch]:
            produce(producer, s, m)
        producer.flush(120)
        first.wait(lambda p: int(p.get("telemetry", 0)) >= touch, args.timeout)
        time.sleep(1)
    finally:
        first.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    for m in messages[touch:]:
        produce(producer, s, m)
    producer.flush(120)
    second = Worker(s, app_id, home / "sigkill-second.log", args.checkpoint_s)
    try:
        resumed_at = second.wait(lambda p: "telemetry" in p, args.timeout)
        second.wait(lambda p: int(p.get("telemetry", 0)) >= len(messages) - touch, args.timeout)
        time.sleep(5)
        progress = second.progress()
    finally:
        second.stop()
    got = claims_on(s, {m.node for m in messages})
    return {
        "scenario": "sigkill",
        "messages": len(messages),
        "keys_restored_after_kill": int(progress.get("restored", 0)),
        "checkpoints_refused": int(progress.get("refused", 0)),
        "state_age_bound_s": args.checkpoint_s,
        "kill_to_first_progress_s": round(resumed_at - killed_at, 1),
        "claims_expected": sorted(expected),
        "claims_got": sorted(got),
        "claims_equal": got == expected,
        "claims_missing": sorted(expected - got),
    }


def run_broken_check(bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A check that fails every node (a GEMM floor no node reaches: ``echo 1.0`` against 500
    TFLOPS, the ``commands`` executor) behind a live ``guard orchestrator``, every node of a
    ``--storm-nodes`` cluster flagged at once. Twice: with the cordon cap alone (12.5 %; the
    nodes in repair keep their places under it), and with the failure-rate stop (4 sweeps,
    over 50 % failed) under a cap it never reaches; a webhook receiver on loopback gets the
    ``GuardSweepsStopped`` alert. Figures: sweeps run and failed, most nodes out at once vs
    the cap, nodes held back, the stop gauge and alert."""
    import http.server
    import threading

    alerts: list[dict[str, Any]] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_POST(self) -> None:
            alerts.extend(
                json.loads(self.rfile.read(int(self.headers["Content-Length"])))["alerts"]
            )
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    nodes = [f"node-{i:03d}" for i in range(args.storm_nodes)]
    min_sweeps, workers = 4, 2

    def phase(name: str, fraction: float, stop_fraction: float) -> dict[str, Any]:
        s = _settings(bootstrap, home / name)
        config = home / name / "guard.toml"
        config.write_text(
            "[orchestrator]\n"
            f'executor = "commands"\nnodes = {json.dumps(nodes)}\n'
            f"max_cordoned_fraction = {fraction}\nsweep_workers = {workers}\n"
            f"sweep_stop_failed_fraction = {stop_fraction}\nsweep_stop_min_sweeps = {min_sweeps}\n"
            f'webhook_url = "http://127.0.0.1:{hook.server_address[1]}/hook"\n'
            "[[orchestrator.sweep_checks]]\n"
            'name = "gemm_bf16_tflops"\ncommand = "echo 1.0"\nmin = 500\nunit = "TFLOPS"\n'
        )
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
        env.update(GUARD_CONFIG=str(config), GUARD_KAFKA_BOOTSTRAP=s.kafka.bootstrap,
                   GUARD_KAFKA_TOPIC_PREFIX=s.kafka.topic_prefix, GUARD_HOME=str(home / name),
                   GUARD_METRICS_ORCHESTRATOR_PORT=str(port))  # fmt: skip
        out = open(home / name / "orchestrator.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, "-m", "guard.cli", "orchestrator", "--log-level", "warning"],
            env=env, cwd=home / name, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        samples: list[dict[str, float]] = []
        try:
            wait_until(lambda: _reachable(port), timeout_s=60)
            now = time.time()
            send(s, *(flag(n, f"broken-{n}", now - 1) for n in nodes))

            def settled() -> bool:  # no sweep running; the rest held back or stopped
                samples.append(_metrics(port)[1])
                states = states_on_topic(s)
                stopped = samples[-1]["guard_sweeps_stopped"] == 1
                return len(states) == len(nodes) and all(
                    v in ("repair", "suspect") or (v == "cordoned" and stopped)
                    for v in states.values()
                )

            wait_until(settled, timeout_s=args.timeout)
            time.sleep(2.0)  # ten more ticks: nothing else may start
            samples.append(_metrics(port)[1])
            alive = proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            out.close()
        views = read_node_states(s, keep_history=True)
        history = [h for v in views.values() for h in v.history]
        sweeps = [decode(r.value(), "sweep") for r in read_topic(s, "sweeps")]
        return {
            "cordon_cap": int(samples[0]["guard_cordon_cap"]),
            "max_out_of_pool": max_out_of_pool(history, SweepPolicy.from_settings(s.orchestrator)),
            "sweeps": len(sweeps),
            "sweeps_failed": sum(not x.passed for x in sweeps),
            "in_repair": sum(
                v.state is not None and v.state.state == "repair" for v in views.values()
            ),
            "held_back": int(samples[-1]["guard_cordons_held_back"]),
            "stopped_gauge": int(samples[-1]["guard_sweeps_stopped"]),
            "orchestrator_alive_after": alive,
        }

    try:
        cap = phase("cap", 0.125, 1.0)
        rate = phase("rate", 0.5, 0.5)
    finally:
        hook.shutdown()
        hook.server_close()
    stop_alerts = [a for a in alerts if a["labels"].get("alertname") == "GuardSweepsStopped"]
    return {
        "scenario": "broken_check",
        "cluster_nodes": len(nodes),
        "nodes_flagged": len(nodes),
        "cap_only": cap,
        "failure_stop": rate,
        "failure_stop_sweeps_bound": min_sweeps + workers - 1,
        "stop_alert": [a["status"] for a in stop_alerts],
        "stop_held": (
            cap["max_out_of_pool"] <= cap["cordon_cap"] == cap["sweeps_failed"] == cap["in_repair"]
            and min_sweeps <= rate["sweeps_failed"] <= min_sweeps + workers - 1
            and rate["max_out_of_pool"] <= min_sweeps + workers - 1  # cordoned only for a worker
            and rate["sweeps_failed"] < rate["cordon_cap"]
            and rate["stopped_gauge"] == 1
            and [a["status"] for a in stop_alerts] == ["firing"]
        ),
        "orchestrator_alive_after": cap["orchestrator_alive_after"]
        and rate["orchestrator_alive_after"],
    }


SCENARIOS = {
    "broker_stop": run_broker_stop,
    "store_down": run_store_down,
    "flag_storm": run_flag_storm,
    "orch_sigkill": run_orch_sigkill,
    "names": run_names,
    "hostile": run_hostile,
    "sigkill": run_sigkill,
    "broken_check": run_broken_check,
}


#: figures that must be true for a scenario to pass
OK_FIGURES = ("claims_equal", "exactly_once", "cap_held", "sweep_resumed", "worker_alive_after",
              "sink_alive_after", "orchestrator_alive_after", "nothing_lost",
              "stop_held")  # fmt: skip


#: ``--short``: seconds a scenario, for CI (tests/test_chaos.py); explicit options still win
SHORT = {
    "hostile": 2000,
    "duration": 120.0,
    "checkpoint_s": 2.0,
    "outage": 6.0,
    "phase_s": 1.0,
    "store_outage": 10.0,
    "storm_nodes": 16,
    "storm_s": 5.0,
    "sweep_delay": 0.5,
    "names": 3000,
    "names_rate": 1000.0,
    "key_idle_s": 3.0,
    "timeout": 120.0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated, from: " + ", ".join(SCENARIOS),
    )
    add("--short", action="store_true", help="the seconds-long version of each scenario (CI)")
    add("--hostile", type=int, default=1_000_000, help="hostile messages")
    add("--nodes", type=int, default=8)
    add("--duration", type=float, default=240)
    add("--checkpoint-s", type=float, default=5.0)
    add("--outage", type=float, default=30.0, help="broker_stop: broker away, s")
    add("--phase-s", type=float, default=3.0, help="broker_stop: publishing before/after, s")
    add("--store-outage", type=float, default=60.0, help="store_down: s")
    add("--storm-nodes", type=int, default=64, help="flag_storm: cluster size")
    add("--storm-s", type=float, default=60.0, help="flag_storm: storm length")
    add("--sweep-delay", type=float, default=2.0, help="flag_storm: sweep, s")
    add("--names", type=int, default=100_000, help="names: distinct nodes")
    add("--names-rate", type=float, default=2000.0, help="names: per second")
    add("--key-idle-s", type=float, default=10.0, help="names: key_idle_s")
    add("--timeout", type=float, default=900, help="bound of each wait, s")
    argv = sys.argv[1:] if argv is None else argv
    if "--short" in argv:
        parser.set_defaults(**SHORT)
    return parser.parse_args(argv)


def run(name: str, bootstrap: str, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One scenario's figures; ``ok`` says whether every must-hold figure held."""
    t0 = time.monotonic()
    result = SCENARIOS[name](bootstrap, home / name, args)
    result["scenario_s"] = round(time.monotonic() - t0, 1)
    result["ok"] = all(result.get(k, True) for k in OK_FIGURES)
    return result


def main() -> None:
    args = parse_args()
    home = Path(tempfile.mkdtemp(prefix="guard-chaos-"))
    failed = False
    with contextlib.ExitStack() as stack:
        bootstrap = os.environ.get("GUARD_KAFKA_BOOTSTRAP")
        if not bootstrap:
            from guard.broker import EmbeddedBroker

            bootstrap = stack.enter_context(EmbeddedBroker()).bootstrap
        for name in args.scenarios.split(","):
            result = run(name, bootstrap, home, args)
            failed |= not result["ok"]
            print(json.dumps(result), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
