"""Slurm: own a node before sweeping it, sweep it as a Slurm job on it, give back only what
Guard took.

How Guard owns a node (checked on Debian's Slurm 22.05, see docs/orchestrator.md):

1. ``scontrol update NodeName=X State=DRAIN Reason="guard: ..."`` — no new jobs start; the
   running ones finish (or are requeued, per ``isolate_policy``).
2. Wait until the node is DRAINED (no job left); past ``slurm_drain_timeout_s`` the sweep
   fails with the jobs still there, and the node goes to repair.
3. A maintenance reservation ``guard-<NodeName>`` (``Flags=MAINT,IGNORE_JOBS``, ``Users=`` Guard's
   user) on the node, then ``State=RESUME``: a DRAINED node refuses every job, root's too, while a
   reserved node takes only ``srun --reservation=guard-<NodeName>`` jobs.
4. The sweep runs as ``srun --reservation=... -w X -N1 --exclusive --gres=gpu:N <command>``
   — the whole node, every GPU its ``Gres=gpu:N`` declares (a cgroup with ``ConstrainDevices``
   would hide the GPUs of a job that asks for none) — with ``GUARD_SWEEP_EXPECTED_GPUS=N``, and
   prints one ``sweep`` message (``guard sweep run --json``), judged against those N GPUs. A
   node without GPU GRES is a node without GPUs: the CPU checks are all it can pass.
5. Pass: delete the reservation (the node is back). Fail: DRAIN again with a ``guard:`` reason
   (repair), then delete the reservation.

Guard's marks are the ``guard:`` prefix of the drain Reason and its reservation. A node drained
with any other Reason is someone else's: Guard reads ``scontrol show node -o`` before every
change and leaves such a node exactly as it is (State and Reason), also after a restart; a node
that is in service with no reservation of Guard's was resumed by someone else, and Guard does
not drain it again on a restart.

The operator's word wins: a node Guard holds that someone resumes (``scontrol update
NodeName=X State=RESUME``) is a cancel (:meth:`SlurmScheduler.overridden`; Guard drops its
reservation and does not drain the node again for ``operator_holdoff_s``). Slurm clears the
Reason on a resume and keeps no user or time for it (checked on 22.05), so the note says when
Guard saw it, not who. A node with the feature ``guard_opt_out`` (``scontrol update
NodeName=X AvailableFeatures=guard_opt_out ActiveFeatures=guard_opt_out``, or ``Feature=`` in
slurm.conf) is never touched.

Example
-------
>>> line = ("NodeName=gpu-001 Arch=x86_64 CPUAlloc=0 State=IDLE+DRAIN ThreadsPerCore=1 "
...         "Reason=guard: cordoned for sweep [root@2026-12-01T10:16:33]")
>>> n = SlurmNode.parse(line)
>>> n.name, n.base, sorted(n.flags), n.reason
('gpu-001', 'IDLE', ['DRAIN'], 'guard: cordoned for sweep')
>>> n.drained, n.drained_by_guard, n.drained_by_other, n.gpus
(True, True, False, 0)
>>> SlurmNode.parse("NodeName=g2 Gres=gpu:h100:4(S:0),gpu:h100:4(S:1),nvme:1 State=IDLE").gpus
8
>>> admin = SlurmNode.parse("NodeName=gpu-002 State=MIXED+DRAIN Reason=bad dimm [ann@2026-12-01]")
>>> admin.reason, admin.drained, admin.drained_by_other
('bad dimm', False, True)
"""

from __future__ import annotations

import getpass
import logging
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from guard.config import OrchestratorSettings
from guard.schemas import SweepCheck

from .executors import parse_sweep_output
from .scheduler import JOBS_POLL_MAX_S, JobsPollBackoff, SchedulerError

__all__ = [
    "GUARD_REASON_PREFIX",
    "NodeNotOwned",
    "SlurmCli",
    "SlurmNode",
    "SlurmScheduler",
    "SlurmSweepExecutor",
    "SweepJob",
]

log = logging.getLogger(__name__)

GUARD_REASON_PREFIX = "guard:"
_BUSY = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
#: State flags of an IDLE node that is not free to lend (sinfo's idle alone is not enough).
_NOT_FREE = frozenset(
    {"DRAIN", "COMPLETING", "PLANNED", "RESERVED", "MAINT", "FAIL", "NOT_RESPONDING",
     "POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "REBOOT_REQUESTED", "REBOOT_ISSUED"}
)  # fmt: skip
_REASON_STAMP = re.compile(r"\s*\[[^\]]*@[^\]]*\]\s*$")
_GRES_SOCKETS = re.compile(r"\([^)]*\)")
_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,]+)?:(\d+)")


