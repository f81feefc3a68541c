"""Sweep executors: run a single-node or multi-node sweep and return its checks.

An executor is anything with ``sweep_kinds`` (the sweeps it can run, ``single`` and/or
``multi``) and ``run(node, sweep, peers, now) -> list[SweepCheck]``. It may block for as
long as the sweep takes: the orchestrator calls it from a worker thread.

- :class:`SimulatedSweepExecutor` (the demo's) answers from the simulator's ground truth (``guard
  simulate --truth``): a node with an active fault fails the checks that fault would fail
  on real hardware; a healthy node passes with realistic noise. For ``guard demo``.
- :class:`SshExecutor` runs ``guard sweep run --json`` on the node over ssh and parses its
  one ``sweep`` line (:func:`parse_sweep_output`, shared with the Slurm executor).
- :class:`CommandExecutor` runs a site's own check commands and parses a number from
  their output (``{node}``, ``{peers}``, ``{peer}`` are substituted into the command, so
  ``srun -w {node} ...`` or ``ssh {node} ...`` run a check on the node itself).

There is no default executor: without one (``orchestrator.executor = "none"``) the
orchestrator keeps flagged nodes cordoned and says what to configure. The simulated
executor is for ``guard demo`` and the simulated cluster only.

Example
-------
>>> ex = SimulatedSweepExecutor([SimulatedFault("n1", "thermal_throttle", onset=0.0, gpu=3,
...                                             slowdown=0.12)], gpus_per_node=8)
>>> failed = [c.name for c in ex.run("n1", "single", [], now=10.0) if not c.passed]
>>> failed
['gemm_tflops_gpu3', 'gpu_temp_max_c', 'sm_clock_min_mhz']
>>> all(c.passed for c in ex.run("n2", "single", [], now=10.0))
True
>>> slow_nic = SimulatedFault("n3", "degraded_nic", onset=0.0, device="mlx5_5", slowdown=0.3)
>>> ex = SimulatedSweepExecutor([slow_nic])
>>> [c.name for c in ex.run("n3", "multi", ["n4"], now=10.0) if not c.passed]
['nccl_allreduce_busbw_gbps', 'ib_write_bw_min_gbps']
"""

from __future__ import annotations

import random
import re
import shlex
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from guard.config import ConfigError, Settings
from guard.schemas import SchemaError, SweepCheck, SweepResult, decode, stable_id
from guard.schemas.truth import Fault, Truth, ramped_slowdown

from .checks.base import COVERAGE_CHECK

__all__ = [
    "NO_EXECUTOR_HINT",
    "CheckCommand",
    "CommandExecutor",
    "SimulatedFault",
    "SimulatedSweepExecutor",
    "SshExecutor",
    "SweepExecutor",
    "UndrainedPeers",
    "make_executor",
    "parse_sweep_output",
    "peer_checks",
    "sweep_lines",
]


class SweepExecutor(Protocol):
    sweep_kinds: tuple[str, ...]

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]: ...


# --- simulated ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimulatedFault:
    """One fault of the simulator's truth file (``faults[]``; see docs/simulator-truth.md)."""

    node: str
    kind: str
    onset: float
    end: float | None = None
    slowdown: float = 0.0
    gpu: int | None = None
    device: str | None = None
    id: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def active(self, now: float) -> bool:
        return self.onset <= now and (self.end is None or now < self.end)

    def slowdown_at(self, now: float) -> float:
        """The slowdown at ``now``: a ``degrading`` fault ramps up over ``detail.ramp_s``."""
        ramp = self.detail.get("ramp_s")
        return float(ramped_slowdown(self.slowdown, self.onset, float(ramp) if ramp else None, now))

    @classmethod
    def from_truth(cls, fault: Fault) -> SimulatedFault:
        return cls(**fault.model_dump(include=_SIMULATED_FIELDS))


_SIMULATED_FIELDS = {"node", "kind", "onset", "end", "slowdown", "gpu", "device", "id", "detail"}

GPU_FAULTS = frozenset({"thermal_throttle", "power_cap", "power_brake", "slow_gpu"})
NIC_FAULTS = frozenset({"degraded_nic", "nic_reduced_speed", "link_flap"})


