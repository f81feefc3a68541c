"""The simulator: deterministic, schema-valid, and every fault visible where its signature says."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from guard.agents.calibration import FAULT_KINDS, FAULT_MIX, TRACE_TO_KIND, fault_weights
from guard.agents.simulator import (
    CATEGORY_BY_KIND,
    CONFOUNDER_KINDS,
    THROTTLE_TEMP_C,
    ClusterSimulator,
    FaultSpec,
    JobSpec,
    SimConfig,
    write_jsonl,
)
from guard.schemas import GuardMessage, encode, parse_message

DATA = Path(__file__).resolve().parent.parent / "data" / "infinitehbd"
KINDS = list(CATEGORY_BY_KIND)


def _all_kinds_config(**overrides: Any) -> SimConfig:
    # node-010 stays healthy: the tests compare faulty ranks with its ranks
    faults = [
        FaultSpec(kind, node=f"node-{i + 1 + (i >= 9):03d}", gpu=i % 8, onset_s=120.0)
        for i, kind in enumerate(KINDS)
    ]
    faults[0].pattern = "steady"  # thermal: throttles all the time after onset
    faults[3].pattern = "steady"  # slow GPU: full slowdown from onset
    params: dict[str, Any] = {
        "nodes": 24,
        "duration_s": 900.0,
        "seed": 11,
        "faults": faults,
        "random_faults": 0,
        "checkpoint_every_s": 400.0,
    }
    params.update(overrides)
    return SimConfig(**params)


@pytest.fixture(scope="module")
def run() -> tuple[list[GuardMessage], dict[str, Any]]:
    sim = ClusterSimulator(_all_kinds_config())
    messages = list(sim.messages())
    return messages, sim.truth().model_dump()


@pytest.fixture(scope="module")
def index(run: tuple[list[GuardMessage], dict[str, Any]]) -> dict[tuple[str, str], list[Any]]:
    by: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for message in run[0]:
        by[(message.kind, message.node)].append(message)
    return by


def _fault(truth: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(f for f in truth["faults"] if f["kind"] == kind)


def _index_of(fault: dict[str, Any]) -> int:
    return fault["gpu"] if fault["gpu"] is not None else int(fault["device"].removeprefix("mlx5_"))


def test_every_message_validates_against_the_schemas(run: Any) -> None:
    messages, _ = run
    kinds = {m.kind for m in messages}
    assert kinds == {"gpu", "nic", "step", "collective"}
    for message in messages[::7]:
        parsed = parse_message(encode(message))
        assert parsed == type(message).model_validate(message.model_dump())
        assert type(parsed) is type(message)


def test_truth_follows_the_documented_format(run: Any) -> None:
    _, truth = run
    assert truth["version"] == 1 and truth["gpus_per_node"] == 8
    assert {"seed", "start_ts", "end_ts", "nodes", "jobs", "faults", "confounders"} <= set(truth)
    for fault in truth["faults"]:
        assert set(fault) >= {"id", "node", "gpu", "device", "kind", "category", "onset", "end"}
        assert fault["category"] == CATEGORY_BY_KIND[fault["kind"]]
        assert fault["slowdown"] >= 0 and fault["pattern"] in (
            "steady",
            "intermittent",
            "degrading",
        )
    assert {f["kind"] for f in truth["faults"]} == set(KINDS)
    seen = {c["kind"] for c in truth["confounders"]}
    assert seen == set(CONFOUNDER_KINDS)
    json.dumps(truth)  # plain data
    job_b = next(j for j in truth["jobs"] if j["job"] == "job-b")
    assert job_b["pp_stages"] == 2 and job_b["ranks"] == 8 * len(job_b["nodes"])


def test_time_order_except_the_skew_and_out_of_order_confounders(run: Any) -> None:
    messages, truth = run
    ooo_nodes = {c["node"] for c in truth["confounders"] if c["kind"] == "out_of_order"}
    skew = max(
        abs(c["detail"]["skew_s"]) for c in truth["confounders"] if c["kind"] == "clock_skew"
    )
    last = 0.0
    for message in messages:
        if message.node in ooo_nodes:
            continue
        assert message.ts >= last - 2 * skew - 0.01
        last = max(last, message.ts)
    assert truth["start_ts"] <= messages[0].ts and messages[-1].ts <= truth["end_ts"] + 1


def test_same_seed_same_bytes_and_workers_do_not_change_them(tmp_path: Path) -> None:
    config = SimConfig(nodes=6, duration_s=90, seed=5)
    digests = []
    for workers in (1, 2, 1):
        out = tmp_path / f"t{workers}.jsonl"
        truth, counts = write_jsonl(config, out, workers=workers)
        digests.append((hashlib.sha256(out.read_bytes()).hexdigest(), truth.model_dump_json()))
        assert sum(counts.values()) == len(out.read_bytes().splitlines())
    assert digests[0] == digests[1] == digests[2]
    # The writer's shortcuts (reused sample objects, whole-tick encoding) change no byte.
    plain = b"".join(encode(m) + b"\n" for m in ClusterSimulator(config).messages())
    assert plain == (tmp_path / "t1.jsonl").read_bytes()
    other = tmp_path / "other.jsonl"
    write_jsonl(SimConfig(nodes=6, duration_s=90, seed=6), other, workers=1)
    assert other.read_bytes() != (tmp_path / "t1.jsonl").read_bytes()
    for line in (tmp_path / "t2.jsonl").read_bytes().splitlines()[::11]:
        parse_message(line)


def test_same_seed_same_bytes_whichever_simd_kernels_numpy_picks(tmp_path: Path) -> None:
    """numpy picks its vector kernels by CPU at import: on an AVX-512 machine ``np.exp`` gave
    other last bits than elsewhere, so the same seed wrote other bytes (and the regression
    fixture's hash failed there). The simulator's output must not depend on the machine: a
    run limited to numpy's baseline kernels writes the same bytes as one with every kernel
    this CPU has."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    extras = [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]
    args = ["simulate", "--nodes", "4", "--duration", "120", "--seed", "3", "--workers", "1"]
    written = []
    for disable in ("", " ".join(extras)):
        out, truth = tmp_path / f"t{len(written)}.jsonl", tmp_path / f"truth{len(written)}.json"
        env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": disable}
        done = subprocess.run(
            [sys.executable, "-m", "guard.cli", *args, "--out", str(out), "--truth", str(truth)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        written.append(out.read_bytes() + truth.read_bytes())
    assert written[0] == written[1], f"numpy kernels {extras} change the simulator's output"


def _after(messages: list[Any], ts: float, index: int, attr: str) -> list[Any]:
    return [m for m in messages if m.ts >= ts and getattr(m, attr) == index]


def test_thermal_throttle_is_hot_slow_clocked_and_says_why(run: Any, index: Any) -> None:
    _, truth = run
    fault = _fault(truth, "thermal_throttle")
    gpu = fault["gpu"]
    samples = _after(index[("gpu", fault["node"])], fault["onset"] + 180, gpu, "gpu")
    assert samples and all(s.temp_c >= THROTTLE_TEMP_C for s in samples)
    assert all(s.clock_event_reasons & 0x20 for s in samples)
    assert all(s.sm_clock_mhz < 0.97 * s.sm_clock_max_mhz for s in samples)
    steps = _after(index[("step", fault["node"])], fault["onset"] + 180, gpu, "gpu")
    peers = [s.compute_s for s in index[("step", "node-010")] if s.ts > fault["onset"] + 180]
    ratio = statistics.median(s.compute_s for s in steps) / statistics.median(peers)
    assert ratio == pytest.approx(1 + fault["slowdown"], abs=0.03)


@pytest.mark.parametrize("kind, bits", [("power_cap", 0x4), ("power_brake", 0x80)])
def test_power_faults_draw_less_and_set_their_reason_bits(
    run: Any, index: Any, kind: str, bits: int
) -> None:
    _, truth = run
    fault = _fault(truth, kind)
    mine = _after(index[("gpu", fault["node"])], fault["onset"] + 5, fault["gpu"], "gpu")
    others = [s for s in index[("gpu", "node-010")] if s.ts > fault["onset"] + 5]
    assert all(s.clock_event_reasons & bits for s in mine)
    assert statistics.median(s.power_w for s in mine) < 0.9 * statistics.median(
        s.power_w for s in others
    )
    assert statistics.median(s.sm_clock_mhz for s in mine) < 1980


def test_silent_slow_gpu_is_slow_without_any_telemetry_signature(run: Any, index: Any) -> None:
    _, truth = run
    fault = _fault(truth, "slow_gpu")
    gpu = fault["gpu"]
    samples = _after(index[("gpu", fault["node"])], fault["onset"], gpu, "gpu")
    assert all(s.clock_event_reasons in (0, 0x4) and s.temp_c < 85 for s in samples)
    before = [
        s.compute_s
        for s in index[("step", fault["node"])]
        if s.gpu == gpu and s.ts < fault["onset"]
    ]
    after = _after(index[("step", fault["node"])], fault["onset"] + 30, gpu, "gpu")
    ratio = statistics.median(s.compute_s for s in after) / statistics.median(before)
    assert ratio > 1 + 0.6 * fault["slowdown"]


def test_degraded_nic_counts_errors_and_slows_its_connections(run: Any, index: Any) -> None:
    _, truth = run
    fault = _fault(truth, "degraded_nic")
    nic = _index_of(fault)
    samples = [s for s in index[("nic", fault["node"])] if s.device == fault["device"]]
    first, last = samples[0].counters, samples[-1].counters
    assert last["symbol_error"] > first["symbol_error"] + 100
    assert last["out_of_sequence"] > first["out_of_sequence"]
    assert all(s.speed_gbps == 400 for s in samples)
    coll = [m for m in index[("collective", fault["node"])] if m.ts > fault["onset"] + 10]
    mine = [p.duration_s for m in coll if m.rank % 8 == nic for p in m.peers]
    theirs = [p.duration_s for m in coll if m.rank % 8 != nic for p in m.peers]
    assert statistics.median(mine) > (1 + 0.8 * fault["slowdown"]) * statistics.median(theirs)


def test_reduced_speed_nic_reports_its_rate_and_no_errors(run: Any, index: Any) -> None:
    _, truth = run
    fault = _fault(truth, "nic_reduced_speed")
    samples = [s for s in index[("nic", fault["node"])] if s.device == fault["device"]]
    assert {s.speed_gbps for s in samples if s.ts > fault["onset"] + 1} == {200.0}
    assert {s.speed_gbps for s in samples if s.ts < fault["onset"] - 1} == {400.0}
    assert samples[-1].counters["symbol_error"] <= 2


def test_link_flap_downs_the_link_and_hangs_the_whole_job(run: Any, index: Any) -> None:
    _, truth = run
    fault = _fault(truth, "link_flap")
    samples = [s for s in index[("nic", fault["node"])] if s.device == fault["device"]]
    assert samples[-1].counters["link_downed"] - samples[0].counters["link_downed"] >= 1
    assert any(s.link_up is False for s in samples)
    job = next(j for j in truth["jobs"] if fault["node"] in j["nodes"])
    far = next(n for n in job["nodes"] if n != fault["node"])
    hang = [s.step_s for s in index[("step", far)] if fault["onset"] <= s.ts < fault["onset"] + 30]
    assert max(hang) > job["step_s_nominal"] + 0.8 * fault["detail"]["hang_s"]


@pytest.mark.parametrize("kind", ["xid", "ecc_dbe"])
def test_gpu_errors_show_as_xid_and_ecc(run: Any, index: Any, kind: str) -> None:
    _, truth = run
    fault = _fault(truth, kind)
    samples = [s for s in index[("gpu", fault["node"])] if s.gpu == fault["gpu"]]
    xids = [s for s in samples if s.xid]
    assert xids and all(s.ts >= fault["onset"] - 1 for s in xids)
    assert {s.xid for s in xids} == {fault["detail"]["xid"]}
    if kind == "ecc_dbe":
        assert samples[-1].ecc_dbe_total >= 1 and samples[0].ecc_dbe_total == 0


def test_step_time_is_shared_and_stragglers_show_in_compute(run: Any) -> None:
    messages, _ = run
    by_step: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for m in messages:
        if m.kind == "step":
            by_step[(m.job, m.step)].append(m)
    for steps in list(by_step.values())[5:50]:
        assert len({round(s.step_s, 9) for s in steps}) == 1
        assert max(s.compute_s for s in steps) < steps[0].step_s


def test_confounders_look_like_the_truth_says(run: Any, index: Any) -> None:
    messages, truth = run
    conf = defaultdict(list)
    for c in truth["confounders"]:
        conf[c["kind"]].append(c)
    # A hot rack is hotter but never throttles.
    hot = conf["hot_rack"][0]["node"]
    hot_temps = [s.temp_c for s in index[("gpu", hot)] if s.ts > truth["start_ts"] + 120]
    assert statistics.median(hot_temps) > 65 and max(hot_temps) < THROTTLE_TEMP_C
    assert not any(s.clock_event_reasons & 0x60 for s in index[("gpu", hot)])
    # Agent restart: a gap, then counters start again from zero.
    restart = conf["agent_restart"][0]
    nic = [s for s in index[("nic", restart["node"])] if s.device == "mlx5_0"]
    assert not any(restart["start"] <= s.ts < restart["end"] for s in nic)
    before = [s for s in nic if s.ts < restart["start"]][-1]
    after = next(s for s in nic if s.ts >= restart["end"])
    assert after.counters["port_xmit_data"] < before.counters["port_xmit_data"]
    # Telemetry gap: no samples, steps continue.
    gap = conf["telemetry_gap"][0]
    assert not any(gap["start"] <= s.ts < gap["end"] for s in index[("gpu", gap["node"])])
    assert any(gap["start"] <= s.ts < gap["end"] for s in index[("step", gap["node"])])
    # Congestion: ECN everywhere, no errors.
    cong = conf["fabric_congestion"][0]
    node = "node-020"
    nic = [s for s in index[("nic", node)] if s.device == "mlx5_3"]
    inside = [s for s in nic if cong["start"] <= s.ts < cong["end"]]
    ecn = (
        inside[-1].counters["np_ecn_marked_roce_packets"]
        - inside[0].counters["np_ecn_marked_roce_packets"]
    )
    assert ecn > 100 * (inside[-1].ts - inside[0].ts)
    assert inside[-1].counters["port_rcv_errors"] == inside[0].counters["port_rcv_errors"]
    # Checkpoint: everyone's step is long, nobody's compute.
    ck = conf["checkpoint"][0]
    steps = [
        m
        for m in messages
        if m.kind == "step" and m.job == ck["job"] and m.step == ck["detail"]["step"]
    ]
    assert min(s.step_s for s in steps) > ck["end"] - ck["start"]
    assert max(s.compute_s for s in steps) < 3
    # Stage imbalance: the last stage computes longer than the first, on every node.
    imb = conf["stage_imbalance"][0]
    stage = defaultdict(list)
    for m in messages:
        if m.kind == "step" and m.job == imb["job"]:
            stage[m.pp_stage].append(m.compute_s)
    extra = statistics.median(stage[1]) / statistics.median(stage[0]) - 1
    assert extra == pytest.approx(imb["detail"]["extra"], abs=0.02)


def test_remediation_moves_ranks_to_a_spare_and_restores_step_time() -> None:
    def config() -> SimConfig:
        spec = FaultSpec("slow_gpu", node="node-002", gpu=1, onset_s=30, slowdown=0.3)
        spec.pattern = "steady"
        return SimConfig(
            nodes=6, duration_s=400, seed=2, faults=[spec], random_faults=0, confounders=False
        )

    plain = ClusterSimulator(config())
    list(plain.messages())
    fixed = ClusterSimulator(config())
    seen_spare = False
    for message in fixed.messages():
        if (
            message.kind == "step"
            and message.ts > 100 + fixed.start_ts
            and not fixed.truth().remediations
        ):
            fixed.remediate("node-002")
        if message.kind == "step" and message.node == "node-005":
            seen_spare = True
    remediation = fixed.truth().remediations[0]
    assert remediation.node == "node-002" and remediation.replaced_by == "node-005"
    assert seen_spare
    late = fixed.start_ts + 250
    slow = statistics.median(s for ts, s in plain.step_times("job-a") if ts > late)
    healed = statistics.median(s for ts, s in fixed.step_times("job-a") if ts > late)
    assert healed < slow / 1.15


def test_bad_configs_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        ClusterSimulator(SimConfig(faults=[FaultSpec("melted")]))
    with pytest.raises(ValueError, match="unknown node"):
        ClusterSimulator(SimConfig(faults=[FaultSpec("xid", node="nope")]))
    with pytest.raises(ValueError, match="at least one node"):
        ClusterSimulator(SimConfig(nodes=0))


def fault_mix_from_statistics(stats: dict[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
    """Mapped counts and weights from the trace's ``fault_statistics.json`` (a parsed dict)."""
    counts = dict.fromkeys(FAULT_KINDS, 0)
    for level in stats.values():
        for class_name, descs in level.items():
            if not isinstance(descs, dict):
                continue
            for desc, count in descs.items():
                kind = TRACE_TO_KIND.get((class_name, desc))
                if kind is not None and desc != "ClassTotal":
                    counts[kind] += int(count)
    return counts, fault_weights(counts)


def test_fault_mix_is_the_one_derived_from_the_infinitehbd_trace() -> None:
    counts, weights = fault_mix_from_statistics(
        json.loads((DATA / "fault_statistics.json").read_text())
    )
    assert weights == FAULT_MIX
    assert counts["slow_gpu"] == 126 and counts["link_flap"] == 40
    assert sum(FAULT_MIX.values()) == pytest.approx(1, abs=1e-3)


def test_guard_simulate_cli_writes_telemetry_and_truth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from guard.cli import main

    out, truth = tmp_path / "t.jsonl", tmp_path / "truth.json"
    args = ["simulate", "--nodes", "4", "--duration", "30", "--seed", "1", "--out", str(out)]
    code = main(
        [*args, "--truth", str(truth), "--fault", "slow_gpu:node=node-001:gpu=2:onset=5", "--json"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    lines = out.read_bytes().splitlines()
    assert summary["messages"] == len(lines) and all(parse_message(line) for line in lines[::5])
    faults = json.loads(truth.read_text())["faults"]
    assert any(
        f["node"] == "node-001" and f["gpu"] == 2 and f["kind"] == "slow_gpu" for f in faults
    )
    assert main([*args, "--truth", str(truth), "--fault", "slow_gpu:gpu=99"]) == 2
    assert main(["simulate", "--out", str(tmp_path / "no" / "t.jsonl"), "--truth", str(truth)]) == 2
    assert "error" in capsys.readouterr().err


def test_guard_simulate_cli_runs_a_shared_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fleet options from the command line: short-step jobs, host clock offsets, job
    churn with warm-up, hot idle nodes; the same as the SimConfig they stand for."""
    from guard.cli import main
    from guard.schemas.truth import Truth

    out, truth_path = tmp_path / "t.jsonl", tmp_path / "truth.json"
    fleet = ["--job", "job-a:nodes=4:step=5", "--job", "job-b:nodes=2:stages=2:step=8"]
    fleet += ["--clock-offset", "0.5", "--job-lifetime", "200", "--job-gap", "40"]
    fleet += ["--warmup-steps", "10", "--warmup-extra", "0.3", "--hot-idle-nodes", "1"]
    args = ["simulate", "--nodes", "8", "--duration", "400", "--seed", "3"]
    assert main([*args, *fleet, "--out", str(out), "--truth", str(truth_path)]) == 0
    truth = Truth.load(truth_path)
    steps = {j.job: j.step_s_nominal for j in truth.jobs}
    assert steps["job-a"] == 5.0 and steps["job-b"] == 8.0 and "job-a-2" in steps
    assert [j.pp_stages for j in truth.jobs if j.job == "job-b"] == [2]
    kinds = {c.kind for c in truth.confounders}
    assert {"job_end", "warmup", "hot_idle"} <= kinds
    warmup = next(c for c in truth.confounders if c.kind == "warmup")
    assert warmup.detail["steps"] == 10
    assert truth.clock_offsets and max(map(abs, truth.clock_offsets.values())) <= 0.52
    assert len(truth.idle_nodes) == 2  # 8 nodes, jobs on 6
    config = SimConfig(
        nodes=8,
        duration_s=400.0,
        seed=3,
        jobs=[JobSpec("job-a", 4, 1, 5.0), JobSpec("job-b", 2, 2, 8.0)],
        clock_offset_s=0.5,
        job_lifetime_s=200.0,
        job_gap_s=40.0,
        warmup_steps=10,
        warmup_extra=0.3,
        hot_idle_nodes=1,
    )
    again, direct = tmp_path / "direct.jsonl", tmp_path / "direct.json"
    write_jsonl(config, again)[0].save(direct)
    assert again.read_bytes() == out.read_bytes() and Truth.load(direct) == truth
    capsys.readouterr()
    for bad in (["--job", "job-a:nodes=0"], ["--job", "job-a:gpus=2"], ["--hot-idle-nodes", "7"]):
        assert main([*args, *bad, "--out", str(out), "--truth", str(truth_path)]) == 2, bad
        assert capsys.readouterr().err.count("\n") == 1, bad  # one line that says why


def test_gpus_of_a_chassis_spread_by_airflow_position_steadily(run: Any, index: Any) -> None:
    messages, truth = run
    faulty = {f["node"] for f in truth["faults"]}
    hot_rack = {c["node"] for c in truth["confounders"] if c["kind"] == "hot_rack"}
    busy = {n for j in truth["jobs"] for n in j["nodes"]} - faulty - hot_rack
    settled = truth["start_ts"] + 300
    spreads, hottest_above = [], []
    for node in sorted(busy):
        per_gpu: dict[int, list[float]] = defaultdict(list)
        for s in index[("gpu", node)]:
            if s.ts > settled:
                per_gpu[s.gpu].append(s.temp_c)
        first = {g: statistics.median(v[: len(v) // 2]) for g, v in per_gpu.items()}
        last = {g: statistics.median(v[len(v) // 2 :]) for g, v in per_gpu.items()}
        assert all(abs(first[g] - last[g]) <= 1.0 for g in first)  # steady
        temps = sorted(last.values())
        spreads.append(temps[-1] - temps[0])
        hottest_above.append(temps[-1] - statistics.median(temps))
        assert temps[-1] < THROTTLE_TEMP_C - 3  # healthy: far from the slowdown threshold
    assert min(spreads) >= 4.0 and max(spreads) <= 18.0
    assert max(hottest_above) >= 8.0  # some healthy GPU runs ~10 C above its siblings
    assert all(s.temp_slowdown_c == THROTTLE_TEMP_C for s in messages[:50] if s.kind == "gpu")


def test_pipeline_job_has_a_cross_stage_collective_where_the_heaviest_stage_arrives_last(
    run: Any,
) -> None:
    messages, truth = run
    pp = next(j for j in truth["jobs"] if j["pp_stages"] > 1)
    stage_of = {m.rank: m.pp_stage for m in messages if m.kind == "step" and m.job == pp["job"]}
    world: dict[int, list[Any]] = defaultdict(list)
    for m in messages:
        if (
            m.kind == "collective"
            and m.job == pp["job"]
            and m.comm.startswith(f"{pp['job']}/world")
        ):
            world[m.seq].append(m)
    assert len(world) > 50
    heavy = pp["pp_stages"] - 1  # the last stage also runs the loss
    for ops in list(world.values())[5:50]:
        assert len(ops) == pp["ranks"]
        last = max(ops, key=lambda m: m.arrive_ts)
        assert stage_of[last.rank] == heavy
        assert len({m.end_ts for m in ops}) <= 1 + len({m.node for m in ops})  # one end (+skew)


def test_a_share_of_random_faults_lands_in_the_heaviest_stage() -> None:
    sim = ClusterSimulator(SimConfig(nodes=64, duration_s=3600, seed=5, faults_per_node_hour=0.5))
    heavy = {sim.node_names[n] for n in sim.scenario.heaviest_stage_nodes()}
    nodes = [f["node"] for f in sim.truth().model_dump()["faults"]]
    share = sum(n in heavy for n in nodes) / len(nodes)
    # 35 % of faults are drawn into a stage that holds ~12 % of the nodes
    assert len(nodes) >= 20 and 0.2 <= share <= 0.6


def _ts_fields(message: Any) -> tuple[float, ...]:
    if message.kind == "collective":
        return (message.ts, message.arrive_ts, message.end_ts)
    return (message.ts,)


def _untimed(message: Any) -> dict[str, Any]:
    fields = json.loads(encode(message))
    for key in ("ts", "arrive_ts", "end_ts"):
        fields.pop(key, None)
    return fields


def test_host_clock_offsets_shift_every_timestamp_a_host_writes_and_are_in_the_truth() -> None:
    base = {"nodes": 16, "duration_s": 120.0, "seed": 5, "random_faults": 1}
    plain_sim = ClusterSimulator(SimConfig(**base))
    plain = list(plain_sim.messages())
    assert "clock_offsets" not in plain_sim.truth().model_dump()  # off: the file as before
    sim = ClusterSimulator(SimConfig(**base, clock_offset_s=0.5))
    shifted = list(sim.messages())
    truth = sim.truth()
    assert truth.clock_offsets is not None and set(truth.clock_offsets) == set(truth.nodes)
    # Messages arrive when they did (the order is the same); only the host's clock is off.
    assert len(shifted) == len(plain)
    shift: dict[str, set[float]] = defaultdict(set)
    for a, b in zip(plain, shifted, strict=True):
        assert _untimed(a) == _untimed(b)  # compute_s, step_s, peers' durations: unchanged
        for ta, tb in zip(_ts_fields(a), _ts_fields(b), strict=True):
            shift[a.node].add(round(tb - ta, 6))
    kinds = {m.kind for m in shifted}
    assert kinds == {"gpu", "nic", "step", "collective"}
    offsets = {}
    for node, values in shift.items():
        assert len(values) == 1, f"{node}: one constant offset on every timestamp, not {values}"
        offsets[node] = values.pop()
        assert abs(offsets[node]) <= 0.5
        # the truth's offset is the host's whole clock error: this plus the ms-scale skew
        assert abs(truth.clock_offsets[node] - offsets[node]) <= 0.0151
    assert max(offsets.values()) - min(offsets.values()) > 0.3  # drawn per host, spread
    # The wait inside a collective on the host's own clock is unchanged.
    for a, b in zip(plain, shifted, strict=True):
        if a.kind == "collective":
            assert b.end_ts - b.arrive_ts == pytest.approx(a.end_ts - a.arrive_ts, abs=1e-9)
    # Seeded: the same config draws the same offsets; the truth survives its own file.
    again = ClusterSimulator(SimConfig(**base, clock_offset_s=0.5))
    assert again.truth().clock_offsets == truth.clock_offsets
    assert type(truth).model_validate_json(truth.model_dump_json()) == truth
    with pytest.raises(ValueError, match="clock_offset_s"):
        ClusterSimulator(SimConfig(**base, clock_offset_s=-1.0))


def test_host_slow_slows_every_rank_of_its_node_and_leaves_gpu_telemetry_normal() -> None:
    def run_with(slowdown: float) -> tuple[list[Any], Any]:
        fault = FaultSpec("host_slow", node="node-002", onset_s=60.0, slowdown=slowdown)
        config = SimConfig(nodes=8, duration_s=300.0, seed=3, random_faults=0, faults=[fault])
        sim = ClusterSimulator(config)
        return list(sim.messages()), sim.truth()

    healthy, _ = run_with(0.0)
    slowed, truth = run_with(0.06)
    (fault,) = truth.faults
    assert (fault.kind, fault.category, fault.node) == ("host_slow", "straggler", "node-002")
    assert fault.gpu is None and fault.device is None  # the whole node's, no one device's
    # GPU (and NIC) telemetry: exactly what the same node reports without the fault.
    samples = [[encode(m) for m in run if m.kind in ("gpu", "nic")] for run in (healthy, slowed)]
    assert samples[0] == samples[1] and len(samples[0]) > 0
    after = fault.onset + 10
    gpus = [m for m in slowed if m.kind == "gpu" and m.node == "node-002" and m.ts > after]
    clocks = [m.sm_clock_mhz / m.sm_clock_max_mhz for m in gpus]
    assert statistics.median(clocks) == 1.0 and min(clocks) > 0.95  # full clocks
    assert all(m.clock_event_reasons & ~0x4 == 0 for m in gpus)  # no throttle bits
    power = statistics.median(m.power_w for m in gpus)
    assert (
        0.8 * gpus[0].power_limit_w < power < gpus[0].power_limit_w
    )  # the busy draw of a healthy GPU

    # Every rank of the node computes slower by the fault's slowdown, the others do not.
    def compute(run: list[Any]) -> dict[tuple[int, int], float]:
        return {
            (m.rank, m.step): m.compute_s
            for m in run
            if m.kind == "step" and m.ts > after and m.step > 0
        }

    before, now = compute(healthy), compute(slowed)
    node_of = {m.rank: m.node for m in slowed if m.kind == "step"}
    ratio: dict[int, list[float]] = defaultdict(list)
    for key in before.keys() & now.keys():
        ratio[key[0]].append(now[key] / before[key])
    on_node = [statistics.median(v) for r, v in ratio.items() if node_of[r] == "node-002"]
    others = [statistics.median(v) for r, v in ratio.items() if node_of[r] != "node-002"]
    assert len(on_node) == 8
    assert all(x == pytest.approx(1.06, abs=0.002) for x in on_node)
    assert all(x == pytest.approx(1.0, abs=0.002) for x in others)


def test_job_churn_ends_jobs_cools_their_gpus_and_warms_up_the_next_job() -> None:
    config = SimConfig(
        nodes=8, duration_s=900.0, seed=4, random_faults=0, job_lifetime_s=300.0, job_gap_s=60.0
    )
    sim = ClusterSimulator(config)
    messages = list(sim.messages())
    truth = sim.truth()
    jobs = [j.job for j in truth.jobs]
    assert jobs[0] == "job-a" and len(jobs) >= 3 and len(set(jobs)) == len(jobs)
    assert all(j.nodes == truth.jobs[0].nodes for j in truth.jobs)  # on the same nodes
    ends = [c for c in truth.confounders if c.kind == "job_end"]
    warmups = [c for c in truth.confounders if c.kind == "warmup"]
    assert [c.job for c in ends] == jobs[:-1] and [c.job for c in warmups] == jobs[1:]
    first_end = ends[0]
    node = truth.jobs[0].nodes[0]
    gpu = [m for m in messages if m.kind == "gpu" and m.node == node and m.gpu == 0]
    busy = [m for m in gpu if m.ts < first_end.start - 5]
    idle = [m for m in gpu if first_end.start + 30 < m.ts < first_end.end - 1]
    assert idle and all(m.job is None and m.util_pct == 0 for m in idle)
    assert statistics.median(m.power_w for m in idle) < 0.2 * statistics.median(
        m.power_w for m in busy
    )
    assert idle[-1].temp_c < busy[-1].temp_c - 10  # cooling towards idle
    steps: dict[str, list[Any]] = defaultdict(list)
    for m in messages:
        if m.kind == "step":
            steps[m.job].append(m)
    assert set(steps) == set(jobs)
    assert not [m for m in steps["job-a"] if first_end.start + 0.1 < m.ts]  # it has ended
    for name in jobs[1:]:
        own = steps[name]
        assert min(m.step for m in own) == 0  # a new job counts its steps from the start
        early = [m.compute_s for m in own if m.step < 3]
        warm = [m.compute_s for m in own if m.step >= config.warmup_steps + 5]
        ranks_early = {m.rank for m in own if m.step < 3}
        assert len(ranks_early) == truth.jobs[0].ranks  # every rank warms up
        assert min(early) > 1.3 * statistics.median(warm)
    assert ClusterSimulator(config).truth().jobs == truth.jobs[:1]  # before running: one job
    with pytest.raises(ValueError, match="job_lifetime_s"):
        ClusterSimulator(SimConfig(job_lifetime_s=-1.0))


def test_hot_idle_nodes_run_hot_while_idle_and_change_nothing_else() -> None:
    """An idle node whose GPUs run hot (blocked airflow, a context left open): a confounder
    in the truth, not a fault; the rest of the run is byte for byte the run without it."""
    base = {"nodes": 16, "duration_s": 180.0, "seed": 6, "random_faults": 0}
    plain = list(ClusterSimulator(SimConfig(**base)).messages())
    sim = ClusterSimulator(SimConfig(**base, hot_idle_nodes=1))
    messages = list(sim.messages())
    truth = sim.truth()
    (hot,) = [c for c in truth.confounders if c.kind == "hot_idle"]
    assert hot.node in truth.idle_nodes and not truth.faults
    assert 20 <= hot.detail["extra_c"] <= 35 and 15 <= hot.detail["extra_w"] <= 45
    (cool,) = [n for n in truth.idle_nodes if n != hot.node]  # 16 nodes: two idle

    def settled(msgs: list[Any], node: str) -> list[Any]:
        return [
            m for m in msgs if m.kind == "gpu" and m.node == node and m.ts > truth.start_ts + 90
        ]

    hot_now, hot_before = settled(messages, hot.node), settled(plain, hot.node)
    assert all(m.job is None and m.util_pct == 0 and m.clock_event_reasons == 1 for m in hot_now)
    warmer = statistics.median(m.temp_c for m in hot_now) - statistics.median(
        m.temp_c for m in hot_before
    )
    assert warmer == pytest.approx(hot.detail["extra_c"], abs=3)
    assert max(m.temp_c for m in hot_now) < THROTTLE_TEMP_C - 5  # below throttling
    more = statistics.median(m.power_w for m in hot_now) - statistics.median(
        m.power_w for m in hot_before
    )
    assert more == pytest.approx(hot.detail["extra_w"], abs=3)
    assert settled(messages, cool) == settled(plain, cool)
    others = [m for m in messages if m.node != hot.node]
    assert others == [m for m in plain if m.node != hot.node]  # nothing else changed
    again = ClusterSimulator(SimConfig(**base, hot_idle_nodes=1)).truth().confounders
    assert [c for c in again if c.kind == "hot_idle"] == [hot]  # seeded
    with pytest.raises(ValueError, match="hot_idle_nodes=3 but only 2 nodes are idle"):
        ClusterSimulator(SimConfig(**base, hot_idle_nodes=3))


def test_fleet_options_together_split_across_workers_write_the_same_bytes(tmp_path: Path) -> None:
    config = SimConfig(
        nodes=8,
        duration_s=600.0,
        seed=4,
        random_faults=1,
        job_lifetime_s=200.0,
        job_gap_s=60.0,
        clock_offset_s=0.5,
        hot_idle_nodes=1,
        faults=[FaultSpec("host_slow", node="node-003", onset_s=100.0)],
    )
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    truth_one, _ = write_jsonl(config, one, workers=1)
    truth_two, _ = write_jsonl(config, two, workers=2)
    assert one.read_bytes() == two.read_bytes()
    assert truth_one == truth_two and truth_one.clock_offsets is not None
    assert {"job_end", "warmup", "hot_idle"} <= {c.kind for c in truth_one.confounders}