class NodeNotOwned(RuntimeError):
    """The node is drained by someone else (or was resumed by someone else): Guard keeps off."""


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """What ``scontrol show node -o NAME`` says about a node."""

    name: str
    base: str
    flags: frozenset[str]
    reason: str
    #: GPUs the node's ``Gres=`` declares (``gpu:8``, ``gpu:h100:4(S:0),...``): what it has.
    gpus: int = 0
    #: the node's AvailableFeatures and ActiveFeatures
    features: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, line: str) -> SlurmNode:
        head, _, reason = line.partition(" Reason=")
        fields = dict(w.split("=", 1) for w in head.split() if "=" in w)
        state = fields.get("State", "UNKNOWN").upper().split("+")
        gres = _GRES_SOCKETS.sub("", fields.get("Gres", ""))
        return cls(
            name=fields.get("NodeName", ""),
            base=state[0].rstrip("*~#!%$@^-"),
            flags=frozenset(state[1:]),
            reason=_REASON_STAMP.sub("", reason).strip(),
            gpus=sum(int(m.group(1)) for m in _GRES_GPU.finditer(gres)),
            features=frozenset(
                f
                for key in ("AvailableFeatures", "ActiveFeatures")
                for f in fields.get(key, "").split(",")
                if f and f != "(null)"
            ),
        )

    @property
    def drain(self) -> bool:
        return "DRAIN" in self.flags or self.base in ("DRAIN", "DRAINED", "DRAINING")

    @property
    def busy(self) -> bool:
        return self.base in _BUSY or "COMPLETING" in self.flags

    @property
    def idle(self) -> bool:
        """Free to lend to a sweep now: IDLE, nothing running, planned, reserved or held."""
        return self.base == "IDLE" and not self.flags & _NOT_FREE

    @property
    def drained(self) -> bool:
        """Drained and no job left on it."""
        return self.drain and not self.busy

    @property
    def drained_by_guard(self) -> bool:
        return self.drain and self.reason.startswith(GUARD_REASON_PREFIX)

    @property
    def drained_by_other(self) -> bool:
        """Drained, or down, with a Reason that is not Guard's."""
        down = self.base in ("DOWN", "FAIL") or "FAIL" in self.flags
        return (self.drain or down) and not self.reason.startswith(GUARD_REASON_PREFIX)