class SimulatedSweepExecutor:
    """Sweep checks consistent with the simulator's injected faults (H100-class baselines).

    Single-node sweep: GEMM TFLOPS per GPU, hottest GPU under load, slowest SM clock and
    lowest enforced power limit under load, Xid and uncorrectable ECC counts, NIC link
    speed, symbol errors and link-down events during a loopback test. Multi-node sweep
    (with the peers): NCCL all-reduce bus bandwidth and the worst ``ib_write_bw`` to a peer.
    Thresholds: GEMM and clocks >= 97 % of baseline, temperature <= 85 C, bandwidths
    >= 90 % of baseline, error counts zero.
    """

    sweep_kinds: tuple[str, ...] = ("single", "multi")

    GEMM_TFLOPS = 700.0
    TEMP_C = 72.0
    TEMP_LIMIT_C = 85.0
    SM_CLOCK_MHZ = 1980.0
    POWER_LIMIT_W = 700.0
    LINK_GBPS = 400.0
    BUSBW_GBPS = 360.0
    IB_WRITE_GBPS = 390.0

    def __init__(
        self,
        faults: Iterable[SimulatedFault],
        gpus_per_node: int = 8,
        nics_per_node: int = 8,
        seed: int = 0,
        duration_s: float = 0.0,
    ) -> None:
        self.faults = list(faults)
        self.gpus_per_node = gpus_per_node
        self.nics_per_node = nics_per_node
        self.seed = seed
        self.duration_s = duration_s

    @classmethod
    def from_truth(
        cls, truth: Truth | str | Path, duration_s: float = 0.0
    ) -> SimulatedSweepExecutor:
        """From the simulator's truth (the model, or the path of TRUTH.json)."""
        if not isinstance(truth, Truth):
            truth = Truth.load(truth)
        return cls(
            [SimulatedFault.from_truth(f) for f in truth.faults],
            gpus_per_node=truth.gpus_per_node,
            seed=truth.seed,
            duration_s=duration_s,
        )

    def active_faults(self, node: str, now: float) -> list[SimulatedFault]:
        return [f for f in self.faults if f.node == node and f.active(now)]

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]:
        if self.duration_s > 0:
            time.sleep(self.duration_s)
        rng = random.Random(stable_id(self.seed, node, sweep, *peers, round(now, 3)))
        if sweep == "single":
            return self._single(node, now, rng)
        return self._multi(node, list(peers), now, rng)

    def _single(self, node: str, now: float, rng: random.Random) -> list[SweepCheck]:
        faults = self.active_faults(node, now)
        checks: list[SweepCheck] = []
        temps, clocks, limits = [], [], []
        for gpu in range(self.gpus_per_node):
            gemm = self.GEMM_TFLOPS * (1 + rng.gauss(0, 0.004))
            temp = self.TEMP_C + rng.gauss(0, 1.5)
            clock = self.SM_CLOCK_MHZ * (1 + rng.gauss(0, 0.002))
            limit = self.POWER_LIMIT_W
            for f in faults:
                if f.kind not in GPU_FAULTS or f.gpu not in (None, gpu):
                    continue
                # The simulator's physics: compute takes (1 + slowdown) x as long.
                factor = 1 / (1 + f.slowdown_at(now))
                gemm *= factor
                if f.kind == "thermal_throttle":
                    # A sweep loads the GPU for minutes: an intermittent throttler throttles.
                    hot = float(f.detail.get("temp_c", self.TEMP_LIMIT_C + 5))
                    temp = hot + rng.gauss(0, 0.5)
                    clock *= factor
                elif f.kind == "power_cap":
                    limit = float(f.detail.get("power_limit_w", self.POWER_LIMIT_W * 0.7))
                    clock *= factor
                elif f.kind == "power_brake":
                    clock *= factor
            checks.append(
                _check(f"gemm_tflops_gpu{gpu}", gemm, "TFLOPS", self.GEMM_TFLOPS, low=0.97)
            )
            temps.append((temp, gpu))
            clocks.append((clock, gpu))
            limits.append((limit, gpu))
        temp, gpu = max(temps)
        checks.append(
            SweepCheck(
                name="gpu_temp_max_c",
                value=round(temp, 1),
                unit="C",
                baseline=self.TEMP_C,
                passed=temp <= self.TEMP_LIMIT_C,
                detail=f"hottest gpu{gpu}; limit {self.TEMP_LIMIT_C:g} C",
            )
        )
        clock, gpu = min(clocks)
        checks.append(
            _check("sm_clock_min_mhz", clock, "MHz", self.SM_CLOCK_MHZ, 0.97, f"slowest gpu{gpu}")
        )
        limit, gpu = min(limits)
        checks.append(
            _check("power_limit_min_w", limit, "W", self.POWER_LIMIT_W, 0.95, f"lowest gpu{gpu}")
        )
        for name, kind in (("xid_errors", "xid"), ("ecc_dbe_errors", "ecc_dbe")):
            hits = [f for f in faults if f.kind == kind]
            detail = ", ".join(
                f"gpu{f.gpu}" + (f" xid {f.detail['xid']}" if "xid" in f.detail else "")
                for f in hits
            )
            checks.append(_count(name, len(hits), detail))
        checks += self._nic_single(faults, rng)
        return checks

    def _nic_single(self, faults: list[SimulatedFault], rng: random.Random) -> list[SweepCheck]:
        speed, slow_dev = self.LINK_GBPS, ""
        symbol_errors, downed = 0, 0
        bad_devs, flap_devs = [], []
        for f in faults:
            dev = f.device or "mlx5_0"
            if f.kind == "nic_reduced_speed":
                reduced = float(f.detail.get("speed_gbps", self.LINK_GBPS / (1 + f.slowdown)))
                if reduced < speed:
                    speed, slow_dev = reduced, dev
            elif f.kind == "degraded_nic":
                symbol_errors += 50 + int(rng.random() * 500)
                bad_devs.append(dev)
            elif f.kind == "link_flap":
                downed += 1 + int(rng.random() * 3)
                flap_devs.append(dev)
        return [
            SweepCheck(
                name="nic_link_speed_min_gbps",
                value=speed,
                unit="Gb/s",
                baseline=self.LINK_GBPS,
                passed=speed >= self.LINK_GBPS,
                detail=f"{slow_dev} below its rated speed" if slow_dev else "all ports at rate",
            ),
            _count("nic_symbol_errors", symbol_errors, ", ".join(bad_devs)),
            _count("nic_link_downed", downed, ", ".join(flap_devs)),
        ]

    def _multi(
        self, node: str, peers: list[str], now: float, rng: random.Random
    ) -> list[SweepCheck]:
        # A collective runs at the pace of its slowest member: every participant's faults count.
        factor = 1.0
        worst = ""
        for member in [node, *peers]:
            for f in self.active_faults(member, now):
                if f.kind in NIC_FAULTS and 1 / (1 + f.slowdown) < factor:
                    # Connections through the NIC take (1 + slowdown) x as long.
                    factor, worst = 1 / (1 + f.slowdown), f"{member} {f.device or 'mlx5_0'}"
        busbw = self.BUSBW_GBPS * factor * (1 + rng.gauss(0, 0.01))
        ib = self.IB_WRITE_GBPS * factor * (1 + rng.gauss(0, 0.005))
        with_peers = f"with {', '.join(peers)}" if peers else "no peers"
        detail = f"{with_peers}; slowest {worst}" if worst else with_peers
        return [
            _check("nccl_allreduce_busbw_gbps", busbw, "GB/s", self.BUSBW_GBPS, 0.9, detail),
            _check("ib_write_bw_min_gbps", ib, "Gb/s", self.IB_WRITE_GBPS, 0.9, detail),
        ]


