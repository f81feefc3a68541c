"""Sweep executors: the simulated one against the simulator's faults; the commands and ssh
ones for real (ssh stood in for by a script that runs the remote command here); and no
executor at all, which keeps flagged nodes cordoned."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from guard.config import OrchestratorSettings, Settings
from guard.schemas import Flag, NodeState
from guard.sweeps.executors import (
    NO_EXECUTOR_HINT,
    CheckCommand,
    CommandExecutor,
    SimulatedFault,
    SimulatedSweepExecutor,
    SshExecutor,
    SweepExecutor,
    make_executor,
    parse_sweep_output,
)
from guard.sweeps.orchestrator import Orchestrator
from guard.sweeps.scheduler import DryRunScheduler

NOW = 1_767_226_500.0
PY = sys.executable


def failing(
    ex: SimulatedSweepExecutor, node: str, sweep: str, peers: list[str] | None = None
) -> list[str]:
    return [c.name for c in ex.run(node, sweep, peers or [], NOW) if not c.passed]


# Fault records as the simulator writes them (kinds, detail and slowdown ranges from it).
FAULTS = [
    (
        "thermal_throttle",
        2,
        None,
        0.08,
        {"temp_c": 90.5},
        {"single": ["gemm_tflops_gpu2", "gpu_temp_max_c", "sm_clock_min_mhz"], "multi": []},
    ),
    (
        "power_cap",
        1,
        None,
        0.05,
        {"power_limit_w": 480},
        {"single": ["gemm_tflops_gpu1", "sm_clock_min_mhz", "power_limit_min_w"], "multi": []},
    ),
    (
        "power_brake",
        0,
        None,
        0.3,
        {},
        {"single": ["gemm_tflops_gpu0", "sm_clock_min_mhz"], "multi": []},
    ),
    ("slow_gpu", 6, None, 0.05, {}, {"single": ["gemm_tflops_gpu6"], "multi": []}),
    (
        "degraded_nic",
        None,
        "mlx5_4",
        0.2,
        {"symbol_errors_per_s": 5.0},
        {
            "single": ["nic_symbol_errors"],
            "multi": ["nccl_allreduce_busbw_gbps", "ib_write_bw_min_gbps"],
        },
    ),
    (
        "nic_reduced_speed",
        None,
        "mlx5_1",
        1.0,
        {"speed_gbps": 200.0},
        {
            "single": ["nic_link_speed_min_gbps"],
            "multi": ["nccl_allreduce_busbw_gbps", "ib_write_bw_min_gbps"],
        },
    ),
    (
        "link_flap",
        None,
        "mlx5_7",
        0.0,
        {"flaps": 3, "hang_s": 8.0},
        {"single": ["nic_link_downed"], "multi": []},
    ),
    ("xid", 5, None, 0.0, {"xid": 31}, {"single": ["xid_errors"], "multi": []}),
    ("ecc_dbe", 4, None, 0.0, {"xid": 48}, {"single": ["ecc_dbe_errors"], "multi": []}),
]


@pytest.mark.parametrize(
    "kind,gpu,device,slowdown,detail,expected", FAULTS, ids=[f[0] for f in FAULTS]
)
def test_each_fault_fails_the_checks_it_would_fail_on_real_hardware(
    kind: str, gpu: int | None, device: str | None, slowdown: float, detail: dict, expected: dict
) -> None:
    fault = SimulatedFault("node-003", kind, NOW - 100, None, slowdown, gpu, device, "f-1", detail)
    ex = SimulatedSweepExecutor([fault], seed=7)
    assert failing(ex, "node-003", "single") == expected["single"]
    assert failing(ex, "node-003", "multi", ["node-004", "node-005"]) == expected["multi"]
    # Its neighbours pass, whatever the noise.
    for node in ("node-004", "node-005", "node-006"):
        assert failing(ex, node, "single") == []
        assert failing(ex, node, "multi", ["node-007"]) == []


def test_a_fault_counts_only_while_it_is_active_and_degrading_faults_ramp() -> None:
    ended = SimulatedFault("n1", "slow_gpu", NOW - 1000, NOW - 10, 0.3, gpu=1)
    later = SimulatedFault("n2", "slow_gpu", NOW + 10, None, 0.3, gpu=1)
    ramp = SimulatedFault("n3", "slow_gpu", NOW - 60, None, 0.25, gpu=2, detail={"ramp_s": 1200})
    ex = SimulatedSweepExecutor([ended, later, ramp])
    assert failing(ex, "n1", "single") == []
    assert failing(ex, "n2", "single") == []
    # 60 s into a 20-minute ramp the GPU is ~1 % slower: within tolerance; at the end it is not.
    assert failing(ex, "n3", "single") == []
    assert ramp.slowdown_at(NOW + 1200) == pytest.approx(0.25)
    late = [c for c in ex.run("n3", "single", [], NOW + 1200) if not c.passed]
    assert [c.name for c in late] == ["gemm_tflops_gpu2"]
    assert late[0].value == pytest.approx(700 / 1.25, rel=0.03)


def test_a_peer_with_a_slow_nic_fails_the_multi_node_sweep() -> None:
    bad_peer = SimulatedFault("n9", "degraded_nic", NOW - 10, None, 0.4, device="mlx5_2")
    ex = SimulatedSweepExecutor([bad_peer])
    checks = ex.run("n1", "multi", ["n9"], NOW)
    assert not checks[0].passed and "slowest n9 mlx5_2" in checks[0].detail


def test_the_truth_file_is_read(tmp_path: Path) -> None:
    truth = {
        "version": 1,
        "seed": 3,
        "start_ts": NOW - 3600,
        "end_ts": NOW + 3600,
        "nodes": ["node-000", "node-001"],
        "gpus_per_node": 4,
        "jobs": [],
        "faults": [
            {
                "id": "f-0001",
                "node": "node-001",
                "gpu": 3,
                "device": None,
                "kind": "thermal_throttle",
                "category": "thermal",
                "onset": NOW - 60,
                "end": None,
                "slowdown": 0.12,
                "pattern": "steady",
                "detail": {},
            }
        ],
        "confounders": [],
    }
    path = tmp_path / "truth.json"
    path.write_text(json.dumps(truth))
    ex = SimulatedSweepExecutor.from_truth(path)
    assert ex.gpus_per_node == 4 and ex.seed == 3
    assert "gemm_tflops_gpu3" in failing(ex, "node-001", "single")
    assert len([c for c in ex.run("node-000", "single", [], NOW) if c.name.startswith("gemm")]) == 4


def test_command_checks_run_real_commands_and_judge_their_numbers() -> None:
    ex = CommandExecutor(
        [
            {
                "name": "bw",
                "command": [PY, "-c", "print('busbw: 371.5 GB/s')"],
                "unit": "GB/s",
                "pattern": r"busbw: ([\d.]+)",
                "min": 300,
                "baseline": 360,
            },
            {"name": "temp", "command": f'{PY} -c "print(91)"', "max": 85, "unit": "C"},
            {
                "name": "node",
                "command": [PY, "-c", "import sys; print(len(sys.argv[1]))", "{node}"],
                "min": 8,
                "max": 8,
            },
            {
                "name": "peers",
                "sweep": "multi",
                "min": 2,
                "command": [PY, "-c", "import sys; print(len(sys.argv[1].split(',')))", "{peers}"],
            },
        ],
        multi_node=True,
    )
    assert ex.sweep_kinds == ("single", "multi")
    bw, temp, node = ex.run("node-001", "single", [], 0.0)
    assert (bw.value, bw.passed, bw.baseline) == (371.5, True, 360)
    assert (temp.value, temp.passed) == (91.0, False)
    assert (node.value, node.passed) == (8.0, True)
    [peers] = ex.run("node-001", "multi", ["node-002", "node-003"], 0.0)
    assert (peers.value, peers.passed) == (2.0, True)


def test_command_checks_fail_on_errors_timeouts_and_missing_numbers() -> None:
    ex = CommandExecutor(
        [
            CheckCommand(
                name="exit", command=[PY, "-c", "import sys; sys.exit('no GPU found')"], min=0
            ),
            CheckCommand(
                name="slow", command=[PY, "-c", "import time; time.sleep(30)"], min=0, timeout_s=0.5
            ),
            CheckCommand(name="words", command=[PY, "-c", "print('all good')"], min=0),
            CheckCommand(name="missing", command=["/nonexistent/dcgmi", "diag"], min=0),
        ]
    )
    results = {c.name: c for c in ex.run("n1", "single", [], 0.0)}
    assert not any(c.passed for c in results.values())
    assert "exited 1: no GPU found" in results["exit"].detail
    assert "timed out after 0.5 s" in results["slow"].detail
    assert "no number" in results["words"].detail
    assert "could not run" in results["missing"].detail


def states_after_a_flag(executor: SweepExecutor, category: str) -> list[NodeState]:
    """The states of n3 (of n0..n7) after a critical ``category`` flag, swept inline."""
    out: list = []
    orch = Orchestrator(
        OrchestratorSettings(nodes=[f"n{i}" for i in range(8)]),
        scheduler=DryRunScheduler(),
        executor=executor,
        publish=out.append,
        clock=lambda: 100.0,
        inline_sweeps=True,
    )
    flag = Flag(
        id=category,
        ts=99.0,
        node="n3",
        detector="d",
        category=category,
        severity="critical",
        score=5.0,
    )
    orch.handle_flag(flag)
    orch.tick()
    return [m for m in out if isinstance(m, NodeState)]


def test_the_commands_executor_runs_no_peer_check_on_peers_nobody_drained(tmp_path: Path) -> None:
    # Like ssh, the commands executor cannot drain a peer nor wait for its jobs: its
    # sweep = "multi" checks run only where the site says the nodes run nothing else.
    ran = tmp_path / "ran"
    record = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + chr(10)); print(0)"
    checks = [
        {"name": "local", "command": [PY, "-c", record, str(ran), "single {node}"], "max": 0},
        {
            "name": "allreduce",
            "sweep": "multi",
            "command": [PY, "-c", record, str(ran), "multi {node} {peers}"],
            "max": 0,
        },
    ]
    settings = Settings(orchestrator={"executor": "commands", "sweep_checks": checks})
    ex = make_executor(settings)
    assert isinstance(ex, CommandExecutor) and ex.sweep_kinds == ("single",)
    [refused] = ex.run("n1", "multi", ["n2"], 0)
    assert refused.name == "commands_multi_node" and not refused.passed
    assert refused.detail == f"untested: {ex.single_only_why}"
    assert ex.single_only_why.startswith("the commands executor cannot take peers out")
    assert "orchestrator.commands_multi_node" in ex.single_only_why
    assert not ran.exists()  # the peer check never started

    states = states_after_a_flag(ex, "nic")  # a link is only tested between nodes: untested, repair
    assert [s.state for s in states] == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    assert states[3].reason == (
        "passed the single-node sweep; untested: a nic flag needs a multi-node sweep, "
        f"{ex.single_only_why}; after a critical nic flag"
    )
    assert ran.read_text() == "single n3\n"
    ran.unlink()

    allowed = make_executor(
        Settings(
            orchestrator={
                "executor": "commands",
                "sweep_checks": checks,
                "commands_multi_node": True,
            }
        )
    )
    assert isinstance(allowed, CommandExecutor) and allowed.sweep_kinds == ("single", "multi")
    states = states_after_a_flag(allowed, "nic")
    assert states[-1].state == "healthy"
    assert states[-1].reason == "passed the single-node and multi-node sweeps"
    single, multi = ran.read_text().splitlines()
    assert single == "single n3" and multi.startswith("multi n3 n")

    # no multi check configured: the reason says that, not the setting
    only_single = CommandExecutor(checks[:1], multi_node=True)
    assert only_single.sweep_kinds == ("single",)
    assert "no check with sweep" in only_single.single_only_why


def test_a_check_needs_a_bound_and_the_commands_executor_needs_checks() -> None:
    with pytest.raises(ValueError, match="needs a min or a max"):
        CheckCommand(name="x", command="true")
    with pytest.raises(ValueError, match=r"at least one check in orchestrator\.sweep_checks"):
        CommandExecutor([])


GUARD_ON_NODE = str(Path(sys.executable).parent / "guard")


@pytest.fixture
def fake_ssh(tmp_path: Path) -> Path:
    """ssh at the network boundary: runs the remote command here, as the named node would;
    the host ``unreachable`` fails as ssh does (exit 255)."""
    script = tmp_path / "ssh"
    script.write_text(
        "#!/bin/sh\n"
        'node="$1"; shift\n'
        'if [ "$node" = unreachable ]; then\n'
        '  echo "ssh: connect to host unreachable port 22: No route to host" >&2; exit 255\n'
        "fi\n"
        'echo "$node $*" >> "$(dirname "$0")/calls"\n'
        'exec sh -c "$*"\n'
    )
    script.chmod(0o755)
    return script


def ssh_executor(fake_ssh: Path, checks: list[str], multi_node: bool = False) -> SshExecutor:
    return SshExecutor([str(fake_ssh)], GUARD_ON_NODE, checks, timeout_s=240, multi_node=multi_node)


@pytest.fixture
def no_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fleet yet; the nodes are declared GPU-less, judged on a site floor (sweep.floors)."""
    monkeypatch.setenv("GUARD_SWEEP_FLEET_SOURCE", "none")
    monkeypatch.setenv("GUARD_SWEEP_EXPECTED_GPUS", "0")
    monkeypatch.setenv("GUARD_SWEEP_FLOORS", '{"cpu_memory_bandwidth_gbps": 0.5}')


