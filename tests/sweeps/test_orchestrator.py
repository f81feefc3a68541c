"""The orchestrator's policy and state machine, driven directly (no Kafka)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from guard.config import OrchestratorSettings
from guard.schemas import GuardMessage, NodeState, SweepResult
from guard.sweeps.executors import CommandExecutor, SimulatedFault, SimulatedSweepExecutor
from guard.sweeps.orchestrator import Orchestrator, SimulatedClock
from guard.sweeps.scheduler import DryRunScheduler, SchedulerError
from guard.sweeps.states import ALLOWED, is_operator
from tests.sweeps.helpers import NODES, Clock, GatedExecutor, flag, wait_until

T0 = 1_767_226_000.0
SLOW = SimulatedFault("node-005", "slow_gpu", onset=T0 - 500, gpu=3, slowdown=0.2)


class Harness:
    def __init__(
        self,
        faults: list[SimulatedFault] | None = None,
        executor: Any = None,
        inline: bool = True,
        **settings: Any,
    ) -> None:
        self.clock = Clock(T0)
        self.out: list[GuardMessage] = []
        self.scheduler = DryRunScheduler()
        self.executor = executor or SimulatedSweepExecutor(faults or [], seed=1)
        self.orch = Orchestrator(
            OrchestratorSettings(nodes=NODES, **settings),
            scheduler=self.scheduler,
            executor=self.executor,
            publish=self.out.append,
            clock=self.clock,
            inline_sweeps=inline,
        )

    def states(self, node: str) -> list[str]:
        return [m.state for m in self.out if isinstance(m, NodeState) and m.node == node]

    def sweeps(self, node: str) -> list[SweepResult]:
        return [m for m in self.out if isinstance(m, SweepResult) and m.node == node]

    def actions(self, node: str) -> list[str]:
        return [a.action for a in self.scheduler.actions if a.node == node]


def test_a_faulty_node_is_cordoned_swept_and_sent_to_repair() -> None:
    h = Harness([SLOW])
    assert h.orch.handle_flag(flag("node-005", "f1", T0 - 1)) == "qualified"
    h.orch.tick()
    assert h.states("node-005") == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    [single] = h.sweeps("node-005")
    assert single.sweep == "single" and not single.passed
    failing = [c.name for c in single.checks if not c.passed]
    assert failing == ["gemm_tflops_gpu3"]
    assert h.actions("node-005") == ["cordon", "cordon"]  # drained, then the reason updated
    assert "node-005" in h.scheduler.cordoned
    last = h.out[-1]
    assert isinstance(last, NodeState) and "gemm_tflops_gpu3" in last.reason
    assert last.actor == "orchestrator" and last.prev == "failed"


def test_a_falsely_flagged_node_passes_both_sweeps_and_returns_to_the_pool() -> None:
    h = Harness([SLOW])
    h.orch.handle_flag(flag("node-010", "f1", T0 - 1))
    h.orch.tick()
    assert h.states("node-010") == ["suspect", "cordoned", "sweeping", "healthy"]
    single, multi = h.sweeps("node-010")
    assert single.sweep == "single" and single.passed and single.peers == []
    assert multi.sweep == "multi" and multi.passed and len(multi.peers) == 2
    assert "node-010" not in multi.peers and "node-005" in NODES
    assert h.actions("node-010") == ["cordon", "uncordon"]
    assert h.orch.state_of("node-010") == "healthy"


def test_observations_and_job_level_flags_change_nothing() -> None:
    h = Harness()
    assert h.orch.handle_flag(flag("node-001", "i1", T0, severity="info")) == "observation"
    assert h.orch.handle_flag(flag(None, "j1", T0, gpu=None)) == "observation"
    assert h.orch.handle_flag(flag("node-001", "im", T0, category="imbalance")) == "observation"
    h.orch.tick()
    assert h.out == [] and h.scheduler.actions == []


def test_a_node_whose_telemetry_is_refused_is_reported_not_cordoned() -> None:
    # The agent's clock notice (detector agent_clock) is a warning of category anomaly: its
    # node's GPUs are not suspect, so it must not cost a cordon and a job restart by default.
    h = Harness()
    notice = flag("node-003", "clock", T0, severity="warning", category="anomaly")
    assert h.orch.handle_flag(notice) == "observation"
    h.orch.tick()
    assert h.scheduler.actions == [] and h.orch.state_of("node-003") == "healthy"
    opted_in = Harness(sweep_categories=["anomaly"])
    assert opted_in.orch.handle_flag(notice) == "qualified"


def test_a_duplicated_flag_is_acted_on_once() -> None:
    h = Harness(persist_flags=2)
    assert h.orch.handle_flag(flag("node-002", "dup", T0, severity="warning")) == "suspect"
    assert h.orch.handle_flag(flag("node-002", "dup", T0, severity="warning")) == "duplicate"
    h.orch.tick()
    assert h.states("node-002") == ["suspect"]  # one flag, not two: no cordon
    assert h.orch.stats["flags_duplicate"] == 1


def test_warnings_must_persist_and_a_suspect_that_does_not_persist_is_cleared() -> None:
    h = Harness(persist_flags=2, persistence_s=120, suspect_ttl_s=300)
    assert h.orch.handle_flag(flag("node-003", "w1", T0, severity="warning")) == "suspect"
    h.orch.tick()
    assert h.states("node-003") == ["suspect"]
    h.clock.now = T0 + 301
    h.orch.tick()
    assert h.states("node-003") == ["suspect", "healthy"]
    assert h.scheduler.actions == []  # never cordoned

    # Two distinct warnings persist: the node is cordoned and swept.
    h.clock.now = T0 + 400
    h.orch.handle_flag(flag("node-003", "w2", T0 + 390, severity="warning"))
    assert h.orch.handle_flag(flag("node-003", "w3", T0 + 399, severity="warning")) == "qualified"
    h.orch.tick()
    assert h.states("node-003")[-4:] == ["suspect", "cordoned", "sweeping", "healthy"]


def test_one_warning_with_a_long_enough_evidence_window_qualifies() -> None:
    h = Harness(persist_flags=3, persistence_s=120)
    short = flag("node-004", "s", T0, severity="warning", window_s=30)
    assert h.orch.handle_flag(short) == "suspect"
    long = flag("node-006", "l", T0, severity="warning", window_s=180)
    assert h.orch.handle_flag(long) == "qualified"


def test_the_cap_limits_nodes_out_of_the_pool_and_never_two_sweeps_on_one_node() -> None:
    gated = GatedExecutor(SimulatedSweepExecutor([], seed=2))
    # 40 nodes at 5 %: two at a time.
    h = Harness(executor=gated, inline=False, cluster_size=40)
    try:
        for i, node in enumerate(["node-001", "node-002", "node-003", "node-004"]):
            h.orch.handle_flag(flag(node, f"c{i}", T0 - 10 + i))
        h.orch.tick()
        states = {n: h.orch.state_of(n) for n in ["node-001", "node-002", "node-003", "node-004"]}
        assert states == {
            "node-001": "sweeping",
            "node-002": "sweeping",
            "node-003": "suspect",
            "node-004": "suspect",
        }
        assert "cap of 2 of 40 nodes" in h.orch.snapshot()["node-003"].reason
        assert h.orch.held_back == ["node-003", "node-004"]  # what the cap holds back, said
        # More flags for a node being swept are evidence, not a second sweep.
        assert h.orch.handle_flag(flag("node-001", "again", T0)) == "evidence"
        h.orch.tick()
        wait_until(lambda: len(gated.started) == 2)
        assert sorted(gated.started) == [("node-001", "single"), ("node-002", "single")]
        gated.gate.set()
        wait_until(
            lambda: all(
                h.orch.state_of(n) == "healthy"
                for n in ["node-001", "node-002", "node-003", "node-004"]
            ),
            tick=h.orch.tick,
        )
        assert h.orch.held_back == []
        for node in ["node-001", "node-002", "node-003", "node-004"]:
            assert [(s.sweep, s.passed) for s in h.sweeps(node)] == [
                ("single", True),
                ("multi", True),
            ]
        # At no point were more than two nodes out of the pool.
        out = set()
        most = 0
        for m in h.out:
            if isinstance(m, NodeState):
                if m.state in ("cordoned", "sweeping", "failed"):
                    out.add(m.node)
                else:
                    out.discard(m.node)
                most = max(most, len(out))
        assert most == 2
    finally:
        gated.gate.set()
        h.orch.close()


def test_flagged_again_soon_after_passing_goes_to_repair_but_later_is_swept_again() -> None:
    # 40 nodes at 5 %: two may be out, node-007 in repair and node-008 swept.
    h = Harness(cooldown_s=3600, cluster_size=40)
    h.orch.handle_flag(flag("node-007", "a", T0 - 1))
    h.orch.tick()
    assert h.states("node-007")[-1] == "healthy"
    h.clock.now = T0 + 600
    assert h.orch.handle_flag(flag("node-007", "b", T0 + 590, severity="warning")) == "repair"
    h.orch.tick()
    assert h.states("node-007")[-3:] == ["suspect", "cordoned", "repair"]
    assert len(h.sweeps("node-007")) == 2  # no third sweep: straight to repair
    assert "flagged again 590 s after passing a sweep" in h.out[-1].reason  # type: ignore[union-attr]

    # Another node, flagged again only after the cooldown, is swept again.
    h.orch.handle_flag(flag("node-008", "c", T0 + 599))
    h.orch.tick()
    h.clock.now = T0 + 600 + 3601 + 10
    assert h.orch.handle_flag(flag("node-008", "d", h.clock.now - 5)) == "qualified"
    h.orch.tick()
    assert h.states("node-008")[-4:] == ["suspect", "cordoned", "sweeping", "healthy"]
    assert len(h.sweeps("node-008")) == 4


def test_stale_flags_are_ignored() -> None:
    h = Harness(max_flag_age_s=600)
    h.orch.handle_flag(flag("node-009", "a", T0 - 1))
    h.orch.tick()
    released = h.orch.snapshot()["node-009"].since
    # Evidence from before the node passed its sweep (a redelivery, a slow detector).
    h.clock.now = T0 + 100
    assert h.orch.handle_flag(flag("node-009", "old", released - 1)) == "stale"
    assert h.orch.handle_flag(flag("node-011", "ancient", T0 + 100 - 601)) == "stale"
    assert h.orch.state_of("node-011") == "healthy"


def test_operators_release_and_repair_any_node() -> None:
    h = Harness([SLOW])
    h.orch.handle_flag(flag("node-005", "f1", T0 - 1))
    h.orch.tick()
    assert h.orch.state_of("node-005") == "repair"
    h.clock.now = T0 + 50
    h.orch.handle_operator(
        NodeState(
            ts=T0 + 50,
            node="node-005",
            state="healthy",
            reason="GPU 3 replaced",
            actor="operator:ann",
        )
    )
    last = h.out[-1]
    assert isinstance(last, NodeState)
    assert (last.prev, last.state, last.actor) == ("repair", "healthy", "orchestrator")
    assert last.reason == "released by operator:ann: GPU 3 replaced"
    assert h.actions("node-005")[-1] == "uncordon"
    # A flag right after an operator's release is not "flagged again after passing a sweep".
    h.clock.now = T0 + 60
    assert h.orch.handle_flag(flag("node-005", "f2", T0 + 55)) == "qualified"

    h.orch.handle_operator(NodeState(ts=T0, node="node-012", state="repair", actor="operator:bo"))
    assert h.orch.state_of("node-012") == "repair"
    assert h.actions("node-012") == ["cordon"]
    h.orch.handle_operator(NodeState(ts=T0, node="node-012", state="sweeping", actor="operator"))
    assert h.orch.state_of("node-012") == "repair"
    assert "ignored operator's request for 'sweeping'" in h.out[-1].reason  # type: ignore[union-attr]


def test_a_restarted_orchestrator_recovers_and_finishes_the_work() -> None:
    first = Harness([SLOW], executor=GatedExecutor(SimulatedSweepExecutor([SLOW])), inline=False)
    try:
        first.orch.handle_flag(flag("node-005", "f1", T0 - 1))  # will fail: repair
        first.orch.handle_flag(flag("node-010", "f2", T0 - 1))  # will pass: healthy
        first.orch.tick()
        assert first.orch.sweeping() == ["node-005"]  # cap of 1 for 32 nodes
        assert first.orch.state_of("node-010") == "suspect"
    finally:
        first.orch.close()  # "killed" mid-sweep: the gate never opens
        first.executor.gate.set()

    second = Harness([SLOW])
    pending = second.orch.recover(m for m in first.out if isinstance(m, NodeState))
    assert pending == []
    assert second.orch.state_of("node-005") == "sweeping"
    second.orch.resume(pending)
    second.orch.tick()
    assert second.states("node-005") == ["sweeping", "failed", "repair"]
    assert "restarted" in second.out[0].reason  # type: ignore[union-attr]
    assert second.actions("node-005")[0] == "cordon"  # the cordon was re-asserted
    # node-005 in repair still holds the one place under the cap: node-010 waits ...
    assert second.states("node-010") == []
    assert second.orch.held_back == ["node-010"]
    # ... until the repaired node is released; then the restarted orchestrator sweeps it.
    second.orch.handle_operator(
        NodeState(ts=T0 + 1, node="node-005", state="healthy", actor="operator:ann")
    )
    second.orch.tick()
    assert second.states("node-010") == ["cordoned", "sweeping", "healthy"]


def test_pending_operator_requests_are_applied_on_recovery() -> None:
    h = Harness()
    pending = h.orch.recover(
        [
            NodeState(ts=T0, node="node-001", state="repair", prev="failed", actor="orchestrator"),
            NodeState(ts=T0 + 5, node="node-001", state="healthy", actor="operator:ann"),
            NodeState(
                ts=T0, node="node-002", state="failed", prev="sweeping", actor="orchestrator"
            ),
        ]
    )
    assert [p.node for p in pending] == ["node-001"]
    h.orch.resume(pending)
    assert h.orch.state_of("node-001") == "healthy"
    assert h.orch.state_of("node-002") == "repair"


def test_a_scheduler_failure_is_retried_before_the_sweep_starts() -> None:
    class Flaky(DryRunScheduler):
        def __init__(self) -> None:
            super().__init__()
            self.failures = 1

        def cordon(self, node: str, reason: str) -> None:
            if self.failures:
                self.failures -= 1
                raise SchedulerError("slurmctld not responding")
            super().cordon(node, reason)

    h = Harness()
    h.scheduler = Flaky()
    h.orch.scheduler = h.scheduler
    h.orch.handle_flag(flag("node-001", "f", T0 - 1))
    h.orch.tick()
    assert h.states("node-001") == ["suspect", "cordoned"]  # no sweep on an undrained node
    h.orch._scheduler_todo["node-001"] = ("cordon", "retry", 0.0)  # make the retry due now
    h.orch.tick()
    assert h.states("node-001") == ["suspect", "cordoned", "sweeping", "healthy"]
    assert h.orch.stats["scheduler_errors"] == 1


def test_every_published_transition_is_allowed() -> None:
    h = Harness([SLOW])
    for i, node in enumerate(NODES[:6]):
        h.orch.handle_flag(flag(node, f"f{i}", T0 - 1))
        h.orch.tick()
    h.orch.handle_flag(flag("node-005", "x", T0))
    for m in h.out:
        if isinstance(m, NodeState) and not is_operator(m.actor):
            assert m.prev is not None
            assert m.state in ALLOWED[m.prev], (m.prev, m.state)


@pytest.mark.parametrize("fraction,size,limit", [(0.05, 32, 1), (0.05, 40, 2), (0.25, 8, 2)])
def test_cordon_limit(fraction: float, size: int, limit: int) -> None:
    h = Harness(max_cordoned_fraction=fraction)
    assert h.orch.policy.cordon_limit(size) == limit


def test_a_simulated_cluster_needs_the_simulated_clock(caplog: pytest.LogCaptureFixture) -> None:
    sim_start = 1_767_225_600.0  # the simulator's default start, long before "now"
    fault = SimulatedFault("node-001", "xid", sim_start + 100, detail={"xid": 79})
    sim_flag = flag("node-001", "x", sim_start + 130, category="gpu_error", gpu=0)

    wall = Orchestrator(
        OrchestratorSettings(nodes=NODES),
        scheduler=DryRunScheduler(),
        executor=SimulatedSweepExecutor([fault]),
        publish=lambda m: None,
        inline_sweeps=True,
    )
    assert wall.handle_flag(sim_flag) == "stale"
    assert "SimulatedClock" in caplog.text

    out: list[GuardMessage] = []
    clock = SimulatedClock(sim_start, speed=60.0, wall_start=time.time() - 2.5)
    assert sim_start + 150 <= clock() < sim_start + 3600
    sim = Orchestrator(
        OrchestratorSettings(nodes=NODES),
        scheduler=DryRunScheduler(),
        executor=SimulatedSweepExecutor([fault]),
        publish=out.append,
        clock=clock,
        inline_sweeps=True,
    )
    assert sim.handle_flag(sim_flag) == "qualified"
    sim.tick()
    assert sim.state_of("node-001") == "repair"
    [single] = [m for m in out if isinstance(m, SweepResult)]
    assert [c.name for c in single.checks if not c.passed] == ["xid_errors"]
    assert all(sim_start < m.ts < sim_start + 3600 for m in out)  # states carry simulated time


def test_a_sweep_that_hangs_or_crashes_fails_and_the_node_goes_to_repair() -> None:
    gated = GatedExecutor(SimulatedSweepExecutor([]))
    h = Harness(executor=gated, inline=False, sweep_timeout_s=0.3)
    try:
        h.orch.handle_flag(flag("node-001", "f", T0 - 1))
        wait_until(lambda: h.orch.state_of("node-001") == "repair", tick=h.orch.tick)
    finally:
        gated.gate.set()
        h.orch.close()
    [result] = h.sweeps("node-001")
    assert [(c.name, c.passed) for c in result.checks] == [("sweep_timeout", False)]

    class Broken:
        sweep_kinds = ("single",)

        def run(self, *args: Any) -> list[Any]:
            raise OSError("dcgmi: not found")

    h = Harness(executor=Broken())
    h.orch.handle_flag(flag("node-002", "g", T0 - 1))
    h.orch.tick()
    assert h.orch.state_of("node-002") == "repair"
    assert "sweep_error (OSError: dcgmi: not found)" in h.out[-1].reason  # type: ignore[union-attr]


#: A broken check, for real: a command whose number (1 TFLOPS) no node can reach.
BROKEN_GEMM = {"name": "gemm_bf16_tflops", "command": "echo 1.0", "min": 500, "unit": "TFLOPS"}
FLAGGED = [f"node-{i:03d}" for i in range(1, 13)]


def test_a_check_that_fails_every_node_stops_at_the_cap() -> None:
    # No failure-rate stop (1: never): only the cap, 2 of 40, holds the drain back.
    h = Harness(
        executor=CommandExecutor([BROKEN_GEMM]), cluster_size=40, sweep_stop_failed_fraction=1
    )
    for i, node in enumerate(FLAGGED):
        h.orch.handle_flag(flag(node, f"b{i}", T0 - 20 + i))
    for _ in range(3):
        h.orch.tick()
    in_repair = [n for n in FLAGGED if h.orch.state_of(n) == "repair"]
    assert in_repair == ["node-001", "node-002"]  # the nodes in repair hold the cap
    assert sum(len(h.sweeps(n)) for n in FLAGGED) == 2
    assert h.orch.held_back == FLAGGED[2:]
    assert "cap of 2 of 40 nodes" in h.orch.snapshot()["node-003"].reason
    assert h.orch.sweeps_stopped is None


def test_a_check_that_fails_every_node_stops_sweeping_and_alerts() -> None:
    told: list[tuple[bool, str]] = []
    h = Harness(
        executor=CommandExecutor([BROKEN_GEMM]),
        cluster_size=40,
        max_cordoned_fraction=0.5,  # a cap of 20: the failure rate stops it first
        sweep_stop_min_sweeps=4,
    )
    h.orch.stop_listeners.append(lambda stopped, why: told.append((stopped, why)))
    for i, node in enumerate(FLAGGED):
        h.orch.handle_flag(flag(node, f"b{i}", T0 - 20 + i))
    h.orch.tick()
    h.orch.tick()
    swept = [n for n in FLAGGED if h.sweeps(n)]
    assert swept == FLAGGED[:4] and all(h.orch.state_of(n) == "repair" for n in swept)
    why = "4 of the last 4 sweeps within 3600 s failed (over 50 %)"
    assert h.orch.sweeps_stopped == why and told == [(True, why)]
    assert h.orch.held_back == FLAGGED[4:]
    assert f"sweeping stopped: {why}" in h.orch.snapshot()["node-005"].reason
    assert not any(
        m.node in FLAGGED[4:] and m.state == "cordoned" for m in h.out if isinstance(m, NodeState)
    )

    # A restarted orchestrator stops too: the failures are on the node-state topic.
    again = Harness(executor=CommandExecutor([BROKEN_GEMM]), cluster_size=40,
                    max_cordoned_fraction=0.5, sweep_stop_min_sweeps=4)  # fmt: skip
    again.orch.resume(again.orch.recover(m for m in h.out if isinstance(m, NodeState)))
    again.orch.tick()
    assert again.orch.sweeps_stopped == why and again.sweeps("node-005") == []

    # Once the failures age out of the window, sweeping goes on, and stops again.
    h.clock.now = T0 + 3601
    h.orch.tick()
    assert told[1] == (False, why)
    assert [n for n in FLAGGED if h.sweeps(n)] == FLAGGED[:8]
    assert h.orch.sweeps_stopped == why and told[2] == (True, why)


def _most_out_at_once(out: list[GuardMessage], states: tuple[str, ...]) -> int:
    """The most nodes in ``states`` at the same time, from the published history."""
    now_in: set[str] = set()
    most = 0
    for m in out:
        if isinstance(m, NodeState):
            (now_in.add if m.state in states else now_in.discard)(m.node)
            most = max(most, len(now_in))
    return most


def test_a_burst_with_a_broken_check_is_cordoned_only_as_sweep_workers_free_up() -> None:
    # The chaos scenario broken_check in small: 12 nodes flagged at once, a GEMM no node
    # passes, a cap of 20 it never reaches. A node is cordoned only when one of the 2 sweep
    # workers can take it, so the stop (4 failures) is judged before every new cordon.
    workers, min_sweeps = 2, 4
    h = Harness(
        executor=CommandExecutor([BROKEN_GEMM]),
        inline=False,
        cluster_size=40,
        max_cordoned_fraction=0.5,
        sweep_workers=workers,
        sweep_stop_min_sweeps=min_sweeps,
    )
    try:
        for i, node in enumerate(FLAGGED):
            h.orch.handle_flag(flag(node, f"b{i}", T0 - 20 + i))
        h.orch.tick()
        assert h.orch.sweeping() == FLAGGED[:2]
        # The others wait flagged, not cordoned: in the pool, their jobs untouched.
        assert [h.orch.state_of(n) for n in FLAGGED[2:]] == ["suspect"] * 10
        assert h.orch.queued == FLAGGED[2:] and h.orch.held_back == []
        assert "queued: all 2 sweep workers busy" in h.orch.snapshot()["node-003"].reason
        assert h.actions("node-003") == []
        wait_until(lambda: h.orch.sweeps_stopped and not h.orch.sweeping(), tick=h.orch.tick)
        h.orch.tick()
    finally:
        h.orch.close()
    cordoned = [n for n in FLAGGED if "cordoned" in h.states(n)]
    # Stopped at the 4th failure; the sweep still running then may end too (the 5th).
    assert min_sweeps <= len(cordoned) <= workers + min_sweeps - 1
    assert all(h.orch.state_of(n) == "repair" for n in cordoned)
    assert all([s.passed for s in h.sweeps(n)] == [False] for n in cordoned)
    assert _most_out_at_once(h.out, ("cordoned", "sweeping")) == workers
    rest = [n for n in FLAGGED if n not in cordoned]
    assert h.orch.held_back == rest and h.orch.queued == []
    assert all(h.actions(n) == [] for n in rest)  # never drained
    assert "sweeping stopped: " in h.orch.snapshot()[rest[0]].reason
    assert "queued: " not in h.orch.snapshot()[rest[0]].reason


def test_the_queue_of_flagged_nodes_survives_a_restart() -> None:
    gated = GatedExecutor(SimulatedSweepExecutor([], seed=3))
    settings: dict[str, Any] = {
        "cluster_size": 40,
        "max_cordoned_fraction": 0.5,
        "sweep_workers": 2,
    }
    first = Harness(executor=gated, inline=False, **settings)
    six = FLAGGED[:6]
    try:
        for i, node in enumerate(six):
            first.orch.handle_flag(flag(node, f"q{i}", T0 - 20 + i))
        first.orch.tick()
        assert first.orch.sweeping() == six[:2] and first.orch.queued == six[2:]
    finally:
        first.orch.close()  # killed mid-sweep: the queue is only on the node-state topic
        gated.gate.set()
    second = Harness(inline=False, **settings)
    try:
        second.orch.resume(second.orch.recover(m for m in first.out if isinstance(m, NodeState)))
        second.orch.tick()
        assert second.orch.queued == six[2:]  # still queued, still not cordoned
        assert all(second.actions(n) == [] for n in six[2:])
        wait_until(
            lambda: all(second.orch.state_of(n) == "healthy" for n in six), tick=second.orch.tick
        )
    finally:
        second.orch.close()
    assert all(second.states(n)[-3:] == ["cordoned", "sweeping", "healthy"] for n in six[2:])
    assert _most_out_at_once(second.out, ("cordoned", "sweeping")) <= 2


class JobsEndAt(DryRunScheduler):
    """A scheduler whose node runs one job until ``end`` (``time.monotonic()``); it records
    when it was asked (``squeue -w`` / the node's pods)."""

    def __init__(self, end: float) -> None:
        super().__init__()
        self.end = end
        self.asked: list[float] = []

    def jobs_on(self, node: str) -> list[str]:
        self.asked.append(time.monotonic())
        return ["4242"] if self.asked[-1] < self.end else []


def test_the_wait_for_a_nodes_jobs_asks_the_scheduler_less_and_less_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1 s doubling to 15 s, scaled down 50 x: a job ending 100 "s" after the cordon is asked
    # about ~11 times, not 100 (once a second); a job that stays is asked about once more at
    # the deadline, and the node is untested.
    from guard.sweeps import orchestrator

    monkeypatch.setattr(orchestrator, "_JOBS_POLL_S", 0.02)
    monkeypatch.setattr(orchestrator, "_JOBS_POLL_MAX_S", 0.3)
    check = {"name": "ran", "command": ["echo", "0"], "max": 0}

    def orchestrate(jobs_for_s: float, drain_timeout_s: float) -> tuple[JobsEndAt, list[Any]]:
        out: list[GuardMessage] = []
        scheduler = JobsEndAt(time.monotonic() + jobs_for_s)
        orch = Orchestrator(
            OrchestratorSettings(nodes=NODES, drain_timeout_s=drain_timeout_s),
            scheduler=scheduler,
            executor=CommandExecutor([check]),
            publish=out.append,
            clock=Clock(T0),
            inline_sweeps=True,
        )
        orch.handle_flag(flag("node-007", "f-7", T0 - 1))
        orch.tick()
        return scheduler, [m for m in out if isinstance(m, SweepResult)]

    scheduler, sweeps = orchestrate(jobs_for_s=2.0, drain_timeout_s=60)
    assert [(c.name, c.passed) for c in sweeps[0].checks] == [("ran", True)]
    gaps = [b - a for a, b in zip(scheduler.asked, scheduler.asked[1:], strict=False)]
    wanted = [min(0.02 * 2**i, 0.3) for i in range(len(gaps))]
    assert all(gap >= want - 0.005 for gap, want in zip(gaps, wanted, strict=True)), gaps
    assert 6 <= len(scheduler.asked) <= 12, len(scheduler.asked)  # once each 0.02 s: 100
    assert scheduler.asked[-1] >= scheduler.end  # asked until the job was gone

    start = time.monotonic()
    scheduler, sweeps = orchestrate(jobs_for_s=1e9, drain_timeout_s=1.5)  # stays: untested
    assert [c.name for c in sweeps[0].checks] == ["drain_timeout"]
    assert scheduler.asked[-1] >= start + 1.5  # the last question at the deadline
    assert len(scheduler.asked) <= 10  # 0.02, 0.04, ... 0.3 at most, the last one clipped