def _check(
    name: str, value: float, unit: str, baseline: float, low: float, detail: str = ""
) -> SweepCheck:
    passed = value >= low * baseline
    text = f"{value / baseline:.1%} of baseline (>= {low:.0%} passes)"
    return SweepCheck(
        name=name,
        value=round(value, 2),
        unit=unit,
        baseline=baseline,
        passed=passed,
        detail=f"{detail}; {text}" if detail else text,
    )


def _count(name: str, count: int, detail: str) -> SweepCheck:
    return SweepCheck(
        name=name, value=float(count), unit="count", baseline=0.0, passed=count == 0, detail=detail
    )


# --- local subprocess -----------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class CheckCommand(BaseModel):
    """One real check: a command whose output holds the measured number.

    ``min`` / ``max`` bound the value for a pass (either or both); ``pattern`` is a regular
    expression whose first group (or whole match) is the number, by default the last number
    printed. A non-zero exit, a timeout or no number is a failed check.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    command: str | list[str]
    sweep: Literal["single", "multi"] = "single"
    unit: str = ""
    baseline: float | None = None
    min: float | None = None
    max: float | None = None
    pattern: str | None = None
    timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _has_bound(self) -> CheckCommand:
        if self.min is None and self.max is None:
            raise ValueError(f"check {self.name!r} needs a min or a max to pass or fail")
        if self.pattern is not None:
            re.compile(self.pattern)
        return self

    def argv(self, node: str, peers: Sequence[str]) -> list[str]:
        values = {"node": node, "peers": ",".join(peers), "peer": peers[0] if peers else ""}
        parts = shlex.split(self.command) if isinstance(self.command, str) else self.command
        return [part.format(**values) for part in parts]

    def parse(self, output: str) -> float | None:
        if self.pattern is not None:
            match = re.search(self.pattern, output)
            if match is None:
                return None
            text = match.group(1) if match.groups() else match.group(0)
            try:
                return float(text)
            except ValueError:
                return None
        numbers = _NUMBER.findall(output)
        return float(numbers[-1]) if numbers else None


class UndrainedPeers:
    """Multi-node sweeps for the executors that cannot drain a peer (ssh, commands).

    They cannot take a peer out of the pool or wait for its jobs to end, so a multi-node sweep
    would share the peers with whatever runs there (and disturb it). They run none unless the
    site says its nodes run nothing but Guard's sweeps (``orchestrator.<executor>_multi_node``):
    a network flag then fails as untested (:attr:`single_only_why` says why, on the node's
    state), which keeps the node out; a multi-node sweep asked for anyway is a failed check.
    """

    #: The executor's name in ``orchestrator.executor``.
    executor_name: ClassVar[str]
    sweep_kinds: tuple[str, ...]

    def runnable(self, kinds: Iterable[str], multi_node: bool) -> tuple[str, ...]:
        """``kinds`` without ``multi`` unless the site allowed peers borrowed as they are."""
        return tuple(k for k in kinds if k != "multi" or multi_node)

    @property
    def single_only_why(self) -> str:
        """Why a network flag stays untested under this executor (on the node's state)."""
        name = self.executor_name
        return (
            f"the {name} executor cannot take peers out of the pool or wait for their jobs: use "
            f"the slurm or kubernetes executor, or set orchestrator.{name}_multi_node where the "
            "nodes run nothing but Guard's sweeps"
        )

    def refused_multi(self) -> list[SweepCheck]:
        """The verdict of a multi-node sweep this executor will not run: untested."""
        detail = f"untested: {self.single_only_why}"
        return [SweepCheck(name=f"{self.executor_name}_multi_node", passed=False, detail=detail)]


class CommandExecutor(UndrainedPeers):
    """Runs each configured check command (``orchestrator.sweep_checks``) and judges the
    number it prints; a site's own checks, on the node through ``srun -w {node}`` or ssh.

    The ``multi`` checks (``{peers}``, ``{peer}``) run only with ``multi_node=True``
    (``orchestrator.commands_multi_node``): the peers are not drained for them
    (:class:`UndrainedPeers`)."""

    executor_name = "commands"

    def __init__(
        self, checks: Iterable[CheckCommand | dict[str, Any]], multi_node: bool = False
    ) -> None:
        self.checks = [c if isinstance(c, CheckCommand) else CheckCommand(**c) for c in checks]
        if not self.checks:
            raise ValueError(
                "the commands executor needs at least one check in orchestrator.sweep_checks"
            )
        configured = [k for k in ("single", "multi") if self._of(k)]
        self.sweep_kinds = self.runnable(configured, multi_node)

    @property
    def single_only_why(self) -> str:
        if not self._of("multi"):
            return 'the commands executor has no check with sweep = "multi" in sweep_checks'
        return super().single_only_why

    def _of(self, sweep: str) -> list[CheckCommand]:
        return [c for c in self.checks if c.sweep == sweep]

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]:
        if sweep == "multi" and sweep not in self.sweep_kinds:
            return self.refused_multi()
        return [self._run_one(check, node, peers) for check in self._of(sweep)]

    def _run_one(self, check: CheckCommand, node: str, peers: Sequence[str]) -> SweepCheck:
        def failed(detail: str, value: float | None = None) -> SweepCheck:
            return SweepCheck(
                name=check.name,
                value=value,
                unit=check.unit,
                baseline=check.baseline,
                passed=False,
                detail=detail[:4000],
            )

        argv = check.argv(node, peers)
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=check.timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return failed(f"timed out after {check.timeout_s:g} s: {shlex.join(argv)}")
        except OSError as exc:
            return failed(f"could not run {shlex.join(argv)}: {exc}")
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-500:]
            return failed(f"exited {done.returncode}: {tail}")
        value = check.parse(done.stdout)
        if value is None:
            return failed(f"no number in the output: {done.stdout.strip()[-300:]!r}")
        bounds = []
        if check.min is not None:
            bounds.append(f">= {check.min:g}")
        if check.max is not None:
            bounds.append(f"<= {check.max:g}")
        passed = (check.min is None or value >= check.min) and (
            check.max is None or value <= check.max
        )
        return SweepCheck(
            name=check.name,
            value=value,
            unit=check.unit,
            baseline=check.baseline,
            passed=passed,
            detail=f"passes when {' and '.join(bounds)}",
        )


