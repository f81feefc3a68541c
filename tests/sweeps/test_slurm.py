"""The Slurm adapter and the Slurm sweep executor against a real one-host Slurm 22.05.

``deploy/slurm/slurm.sh start`` runs it (``.ci/run`` does, and exports ``GUARD_CI_SLURM=1``);
when no Slurm answers, the session starts it with the same script. Never skipped: a missing
Slurm fails these tests. "The node" is this host (``hostname -s``).

Most tests' sweep job runs ``tests/sweeps/slurm_sweep_job.py`` (prints a ``sweep`` message from
schemas' model, from inside the job, and a ``slurm_job_host`` check saying where it ran), so that
a pass or a fail can be chosen; one runs the real ``guard sweep run --json`` (CPU checks) there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.config import OrchestratorSettings
from guard.schemas import Flag, GuardMessage, NodeState
from guard.sweeps.executors import CommandExecutor, sweep_lines
from guard.sweeps.multinode import slurm_multi_argv
from guard.sweeps.orchestrator import Orchestrator
from guard.sweeps.slurm import SlurmNode, SlurmScheduler, SlurmSweepExecutor, SweepJob

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("slurm_sweep_job.py")


def _slurm_answers() -> bool:
    try:
        done = subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "UP" in done.stdout


@pytest.fixture(scope="session")
def slurm_node() -> Iterator[str]:
    """The node of the running one-host Slurm; started with deploy/slurm/slurm.sh (and
    stopped at the end) when none answers, except in CI, where .ci/run must have started it."""
    os.environ.setdefault("SLURM_CONF", "/var/tmp/guard-slurm/slurm.conf")
    started = False
    if not _slurm_answers():
        if os.environ.get("GUARD_CI_SLURM") == "1":
            pytest.fail("GUARD_CI_SLURM=1 but no Slurm answers `scontrol ping`: see .ci/run")
        done = subprocess.run(
            [str(ROOT / "deploy/slurm/slurm.sh"), "start"],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.fail(
                "no Slurm answers and deploy/slurm/slurm.sh start failed "
                f"(exit {done.returncode}): {done.stderr[-2000:]}"
            )
        for line in done.stdout.splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            os.environ[name] = value
        started = True
    yield os.environ.get("GUARD_CI_SLURM_NODE") or os.uname().nodename.split(".")[0]
    if started:
        subprocess.run([str(ROOT / "deploy/slurm/slurm.sh"), "stop"], check=False, timeout=120)


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def node_line(node: str) -> SlurmNode:
    return SlurmNode.parse(sh("scontrol", "show", "node", "-o", node).strip())


def state_and_reason(node: str) -> tuple[str, str]:
    """State and Reason exactly as ``scontrol show node -o`` prints them (with the stamp)."""
    line = sh("scontrol", "show", "node", "-o", node).strip()
    head, _, reason = line.partition(" Reason=")
    state = next(w for w in head.split() if w.startswith("State="))
    # slurmctld's own liveness flag (a missed ping on a loaded host), not something anyone set
    return state.replace("+NOT_RESPONDING", ""), reason


def wait_for(what: str, test, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = test()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:g} s")


@pytest.fixture
def node(slurm_node: str) -> Iterator[str]:
    """The node, idle and in service before and after each test (jobs cancelled, Guard's
    reservation gone, drains undone)."""

    def clean() -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], check=False)
        subprocess.run(
            ["scontrol", "delete", f"ReservationName=guard-{slurm_node}"],
            capture_output=True,
            check=False,
        )
        if node_line(slurm_node).drain:
            sh("scontrol", "update", f"NodeName={slurm_node}", "State=RESUME")
        wait_for(
            "an idle node",
            lambda: (n := node_line(slurm_node)).base == "IDLE" and not n.drain,
        )

    clean()
    yield slurm_node
    clean()


def make_orchestrator(
    node: str,
    out: list[GuardMessage],
    *,
    fail: bool = False,
    command: str | None = None,
    isolate: str = "notify",
    drain_timeout_s: float = 30.0,
    listeners: tuple = (),  # type: ignore[type-arg]
) -> Orchestrator:
    scheduler = SlurmScheduler(user="root")
    if command is None:
        command = f"{sys.executable} {JOB} --node {{node}}" + (" --fail" if fail else "")
    executor = SlurmSweepExecutor(
        scheduler,
        SweepJob(command, drain_timeout_s=drain_timeout_s, sweep_timeout_s=120, poll_s=0.2),
    )
    return Orchestrator(
        OrchestratorSettings(nodes=[node], multi_sweep_peers=0, isolate_policy=isolate),
        scheduler=scheduler,
        executor=executor,
        publish=out.append,
        listeners=listeners,
        inline_sweeps=True,
    )


def critical_flag(node: str) -> Flag:
    return Flag(
        id=f"f-{time.time_ns()}",
        ts=time.time(),
        node=node,
        gpu=3,
        detector="thermal",
        category="thermal",
        severity="critical",
        score=3.0,
    )


def states(out: list[GuardMessage]) -> list[str]:
    return [m.state for m in out if isinstance(m, NodeState)]


def test_flagged_node_is_drained_swept_in_a_slurm_job_on_it_and_resumed(node: str) -> None:
    seen: dict[str, SlurmNode] = {}

    def at_sweeping(message: GuardMessage) -> None:
        if isinstance(message, NodeState) and message.state == "sweeping":
            seen["sweeping"] = node_line(node)  # Guard's drain is on before the sweep starts

    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, listeners=(at_sweeping,))
    assert orch.handle_flag(critical_flag(node)) == "qualified"
    orch.tick()

    assert states(out) == ["suspect", "cordoned", "sweeping", "healthy"]
    assert seen["sweeping"].drained_by_guard
    assert seen["sweeping"].reason.startswith("guard: cordoned for sweep: critical thermal")
    (sweep,) = [m for m in out if m.kind == "sweep"]
    assert sweep.passed
    host = next(c for c in sweep.checks if c.name == "slurm_job_host")
    assert host.passed and f"on {node} reservation=guard-{node}" in host.detail
    # the whole node: every GPU its Gres declares, and no other job beside the sweep
    gpus = node_line(node).gpus
    assert gpus == int(os.environ.get("GUARD_CI_SLURM_GPUS", "2")) > 0
    assert f"TresPerNode=gres:gpu:{gpus} OverSubscribe=NO" in host.detail, host.detail
    covered = next(c for c in sweep.checks if c.name == "sweep_coverage")
    assert (covered.value, covered.baseline) == (gpus, gpus)
    after = node_line(node)
    assert not after.drain and after.base == "IDLE" and after.reason == ""
    assert "guard-" not in sh("scontrol", "show", "reservation")


def test_the_real_guard_sweep_run_on_a_gpu_node_without_gpus_sends_it_to_repair(
    node: str,
) -> None:
    """The node's Gres says it has GPUs; this host has none, so the CPU checks the sweep can
    run here do not pass it, whatever they measure: a thermal-flagged GPU node is not
    released on CPU checks."""
    guard = Path(sys.executable).with_name("guard")
    command = (
        f"env GUARD_SWEEP_FLEET_SOURCE=none {guard} sweep run --json --node {{node}} "
        "--checks cpu_count,cpu_matmul,cpu_memory"
    )
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, command=command)
    orch.handle_flag(critical_flag(node))
    orch.tick()

    gpus = node_line(node).gpus
    (sweep,) = [m for m in out if m.kind == "sweep"]
    names = {c.name.split(":")[0] for c in sweep.checks}
    assert {"cpu_count", "cpu_matmul_gflops", "cpu_memory_bandwidth_gbps"} <= names, names
    assert not sweep.passed
    covered = next(c for c in sweep.checks if c.name == "sweep_coverage")
    assert (covered.value, covered.baseline) == (0, gpus)  # told by srun's environment
    assert f"failed: {gpus} GPUs expected, 0 seen (NVML not started" in covered.detail
    assert states(out) == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    assert node_line(node).reason.startswith("guard: sent to repair: failed the single-node")


def test_the_srun_line_asks_for_the_whole_node_and_every_gpu_it_declares(node: str) -> None:
    slurm = SlurmScheduler(user="root")
    executor = SlurmSweepExecutor(slurm, SweepJob("guard sweep run --json --node {node}"))
    gpus = node_line(node).gpus
    argv = executor.srun_argv(node, node, f"guard-{node}", gpus)
    assert argv[:9] == [
        "srun",
        f"--reservation=guard-{node}",
        f"--nodelist={node}",
        "--nodes=1",
        "--ntasks=1",
        "--exclusive",
        f"--gres=gpu:{gpus}",
        f"--export=ALL,GUARD_SWEEP_EXPECTED_GPUS={gpus}",
        "--job-name=guard-sweep",
    ]
    no_gpu = executor.srun_argv(node, node, f"guard-{node}", 0)
    assert not any(a.startswith("--gres") for a in no_gpu)
    assert "--export=ALL,GUARD_SWEEP_EXPECTED_GPUS=0" in no_gpu


def test_a_failed_sweep_leaves_the_node_drained_for_repair(node: str) -> None:
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, fail=True)
    orch.handle_flag(critical_flag(node))
    orch.tick()

    assert states(out) == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    after = node_line(node)
    assert after.drained_by_guard
    assert after.reason.startswith("guard: sent to repair: failed the single-node sweep")
    assert "stand_in_check" in after.reason
    assert "guard-" not in sh("scontrol", "show", "reservation")  # no job can start there


def test_an_admin_drained_node_stays_exactly_as_the_admin_left_it(node: str) -> None:
    sh("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=bad DIMM, ticket 4711")
    before = state_and_reason(node)
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out)
    orch.handle_flag(critical_flag(node))
    orch.tick()
    assert states(out)[-1] == "repair"
    assert "already taken out by someone else in slurm" in out[-1].reason
    assert state_and_reason(node) == before

    # an operator's release and an orchestrator restart do not touch it either
    orch.handle_operator(NodeState(ts=time.time(), node=node, state="healthy", actor="operator:x"))
    assert state_and_reason(node) == before
    again = make_orchestrator(node, [])
    again.resume(again.recover(m for m in out if isinstance(m, NodeState)))
    assert state_and_reason(node) == before
    assert before[1].startswith("bad DIMM, ticket 4711")


def test_a_restart_does_not_drain_again_a_node_someone_resumed(node: str) -> None:
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, fail=True)
    orch.handle_flag(critical_flag(node))
    orch.tick()
    assert node_line(node).drained_by_guard and states(out)[-1] == "repair"

    sh("scontrol", "update", f"NodeName={node}", "State=RESUME")  # an admin puts it back
    after: list[GuardMessage] = []
    restarted = make_orchestrator(node, after)
    restarted.resume(restarted.recover(m for m in out if isinstance(m, NodeState)))
    assert not node_line(node).drain
    assert states(after) == ["healthy"]
    assert after[-1].reason.startswith(  # type: ignore[union-attr]
        "put back in service by an operator in slurm (while Guard was away; resumed: State=IDLE"
    )
    assert restarted.handle_flag(critical_flag(node)) == "held-off"  # not drained again


def test_a_manual_resume_is_a_cancel_that_guard_does_not_fight(node: str) -> None:
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, fail=True)
    orch.settings.operator_check_s = 0.05  # how often held nodes are read (default 30 s)
    orch.handle_flag(critical_flag(node))
    orch.tick()
    assert node_line(node).drained_by_guard and states(out)[-1] == "repair"

    sh("scontrol", "update", f"NodeName={node}", "State=RESUME")  # the operator's word
    time.sleep(0.1)
    orch.tick()
    assert states(out)[-1] == "healthy"
    reason = out[-1].reason  # type: ignore[union-attr]
    assert reason.startswith("put back in service by an operator in slurm (resumed: State=IDLE")
    assert "Slurm clears the Reason on a resume and does not say who" in reason
    assert "does not cordon it again for 86400 s" in reason
    assert orch.handle_flag(critical_flag(node)) == "held-off"
    orch.tick()
    assert not node_line(node).drain and states(out)[-1] == "healthy"
    assert "guard-" not in sh("scontrol", "show", "reservation")


def test_a_node_with_the_opt_out_feature_is_never_drained(node: str) -> None:
    feature = ("AvailableFeatures=guard_opt_out", "ActiveFeatures=guard_opt_out")
    sh("scontrol", "update", f"NodeName={node}", *feature)
    try:
        before = state_and_reason(node)
        out: list[GuardMessage] = []
        orch = make_orchestrator(node, out)
        orch.handle_flag(critical_flag(node))
        orch.tick()
        assert states(out) == ["suspect", "healthy"]
        assert out[-1].reason.startswith(  # type: ignore[union-attr]
            "opted out of Guard (Slurm feature guard_opt_out): left alone"
        )
        assert state_and_reason(node) == before
    finally:
        sh("scontrol", "update", f"NodeName={node}", "AvailableFeatures=", "ActiveFeatures=")


def test_the_sweep_waits_for_the_drain_and_a_job_that_stays_sends_the_node_to_repair(
    node: str,
) -> None:
    job = sh("sbatch", "--parsable", "-w", node, "-o", "/dev/null", "--wrap", "sleep 300").strip()
    wait_for("the job running", lambda: job in sh("squeue", "-h", "-t", "R", "-o", "%i"))
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, drain_timeout_s=2.0)
    orch.handle_flag(critical_flag(node))
    orch.tick()

    sweeping = next(m for m in out if isinstance(m, NodeState) and m.state == "sweeping")
    assert f"jobs on the node: {job}" in sweeping.reason and "requeued" not in sweeping.reason
    (sweep,) = [m for m in out if m.kind == "sweep"]
    assert [c.name for c in sweep.checks] == ["slurm_drain_timeout"]
    assert f"still runs jobs ({job})" in sweep.checks[0].detail
    assert states(out)[-1] == "repair"
    assert job in sh("squeue", "-h", "-t", "R", "-o", "%i")  # the job was left to run


def test_requeue_restarts_the_running_job_once_the_node_is_back(node: str) -> None:
    marker = Path(f"/tmp/guard-requeue-{os.getpid()}-{time.time_ns()}")
    script = f"echo run$SLURM_RESTART_COUNT >> {marker}; sleep 300"
    job = sh("sbatch", "--parsable", "-w", node, "-o", "/dev/null", "--wrap", script).strip()
    wait_for("the job running", marker.exists)
    out: list[GuardMessage] = []
    orch = make_orchestrator(node, out, isolate="requeue")
    flagged = time.monotonic()
    orch.handle_flag(critical_flag(node))
    orch.tick()

    sweeping = next(m for m in out if isinstance(m, NodeState) and m.state == "sweeping")
    assert f"jobs on the node: {job} (requeued)" in sweeping.reason
    assert states(out)[-1] == "healthy"
    wait_for(
        "the requeued job running again",
        lambda: len(marker.read_text().split()) == 2,
        timeout_s=120,
    )
    restarted_s = time.monotonic() - flagged
    marker.unlink()
    shown = sh("scontrol", "show", "job", "-o", job)
    assert "Restarts=1" in shown and "JobState=RUNNING" in shown
    print(f"\nflag -> restarted job: {restarted_s:.1f} s (drain, requeue, sweep job, resume)")


def test_a_restart_during_a_sweep_drains_again_and_sweeps_once_the_old_job_ended(
    node: str,
) -> None:
    now = time.time()
    before = [
        NodeState(ts=now - 3, node=node, state="suspect", prev="healthy", actor="orchestrator"),
        NodeState(ts=now - 2, node=node, state="cordoned", prev="suspect", actor="orchestrator"),
        NodeState(ts=now - 1, node=node, state="sweeping", prev="cordoned", actor="orchestrator"),
    ]
    # what the orchestrator that died had done: its reservation, the node resumed into it,
    # and its sweep job still running there
    sh(
        "scontrol",
        "create",
        f"ReservationName=guard-{node}",
        "Flags=MAINT,IGNORE_JOBS",
        "Users=root",
        f"Nodes={node}",
        "StartTime=now",
        "Duration=UNLIMITED",
    )
    old_sweep = subprocess.Popen(
        ["srun", f"--reservation=guard-{node}", "-w", node, "-N1", "sleep", "3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for("the old sweep running", lambda: sh("squeue", "-h", "-t", "R", "-o", "%i").strip())
    out: list[GuardMessage] = []
    restarted = make_orchestrator(node, out)
    restarted.resume(restarted.recover(before))
    old_sweep.wait(timeout=30)

    assert states(out) == ["sweeping", "healthy"]
    assert "restarted after an orchestrator restart" in out[0].reason
    (sweep,) = [m for m in out if m.kind == "sweep"]
    assert sweep.passed
    after = node_line(node)
    assert not after.drain and after.base == "IDLE"
    assert "guard-" not in sh("scontrol", "show", "reservation")


def test_an_abandoned_sweep_never_reserves_a_node_sent_to_repair(node: str) -> None:
    slurm = SlurmScheduler(user="root")
    assert (
        slurm.cordon(node, "sent to repair: sweep_timeout (no result within 1800 s)") == "drained"
    )
    executor = SlurmSweepExecutor(slurm, SweepJob(poll_s=0.2))
    (check,) = executor.run(node, "single", [], time.time())
    assert check.name == "slurm_node_not_owned" and "not Guard's to sweep" in check.detail
    assert node_line(node).drained_by_guard  # still drained, no reservation made
    assert "guard-" not in sh("scontrol", "show", "reservation")
    assert slurm.uncordon(node) == "resumed" and not node_line(node).drain


def test_agent_names_map_to_slurm_node_names(node: str) -> None:
    slurm = SlurmScheduler(node_map={"agent-host-7": node}, user="root")
    command = f"{sys.executable} {JOB} --node {{node}} --fail"
    out: list[GuardMessage] = []
    orch = Orchestrator(
        OrchestratorSettings(nodes=["agent-host-7"], multi_sweep_peers=0),
        scheduler=slurm,
        executor=SlurmSweepExecutor(slurm, SweepJob(command, poll_s=0.2)),
        publish=out.append,
        inline_sweeps=True,
    )
    assert slurm.inventory() == ["agent-host-7"]
    orch.handle_flag(critical_flag("agent-host-7"))
    orch.tick()
    assert states(out) == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    (sweep,) = [m for m in out if m.kind == "sweep"]
    assert sweep.node == "agent-host-7"
    host = next(c for c in sweep.checks if c.name == "slurm_job_host")
    assert f"on {node} reservation=guard-{node}" in host.detail
    assert node_line(node).reason.startswith("guard: sent to repair")


def test_the_multi_node_job_runs_under_the_real_slurm_and_an_unknown_peer_is_untested(
    node: str,
) -> None:
    """This cluster has one node, so the multi-node job (``srun --nodes=N --ntasks-per-node=1
    ... bash -c 'case $SLURMD_NODENAME ...'``) runs for the suspect alone: the same script,
    reservation, GRES and export as with peers; a job over two nodes needs a second one (see
    test_multi_node.py for the peers' part)."""
    scheduler = SlurmScheduler(user="root")
    command = f"{sys.executable} {JOB} --node {{node}}"
    ex = SlurmSweepExecutor(scheduler, SweepJob(command, 30, 120, 0.2), rendezvous_port=29511)
    scheduler.cordon(node, "the multi-node job's test")
    reservation = scheduler.hold_for_sweep(node, 30, 0.2)
    gpus = node_line(node).gpus
    argv = slurm_multi_argv(ex, [(node, node)], reservation, gpus)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    [line] = sweep_lines(done.stdout)
    assert (line.node, line.sweep, line.passed) == (node, "multi", True)
    by = {c.name: c for c in line.checks}
    assert by["sweep_role"].detail == f"rank 0 peers  rendezvous {node}:29511"
    assert f"reservation={reservation} TresPerNode=gres:gpu:{gpus} OverSubscribe=NO" in (
        by["slurm_job_host"].detail
    )
    # a peer Slurm does not know: the multi-node sweep is untested, the suspect stays Guard's
    checks = ex.run(node, "multi", ["no-such-node"], time.time())
    assert [(c.name, c.passed) for c in checks] == [("slurm_peer", False)]
    assert checks[0].detail.startswith("untested: ")
    assert f"Nodes={node} " in sh("scontrol", "show", "reservation", reservation)


def _open_gpus(node: str, *srun_args: str) -> list[str]:
    """What each GPU device file gives a job on the node: ``ok``, or the error's name."""
    devices = Path(os.environ["SLURM_CONF"]).parent / "dev"
    probe = (
        "import os, sys\n"
        "for f in sorted(os.listdir(sys.argv[1])):\n"
        "    try:\n"
        "        open(os.path.join(sys.argv[1], f), 'rb').close(); print(f, 'ok')\n"
        "    except OSError as e:\n"
        "        print(f, type(e).__name__)\n"
    )
    out = sh(
        "srun",
        f"--nodelist={node}",
        "-N1",
        "-n1",
        *srun_args,
        sys.executable,
        "-c",
        probe,
        str(devices),
    )
    return out.split("\n")[:-1]


def test_a_job_opens_only_the_gpus_slurm_gave_it(node: str) -> None:
    """Device cgroups (ConstrainDevices=yes) as on a GPU cluster, where this host allows them
    (deploy/slurm/slurm.sh says in cgroup.state why not otherwise): a job that asks for no
    GPU gets none — why the sweep's srun asks for every GPU the node declares. The device files
    are NVIDIA's character devices without a driver: a GPU the job has opens with ENXIO
    (OSError), one it was not given fails EPERM."""
    state = (Path(os.environ["SLURM_CONF"]).parent / "cgroup.state").read_text().strip()
    config = sh("scontrol", "show", "config")
    if state != "on":  # the documented fallback, said in the state file and in the config
        assert state.startswith("off: ") and "task/none" in config, state
        return
    assert "task/cgroup" in config and "proctrack/cgroup" in config
    gpus = node_line(node).gpus
    assert _open_gpus(node) == [f"nvidia{i} PermissionError" for i in range(gpus)]
    assert _open_gpus(node, "--gres=gpu:1") == ["nvidia0 OSError"] + [
        f"nvidia{i} PermissionError" for i in range(1, gpus)
    ]
    whole = _open_gpus(node, "--exclusive", f"--gres=gpu:{gpus}")  # the sweep's request
    assert whole == [f"nvidia{i} OSError" for i in range(gpus)]


def test_an_idle_node_is_lent_first_and_a_busy_or_drained_one_is_not_idle(node: str) -> None:
    # The peer choice of a multi-node sweep reads the real node states (one scontrol call).
    scheduler = SlurmScheduler(user="root")
    # The fixture leaves the node IDLE, but the previous test's cancelled job or resume can
    # leave it COMPLETING or NOT_RESPONDING for a moment (until slurmctld's next ping): not
    # free to lend until that has passed (CI once asked within that moment).
    wait_for("the node free to lend", lambda: scheduler.idle_peers([node], 1) == [node])
    job = sh("sbatch", "--parsable", "-w", node, "-o", "/dev/null", "--wrap", "sleep 300").strip()
    wait_for("the job running", lambda: job in sh("squeue", "-h", "-t", "R", "-o", "%i"))
    assert scheduler.idle_peers([node], 1) == []  # MIXED or ALLOCATED: a job runs there
    sh("scancel", job)
    wait_for("the node idle again", lambda: scheduler.idle_peers([node], 1) == [node])
    sh("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=bad cable")
    assert scheduler.idle_peers([node], 1) == []  # IDLE+DRAIN: not free to lend
    assert scheduler.idle_peers(["no-such-node"], 1) == []


def test_an_ssh_or_commands_sweep_starts_only_once_the_jobs_on_the_node_ended(node: str) -> None:
    # The commands executor does not wait for the node's jobs itself (ssh neither): the
    # orchestrator asks Slurm. The check fails if any job runs on the node when it runs.
    idle_check = {
        "name": "jobs_on_node",
        "command": ["sh", "-c", f"squeue -h -w {node} -t RUNNING -o %i | wc -l"],
        "max": 0,
        "unit": "jobs",
    }

    def orchestrate(drain_timeout_s: float) -> tuple[list[GuardMessage], str, Orchestrator]:
        job = sh("sbatch", "--parsable", "-w", node, "-o", "/dev/null", "--wrap", "sleep 300")
        job = job.strip()
        wait_for("the job running", lambda: job in sh("squeue", "-h", "-t", "R", "-o", "%i"))
        out: list[GuardMessage] = []
        orch = Orchestrator(
            OrchestratorSettings(nodes=[node], drain_timeout_s=drain_timeout_s),
            scheduler=SlurmScheduler(user="root"),
            executor=CommandExecutor([idle_check]),
            publish=out.append,
            inline_sweeps=True,
        )
        orch.handle_flag(critical_flag(node))
        return out, job, orch

    out, job, orch = orchestrate(drain_timeout_s=60)
    threading.Timer(2.0, sh, ("scancel", job)).start()  # the job ends while Guard waits
    orch.tick()
    [sweep] = [m for m in out if m.kind == "sweep"]
    assert [(c.name, c.value, c.passed) for c in sweep.checks] == [("jobs_on_node", 0.0, True)]
    assert states(out)[-1] == "healthy"

    out, job, orch = orchestrate(drain_timeout_s=1.5)  # a job that stays: untested, repair
    orch.tick()
    [sweep] = [m for m in out if m.kind == "sweep"]
    assert [c.name for c in sweep.checks] == ["drain_timeout"]
    assert sweep.checks[0].detail.startswith(f"untested: {node} still runs jobs {job} 1.5 s")
    assert states(out)[-1] == "repair"
    assert job in sh("squeue", "-h", "-t", "R", "-o", "%i")  # the job was left to run