def test_the_ssh_executor_runs_guard_sweep_run_on_the_node_and_reads_its_line(
    fake_ssh: Path, no_fleet: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = ssh_executor(fake_ssh, ["cpu_count", "cpu_memory"]).run("cpu-node-3", "single", [], 0)
    assert [c.name for c in checks] == ["cpu_count", "cpu_memory_bandwidth_gbps", "sweep_coverage"]
    assert all(c.passed for c in checks) and checks[1].value > 0
    calls = (fake_ssh.parent / "calls").read_text()
    assert calls.startswith(
        f"cpu-node-3 {GUARD_ON_NODE} sweep run --json --node cpu-node-3 --checks "
        "cpu_count,cpu_memory"
    )
    monkeypatch.setenv("GUARD_SWEEP_EXPECTED_CPUS", "4096")
    failed = ssh_executor(fake_ssh, ["cpu_count"]).run("cpu-node-3", "single", [], 0)
    assert [(c.name, c.passed) for c in failed] == [("cpu_count", False), ("sweep_coverage", True)]
    assert "expected 4096" in failed[0].detail


def test_the_ssh_executor_fails_what_it_could_not_test(fake_ssh: Path, no_fleet: None) -> None:
    [down] = ssh_executor(fake_ssh, ["cpu_count"]).run("unreachable", "single", [], 0)
    assert (down.name, down.passed) == ("sweep_error", False)
    assert "ssh could not run the sweep on unreachable (exit 255)" in down.detail
    assert "No route to host" in down.detail
    [bad] = ssh_executor(fake_ssh, ["gemm_bf16"]).run("cpu-node-3", "single", [], 0)
    assert bad.name == "sweep_error" and "exited 2 without a sweep line" in bad.detail
    assert "unknown CPU check(s) gemm_bf16" in bad.detail


def test_parse_sweep_output_trusts_only_a_line_for_this_node() -> None:
    line = (
        '{"kind":"sweep","v":1,"ts":1.0,"node":"n2","id":"s1","sweep":"single",'
        '"checks":[{"name":"cpu_count","value":2,"unit":"count","passed":true},'
        '{"name":"sweep_coverage","value":0,"unit":"gpus","baseline":0,"passed":true}],'
        '"passed":true}'
    )
    ok = parse_sweep_output("n2", ["ssh", "n2"], 0, f"noise\n{line}\n", "")
    assert all(c.passed for c in ok) and [c.name for c in ok] == ["cpu_count", "sweep_coverage"]
    checks = parse_sweep_output("n1", ["ssh", "n1"], 0, line, "")
    assert [c.name for c in checks] == ["cpu_count", "sweep_coverage", "sweep_node_mismatch"]
    assert "the sweep line is for n2, not n1" in checks[2].detail
    crashed = parse_sweep_output("n2", ["srun", "-w", "n2"], 137, line, "Killed")
    assert [c.name for c in crashed][-1] == "sweep_error" and "exited 137: Killed" in (
        crashed[-1].detail
    )
    [garbage] = parse_sweep_output("n2", ["x"], 0, '{"kind": "sweep"}\n', "")
    assert garbage.name == "sweep_error" and not garbage.passed


def test_a_multi_node_sweep_starts_the_command_on_the_node_and_every_peer(
    fake_ssh: Path, no_fleet: None
) -> None:
    ex = ssh_executor(fake_ssh, [], multi_node=True)
    assert ex.sweep_kinds == ("single", "multi")
    assert ex.command("n1", "multi", ["n1", "n2", "n3"], rank=0)[-1] == (
        f"{GUARD_ON_NODE} sweep run --json --node n1 --sweep multi --peers n2,n3 "
        "--node-rank 0 --rendezvous n1:29500"
    )
    assert ex.command("n3", "multi", ["n1", "n2", "n3"], rank=2)[-1].endswith(
        "--peers n1,n2 --node-rank 2 --rendezvous n1:29500"
    )
    # On this CPU host the multi-node checks cannot measure: they fail, and say why.
    checks = {c.name: c for c in ex.run("n1", "multi", ["n2"], 0)}
    assert not checks["gpu_health"].passed and not checks["nccl_multinode_busbw_gbps"].passed
    assert "NVML is not available" in checks["gpu_health"].detail
    assert "no GPU backend" in checks["nccl_multinode_busbw_gbps"].detail
    calls = sorted((fake_ssh.parent / "calls").read_text().splitlines())
    assert [c.split()[0] for c in calls] == ["n1", "n2"]


def test_without_an_executor_a_flagged_node_stays_cordoned_and_says_what_to_configure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert make_executor(Settings()) is None  # nothing is the default: no sweep is faked
    out: list = []
    scheduler = DryRunScheduler()
    orch = Orchestrator(
        OrchestratorSettings(nodes=[f"n{i}" for i in range(8)]),
        scheduler=scheduler,
        executor=None,
        publish=out.append,
        clock=lambda: 100.0,
        inline_sweeps=True,
    )
    flag = Flag(
        id="f1",
        ts=99.0,
        node="n1",
        gpu=2,
        detector="peer",
        category="straggler",
        severity="critical",
        score=5.0,
    )
    assert orch.handle_flag(flag) == "qualified"
    for _ in range(3):
        orch.tick()
    states = [m for m in out if m.kind == "node_state"]
    assert [s.state for s in states] == ["suspect", "cordoned"]
    assert NO_EXECUTOR_HINT in states[-1].reason
    assert "set orchestrator.executor" in states[-1].reason
    assert orch.state_of("n1") == "cordoned" and not [m for m in out if m.kind == "sweep"]
    assert scheduler.cordoned == {"n1"}
    assert NO_EXECUTOR_HINT in caplog.text


@pytest.mark.parametrize("cpus,end", [(None, "healthy"), ("4096", "repair")])
def test_a_flagged_node_is_swept_over_ssh_and_released_or_sent_to_repair_by_its_result(
    fake_ssh: Path,
    no_fleet: None,
    monkeypatch: pytest.MonkeyPatch,
    cpus: str | None,
    end: str,
) -> None:
    if cpus:
        monkeypatch.setenv("GUARD_SWEEP_EXPECTED_CPUS", cpus)
    out: list = []
    scheduler = DryRunScheduler()
    orch = Orchestrator(
        OrchestratorSettings(nodes=[f"n{i}" for i in range(8)], multi_sweep_peers=0),
        scheduler=scheduler,
        executor=ssh_executor(fake_ssh, ["cpu_count"]),
        publish=out.append,
        clock=lambda: 100.0,
        inline_sweeps=True,
    )
    flag = Flag(
        id="f1",
        ts=99.0,
        node="n3",
        detector="peer",
        category="straggler",
        severity="critical",
        score=5.0,
    )
    orch.handle_flag(flag)
    orch.tick()
    [sweep] = [m for m in out if m.kind == "sweep"]
    names = [c.name for c in sweep.checks]
    assert names == ["cpu_count", "sweep_coverage"] and sweep.passed is (end == "healthy")
    assert orch.state_of("n3") == end
    assert scheduler.cordoned == (set() if end == "healthy" else {"n3"})
    assert (fake_ssh.parent / "calls").read_text().startswith("n3 ")


def test_ssh_runs_no_multi_node_sweep_on_peers_it_cannot_drain(
    fake_ssh: Path, no_fleet: None
) -> None:
    # ssh cannot take a peer out of the pool nor wait for its jobs: by default it runs no
    # multi-node sweep, and a network flag is untested (failed, to repair) and says why.
    assert make_executor(Settings(orchestrator={"executor": "ssh"})).sweep_kinds == ("single",)  # type: ignore[union-attr]
    ex = ssh_executor(fake_ssh, ["cpu_count"])
    [refused] = ex.run("n1", "multi", ["n2"], 0)
    assert refused.name == "ssh_multi_node" and not refused.passed
    assert refused.detail.startswith("untested: the ssh executor cannot take peers out")

    def orchestrate(category: str) -> tuple[list[NodeState], str]:
        states = states_after_a_flag(ex, category)
        calls = (fake_ssh.parent / "calls").read_text()
        (fake_ssh.parent / "calls").unlink()
        return states, calls

    states, calls = orchestrate("nic")
    assert [s.state for s in states] == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    assert states[3].reason == (
        "passed the single-node sweep; untested: a nic flag needs a multi-node sweep, "
        f"{ex.single_only_why}; after a critical nic flag"
    )
    assert "--sweep multi" not in calls and calls.count("\n") == 1  # no peer was touched
    states, calls = orchestrate("thermal")  # a GPU flag: the single-node sweep decides
    assert [s.state for s in states][-1] == "healthy"
    assert states[-1].reason == "passed the single-node sweep"
    assert calls.startswith("n3 ") and calls.count("\n") == 1