class SlurmCli:
    """The Slurm commands Guard uses (``scontrol``, ``squeue``, ``srun``), with clear errors."""

    def __init__(
        self,
        scontrol: str = "scontrol",
        squeue: str = "squeue",
        srun: str = "srun",
        timeout_s: float = 30.0,
    ) -> None:
        self.scontrol, self.squeue, self.srun = scontrol, squeue, srun
        self.timeout_s = timeout_s

    def run(self, argv: Sequence[str], timeout_s: float | None = None) -> str:
        try:
            done = subprocess.run(
                list(argv),
                capture_output=True,
                text=True,
                timeout=timeout_s or self.timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SchedulerError(f"{shlex.join(argv)}: {exc}") from exc
        if done.returncode != 0:
            raise SchedulerError(
                f"{shlex.join(argv)} exited {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[:500]}"
            )
        return done.stdout

    def scontrol_run(self, *args: str) -> str:
        return self.run([self.scontrol, *args])

    def node(self, name: str) -> SlurmNode:
        out = self.scontrol_run("show", "node", "-o", name)
        line = next((x for x in out.splitlines() if x.startswith("NodeName=")), "")
        if not line:
            raise SchedulerError(f"scontrol show node {name}: no such node in {out[:200]!r}")
        return SlurmNode.parse(line)

    def nodes(self) -> list[str]:
        return [n.name for n in self.node_states()]

    def node_states(self) -> list[SlurmNode]:
        """Every node, from one ``scontrol show nodes``."""
        out = self.scontrol_run("show", "nodes", "--oneliner")
        return [SlurmNode.parse(x) for x in out.splitlines() if x.startswith("NodeName=")]

    def jobs_on(self, name: str) -> list[str]:
        """Ids of the jobs running (or being set up) on the node."""
        argv = [self.squeue, "-h", "-w", name, "-t", "RUNNING,CONFIGURING,COMPLETING", "-o", "%i"]
        return [j for j in self.run(argv).split() if j]

    def reservation_exists(self, name: str) -> bool:
        try:
            out = self.scontrol_run("show", "reservation", "-o", name)
        except SchedulerError as exc:
            if "not found" in str(exc).lower() or "invalid" in str(exc).lower():
                return False
            raise
        return f"ReservationName={name} " in out


@dataclass(frozen=True, slots=True)
class _Names:
    node_map: Mapping[str, str]

    def slurm(self, node: str) -> str:
        return self.node_map.get(node, node)

    def agent(self, slurm_name: str) -> str:
        back = {v: k for k, v in self.node_map.items()}
        return back.get(slurm_name, slurm_name)


class SlurmScheduler:
    """Drains, owns and resumes Slurm nodes, touching only what Guard drained (see the module).

    ``cordon`` and ``uncordon`` return what they did: ``drained``, ``resumed``, ``foreign``
    (someone else's drain: left alone), ``resumed-by-other`` (a restart found the node back in
    service: not drained again) or ``in-service`` (nothing of Guard's to undo).
    """

    name = "slurm"

    def __init__(
        self,
        cli: SlurmCli | None = None,
        *,
        node_map: Mapping[str, str] | None = None,
        user: str | None = None,
        opt_out_feature: str = "guard_opt_out",
    ) -> None:
        self.cli = cli or SlurmCli()
        self.names = _Names(dict(node_map or {}))
        self.user = user or getpass.getuser()
        self.opt_out_feature = opt_out_feature

    @classmethod
    def from_settings(cls, o: OrchestratorSettings) -> SlurmScheduler:
        cli = SlurmCli(o.slurm_scontrol, o.slurm_squeue, o.slurm_srun)
        return cls(
            cli,
            node_map=o.slurm_node_map,
            user=o.slurm_user,
            opt_out_feature=o.slurm_opt_out_feature,
        )

    @staticmethod
    def reservation_name(slurm_node: str) -> str:
        return f"guard-{slurm_node}"

    def state(self, node: str) -> SlurmNode:
        return self.cli.node(self.names.slurm(node))

    def _drain(self, slurm_node: str, reason: str) -> None:
        # Slurm keeps the reason verbatim; one line keeps `sinfo -R` readable.
        text = f"{GUARD_REASON_PREFIX} " + " ".join(reason.split())
        self.cli.scontrol_run(
            "update", f"NodeName={slurm_node}", "State=DRAIN", f"Reason={text[:250]}"
        )

    def _drop_reservation(self, slurm_node: str) -> None:
        name = self.reservation_name(slurm_node)
        if self.cli.reservation_exists(name):
            self.cli.scontrol_run("delete", f"ReservationName={name}")

    def cordon(self, node: str, reason: str) -> str:
        return self._cordon(node, reason, reassert=False)

    def reassert(self, node: str, reason: str) -> str:
        return self._cordon(node, reason, reassert=True)

    def _cordon(self, node: str, reason: str, reassert: bool) -> str:
        slurm_node = self.names.slurm(node)
        current = self.cli.node(slurm_node)
        ours = self.cli.reservation_exists(self.reservation_name(slurm_node))
        if current.drained_by_other:
            log.warning(
                "%s is drained by someone else (%r): Guard leaves it as it is", node, current.reason
            )
            return "foreign"
        if reassert and not current.drain and not ours:
            log.warning("%s is back in service (resumed by someone else): not drained again", node)
            return "resumed-by-other"
        self._drain(slurm_node, reason)
        if ours:
            try:
                self._drop_reservation(slurm_node)
            except SchedulerError as exc:
                if "in use" not in str(exc):
                    raise
                # a sweep job of Guard's (from before a restart) still runs in it: the drain
                # holds the node; the reservation goes with the next uncordon or cordon
                log.info("%s: reservation kept while a sweep job runs in it", node)
        return "drained"

    def uncordon(self, node: str) -> str:
        slurm_node = self.names.slurm(node)
        current = self.cli.node(slurm_node)
        if current.drained_by_other:
            self._drop_reservation(slurm_node)  # ours; the drain is not
            log.warning("%s was drained by someone else (%r): left drained", node, current.reason)
            return "foreign"
        if current.drained_by_guard:
            self.cli.scontrol_run("update", f"NodeName={slurm_node}", "State=RESUME")
            self._drop_reservation(slurm_node)
            return "resumed"
        had = self.cli.reservation_exists(self.reservation_name(slurm_node))
        self._drop_reservation(slurm_node)
        return "resumed" if had else "in-service"

    def jobs_on(self, node: str) -> list[str]:
        return self.cli.jobs_on(self.names.slurm(node))

    # --- the operator's word -------------------------------------------------------------------

    def opted_out(self, node: str) -> str | None:
        if self.opt_out_feature in self.state(node).features:
            return f"Slurm feature {self.opt_out_feature}"
        return None

    def overridden(self, node: str) -> str | None:
        """A note when a node Guard holds is in service again and Guard did not put it there
        (no drain, no reservation of Guard's): someone resumed it."""
        slurm_node = self.names.slurm(node)
        current = self.cli.node(slurm_node)
        if current.drain or current.drained_by_other:
            return None
        if self.cli.reservation_exists(self.reservation_name(slurm_node)):
            return None  # Guard's own sweep window: resumed by Guard inside its reservation
        seen = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        flags = "".join(f"+{f}" for f in sorted(current.flags - {"NOT_RESPONDING"}))
        return (
            f"resumed: State={current.base}{flags}, seen by Guard at {seen}; Slurm clears the "
            "Reason on a resume and does not say who"
        )

    def lift(self, node: str) -> None:
        """Drop Guard's reservation; the node's State stays as the operator left it."""
        self._drop_reservation(self.names.slurm(node))

    def isolate(self, node: str, policy: str) -> list[str]:
        """The jobs on the node; ``requeue`` also requeues each (the drained node is excluded
        when they start again)."""
        jobs = self.jobs_on(node)
        if policy == "requeue":
            for job in jobs:
                self.cli.scontrol_run("requeue", job)
            for job in jobs:
                self._eligible_now(job)
        return jobs

    def _eligible_now(self, job: str, wait_s: float = 10.0) -> None:
        """Slurm holds a requeued job ~2 minutes (EligibleTime); restart it at once instead,
        as soon as it is pending again (the drained node is excluded)."""
        deadline, out = time.monotonic() + wait_s, ""
        while time.monotonic() < deadline:
            out = self.cli.run([self.cli.squeue, "-h", "-j", job, "-o", "%T"]).strip()
            if out != "COMPLETING" and out:
                break
            time.sleep(0.2)
        if out == "PENDING":
            self.cli.scontrol_run("update", f"JobId={job}", "StartTime=now")

    def idle_peers(self, candidates: Sequence[str], want: int) -> list[str]:
        """Up to ``want`` of ``candidates`` (in their order) that are idle now (IDLE, not
        drained, reserved or planned for a job): a multi-node sweep takes those first, so
        that no job is drained for it while an idle node would do."""
        idle = {self.names.agent(n.name) for n in self.cli.node_states() if n.idle}
        return [c for c in candidates if c in idle][:want]

    def inventory(self) -> list[str] | None:
        try:
            return [self.names.agent(n) for n in self.cli.nodes()] or None
        except SchedulerError as exc:
            log.warning("cannot list Slurm nodes: %s", exc)
            return None

    def hold_for_sweep(self, node: str, drain_timeout_s: float, poll_s: float = 1.0) -> str:
        """Wait until Guard's drain has emptied the node, then reserve it for Guard's user and
        resume it; returns the reservation to run the sweep in.

        Raises :class:`NodeNotOwned` when someone else drained (or resumed) the node meanwhile,
        or Guard sent it to repair (an abandoned sweep), and :class:`TimeoutError` naming the
        jobs still there after ``drain_timeout_s``.
        """
        slurm_node = self.names.slurm(node)
        deadline = time.monotonic() + drain_timeout_s
        backoff = JobsPollBackoff(poll_s, JOBS_POLL_MAX_S, deadline)
        while True:
            current = self.cli.node(slurm_node)
            if not current.drained_by_guard or "sent to repair" in current.reason:
                raise NodeNotOwned(
                    f"{node} is not Guard's to sweep (State={current.base}"
                    f"{'+' if current.flags else ''}{'+'.join(sorted(current.flags))}, "
                    f"Reason={current.reason!r}): Guard does not sweep it"
                )
            if current.drained and not self.cli.jobs_on(slurm_node):
                break
            if time.monotonic() > deadline:
                jobs = ", ".join(self.cli.jobs_on(slurm_node)) or "none listed"
                raise TimeoutError(
                    f"{node} still runs jobs ({jobs}) {drain_timeout_s:g} s after the drain"
                )
            backoff.sleep()
        reservation = self.reservation_name(slurm_node)
        if not self.cli.reservation_exists(reservation):
            self.cli.scontrol_run(
                "create",
                f"ReservationName={reservation}",
                "Flags=MAINT,IGNORE_JOBS",
                f"Users={self.user}",
                f"Nodes={slurm_node}",
                "StartTime=now",
                "Duration=UNLIMITED",
            )
        self.cli.scontrol_run("update", f"NodeName={slurm_node}", "State=RESUME")
        return reservation


@dataclass(frozen=True, slots=True)
class SweepJob:
    """What a scheduler-run sweep executes and how long it may wait (slurm and kubernetes)."""

    command: str = "guard sweep run --json --node {node}"
    drain_timeout_s: float = 3600.0
    sweep_timeout_s: float = 1800.0
    #: The first wait between two questions about the jobs on a node (then doubling up to
    #: :data:`JOBS_POLL_MAX_S`) and between two looks at the sweep job.
    poll_s: float = 1.0

    @classmethod
    def from_settings(cls, o: OrchestratorSettings, poll_s: float = 1.0) -> SweepJob:
        return cls(o.sweep_command, o.drain_timeout_s, o.sweep_timeout_s, poll_s)

    def jobs_backoff(self, deadline: float) -> JobsPollBackoff:
        """The waits while the jobs on a node (or a peer) drain, until ``deadline``."""
        return JobsPollBackoff(self.poll_s, JOBS_POLL_MAX_S, deadline)


class SlurmSweepExecutor:
    """Runs ``command`` (``{node}`` substituted; default ``guard sweep run --json --node {node}``)
    as a Slurm job on the node, inside Guard's reservation, and returns the checks of the one
    ``sweep`` message it prints. The node must be drained by Guard (the orchestrator cordons
    first); see the module docstring."""

    sweep_kinds: tuple[str, ...] = ("single", "multi")  # multi: guard.sweeps.multinode

    def __init__(
        self, scheduler: SlurmScheduler, job: SweepJob | None = None, rendezvous_port: int = 29500
    ) -> None:
        self.scheduler = scheduler
        self.job = job or SweepJob()
        self.rendezvous_port = rendezvous_port
        self.peers_lock = threading.Lock()  # multinode.return_stranded_peers runs once
        self.stranded_peers_checked = False

    @property
    def drain_wait_s(self) -> float:
        """How long ``run`` may wait before the sweep starts (the orchestrator allows it)."""
        return self.job.drain_timeout_s

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]:
        if sweep == "multi":
            from .multinode import run_slurm_multi

            return run_slurm_multi(self, node, peers)
        try:
            reservation = self.scheduler.hold_for_sweep(
                node, self.job.drain_timeout_s, self.job.poll_s
            )
        except TimeoutError as exc:
            return [SweepCheck(name="slurm_drain_timeout", passed=False, detail=str(exc))]
        except NodeNotOwned as exc:
            return [SweepCheck(name="slurm_node_not_owned", passed=False, detail=str(exc))]
        slurm_node = self.scheduler.names.slurm(node)
        try:
            gpus = self.scheduler.state(node).gpus  # what the node has, from the inventory
        except SchedulerError as exc:
            return [SweepCheck(name="slurm_inventory", passed=False, detail=str(exc))]
        argv = self.srun_argv(node, slurm_node, reservation, gpus)

        started = time.monotonic()
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.job.sweep_timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [SweepCheck(name="sweep_job", passed=False, detail=f"{shlex.join(argv)}: {exc}")]
        log.info("sweep job on %s took %.1f s", node, time.monotonic() - started)
        return parse_sweep_output(
            node, argv, done.returncode, done.stdout, done.stderr, expected_gpus=gpus
        )

    def srun_argv(self, node: str, slurm_node: str, reservation: str, gpus: int) -> list[str]:
        """The sweep job: the whole node (``--exclusive``) and all its GPUs, in Guard's
        reservation, told how many GPUs to expect."""
        minutes = max(1, int(self.job.sweep_timeout_s // 60))
        return [
            self.scheduler.cli.srun,
            f"--reservation={reservation}",
            f"--nodelist={slurm_node}",
            "--nodes=1",
            "--ntasks=1",
            "--exclusive",
            *([f"--gres=gpu:{gpus}"] if gpus else []),
            f"--export=ALL,GUARD_SWEEP_EXPECTED_GPUS={gpus}",
            "--job-name=guard-sweep",
            f"--time={minutes}",
            *shlex.split(self.job.command.format(node=node, slurm_node=slurm_node)),
        ]
