"""The river models of the engine: peer residuals per window, one model per node or stage."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from guard.agents.simulator import ClusterSimulator, SimConfig
from guard.detectors.core import MessageFeed
from guard.detectors.engine import EngineConfig, JobDetectors, NodeDetectors
from guard.detectors.findings import Finding
from guard.detectors.peer_anomaly import GpuJobAnomaly
from guard.schemas import GpuSample, GuardMessage, StepTiming

T0 = 1_767_225_600.0


def node_samples(change: Callable[[int, int], dict[str, float]], seconds: int) -> list[GpuSample]:
    """Eight busy GPUs of one chassis, sampled every second, with sensor noise and a steady
    airflow spread (GPU 7 by the warm exhaust runs 10 degrees above its siblings);
    ``change(t, gpu)`` adds to the readings."""
    rng = np.random.default_rng(3)
    out = []
    for t in range(seconds):
        for g in range(8):
            d = change(t, g)
            out.append(
                GpuSample(
                    ts=T0 + t + 0.01 * g,
                    node="n1",
                    job="j",
                    gpu=g,
                    temp_c=round(61.0 + 0.6 * g + (10.0 if g == 7 else 0.0) + d.get("temp", 0.0)
                                 + rng.normal(0, 0.7)),
                    power_w=round(610.0 * (1 + d.get("power", 0.0)) + rng.normal(0, 12), 2),
                    power_limit_w=700.0,
                    sm_clock_mhz=round(1980.0 * (1 + d.get("clock", 0.0)) - abs(rng.normal(0, 8))),
                    sm_clock_max_mhz=1980.0,
                    util_pct=100.0,
                    clock_event_reasons=0,
                )
            )  # fmt: skip
    return out


def anomalies(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.detector == "peer_anomaly" and not f.clear]


def windows_to(scorer: GpuJobAnomaly, node: NodeDetectors) -> list[Finding]:
    """The windows ``node`` closed, through the job's model (what the core does by way of
    the findings topic)."""
    assert node.anomaly is not None
    found: list[Finding] = []
    for ts, window, job, gpus, features in node.anomaly.closed:
        assert job == scorer.job
        found += scorer.add(node.node, ts, window, gpus, features)
    node.anomaly.closed = []
    return found


def run_node(
    samples: list[GpuSample],
    node: NodeDetectors | None = None,
    scorer: GpuJobAnomaly | None = None,
    end: bool = True,
) -> list[Finding]:
    """One node's samples through its detectors and its job's river model."""
    node = node or NodeDetectors("n1")
    scorer = scorer or GpuJobAnomaly("j")
    found: list[Finding] = []
    for s in samples:
        found += node.update(s)
        found += windows_to(scorer, node)
    if end:
        found += node.flush()
        found += windows_to(scorer, node) + scorer.flush()
    return found


def test_a_steadily_warmer_gpu_is_its_own_normal() -> None:
    """Hot but healthy: GPU 7 is 10 degrees above its siblings all along, at full clocks and
    power. Twenty minutes of it give no anomaly at all."""
    assert anomalies(run_node(node_samples(lambda t, g: {}, 1200))) == []


def test_a_gpu_that_starts_to_differ_is_an_info_anomaly_naming_the_features() -> None:
    def fault(t: int, g: int) -> dict[str, float]:
        return {"temp": 6.0, "power": -0.1, "clock": -0.05} if g == 3 and t >= 600 else {}

    found = anomalies(run_node(node_samples(fault, 900)))
    assert {(f.gpu, f.severity, f.category) for f in found} == {(3, "info", "anomaly")}
    first = found[0]
    assert first.since >= T0 + 600 and first.ts <= T0 + 660  # within a minute of the onset
    assert first.evidence["stand_out"][:1] in (["sm_clock"], ["power"], ["temp_c"])
    assert set(first.evidence["stand_out"]) == {"temp_c", "power", "sm_clock"}
    assert first.evidence["features"]["sm_clock"] < -0.03 and first.score >= 0.6


def test_the_anomaly_clears_when_the_gpu_is_like_its_peers_again() -> None:
    def episode(t: int, g: int) -> dict[str, float]:
        return {"clock": -0.08, "power": -0.12} if g == 2 and 500 <= t < 620 else {}

    node = NodeDetectors("n1")
    found = [f for f in run_node(node_samples(episode, 900), node) if f.detector == "peer_anomaly"]
    assert [(f.gpu, f.clear) for f in found] == [(2, False), (2, True)]
    assert found[1].ts < T0 + 700


def rank_steps(change: Callable[[int, int], float], steps: int) -> list[StepTiming]:
    """32 ranks in two pipeline stages; stage 1 does 30 % more work (structure, not a fault);
    ``change(step, rank)`` is a fractional slowdown of a rank's compute."""
    rng = np.random.default_rng(5)
    out = []
    for step in range(steps):
        for rank in range(32):
            stage = rank // 16
            base = 0.8 * (1.3 if stage == 1 else 1.0)
            compute = base * (1 + change(step, rank)) * (1 + rng.normal(0, 0.005))
            out.append(
                StepTiming(
                    ts=T0 + step + 0.001 * rank,
                    node=f"n{rank // 8}",
                    job="j",
                    rank=rank,
                    gpu=rank % 8,
                    step=step,
                    step_s=1.0,
                    compute_s=compute,
                    pp_stage=stage,
                )
            )
    return out


