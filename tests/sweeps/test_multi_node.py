"""Multi-node sweeps: a network flag never passes on a single-node sweep, and under Slurm and
Kubernetes the suspect is swept with peers Guard drains or cordons for it (``guard:`` reason,
Guard's taint) and gives back after. Kubernetes runs on the recording API of
test_kubernetes.py.

The real one-host Slurm has one node, so a job over two nodes cannot run there (the one-node
form of the same job runs against it in test_slurm.py). Here a stand-in for Slurm's two-node
cluster (``scontrol``/``squeue`` answers kept in a dict, ``srun`` a script that runs the job's
bash once per node with ``SLURMD_NODENAME`` set) plays the second node: a boundary this host
does not have.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from guard.config import OrchestratorSettings
from guard.schemas import GuardMessage, NodeState, SweepCheck, SweepResult
from guard.sweeps.executors import SimulatedSweepExecutor, parse_sweep_output, peer_checks
from guard.sweeps.kubernetes import KubernetesScheduler, KubernetesSweepExecutor
from guard.sweeps.orchestrator import Orchestrator
from guard.sweeps.scheduler import DryRunScheduler, SchedulerError
from guard.sweeps.slurm import SlurmNode, SlurmScheduler, SlurmSweepExecutor, SweepJob

from .helpers import NODES, Clock, flag
from .test_kubernetes import StandInApiServer, as_model, kubeconfig, pod

T0 = 1_767_226_000.0
JOB = Path(__file__).with_name("slurm_sweep_job.py")


class SingleOnly:
    """The simulated executor as a site's single-node-only one (e.g. commands)."""

    sweep_kinds = ("single",)

    def __init__(self) -> None:
        self.inner = SimulatedSweepExecutor([], seed=1)

    def run(self, node: str, sweep: str, peers: Any, now: float) -> list[SweepCheck]:
        return self.inner.run(node, sweep, peers, now)


def orchestrate(category: str, executor: Any, **settings: Any) -> list[NodeState]:
    out: list[GuardMessage] = []
    orch = Orchestrator(
        OrchestratorSettings(nodes=NODES, **settings),
        scheduler=DryRunScheduler(),
        executor=executor,
        publish=out.append,
        clock=Clock(T0),
        inline_sweeps=True,
    )
    orch.handle_flag(flag("node-010", "f1", T0 - 1, category=category, gpu=None))
    orch.tick()
    return [m for m in out if isinstance(m, NodeState) and m.node == "node-010"]


@pytest.mark.parametrize("category", ["nic", "link", "comm_slow", "comm_hang"])
def test_a_network_flag_never_passes_on_a_single_node_sweep(category: str) -> None:
    alone = orchestrate(category, SingleOnly())
    assert [s.state for s in alone] == ["suspect", "cordoned", "sweeping", "failed", "repair"]
    assert alone[3].reason == (
        f"passed the single-node sweep; untested: a {category} flag needs a multi-node sweep, "
        f"this executor runs single-node ones only; after a critical {category} flag"
    )
    no_peer = orchestrate(category, SimulatedSweepExecutor([], seed=1), multi_sweep_peers=0)
    assert [s.state for s in no_peer][-2:] == ["failed", "repair"]
    # with peers the multi-node sweep decides, as for any flag
    multi = orchestrate(category, SimulatedSweepExecutor([], seed=1))
    assert [s.state for s in multi] == ["suspect", "cordoned", "sweeping", "healthy"]
    assert multi[-1].reason == "passed the single-node and multi-node sweeps"