# --- ssh: `guard sweep run --json` on the node ------------------------------------------------


def parse_sweep_output(
    node: str,
    argv: Sequence[str],
    returncode: int,
    stdout: str,
    stderr: str,
    expected_gpus: int | None = None,
) -> list[SweepCheck]:
    """The checks of the one ``sweep`` JSON line ``guard sweep run --json`` printed on ``node``.

    Anything else — no line, a line for another node, an exit status other than 0 (passed)
    or 1 (a check failed) — is a failed check that says what happened, so that nothing passes
    untested. Shared by the executors that run the command remotely (ssh, Slurm, Kubernetes).

    What the verdict covers is checked too: the line must carry its ``sweep_coverage`` check,
    and where the scheduler says how many GPUs the node has (``expected_gpus``), the sweep must
    have been judged against that many and seen that many (a GPU node judged on CPU checks,
    or by a sweep that was told another count, does not pass).
    """
    lines = sweep_lines(stdout)
    # a multi-node job prints one line per node: the node's own is the verdict
    result = next((r for r in reversed(lines) if r.node == node), lines[-1] if lines else None)
    command = shlex.join(argv)
    tail = (stderr or stdout).strip()[-500:]
    if result is None:
        why = f"{command} exited {returncode} without a sweep line"
        if returncode == 255 and argv and Path(argv[0]).name == "ssh":
            why = f"ssh could not run the sweep on {node} (exit 255)"
        return [SweepCheck(name="sweep_error", passed=False, detail=f"{why}: {tail}"[:4000])]
    checks = list(result.checks)
    if result.node != node:
        checks.append(
            SweepCheck(
                name="sweep_node_mismatch",
                passed=False,
                detail=f"the sweep line is for {result.node}, not {node}: is the host name "
                f"the node name? ({command})",
            )
        )
    if returncode not in (0, 1) or not checks:
        checks.append(
            SweepCheck(name="sweep_error", passed=False, detail=f"exited {returncode}: {tail}")
        )
    checks += _coverage_problems(result, expected_gpus, command)
    return checks


