"""Engine, fusion, state, backtest and eval: over a small simulated cluster and by hand."""

from __future__ import annotations

import gc
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from guard.agents.simulator import ClusterSimulator, FaultSpec, SimConfig
from guard.cli import main
from guard.detectors.core import MessageFeed
from guard.detectors.findings import Finding
from guard.detectors.fusion import NodeFusion
from guard.evaluation.scoring import evaluate
from guard.schemas import encode, parse_message

FAULTS = [
    FaultSpec("slow_gpu", node="node-003", gpu=2, onset_s=90, slowdown=0.08, pattern="steady"),
    FaultSpec("degraded_nic", node="node-006", gpu=5, onset_s=120),
    FaultSpec("xid", node="node-009", gpu=1, onset_s=150),
]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[bytes]]:
    """A 12-node, 5-minute run with three faults and the confounders, as JSONL + truth."""
    sim = ClusterSimulator(
        SimConfig(nodes=12, duration_s=300, seed=21, faults=FAULTS, random_faults=0)
    )
    lines = [encode(m) for m in sim.messages()]
    root = tmp_path_factory.mktemp("sim")
    telemetry, truth = root / "t.jsonl", root / "truth.json"
    telemetry.write_bytes(b"\n".join(lines) + b"\n")
    truth.write_text(sim.truth().model_dump_json())
    return telemetry, truth, lines


def test_engine_finds_the_three_faults_and_nothing_else(
    simulated: tuple[Path, Path, list[bytes]],
) -> None:
    _, truth_path, lines = simulated
    engine = MessageFeed()
    flags = [f for line in lines for f in engine.update(parse_message(line))] + engine.flush()
    ev = evaluate(json.loads(truth_path.read_text()), [f.model_dump() for f in flags])
    assert ev.rows["all"].recall == 1.0
    assert ev.false_claims == []
    claims = {(f.node, f.category) for f in flags if f.severity != "info"}
    assert {("node-003", "straggler"), ("node-006", "nic"), ("node-009", "gpu_error")} <= claims