def test_a_network_flag_still_needs_its_multi_node_sweep_after_a_restart() -> None:
    # The orchestrator is killed while the nic-flagged node's single-node sweep runs; the
    # restarted one has no claims, only the node-state topic (compacted: the last state).
    first: list[GuardMessage] = []
    gate = threading.Event()

    class Hanging(SingleOnly):
        def run(self, node: str, sweep: str, peers: Any, now: float) -> list[SweepCheck]:
            gate.wait(60)
            return super().run(node, sweep, peers, now)

    orch = Orchestrator(
        OrchestratorSettings(nodes=NODES),
        scheduler=DryRunScheduler(),
        executor=Hanging(),
        publish=first.append,
        clock=Clock(T0),
    )
    try:
        orch.handle_flag(flag("node-010", "f1", T0 - 1, category="nic", gpu=None))
        orch.tick()
        assert orch.sweeping() == ["node-010"]
    finally:
        orch.close()
        gate.set()
    last = [m for m in first if isinstance(m, NodeState)][-1]
    assert last.state == "sweeping" and last.reason.endswith("; after a critical nic flag")
    after: list[GuardMessage] = []
    again = Orchestrator(
        OrchestratorSettings(nodes=NODES),
        scheduler=DryRunScheduler(),
        executor=SingleOnly(),
        publish=after.append,
        clock=Clock(T0 + 60),
        inline_sweeps=True,
    )
    again.resume(again.recover([last]))
    states = [m for m in after if isinstance(m, NodeState)]
    assert [s.state for s in states] == ["sweeping", "failed", "repair"]  # not released
    assert "untested: a nic flag needs a multi-node sweep" in states[1].reason


def test_a_gpu_flag_still_passes_on_a_single_node_sweep() -> None:
    states = orchestrate("thermal", SingleOnly())
    assert [s.state for s in states] == ["suspect", "cordoned", "sweeping", "healthy"]


def test_the_verdict_is_the_swept_nodes_line_when_every_node_prints_one() -> None:
    def line(node: str, passed: bool) -> str:
        checks = [
            SweepCheck(name="nccl_multinode_busbw_gbps", value=1.0, passed=passed),
            SweepCheck(name="sweep_coverage", value=8, baseline=8, passed=True),
        ]
        result = SweepResult(id=node, ts=T0, node=node, sweep="multi", checks=checks, passed=passed)
        return result.model_dump_json()

    out = "\n".join([line("a", False), "srun: some noise", line("b", True)])
    checks = parse_sweep_output("a", ["srun"], 1, out, "", expected_gpus=8)
    assert [c.name for c in checks if not c.passed] == ["nccl_multinode_busbw_gbps"]
    assert all(c.passed for c in parse_sweep_output("b", ["srun"], 1, out, "", expected_gpus=8))


