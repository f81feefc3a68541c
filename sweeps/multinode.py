"""Multi-node sweeps under Slurm and Kubernetes: the suspect with one or two healthy peers lent
for it, idle ones first (the orchestrator asks the scheduler's ``idle_peers``). The ssh and
commands executors cannot lend peers and run none unless ``ssh_multi_node`` /
``commands_multi_node`` says the nodes run nothing else
(:class:`~guard.sweeps.executors.UndrainedPeers`).

A network flag (a NIC, a link, a slow or hung collective) is about a path between nodes, so a
single-node sweep cannot clear it (the orchestrator fails such a node as untested without a
multi-node sweep). Under Slurm the suspect is already Guard's after its single-node sweep (drained,
then resumed inside its reservation ``guard-<node>``). Each peer is then:

1. drained with a ``guard:`` reason (``guard: peer for the multi-node sweep of X``), unless
   someone else drained it (then the sweep fails: Guard does not borrow an admin's node);
2. waited for until its jobs have ended (``drain_timeout_s``);
3. added to the suspect's reservation and resumed, so that only the sweep job can start there;
4. after the sweep — passed, failed or broken — taken out of the reservation and resumed
   again if Guard's drain is still on it: it is back in the pool as it was. A peer an earlier
   orchestrator left drained (a restart mid-sweep) is resumed before the executor's first
   multi-node sweep (:func:`return_stranded_peers`).

The job is one ``srun --nodes=1+P --ntasks-per-node=1 --exclusive --gres=gpu:N`` over the
suspect and its peers in the suspect's reservation; each task runs ``guard sweep run --json
--sweep multi`` with its own node name, rank (the suspect is rank 0, the all-reduce's
rendezvous) and peers, picked by ``$SLURMD_NODENAME`` (:func:`multi_script`). The suspect's
``sweep`` line is the verdict; a peer that printed none adds a failed ``peer_sweep_error``.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import subprocess
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from guard.schemas import SweepCheck

from .executors import parse_sweep_output, peer_checks
from .scheduler import SchedulerError

if TYPE_CHECKING:
    from .kubernetes import KubernetesSweepExecutor
    from .slurm import SlurmSweepExecutor

log = logging.getLogger(__name__)

#: The drain reason of a peer lent to a multi-node sweep (after Guard's ``guard:`` prefix).
PEER_REASON = "peer for the multi-node sweep of"

__all__ = [
    "lend_peer",
    "multi_script",
    "return_peer",
    "run_kubernetes_multi",
    "run_slurm_multi",
    "slurm_multi_argv",
]


def multi_script(command: str, members: Sequence[tuple[str, str]], port: int) -> str:
    """The bash run by every task: ``members`` are (agent name, Slurm name), the suspect first.

    >>> print(multi_script("guard --node {node}", [("a", "sa"), ("b", "sb")], 29500))
    case "$SLURMD_NODENAME" in
      sa) exec guard --node a --sweep multi --peers b --node-rank 0 --rendezvous sa:29500 ;;
      sb) exec guard --node b --sweep multi --peers a --node-rank 1 --rendezvous sa:29500 ;;
      *) echo "guard: $SLURMD_NODENAME is not a node of this multi-node sweep" >&2; exit 3 ;;
    esac
    """
    rendezvous = f"{members[0][1]}:{port}"
    lines = ['case "$SLURMD_NODENAME" in']
    for rank, (agent, slurm) in enumerate(members):
        others = [a for a, _ in members if a != agent]  # the suspect first for every peer
        argv = [
            *shlex.split(command.format(node=agent, slurm_node=slurm)),
            *("--sweep", "multi", "--peers", ",".join(others), "--node-rank", str(rank)),
            *("--rendezvous", rendezvous),
        ]
        lines.append(f"  {shlex.quote(slurm)}) exec {shlex.join(argv)} ;;")
    lines.append(
        '  *) echo "guard: $SLURMD_NODENAME is not a node of this multi-node sweep" >&2; exit 3 ;;'
    )
    lines.append("esac")
    return "\n".join(lines)


def slurm_multi_argv(
    ex: SlurmSweepExecutor, members: Sequence[tuple[str, str]], reservation: str, gpus: int
) -> list[str]:
    """One task per node, each node whole with every GPU, in the suspect's reservation."""
    minutes = max(1, int(ex.job.sweep_timeout_s // 60))
    return [
        ex.scheduler.cli.srun,
        f"--reservation={reservation}",
        f"--nodelist={','.join(s for _, s in members)}",
        f"--nodes={len(members)}",
        "--ntasks-per-node=1",
        "--exclusive",
        *([f"--gres=gpu:{gpus}"] if gpus else []),
        f"--export=ALL,GUARD_SWEEP_EXPECTED_GPUS={gpus}",
        "--job-name=guard-sweep-multi",
        f"--time={minutes}",
        "bash",
        "-c",
        multi_script(ex.job.command, members, ex.rendezvous_port),
    ]


def lend_peer(ex: SlurmSweepExecutor, peer: str, node: str) -> None:
    """Drain ``peer`` for the sweep of ``node`` and wait until it is empty (steps 1-2)."""
    from .slurm import NodeNotOwned

    sched = ex.scheduler
    slurm_peer = sched.names.slurm(peer)
    current = sched.cli.node(slurm_peer)
    if current.drained_by_other:
        raise NodeNotOwned(f"peer {peer} is drained by someone else ({current.reason!r})")
    sched._drain(slurm_peer, f"{PEER_REASON} {node}")
    deadline = time.monotonic() + ex.job.drain_timeout_s
    backoff = ex.job.jobs_backoff(deadline)
    while not (sched.cli.node(slurm_peer).drained and not sched.cli.jobs_on(slurm_peer)):
        if time.monotonic() > deadline:
            jobs = ", ".join(sched.cli.jobs_on(slurm_peer)) or "none listed"
            raise TimeoutError(f"peer {peer} still runs jobs ({jobs}) after the drain")
        backoff.sleep()


def return_peer(ex: SlurmSweepExecutor, peer: str) -> None:
    """Step 4 for one peer: resumed if Guard's drain is still on it."""
    sched = ex.scheduler
    slurm_peer = sched.names.slurm(peer)
    if sched.cli.node(slurm_peer).drained_by_guard:
        sched.cli.scontrol_run("update", f"NodeName={slurm_peer}", "State=RESUME")


def _reserve(ex: SlurmSweepExecutor, reservation: str, slurm_nodes: Sequence[str]) -> None:
    ex.scheduler.cli.scontrol_run(
        "update", f"ReservationName={reservation}", f"Nodes={','.join(slurm_nodes)}"
    )


def _once(ex: Any, give_back: Any) -> None:
    """``give_back(ex)`` before the executor's first multi-node sweep lends a peer."""
    with ex.peers_lock:
        if not ex.stranded_peers_checked:
            try:
                give_back(ex)
                ex.stranded_peers_checked = True
            except SchedulerError as exc:
                log.error("could not look for peers an earlier run left taken: %s", exc)


def return_stranded_peers(ex: SlurmSweepExecutor) -> list[str]:
    """Resume the peers an earlier orchestrator left drained (a restart mid-sweep): nodes
    drained with Guard's peer reason. Run once per executor, before its first multi-node sweep
    lends any peer, so no sweep of this process holds them."""
    sched = ex.scheduler
    returned = []
    for name in sched.cli.nodes():
        current = sched.cli.node(name)
        if current.drained_by_guard and PEER_REASON in current.reason:
            sched.cli.scontrol_run("update", f"NodeName={name}", "State=RESUME")
            log.warning("%s was left drained as a multi-node sweep's peer: resumed", name)
            returned.append(name)
    return returned


def run_slurm_multi(ex: SlurmSweepExecutor, node: str, peers: Sequence[str]) -> list[SweepCheck]:
    """The multi-node sweep of ``node`` with ``peers`` (see the module)."""
    from .slurm import NodeNotOwned

    _once(ex, return_stranded_peers)
    sched = ex.scheduler
    slurm_node = sched.names.slurm(node)
    reservation = sched.reservation_name(slurm_node)
    if not peers:
        return [SweepCheck(name="multi_no_peer", passed=False, detail="no peer to sweep with")]
    try:
        if not sched.cli.reservation_exists(reservation):
            raise NodeNotOwned(
                f"{node} is not in Guard's reservation {reservation}: its single-node sweep "
                "holds it first"
            )
        gpus = sched.state(node).gpus
    except (NodeNotOwned, SchedulerError) as exc:
        return [SweepCheck(name="slurm_node_not_owned", passed=False, detail=str(exc))]
    members = [(node, slurm_node), *((p, sched.names.slurm(p)) for p in peers)]
    lent: list[str] = []
    try:
        for peer in peers:
            lent.append(peer)
            lend_peer(ex, peer, node)
        _reserve(ex, reservation, [s for _, s in members])
        for _, slurm_peer in members[1:]:
            sched.cli.scontrol_run("update", f"NodeName={slurm_peer}", "State=RESUME")
        argv = slurm_multi_argv(ex, members, reservation, gpus)
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=ex.job.sweep_timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [SweepCheck(name="sweep_job", passed=False, detail=f"{shlex.join(argv)}: {exc}")]
    except (NodeNotOwned, TimeoutError, SchedulerError) as exc:
        return [SweepCheck(name="slurm_peer", passed=False, detail=f"untested: {exc}")]
    finally:
        with contextlib.suppress(SchedulerError):  # the peers were never added
            _reserve(ex, reservation, [slurm_node])
        for peer in lent:
            try:
                return_peer(ex, peer)
            except SchedulerError as exc:  # the sweep's verdict stands; say what is left
                log.error("peer %s may still be drained by Guard: %s", peer, exc)
    checks = parse_sweep_output(
        node, argv, done.returncode, done.stdout, done.stderr, expected_gpus=gpus
    )
    for peer in peers:
        checks += peer_checks(peer, done.returncode, done.stdout, done.stderr)
    return checks


# --- Kubernetes ---------------------------------------------------------------------------


def _node_address(sched: Any, node: str) -> str:
    """The node's InternalIP (the rendezvous of a host-network pod), else its name."""
    addresses = sched._read(node).get("status", {}).get("addresses") or []
    ip = next((a.get("address") for a in addresses if a.get("type") == "InternalIP"), None)
    return str(ip or node)


def return_stranded_kube_peers(ex: KubernetesSweepExecutor) -> list[str]:
    """Uncordon the peers an earlier orchestrator left cordoned (Guard's taint with the peer
    reason), once per executor before its first multi-node sweep lends any."""
    from .kubernetes import ANNOTATION_REASON

    sched = ex.scheduler
    returned = []
    for name in sched.inventory() or []:
        current = sched._read(name)
        reason = (current.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_REASON)
        if sched._guard_taint(current) is not None and str(reason).startswith(PEER_REASON):
            sched.uncordon(name)
            log.warning("%s was left cordoned as a multi-node sweep's peer: uncordoned", name)
            returned.append(name)
    return returned


def run_kubernetes_multi(
    ex: KubernetesSweepExecutor, node: str, peers: Sequence[str]
) -> list[SweepCheck]:
    """The multi-node sweep of ``node`` with ``peers`` under Kubernetes.

    Each peer is cordoned with Guard's taint (reason ``peer for the multi-node sweep of X``;
    a node someone else cordoned is not borrowed: untested) and waited for until its training
    pods are gone; then one Job per node, pinned to it with every GPU and the host network, runs
    ``guard sweep run --sweep multi`` with its rank (the suspect 0, the rendezvous at its
    InternalIP). The suspect's line is the verdict; a peer without a line fails it. The Jobs are
    deleted and the peers uncordoned (only what Guard added) whatever happened.
    """
    from .kubernetes import _count, reason_tag

    sched = ex.scheduler
    if not peers:
        return [SweepCheck(name="multi_no_peer", passed=False, detail="no peer to sweep with")]
    _once(ex, return_stranded_kube_peers)
    cordoned: list[str] = []
    jobs: list[tuple[str, str]] = []
    ns = sched.namespace
    try:
        for peer in peers:
            current = sched._read(peer)
            if (current.get("spec") or {}).get("unschedulable") and not sched._guard_taint(current):
                raise NodeNotOwnedError(f"peer {peer} is cordoned by someone else")
            cordoned.append(peer)
            sched.cordon(peer, f"{PEER_REASON} {node}")
        deadline = time.monotonic() + ex.job.drain_timeout_s
        backoff = ex.job.jobs_backoff(deadline)
        for peer in peers:
            while pods := sched.training_pods(peer):
                if time.monotonic() > deadline:
                    names = ", ".join(p["metadata"]["name"] for p in pods)
                    raise TimeoutError(f"peer {peer} still runs {names} after the cordon")
                backoff.sleep()
        members = [node, *peers]
        rendezvous = f"{_node_address(sched, node)}:{ex.rendezvous_port}"
        gpus: dict[str, str] = {}
        for rank, member in enumerate(members):
            allocatable = sched._read(member).get("status", {}).get("allocatable") or {}
            gpus[member] = str(allocatable.get(sched.gpu_resource, "0"))
            name = f"guard-sweep-m-{reason_tag(member)[:38].lower()}-{uuid.uuid4().hex[:6]}"
            manifest = ex.job_manifest(member, name, gpus[member])
            pod = manifest["spec"]["template"]["spec"]
            pod["hostNetwork"] = True  # the all-reduce and ib_write_bw reach the other nodes
            others = [m for m in members if m != member]
            pod["containers"][0]["command"] += [
                *("--sweep", "multi", "--peers", ",".join(others), "--node-rank", str(rank)),
                *("--rendezvous", rendezvous),
            ]
            sched._call(f"creating Job {name}", ex.batch.create_namespaced_job, ns, manifest)
            jobs.append((member, name))
        logs = {member: ex._wait_and_read_log(ns, name) for member, name in jobs}
    except (NodeNotOwnedError, TimeoutError, LookupError, SchedulerError) as exc:
        return [SweepCheck(name="kube_multi", passed=False, detail=f"untested: {exc}")]
    finally:
        for _, name in jobs:
            try:
                sched._call(
                    f"deleting Job {name}",
                    ex.batch.delete_namespaced_job,
                    name,
                    ns,
                    propagation_policy="Background",
                )
            except SchedulerError as exc:
                log.error("sweep Job %s left behind: %s", name, exc)
        for peer in cordoned:
            try:
                sched.uncordon(peer)
            except SchedulerError as exc:
                log.error("peer %s may still be cordoned by Guard: %s", peer, exc)
    (code, out), name = logs[node], jobs[0][1]
    checks = parse_sweep_output(
        node, [f"job/{name}"], code, out, "", expected_gpus=_count(gpus[node])
    )
    for peer in peers:
        checks += peer_checks(peer, *logs[peer])
    return checks


class NodeNotOwnedError(RuntimeError):
    """A peer someone else holds: Guard does not borrow it."""