def run_job(messages: list[StepTiming]) -> list[Finding]:
    job = JobDetectors("j")
    found: list[Finding] = []
    for m in messages:
        found += job.update(m)
    return anomalies(found + job.flush())


def test_ranks_are_compared_within_their_stage() -> None:
    """The heavy stage is no anomaly; a rank 8 % slower than its own stage is."""
    assert run_job(rank_steps(lambda step, rank: 0.0, 900)) == []
    found = run_job(rank_steps(lambda step, rank: 0.08 if rank == 21 and step >= 500 else 0.0, 900))
    assert {(f.node, f.rank, f.gpu) for f in found} == {("n2", 21, None)}
    assert found[0].evidence["stand_out"] == ["compute"]
    assert found[0].evidence["features"]["compute"] > 0.06


def test_a_checkpointed_model_resumes_where_it_stopped() -> None:
    """Pickled mid-run (a streams checkpoint) and restored, the node gives the same findings
    as one that never stopped."""

    def fault(t: int, g: int) -> dict[str, float]:
        return {"clock": -0.08, "power": -0.1} if g == 5 and t >= 500 else {}

    samples = node_samples(fault, 1000)
    whole = run_node(samples)
    node, scorer = NodeDetectors("n1"), GpuJobAnomaly("j")
    half = run_node(samples[: len(samples) // 2], node, scorer, end=False)
    node, scorer = pickle.loads(pickle.dumps((node, scorer), protocol=pickle.HIGHEST_PROTOCOL))
    rest = run_node(samples[len(samples) // 2 :], node, scorer)
    assert anomalies(whole) and [(f.gpu, f.ts, f.score) for f in anomalies(half + rest)] == [
        (f.gpu, f.ts, f.score) for f in anomalies(whole)
    ]


def _simulated(nodes: int, seconds: float) -> list[GuardMessage]:
    sim = ClusterSimulator(SimConfig(nodes=nodes, duration_s=seconds, seed=4))
    return list(sim.messages())


def test_state_stays_within_the_per_gpu_budget_and_the_switch_turns_it_off() -> None:
    messages = _simulated(8, 240)

    def per_gpu(config: EngineConfig) -> tuple[float, dict[str, Any]]:
        engine = MessageFeed(config)
        for m in messages:
            engine.update(m)
        engine.flush()
        gpus = sum(len(p.errors.gpus) for p in engine.nodes.values())
        return sum(engine.state_bytes().values()) / gpus, engine.nodes

    on, nodes_on = per_gpu(EngineConfig())
    off, nodes_off = per_gpu(EngineConfig(peer_anomaly=False))
    assert all(p.anomaly is not None for p in nodes_on.values())
    assert all(p.anomaly is None for p in nodes_off.values())
    assert off < on < 10_000  # the design's budget: under 10 KB of detector state per GPU


def test_a_node_whose_job_ended_sends_no_more_windows() -> None:
    """Idle GPUs have no job's model: once the node's samples carry no job, its windows stop
    (they must not keep going to the ended job's model)."""
    samples = node_samples(lambda t, g: {}, 200)
    for s in samples[len(samples) // 2 :]:
        s.job = None
    node = NodeDetectors("n1")
    jobs = []
    for s in samples:
        node.update(s)
        assert node.anomaly is not None
        jobs += [job for _, _, job, _, _ in node.anomaly.closed]
        node.anomaly.closed = []
    assert jobs and set(jobs) == {"j"}
    assert len(jobs) <= 100 // 20 + 1  # the windows of the job's 100 s, none after


def _job_records(order: int) -> list[list[tuple[int, str | None, bytes]]]:
    """Four nodes of one job, a second a step; node n2's GPU 3 runs hot, low-power and
    low-clocked from t=600. ``order`` permutes the nodes within each step (a live run's
    partitions interleave in any order), and from 2 on node n0's records come ``order``
    steps late (its partition lags)."""
    from guard.schemas import encode

    per_node = {}
    for n in range(4):

        def fault(t: int, g: int, n: int = n) -> dict[str, float]:
            bad = n == 2 and g == 3 and t >= 600
            return {"temp": 6.0, "power": -0.1, "clock": -0.05} if bad else {}

        samples = node_samples(fault, 900)
        for s in samples:
            s.node, s.ts = f"n{n}", s.ts + 0.1 * n
        per_node[n] = samples
    nodes = list(range(4))
    rng = np.random.default_rng(order)
    lag = order if order >= 2 else 0
    steps = []
    for t in range(900 + lag):
        if order:
            rng.shuffle(nodes)
        step = []
        for n in nodes:
            at = t - lag if n == 0 else t
            if at >= 0:
                step += [(0, "gpu", encode(s)) for s in per_node[n][8 * at : 8 * at + 8]]
        steps.append(step)
    return steps


def _run_core(steps: list[list[tuple[int, str | None, bytes]]]) -> list[Finding]:
    """The records through a DetectionCore, each step's outgoing records fed back the way the
    findings topic does, in a shuffled order; every finding of the jobs' river models."""
    from guard.detectors.core import DetectionCore, encode_findings

    core = DetectionCore()
    scored: list[Finding] = []
    pending: list = []
    for t, records in enumerate(steps):
        out = core.step(records, pending, wall=T0 + t)
        assert not out.bad and not out.bad_findings
        scored += [f for f in out.findings if isinstance(f, Finding)]
        pending = encode_findings(out.findings)
    while pending:
        out = core.step((), pending, wall=T0 + 900)
        scored += [f for f in out.findings if isinstance(f, Finding)]
        pending = encode_findings(out.findings)
    return [f for f in scored if f.detector == "peer_anomaly" and not f.clear]


def test_one_model_per_job_scores_every_nodes_gpus_the_same_in_any_arrival_order() -> None:
    """The nodes send their GPUs' windows to the job's model (``window_features`` records on
    the findings topic, keyed ``anomaly:<job>``); it claims the one GPU that changed, on its
    node, and gives the same scores whatever order the nodes' records arrive in."""
    first = _run_core(_job_records(0))
    assert {(f.node, f.gpu, f.job, f.category) for f in first} == {("n2", 3, "j", "anomaly")}
    assert first[0].since >= T0 + 600 and first[0].ts <= T0 + 700
    for order in (1, 25):
        shuffled = _run_core(_job_records(order))
        assert [(f.node, f.gpu, f.ts, f.score) for f in shuffled] == [
            (f.node, f.gpu, f.ts, f.score) for f in first
        ]


def _gpu_and_nic_records(nic_lag: int) -> list[list[tuple[int, str | None, bytes]]]:
    """Four nodes of one job, a second a step, GPU and NIC records (two ports a node); node
    n1's NIC starts retransmitting at t=300 and its error rate climbs. ``nic_lag``: every
    NIC record comes that many steps after its time (the NIC partition lags the GPU one);
    negative: that many steps early."""
    from guard.schemas import NicSample, encode

    gpus = {n: node_samples(lambda t, g: {}, 600) for n in range(4)}
    steps: list[list[tuple[int, str | None, bytes]]] = [[] for _ in range(600 + abs(nic_lag))]
    lead = max(0, -nic_lag)
    for n in range(4):
        for t in range(600):
            for s in gpus[n][8 * t : 8 * t + 8]:
                s.node, s.ts = f"n{n}", s.ts + 0.1 * n
                steps[t + lead].append((0, "gpu", encode(s)))
            for port in (1, 2):
                errors = (t - 300) ** 2 // 40 if n == 1 and t >= 300 else 0
                nic = NicSample(
                    ts=T0 + t + 0.1 * n + 0.05, node=f"n{n}", job="j", device=f"mlx5_{port}",
                    port=1, speed_gbps=400.0, link_up=True,
                    counters={"out_of_sequence": errors, "symbol_error": 0},
                )  # fmt: skip
                steps[t + lead + nic_lag].append((0, "nic", encode(nic)))
    return steps


def _windows_sent(steps: list[list[tuple[int, str | None, bytes]]]) -> list[tuple[Any, ...]]:
    """The window features the nodes sent to the job's model, in (node, window) order."""
    from guard.detectors.core import DetectionCore
    from guard.schemas import WindowFeatures

    core = DetectionCore()
    sent = []
    for t, records in enumerate(steps):
        out = core.step(records, (), wall=T0 + t)
        assert not out.bad
        sent += [f for f in out.findings if isinstance(f, WindowFeatures)]
    sent += [f for f in core.flush() if isinstance(f, WindowFeatures)]
    return sorted((w.node, w.window, w.gpus, w.features) for w in sent)


def test_a_window_reads_its_nodes_nic_errors_in_event_time_whichever_topic_came_first() -> None:
    """A GPU window's ``nic_errors`` is the node's NIC error rate over that window's NIC
    samples: the same whether the NIC records came with the GPU records, behind them (a
    lagging NIC partition, or a backtest's steps; up to a window, 20 s) or ahead
    of them. (It was the NIC detector's state when the GPU round was judged, which a
    backtest's step size and a live run's partition lag both changed.)"""
    same = _windows_sent(_gpu_and_nic_records(0))
    nic = {(node, w): f["nic_errors"][0] for node, w, _, f in same}
    assert len(nic) == 4 * 30
    assert {k: v for k, v in nic.items() if v > 0} == {
        k: v for k, v in nic.items() if k[0] == "n1" and k[1] >= int((T0 + 300) // 20)
    }  # n1 from the window its errors start in; the others none
    rising = [nic[("n1", int((T0 + t) // 20))] for t in range(300, 600, 20)]
    assert rising == sorted(rising) and rising[-1] > 1.0  # to tens a second
    for lag in (7, 18, -3):
        assert _windows_sent(_gpu_and_nic_records(lag)) == same, lag
    # NIC records later than the wait (the GPU samples two windows on) hold nothing back longer
    late = _windows_sent(_gpu_and_nic_records(45))
    assert [w[:2] for w in late] == [w[:2] for w in same]


def test_a_node_whose_gpu_samples_stopped_keeps_only_a_few_nic_windows() -> None:
    """NIC samples wait in the river feed for the GPU windows that read them; a node whose
    GPU samples stopped (its NIC agent goes on) keeps only the last few windows' worth."""
    from guard.detectors.peer_anomaly import NIC_KEEP_WINDOWS
    from guard.schemas import NicSample

    node = NodeDetectors("n1")
    for s in node_samples(lambda t, g: {}, 60):
        node.update(s)
    for t in range(60, 3600):
        node.update(
            NicSample(
                ts=T0 + t,
                node="n1",
                job="j",
                device="mlx5_0",
                port=1,
                counters={"out_of_sequence": t},
            )
        )
    assert node.anomaly is not None
    kept = sorted(node.anomaly.nic_windows)
    assert 0 < len(kept) <= NIC_KEEP_WINDOWS + 1
    assert kept[-1] == int((T0 + 3599) // 20)


def test_window_features_are_validated_like_any_record_and_keyed_by_their_job() -> None:
    """A malformed window, or one under another job's key, is a bad record (dead letter);
    the worker carries on with the rest."""
    from guard.detectors.core import DetectionCore
    from guard.schemas import WindowFeatures, encode

    good = WindowFeatures(
        ts=T0,
        node="n1",
        job="j",
        window=5,
        window_s=20.0,
        gpus=[0, 1],
        features={"temp_c": [0.5, -0.5]},
    )
    uneven = encode(good).replace(b'"gpus":[0,1]', b'"gpus":[0]')
    records = [
        (0, b"anomaly:j", uneven),
        (0, b"anomaly:other", encode(good)),
        (0, b"anomaly:j", b"{not json"),
        (0, b"anomaly:j", encode(good)),
    ]
    out = DetectionCore().step((), records, wall=T0)
    assert [n for n, _ in out.bad_findings] == [0, 1, 2]
    assert "one value per GPU" in str(out.bad_findings[0][1])
    assert "under key 'anomaly:other'" in str(out.bad_findings[1][1])


def test_score_baselines_keep_river_ew_statistics_to_the_last_bit_in_three_numbers() -> None:
    """The baselines are river's EWMean/EWVar arithmetic kept as three numbers: the same
    thresholds after any scores (zeros, negatives, first values included), and they survive a
    checkpoint (river's Rust state did not, once)."""
    import random

    from river import stats

    from guard.detectors.peer_anomaly import _Baseline

    rng = random.Random(7)
    for fading in (0.1, 0.05, 0.3):
        mean, var, ours = stats.EWMean(fading), stats.EWVar(fading), _Baseline()
        for _ in range(400):
            score = rng.choice([0.0, rng.random(), rng.gauss(0.5, 0.2), -rng.random()])
            mean.update(score)
            var.update(score)
            ours.learn(score, fading)
            assert (ours.mean, ours.var()) == (mean.get(), var.get())
        back = pickle.loads(pickle.dumps(ours))
        assert (back.mean, back.var(), back.seen) == (mean.get(), var.get(), 400)