class TwoNodeSlurm:
    """``SlurmCli``'s methods over two nodes kept in a dict; ``srun`` runs the job's script
    once per node of ``--nodelist`` with ``SLURMD_NODENAME`` set (see the module)."""

    def __init__(self, tmp: Path, peer_jobs: int = 0, admin_drained: bool = False) -> None:
        self.nodes_ = {
            "sa": {"State": "IDLE", "Reason": ""},
            "sb": {"State": "MIXED", "Reason": ""},
        }
        if admin_drained:
            self.nodes_["sb"] = {"State": "IDLE+DRAIN", "Reason": "bad cable [ann@2026-12-01]"}
        self.reservations = {"guard-sa": ["sa"]}  # the suspect: Guard's since its single sweep
        self.peer_jobs = peer_jobs
        self.calls: list[str] = []
        self.srun = str(tmp / "srun")
        (tmp / "bin").mkdir()
        (tmp / "bin" / "scontrol").write_text("#!/bin/sh\n")  # the job asks about itself
        os.chmod(tmp / "bin" / "scontrol", 0o755)
        Path(self.srun).write_text(
            "#!/bin/sh\n"
            f"PATH={tmp / 'bin'}:$PATH\n"
            'for a in "$@"; do case "$a" in\n'
            '  --nodelist=*) nodes="${a#--nodelist=}";;\n'
            '  --gres=gpu:*) export SLURM_GPUS_ON_NODE="${a#--gres=gpu:}";;\n'
            '  --export=ALL,*) export "${a#--export=ALL,}";;\n'
            "esac; done\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            "rc=0\n"
            'for n in $(echo "$nodes" | tr , " "); do SLURMD_NODENAME=$n "$@" || rc=$?; done\n'
            "exit $rc\n"
        )
        os.chmod(self.srun, os.stat(self.srun).st_mode | stat.S_IEXEC)

    def node(self, name: str) -> SlurmNode:
        if name not in self.nodes_:
            raise SchedulerError(f"scontrol show node {name}: no such node")
        n = self.nodes_[name]
        return SlurmNode.parse(
            f"NodeName={name} Gres=gpu:8 State={n['State']} Reason={n['Reason']}"
        )

    def nodes(self) -> list[str]:
        return list(self.nodes_)

    def node_states(self) -> list[SlurmNode]:
        return [self.node(n) for n in self.nodes_]

    def jobs_on(self, name: str) -> list[str]:
        if name == "sb" and self.peer_jobs:
            self.peer_jobs -= 1  # the peer's job ends while Guard waits
            return ["4242"]
        return []

    def reservation_exists(self, name: str) -> bool:
        return name in self.reservations

    def scontrol_run(self, *args: str) -> str:
        self.calls.append(shlex.join(args))
        fields = dict(a.split("=", 1) for a in args[1:] if "=" in a)
        if "NodeName" in fields:
            n = self.nodes_[fields["NodeName"]]
            if fields.get("State") == "DRAIN":
                n["State"], n["Reason"] = "IDLE+DRAIN", fields["Reason"]
            elif fields.get("State") == "RESUME":
                n["State"], n["Reason"] = "IDLE", ""
        elif "ReservationName" in fields and "Nodes" in fields:
            self.reservations[fields["ReservationName"]] = fields["Nodes"].split(",")
        return ""


def slurm_multi(
    tmp: Path, command: str = "", stranded: dict[str, dict[str, str]] | None = None, **kw: Any
) -> tuple[TwoNodeSlurm, list[SweepCheck]]:
    cli = TwoNodeSlurm(tmp, **kw)
    cli.nodes_.update(stranded or {})
    command = command or f"{sys.executable} {JOB} --node {{node}}"
    ex = SlurmSweepExecutor(
        SlurmScheduler(cli, user="guard"),  # type: ignore[arg-type]
        SweepJob(command, drain_timeout_s=10, sweep_timeout_s=60, poll_s=0.01),
        rendezvous_port=29511,
    )
    return cli, ex.run("sa", "multi", ["sb"], time.time())


def test_a_slurm_multi_node_sweep_borrows_a_drained_peer_and_gives_it_back(
    tmp_path: Path,
) -> None:
    cli, checks = slurm_multi(tmp_path, peer_jobs=2)
    assert cli.calls == [
        "update NodeName=sb State=DRAIN 'Reason=guard: peer for the multi-node sweep of sa'",
        "update ReservationName=guard-sa Nodes=sa,sb",  # only the sweep job may start there
        "update NodeName=sb State=RESUME",
        "update ReservationName=guard-sa Nodes=sa",  # given back: in service, no reservation
    ]
    assert cli.nodes_["sb"] == {"State": "IDLE", "Reason": ""}
    role = next(c for c in checks if c.name == "sweep_role")
    assert role.detail == "rank 0 peers sb rendezvous sa:29511"  # the suspect's own line
    assert all(c.passed for c in checks if c.name != "slurm_job_host"), checks


def test_a_peer_that_prints_nothing_fails_the_sweep(tmp_path: Path) -> None:
    command = (
        'sh -c \'test "$SLURMD_NODENAME" = sb && exit 7; exec "$0" "$@"\' '
        f"{sys.executable} {JOB} --node {{node}}"
    )
    _, checks = slurm_multi(tmp_path, command)
    failed = [c for c in checks if not c.passed and c.name != "slurm_job_host"]
    assert [c.name for c in failed] == ["sweep_error", "peer_sweep_error"]  # srun exits 7 too
    assert failed[1].detail.startswith("peer sb printed no sweep line (exit 7)")