def sweep_lines(stdout: str) -> list[SweepResult]:
    """Every ``sweep`` message in ``stdout``, one per line, in order (other lines skipped)."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                decoded = decode(line, "sweep")
            except SchemaError:
                continue
            if isinstance(decoded, SweepResult):
                out.append(decoded)
    return out


def peer_checks(peer: str, code: int, stdout: str, stderr: str = "") -> list[SweepCheck]:
    """What a multi-node sweep's peer adds to the node's verdict: ``peer_sweep_error`` when it
    printed no ``sweep`` line of its own, ``peer_busy`` (untested) when its GPUs were busy with
    other processes at the start (the all-reduce measured the sharing, not the link)."""
    mine = [r for r in sweep_lines(stdout) if r.node == peer]
    if not mine:
        tail = (stderr or stdout).strip()[-300:]
        return [
            SweepCheck(
                name="peer_sweep_error",
                passed=False,
                detail=f"peer {peer} printed no sweep line (exit {code}): {tail}",
            )
        ]
    busy = [c for c in mine[-1].checks if c.name == "gpu_processes" and not c.passed]
    return [
        SweepCheck(name="peer_busy", passed=False, detail=f"peer {peer}: {c.detail}") for c in busy
    ]


def _coverage_problems(
    result: SweepResult, expected_gpus: int | None, command: str
) -> list[SweepCheck]:
    """Failed checks for a verdict that does not cover what the node should have."""
    covered = next((c for c in result.checks if c.name == COVERAGE_CHECK), None)
    if covered is None:
        return [
            SweepCheck(
                name="sweep_uncovered",
                passed=False,
                detail=f"untested: the sweep line does not say what it covered (no "
                f"{COVERAGE_CHECK} check): is the node's guard older than the orchestrator? "
                f"({command})",
            )
        ]
    if expected_gpus is None:
        return []
    problems = []
    if covered.baseline is None or int(covered.baseline) != expected_gpus:
        told = "no count" if covered.baseline is None else f"{covered.baseline:g}"
        problems.append(f"the sweep was judged against {told} expected GPUs")
    if covered.value is None or int(covered.value) != expected_gpus:
        seen = "none" if covered.value is None else f"{covered.value:g}"
        problems.append(f"it saw {seen}")
    if not problems:
        return []
    return [
        SweepCheck(
            name="sweep_gpus_expected",
            value=covered.value,
            unit="gpus",
            baseline=float(expected_gpus),
            passed=False,
            detail=f"the scheduler says {result.node} has {expected_gpus} GPUs; "
            + ", ".join(problems),
        )
    ]


class SshExecutor(UndrainedPeers):
    """Runs ``guard sweep run --json`` on the node over ssh (bare metal without a scheduler).

    Single-node sweeps only, by default (:class:`UndrainedPeers`). ``multi_node=True``
    (``orchestrator.ssh_multi_node``) is for nodes that run nothing but what Guard starts on
    them: a multi-node sweep then starts the command on the node (rank 0, the all-reduce's
    rendezvous) and on every peer at once, borrowed as they are; the node's line is the
    result, and a peer that fails or had other compute processes on its GPUs (``peer_busy``)
    adds a failed check naming it.
    """

    executor_name = "ssh"

    def __init__(
        self,
        ssh: Sequence[str] = ("ssh", "-o", "BatchMode=yes"),
        guard: str = "guard",
        checks: Sequence[str] = (),
        timeout_s: float = 1800.0,
        rendezvous_port: int = 29500,
        multi_node: bool = False,
    ) -> None:
        self.ssh, self.guard, self.checks = list(ssh), guard, list(checks)
        self.timeout_s, self.rendezvous_port = timeout_s, rendezvous_port
        self.sweep_kinds = self.runnable(("single", "multi"), multi_node)

    def command(self, node: str, sweep: str, peers: Sequence[str], rank: int = 0) -> list[str]:
        remote = [self.guard, "sweep", "run", "--json", "--node", node]
        if sweep == "multi":
            members = [p for p in peers if p != node]
            remote += ["--sweep", "multi", "--peers", ",".join(members), "--node-rank", str(rank)]
            remote += ["--rendezvous", f"{peers[0] if rank else node}:{self.rendezvous_port}"]
        elif self.checks:
            remote += ["--checks", ",".join(self.checks)]
        return [*self.ssh, node, shlex.join(remote)]

    def run(self, node: str, sweep: str, peers: Sequence[str], now: float) -> list[SweepCheck]:
        if sweep == "single":
            return self._one(node, self.command(node, "single", []))
        if "multi" not in self.sweep_kinds:
            return self.refused_multi()
        members = [node, *peers]
        argvs = [
            self.command(m, "multi", [node, *[p for p in members if p != m]], rank)
            for rank, m in enumerate(members)
        ]
        procs = [self._start(a) for a in argvs]
        outputs = [self._wait(p) for p in procs]
        checks = parse_sweep_output(node, argvs[0], *outputs[0])
        for member, argv, (code, out, err) in zip(members[1:], argvs[1:], outputs[1:], strict=True):
            if code not in (0, 1):
                failed = parse_sweep_output(member, argv, code, out, err)
                for check in failed:
                    if not check.passed:
                        checks.append(check.model_copy(update={"name": f"peer_{check.name}"}))
            else:
                checks += peer_checks(member, code, out, err)
        return checks

    def _one(self, node: str, argv: list[str]) -> list[SweepCheck]:
        return parse_sweep_output(node, argv, *self._wait(self._start(argv)))

    @staticmethod
    def _start(argv: list[str]) -> subprocess.Popen[str] | OSError:
        try:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            return exc

    def _wait(self, proc: subprocess.Popen[str] | OSError) -> tuple[int, str, str]:
        if isinstance(proc, OSError):
            return 127, "", f"could not start it: {proc}"
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return 124, out, f"timed out after {self.timeout_s:g} s; {err}"
        return proc.returncode, out, err


#: What the orchestrator logs and writes on node states when no executor is configured.
NO_EXECUTOR_HINT = (
    "no sweep executor configured: set orchestrator.executor (GUARD_ORCHESTRATOR_EXECUTOR) "
    "to slurm (a Slurm job on the node), kubernetes (a Job pinned to the node), ssh (guard "
    "sweep run on the node over ssh) or commands (orchestrator.sweep_checks); "
    "the node stays cordoned until then"
)


def make_executor(settings: Settings) -> SweepExecutor | None:
    """The executor ``settings.orchestrator.executor`` names; None for ``none``."""
    o = settings.orchestrator
    if o.executor == "simulated":
        if not o.simulated_truth:
            raise ValueError(
                "the simulated executor needs the simulator's truth file: set "
                "orchestrator.simulated_truth (GUARD_ORCHESTRATOR_SIMULATED_TRUTH) or --truth"
            )
        return SimulatedSweepExecutor.from_truth(o.simulated_truth)
    if o.executor == "slurm":
        from .slurm import SlurmScheduler, SlurmSweepExecutor, SweepJob

        return SlurmSweepExecutor(
            SlurmScheduler.from_settings(o), SweepJob.from_settings(o), o.rendezvous_port
        )
    if o.executor == "kubernetes":
        from .kubernetes import KubernetesScheduler, KubernetesSweepExecutor
        from .slurm import SweepJob

        if not o.kube_sweep_image:
            raise ConfigError(
                "the kubernetes executor runs the sweep in a Job: set orchestrator."
                "kube_sweep_image (GUARD_ORCHESTRATOR_KUBE_SWEEP_IMAGE) to an image with Guard"
            )
        return KubernetesSweepExecutor(
            KubernetesScheduler.from_settings(o),
            o.kube_sweep_image,
            SweepJob.from_settings(o, poll_s=2.0),
            o.rendezvous_port,
        )
    if o.executor == "ssh":
        return SshExecutor(
            o.ssh_command,
            o.remote_guard,
            o.remote_checks,
            o.sweep_timeout_s,
            o.rendezvous_port,
            multi_node=o.ssh_multi_node,
        )
    if o.executor == "commands":
        return CommandExecutor(o.sweep_checks, multi_node=o.commands_multi_node)
    return None