def test_backtest_cli_is_deterministic_and_eval_reads_it(
    simulated: tuple[Path, Path, list[bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    telemetry, truth, _ = simulated
    outs = []
    for i in range(2):
        out = tmp_path / f"flags{i}.jsonl"
        assert main(["backtest", str(telemetry), "--out", str(out), "--quiet"]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0]
    capsys.readouterr()
    assert (
        main(["eval", "--truth", str(truth), "--flags", str(tmp_path / "flags0.jsonl"), "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["categories"]["all"]["recall"] == 1.0
    assert report["false_claims"] == 0
    assert main(["eval", "--truth", str(truth), "--flags", str(tmp_path / "flags0.jsonl")]) == 0
    assert "precision 1.00" in capsys.readouterr().out


def test_a_backtest_of_batch_records_gives_the_flags_of_single_records(
    simulated: tuple[Path, Path, list[bytes]], tmp_path: Path
) -> None:
    """The agents send batch records by default; ``guard backtest`` reads their GPU and NIC
    lines as fields (no model per sample) and must find what the single records give."""
    from guard.schemas.batches import batch_messages

    telemetry, _, lines = simulated
    batched = tmp_path / "batched.jsonl"
    records = batch_messages([parse_message(line) for line in lines])
    assert {r.kind for r in records} >= {"gpu_batch", "nic_batch", "step_batch"}
    batched.write_bytes(b"".join(encode(r) + b"\n" for r in records))
    flags = {}
    for name, path in (("single", telemetry), ("batched", batched)):
        out = tmp_path / f"flags-{name}.jsonl"
        assert main(["backtest", str(path), "--out", str(out), "--quiet"]) == 0
        flags[name] = [json.loads(x) for x in out.read_text().splitlines()]
    assert flags["single"]
    claims = {
        n: {(f["node"], f["category"]) for f in fs if f["severity"] != "info"}
        for n, fs in flags.items()
    }
    assert claims["batched"] == claims["single"]


def test_backtest_skips_bad_lines_and_merges_inputs(
    simulated: tuple[Path, Path, list[bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, lines = simulated
    half = len(lines) // 2
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    bad = [b'{"kind":"gpu","ts":"x"}', b"", b"  \t\r", b"not json"]  # blank lines are no error
    a.write_bytes(b"\n".join([*lines[:half:2], *bad]) + b"\n")
    b.write_bytes(b"\n".join(lines[1:half:2]) + b"\n")
    out = tmp_path / "flags.jsonl"
    assert main(["backtest", str(a), str(b), "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "2 bad lines skipped" in err and "field 'ts'" in err
    assert f"{half:,} messages" in err
    assert "a.jsonl:" + str(half // 2 + half % 2 + 1) + ": skipped" in err  # where the line is
    # One input takes the reader without the merge: the same lines skipped, the rest read.
    assert main(["backtest", str(a), "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "2 bad lines skipped" in err and f"{len(lines[:half:2]):,} messages" in err


def test_baselines_run_through_the_same_backtest(
    simulated: tuple[Path, Path, list[bytes]], tmp_path: Path
) -> None:
    telemetry, _, _ = simulated
    for name in ("static", "nvrx"):
        out = tmp_path / f"flags-{name}.jsonl"
        assert (
            main(["backtest", str(telemetry), "--out", str(out), "--detector", name, "--quiet"])
            == 0
        )
        for line in out.read_text().splitlines():
            assert json.loads(line)["detector"] in ("static_rules", "nvrx_relative")


def test_snapshot_and_restore_midway_gives_the_same_flags(
    simulated: tuple[Path, Path, list[bytes]],
) -> None:
    _, _, lines = simulated
    messages = [parse_message(line) for line in lines]
    whole = MessageFeed()
    expected = [f for m in messages for f in whole.update(m)] + whole.flush()
    first = MessageFeed()
    cut = len(messages) * 2 // 3
    got = [f for m in messages[:cut] for f in first.update(m)]
    resumed = pickle.loads(pickle.dumps(first))  # a checkpoint of the whole engine
    got += [f for m in messages[cut:] for f in resumed.update(m)] + resumed.flush()
    assert [f.id for f in got] == [f.id for f in expected]


def test_state_per_gpu_is_under_10_kb(simulated: tuple[Path, Path, list[bytes]]) -> None:
    _, truth, lines = simulated
    engine = MessageFeed()
    for line in lines:
        engine.update(parse_message(line))
    sizes = engine.state_bytes()
    t = json.loads(truth.read_text())
    gpus = len(t["nodes"]) * t["gpus_per_node"]
    assert sum(sizes.values()) / gpus < 10_240, sizes
    for node in engine.nodes.values():  # one partition pickles on its own (per-key checkpoint)
        assert isinstance(pickle.loads(pickle.dumps(node)), type(node))


def test_fusion_ids_are_stable_and_duplicates_are_dropped() -> None:
    def finding(**kw: object) -> Finding:
        args: dict[str, object] = dict(
            detector="nic",
            category="nic",
            severity="warning",
            node="n1",
            ts=10.0,
            since=8.0,
            score=1.0,
            device="mlx5_1",
        )
        args.update(kw)
        return Finding(**args)  # type: ignore[arg-type]

    a, b = NodeFusion("n1"), NodeFusion("n1")
    fa, fb = a.update(finding()), b.update(finding(ts=11.0))
    assert fa is not None and fb is not None and fa.id == fb.id  # same evidence, same id
    assert a.update(finding(ts=12.0)) is None  # already flagged
    escalated = a.update(finding(category="link", detector="nic", severity="critical", ts=13.0))
    assert escalated is not None and escalated.severity == "critical"
    assert escalated.evidence["also"][0]["category"] == "nic"
    assert "link on n1 mlx5_1" in str(escalated.evidence["summary"])


def test_a_backtest_runs_with_the_data_paths_collector_settings(
    simulated: tuple[Path, Path, list[bytes]], tmp_path: Path
) -> None:
    """``guard backtest`` (like a streams worker) collects cycles less often than CPython's
    default and has frozen what start-up made; its flags are those of a default process.
    Called in-process (as here, below) it leaves the caller's collector alone."""
    from guard.commands.common import GC_THRESHOLDS

    telemetry, _, _ = simulated
    script = (
        "import gc, sys; from guard.cli import main; "
        "code = main(); print(list(gc.get_threshold()), gc.get_freeze_count())"
    )
    out = tmp_path / "flags.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", script, "backtest", str(telemetry), "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    thresholds, frozen = done.stdout.split("] ")
    assert json.loads(thresholds + "]") == list(GC_THRESHOLDS) and int(frozen) > 10_000
    plain, before = tmp_path / "plain.jsonl", gc.get_threshold()
    assert main(["backtest", str(telemetry), "--out", str(plain), "--quiet"]) == 0
    assert gc.get_threshold() == before
    assert out.read_bytes() == plain.read_bytes() and out.read_bytes()


def test_backtest_says_what_it_did_in_json_and_fails_on_nothing_valid(
    simulated: tuple[Path, Path, list[bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    telemetry, _, lines = simulated
    out = tmp_path / "flags.jsonl"
    assert main(["backtest", str(telemetry), "--out", str(out), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["messages"] == len(lines) and summary["bad_lines"] == 0
    assert summary["flags"] == len(out.read_text().splitlines()) > 0
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b'{"kind":"gpu","ts":"x"}\nnot json\n')
    assert main(["backtest", str(garbage), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no valid telemetry" in err and "2 bad lines" in err and "Traceback" not in err
    missing = tmp_path / "no-such-folder" / "flags.jsonl"
    assert main(["backtest", str(telemetry), "--out", str(missing), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err and not missing.parent.exists()
    assert main(["backtest", str(tmp_path / "absent.jsonl"), "--out", str(out)]) == 1


@pytest.mark.slow
def test_backtest_of_clickhouse_gives_the_flags_of_the_file_it_stored(tmp_path: Path) -> None:
    """Telemetry stored in ClickHouse (a chDB path of its own, in other processes: one process
    holds one chDB path) backtests to the flags of the JSONL it came from: the same nodes,
    categories and severities."""
    import time

    start = float(int(time.time()) - 3600)  # within the raw tables' TTL
    sim = ClusterSimulator(
        SimConfig(nodes=10, duration_s=240, seed=21, faults=FAULTS[2:], start_ts=start)
    )
    telemetry = tmp_path / "t.jsonl"
    telemetry.write_bytes(b"".join(encode(m) + b"\n" for m in sim.messages()))
    dsn = f"chdb://{tmp_path / 'store'}"
    env = {**__import__("os").environ, "GUARD_CLICKHOUSE_DSN": dsn}
    store = (
        "import sys; from guard.config import load_settings; from guard.schemas import "
        "parse_message; from guard.store import connect, insert_messages, migrate; "
        "s = load_settings(); c = connect(s); migrate(c, s); "
        "insert_messages(c, s, [parse_message(l) for l in open(sys.argv[1], 'rb')]); c.close()"
    )
    subprocess.run([sys.executable, "-c", store, str(telemetry)], env=env, check=True)
    guard = [sys.executable, "-m", "guard.cli", "backtest"]
    flags = {}
    for source in (str(telemetry), dsn):
        out = tmp_path / f"{len(flags)}.jsonl"
        done = subprocess.run(
            [*guard, source, "--out", str(out), "--quiet", "--json"],
            check=False,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["messages"] > 0
        flags[source] = {
            (f.get("node"), f["category"], f["severity"]) for f in map(json.loads, out.open())
        }
    # (ids differ: ClickHouse keeps event times to the millisecond, and an id has the time
    # its evidence began)
    assert flags[dsn] == flags[str(telemetry)] != set()


def test_eval_chooses_the_target_set_by_the_slowdown_the_job_sees() -> None:
    """A 6 % slow GPU that was born 2.6 % fast is 3.2 % behind its peers: not a target."""
    sim = ClusterSimulator(
        SimConfig(
            nodes=2,
            duration_s=60,
            random_faults=0,
            faults=[FaultSpec("slow_gpu", "node-000", 1, 10, slowdown=0.06, pattern="steady")],
        )
    )
    truth = sim.truth()
    [fault] = truth.faults
    sim.gpu_speed[0, 1] = 0.974
    seen = sim.slowdowns_seen(truth)
    assert seen[fault.id] == pytest.approx(0.974 * 1.06 - 1.0)
    assert evaluate(truth, []).rows["target"].faults == 1
    assert "target" not in evaluate(truth, [], seen=seen).rows