def test_an_admin_drained_peer_is_not_borrowed_and_the_sweep_is_untested(tmp_path: Path) -> None:
    cli, checks = slurm_multi(tmp_path, admin_drained=True)
    assert [(c.name, c.passed) for c in checks] == [("slurm_peer", False)]
    assert checks[0].detail.startswith("untested: peer sb is drained by someone else")
    assert cli.nodes_["sb"]["Reason"] == "bad cable [ann@2026-12-01]"
    assert not any("NodeName=sb" in c for c in cli.calls)


def test_slurm_lends_an_idle_peer_before_a_busy_one(tmp_path: Path) -> None:
    # sa is the suspect; of its two healthy peers one runs a job (MIXED) and one is IDLE:
    # whichever the order of the health-only choice, the idle one is taken, not drained.
    def chosen(states: dict[str, str]) -> list[str]:
        where = tmp_path / "-".join(states.values())
        where.mkdir()
        cli = TwoNodeSlurm(where)
        cli.nodes_.update({n: {"State": st, "Reason": ""} for n, st in states.items()})
        out: list[GuardMessage] = []
        orch = Orchestrator(
            OrchestratorSettings(nodes=["sa", "sb", "sc"], multi_sweep_peers=1),
            scheduler=SlurmScheduler(cli, user="guard"),  # type: ignore[arg-type]
            executor=SimulatedSweepExecutor([], seed=1),
            publish=out.append,
            clock=Clock(T0),
            inline_sweeps=True,
        )
        orch.handle_flag(flag("sa", "f1", T0 - 1, category="nic", gpu=None))
        orch.tick()
        [multi] = [m for m in out if isinstance(m, SweepResult) and m.sweep == "multi"]
        return multi.peers

    assert chosen({"sb": "MIXED", "sc": "IDLE"}) == ["sc"]
    assert chosen({"sb": "IDLE", "sc": "ALLOCATED"}) == ["sb"]
    # IDLE but planned for a job, reserved or drained is not free; with none idle, a busy
    # healthy peer is drained for the sweep (the executor waits for its jobs).
    assert len(chosen({"sb": "IDLE+PLANNED", "sc": "MIXED"})) == 1
    assert [SlurmNode.parse(f"NodeName=x State={st}").idle for st in
            ("IDLE", "IDLE+PLANNED", "IDLE+DRAIN", "IDLE+RESERVED", "MIXED", "DOWN")] == [
        True, False, False, False, False, False]  # fmt: skip


# --- Kubernetes, on the recording API of test_kubernetes.py ---------------------------------


def test_kubernetes_lends_a_peer_without_workload_pods_first(tmp_path: Path) -> None:
    server = StandInApiServer()
    try:
        kube = KubernetesScheduler(kubeconfig=kubeconfig(tmp_path, server.url), namespace="g")
        # gpu-b runs a CPU-only pod of a job: busy (it would be moved); gpu-a only a
        # DaemonSet's pod and a finished pod: idle.
        cpu_job = pod("etl-0", "gpu-b", gpus=None)
        agent = pod("agent-x", "gpu-a", owner="DaemonSet")
        done = pod("old-0", "gpu-a")
        done["status"]["phase"] = "Succeeded"
        server.pods = {"etl-0": cpu_job, "agent-x": agent, "old-0": done}
        assert kube.training_pods("gpu-b") == []  # no GPU asked: not a training pod ...
        assert kube.idle_peers(["gpu-b", "gpu-a"], 2) == ["gpu-a"]  # ... but not idle either
        assert kube.idle_peers(["gpu-b"], 1) == []
    finally:
        server.close()


class TwoNodeApiServer(StandInApiServer):
    """test_kubernetes.py's stand-in API server; each sweep Job's pod logs its own node's line
    (``logs[node]``), as the kubelet of that node would."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, str] = {}
        self.nodes["gpu-a"]["status"]["addresses"] = [
            {"type": "InternalIP", "address": "10.0.0.11"},
            {"type": "Hostname", "address": "gpu-a"},
        ]

    def route(self, method: str, path: str, query: Any, body: Any) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        if parts[-1] == "log":
            job = self.jobs[parts[5].removesuffix("-x")]
            node = job["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"]
            return 200, self.logs.get(node, "")
        return super().route(method, path, query, body)


def multi_line(node: str, passed: bool = True) -> str:
    checks = [
        SweepCheck(name="nccl_multinode_busbw_gbps", value=380.0, unit="GB/s", passed=passed),
        SweepCheck(name="sweep_coverage", value=8, unit="gpus", baseline=8, passed=True),
    ]
    result = SweepResult(id=node, ts=T0, node=node, sweep="multi", checks=checks, passed=passed)
    return result.model_dump_json()


@pytest.fixture
def two_node_api(tmp_path: Path) -> Any:
    server = TwoNodeApiServer()
    kube = KubernetesScheduler(kubeconfig=kubeconfig(tmp_path, server.url), namespace="guard")
    ex = KubernetesSweepExecutor(
        kube, image="registry.example/guard:1", job=SweepJob(poll_s=0.05), rendezvous_port=29511
    )
    yield server, ex
    server.close()


def test_a_kubernetes_multi_node_sweep_cordons_the_peer_runs_a_job_per_node_and_gives_it_back(
    two_node_api: Any,
) -> None:
    server, ex = two_node_api
    server.pods = {"trainer-0": pod("trainer-0", "gpu-b")}  # the peer is busy at first
    server.logs = {"gpu-a": multi_line("gpu-a"), "gpu-b": multi_line("gpu-b")}
    threading.Timer(0.3, server.pods.clear).start()  # its job ends meanwhile
    checks = ex.run("gpu-a", "multi", ["gpu-b"], time.time())
    assert [(c.name, c.passed) for c in checks] == [
        ("nccl_multinode_busbw_gbps", True),
        ("sweep_coverage", True),
    ]
    # the peer: Guard's taint with the reason while lent, then exactly as before
    first, last = server.bodies("PATCH", "/nodes/gpu-b")[0], server.nodes["gpu-b"]
    assert first["spec"]["taints"][-1]["key"] == "guard.io/suspect"
    assert (
        "peer for the multi-node sweep of gpu-a"
        in (first["metadata"]["annotations"]["guard.io/reason"])
    )
    assert not last["spec"].get("unschedulable") and not last["spec"].get("taints")
    jobs = [as_model(b, "V1Job") for b in server.bodies("POST", "/jobs")]
    assert server.jobs == {}  # both deleted
    by_node = {j.spec.template.spec.node_selector["kubernetes.io/hostname"]: j for j in jobs}
    for rank, (member, other) in enumerate([("gpu-a", "gpu-b"), ("gpu-b", "gpu-a")]):
        spec = by_node[member].spec.template.spec
        assert spec.host_network is True
        assert spec.containers[0].command[-8:] == [
            *("--sweep", "multi", "--peers", other, "--node-rank", str(rank)),
            *("--rendezvous", "10.0.0.11:29511"),  # the suspect's InternalIP
        ]
        assert spec.containers[0].resources.limits == {"nvidia.com/gpu": "8"}


def test_a_kubernetes_peer_without_a_line_fails_and_a_foreign_cordon_is_not_borrowed(
    two_node_api: Any,
) -> None:
    server, ex = two_node_api
    server.logs = {"gpu-a": multi_line("gpu-a"), "gpu-b": "Traceback: NCCL error"}
    checks = ex.run("gpu-a", "multi", ["gpu-b"], time.time())
    assert [c.name for c in checks if not c.passed] == ["peer_sweep_error"]
    assert "peer gpu-b printed no sweep line (exit 0): Traceback: NCCL error" in checks[-1].detail
    server.nodes["gpu-b"]["spec"]["unschedulable"] = True  # an admin's cordon
    server.requests.clear()
    [untested] = ex.run("gpu-a", "multi", ["gpu-b"], time.time())
    assert untested.name == "kube_multi" and untested.detail == (
        "untested: peer gpu-b is cordoned by someone else"
    )
    assert server.bodies("PATCH", "/nodes/gpu-b") == [] and server.bodies("POST", "/jobs") == []


def test_a_busy_peer_leaves_the_multi_node_sweep_untested() -> None:
    def peer_line(busy: bool) -> str:
        checks = [
            SweepCheck(
                name="gpu_processes",
                value=1.0 if busy else 0.0,
                passed=not busy,
                detail="untested: GPUs busy with other processes: gpu0: pid 4711"
                if busy
                else "no other compute process on the GPUs",
            )
        ]
        return SweepResult(
            id="p", ts=T0, node="peer", sweep="multi", checks=checks, passed=not busy
        ).model_dump_json()

    assert peer_checks("peer", 0, peer_line(busy=False)) == []
    [busy] = peer_checks("peer", 1, peer_line(busy=True))
    assert (busy.name, busy.passed) == ("peer_busy", False)
    assert busy.detail == "peer peer: untested: GPUs busy with other processes: gpu0: pid 4711"
    [silent] = peer_checks("peer", 1, multi_line("node"), "NCCL WARN")
    assert silent.name == "peer_sweep_error" and silent.detail.endswith("(exit 1): NCCL WARN")


def test_peers_an_earlier_orchestrator_left_drained_are_resumed_before_the_first_sweep(
    tmp_path: Path,
) -> None:
    left = "guard: peer for the multi-node sweep of sx [root@2026-12-01T10:00:00]"
    stranded = {
        "sc": {"State": "IDLE+DRAIN", "Reason": left},  # a restart mid-sweep left it so
        "sd": {"State": "IDLE+DRAIN", "Reason": "guard: sent to repair: failed [root@x]"},
        "se": {"State": "IDLE+DRAIN", "Reason": "bad dimm [ann@2026-12-01]"},
    }
    cli, checks = slurm_multi(tmp_path, stranded=stranded)
    assert cli.calls[0] == "update NodeName=sc State=RESUME"
    assert cli.nodes_["sc"] == {"State": "IDLE", "Reason": ""}
    assert cli.nodes_["sd"]["State"] == cli.nodes_["se"]["State"] == "IDLE+DRAIN"  # not peers
    assert [c for c in cli.calls if "NodeName=sd" in c or "NodeName=se" in c] == []
    assert next(c for c in checks if c.name == "sweep_role").passed  # and the sweep ran


def test_a_kubernetes_peer_left_cordoned_by_an_earlier_orchestrator_is_uncordoned_first(
    two_node_api: Any,
) -> None:
    server, ex = two_node_api
    ex.scheduler.cordon("gpu-b", "peer for the multi-node sweep of gpu-x")  # a restart left it
    ex.scheduler.cordon("gpu-a", "cordoned for sweep: a nic flag")  # the suspect: stays
    server.logs = {"gpu-a": multi_line("gpu-a"), "gpu-b": multi_line("gpu-b")}
    checks = ex.run("gpu-a", "multi", ["gpu-b"], time.time())
    assert all(c.passed for c in checks)
    reasons = [
        b["metadata"]["annotations"].get("guard.io/reason")
        for b in server.bodies("PATCH", "/nodes/gpu-b")
        if b.get("metadata")
    ]
    # cordoned by the restart, uncordoned first, lent to this sweep, given back
    assert reasons == [
        "peer for the multi-node sweep of gpu-x",
        None,
        "peer for the multi-node sweep of gpu-a",
        None,
    ]
    suspect = server.nodes["gpu-a"]
    assert suspect["spec"]["unschedulable"] and suspect["spec"]["taints"][-1]["key"] == (
        "guard.io/suspect"
    )
