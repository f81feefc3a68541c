"""Training: each job's synchronous steps, their gradient all-reduce, and remediation.

A rank's compute is the stage's nominal compute x its GPU's speed x ``1 + slowdown`` x
noise; the all-reduce starts when the last rank arrives and lasts as long as the slowest
ring connection. Step and collective messages are built from per-rank templates.

With ``SimConfig.fail_stop`` (the demo sets it), fail-stop faults fail as on a real
cluster: an ``xid`` or ``ecc_dbe`` fault on a node of a job crashes the job. Its ranks hang
in the collective until the NCCL watchdog fires (``SimConfig.watchdog_s``, PyTorch's
default 10 min), or until the node is cordoned (the remediation kills and restarts the
job); the job then restarts from its last checkpoint (``restart_s``; the steps since that
checkpoint are lost, :attr:`TrainingModel.crashes`) and, while the node is still in the
job, crashes again ``recrash_s`` after each restart, until a person drains the node
(``human_drain_s`` after the first crash; recorded as a remediation ``by`` ``"person"``).
No step or collective message is sent while a job is down. A cordon of a node in a running
job restarts it after a checkpoint on demand: no steps are lost.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from guard.schemas import CollectiveTiming, ConnectionStat, StepTiming
from guard.schemas.fast import fast_builder

from .scenario import RunningJob, Scenario

__all__ = ["TrainingModel"]

_GRADIENT_BYTES = 2 * 1024**3
#: Fault kinds that kill the job's processes (a lost GPU, Xid 79; a double-bit ECC error).
FAIL_STOP_KINDS = frozenset({"xid", "ecc_dbe"})
_WORLD_LATENCY_S = 0.004  # a small all-reduce (one scalar per rank) across the whole job
_step_model = fast_builder(StepTiming)
_coll_model = fast_builder(CollectiveTiming)
_conn_model = fast_builder(ConnectionStat)


class TrainingModel:
    """The jobs' synchronous steps and their all-reduce, drawn from ``step_noise``, and the
    remediation hook: :meth:`remediate` queues a node (thread-safe), the node's job applies
    it at its next step and :attr:`remediations` records what was done."""

    def __init__(
        self,
        scenario: Scenario,
        step_noise: np.random.Generator,
        gpu_speed: np.ndarray,
        churn: np.random.Generator | None = None,
    ) -> None:
        self.config = scenario.config
        #: job lifetimes' own stream (SimConfig.job_lifetime_s), never the step noise
        self._churn_rng = churn or np.random.default_rng([scenario.config.seed, 9])
        self.scenario = scenario
        self._step_noise = step_noise
        self._gpu_speed = gpu_speed
        self._lock = threading.Lock()
        self._pending_remediation: list[str] = []
        self.remediations: list[dict[str, Any]] = []
        self._rank_cache: dict[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]] = {}
        #: False while the run is before the emitted window: steps are timed, not built.
        self.build_steps = True
        #: every crash: ``{job, node, fault, ts, hang_s, lost_steps, restart_s}``
        self.crashes: list[dict[str, Any]] = []
        self._checkpoint_step: dict[str, int] = {}  # job -> first step after its last checkpoint
        self._hung: dict[str, float] = {}  # job -> when its watchdog fires
        self._crash_due: dict[tuple[str, str], float] = {}  # (job, fault id) -> next crash
        self._human_drains: list[tuple[float, str]] = []  # (ts, node), in ts order
        self._drained_by_person: set[str] = set()

    def remediate(self, node: str) -> None:
        """Cordon ``node``: at its job's next step a spare takes over its ranks (thread-safe)."""
        if node not in self.scenario.node_names:
            raise ValueError(f"unknown node {node!r}")
        with self._lock:
            self._pending_remediation.append(node)

    def start(self) -> None:
        """Each job's first step starts at a random point of its first nominal step."""
        for job in self.scenario.jobs:
            job.next_start = self.scenario.start_ts + float(
                self._step_noise.uniform(0, job.step_s_nominal)
            )
            if self.config.job_lifetime_s > 0:
                job.names = [job.name]
                job.ends_at = job.next_start + self._lifetime()

    def _lifetime(self) -> float:
        return self.config.job_lifetime_s * float(self._churn_rng.uniform(0.5, 1.5))

    def _churn(self, job: RunningJob) -> bool:
        """A job's end (its nodes go idle ``job_gap_s``) or the start of the next one on
        them (a new name, steps from 0, a warm-up); False while the job just runs."""
        cfg = self.config
        if cfg.job_lifetime_s <= 0 or (job.running and job.next_start < job.ends_at):
            return False
        now = job.next_start
        if job.running:
            job.running = False
            self.scenario.add_confounder(
                "job_end", now, now + cfg.job_gap_s, job=job.name, steps=job.step
            )
            job.next_start = now + cfg.job_gap_s
        else:
            job.running = True
            job.name = f"{job.names[0]}-{len(job.names) + 1}"
            job.names.append(job.name)
            job.step = job.seq = 0
            job.ends_at = now + self._lifetime()
            job.warm_start = now if cfg.warmup_steps > 0 else None
        self.scenario.layout_changed()
        return True

    def _apply_remediation(self, job: RunningJob) -> bool:
        with self._lock:
            pending = [p for p in self._pending_remediation]
        changed = False
        for name in pending:
            node = self.scenario.node_names.index(name)
            ranks = (job.rank_node == node) & job.active
            if not ranks.any():
                continue
            with self._lock:
                self._pending_remediation.remove(name)
            busy = {int(x) for j in self.scenario.jobs for x in j.rank_node[j.active]}
            spare = next((s for s in self.scenario.spares if s not in busy and s != node), None)
            if spare is not None:
                self.scenario.spares.remove(spare)
                job.rank_node[ranks] = spare
            else:
                job.active[ranks] = False
            self.remediations.append(
                {
                    "node": name,
                    "job": job.name,
                    "ts": round(job.next_start, 3),
                    "replaced_by": None if spare is None else self.scenario.node_names[spare],
                    "restart_s": self.config.restart_s,
                    "by": "person" if name in self._drained_by_person else "guard",
                }
            )
            changed = True
            job.layout_version += 1
            self.scenario.layout_changed()
        return changed

    def run_steps(
        self,
        job: RunningJob,
        tick_end: float,
        s: dict[str, np.ndarray],
        out: list[tuple[float, Any]],
    ) -> None:
        self._drain_by_person(tick_end)
        hang_end = self._hung.get(job.name)
        if hang_end is not None and tick_end < hang_end and self._pending_remediation:
            # a cordon kills the hung job now instead of at the watchdog, and restarts it
            saved, job.next_start = job.next_start, tick_end
            if self._apply_remediation(job):
                job.next_start = tick_end + self.config.restart_s
                job.seq = 0
                del self._hung[job.name]
            else:
                job.next_start = saved
        while job.next_start < tick_end and job.next_start < self.scenario.end_ts:
            self._hung.pop(job.name, None)
            if self._churn(job):
                continue
            if self._pending_remediation and self._apply_remediation(job):
                job.next_start += self.config.restart_s  # after a checkpoint on demand
                # ... which saves every step done so far: a later crash rolls back to here
                self._checkpoint_step[job.name] = job.step
                job.seq = 0  # new communicators count from zero
                continue
            if self._crash_if_due(job):
                continue
            end = self._one_step(job, s, out)
            job.next_start = end + 0.002

    def _drain_by_person(self, tick_end: float) -> None:
        """A person drains a crash-looping node ``human_drain_s`` after its first crash
        (unless it has left its job by then)."""
        while self._human_drains and self._human_drains[0][0] <= tick_end:
            _, name = self._human_drains.pop(0)
            node = self.scenario.node_names.index(name)
            if any((j.rank_node[j.active] == node).any() for j in self.scenario.jobs):
                with self._lock:
                    self._drained_by_person.add(name)
                    self._pending_remediation.append(name)

    def _crash_if_due(self, job: RunningJob) -> bool:
        """A fail-stop fault on a node of the job crashes it: hang, then restart."""
        if not self.config.fail_stop:
            return False
        now = job.next_start
        for f in self.scenario.faults:
            if f.kind not in FAIL_STOP_KINDS or not f.active(now):
                continue
            key = (job.name, f.id)
            if self._crash_due.setdefault(key, f.onset) > now:
                continue
            if not (job.rank_node[job.active] == f.node).any():
                continue
            cfg = self.config
            lost = job.step - self._checkpoint_step.get(job.name, 0)
            self._hung[job.name] = now + cfg.watchdog_s
            job.next_start = now + cfg.watchdog_s + cfg.restart_s
            job.seq = 0
            # It resumes from that checkpoint: what it does from the restart on is at risk again.
            self._checkpoint_step[job.name] = job.step
            self._crash_due[key] = job.next_start + cfg.recrash_s
            if not any(c["fault"] == f.id for c in self.crashes):
                node = self.scenario.node_names[f.node]
                self._human_drains.append((now + cfg.human_drain_s, node))
                self._human_drains.sort()
            self.crashes.append(
                {
                    "job": job.name,
                    "node": self.scenario.node_names[f.node],
                    "fault": f.id,
                    "ts": round(now, 3),
                    "hang_s": cfg.watchdog_s,
                    "lost_steps": lost,
                    "restart_s": cfg.restart_s,
                }
            )
            return True
        return False

    def _one_step(
        self, job: RunningJob, s: dict[str, np.ndarray], out: list[tuple[float, Any]]
    ) -> float:
        start = job.next_start
        conn_nominal = 0.25 * job.step_s_nominal
        compute = self._rank_compute(job, s, start)
        arrive = start + compute
        hang, flapped_nodes = self._flap_hang(job, start, arrive, conn_nominal)
        fabric = self.scenario.fabric
        paths = None if fabric is None else fabric.factors(self.scenario.jobs, start)[job.name]
        stage_end, next_peer, prev_peer, conn = self._allreduce(
            job,
            s,
            arrive,
            self.scenario.comm_factor(start),
            conn_nominal,
            (hang, flapped_nodes),
            paths,
        )
        end = float(stage_end.max())
        world = None
        if job.pp_stages > 1:
            # The gradient-norm all-reduce over every rank spans the stages: each rank enters
            # it when its stage's all-reduce ends, so the heaviest stage arrives last.
            world = stage_end[job.rank_stage] + 0.0003 * self._step_noise.random(len(arrive))
            end = float(world.max()) + _WORLD_LATENCY_S
        world_end = end
        step_s = end - start
        # Checkpoint after this step: everyone waits for the save.
        if job.checkpoints and job.checkpoints[0][0] <= end:
            # One save, however many came due while the job was down (a hang, a restart).
            while len(job.checkpoints) > 1 and job.checkpoints[1][0] <= end:
                job.checkpoints.pop(0)
            ck_s = job.checkpoints.pop(0)[1]
            self.scenario.add_confounder("checkpoint", end, end + ck_s, job=job.name, step=job.step)
            end += ck_s
            step_s += ck_s
            self._checkpoint_step[job.name] = job.step + 1
        job.step_log.append((end, step_s))
        if self.build_steps:
            self._step_messages(
                job, step_s, end, arrive, compute, conn, stage_end, next_peer, prev_peer, out
            )
            if world is not None:
                self._world_messages(job, world, world_end, out)
        job.step += 1
        job.seq += 1
        return end

    def _rank_compute(self, job: RunningJob, s: dict[str, np.ndarray], start: float) -> np.ndarray:
        """Each rank's compute time this step: speed, faults, noise, hiccups, data stalls."""
        rng = self._step_noise
        ranks = len(job.rank_node)
        nodes, gpus = job.rank_node, job.rank_gpu
        compute_nominal = 0.72 * job.step_s_nominal
        stage_factor = np.array(job.stage_factor)[job.rank_stage]
        compute: np.ndarray = (
            compute_nominal
            * stage_factor
            * self._gpu_speed[nodes, gpus]
            * (1.0 + s["slow"][nodes, gpus])
            * rng.lognormal(0.0, 0.004, ranks)
        )
        # One-step hiccups on random ranks (GC pause, page fault storm, host jitter).
        hiccup = rng.random(ranks) < 0.0003
        extras = rng.uniform(0.15, 0.6, ranks)
        if hiccup.any():
            for r in np.flatnonzero(hiccup & job.active).tolist():
                compute[r] *= 1.0 + extras[r]
                self.scenario.add_confounder(
                    "hiccup",
                    start,
                    start + float(compute[r]),
                    node=int(nodes[r]),
                    job=job.name,
                    rank=int(r),
                    step=job.step,
                    extra=round(float(extras[r]), 3),
                )
        if job.warm_start is not None:  # a new job's first steps: every rank slower
            warm = self.config.warmup_steps
            compute *= 1.0 + self.config.warmup_extra * (1.0 - job.step / warm)
            if job.step + 1 >= warm:
                self.scenario.add_confounder(
                    "warmup",
                    job.warm_start,
                    start + float(compute.max()),
                    job=job.name,
                    steps=warm,
                    extra=self.config.warmup_extra,
                )
                job.warm_start = None
        stall_noise = rng.lognormal(0.0, 0.1, ranks)
        for st, en, extra in self.scenario.stalls:
            if st <= start < en:
                compute += compute_nominal * extra * stall_noise
        return compute

    def _flap_hang(
        self, job: RunningJob, start: float, arrive: np.ndarray, conn_nominal: float
    ) -> tuple[float, set[tuple[int, int]]]:
        """A flap while this step runs hangs its all-reduce (each flap hits exactly one step):
        the hang and the flapped ``(node, rail)`` links."""
        hang = 0.0
        flapped_nodes: set[tuple[int, int]] = set()
        window = (max(start, job.flap_cursor), float(arrive.max()) + 2 * conn_nominal)
        job.flap_cursor = window[1]
        for f in self.scenario.faults:
            if f.kind == "link_flap":
                for ev in f.events:
                    if window[0] <= ev < window[1] and (
                        (job.rank_node[job.active] == f.node).any()
                    ):
                        hang = max(hang, f.detail["hang_s"])
                        flapped_nodes.add((f.node, f.gpu))
        return hang, flapped_nodes

    def _allreduce(
        self,
        job: RunningJob,
        s: dict[str, np.ndarray],
        arrive: np.ndarray,
        comm: float,
        conn_nominal: float,
        flaps: tuple[float, set[tuple[int, int]]],
        paths: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-stage rail rings (rank r's next peer is the same GPU on the next node): each
        stage's end, every rank's next and previous peer and its connection's duration
        (times ``paths``, each connection's fabric slowdown, with a multi-path fabric)."""
        hang, flapped_nodes = flaps
        ranks = len(job.rank_node)
        nodes, gpus, stages = job.rank_node, job.rank_gpu, job.rank_stage
        link_slow = s["link_slow"]
        conn_noise = self._step_noise.lognormal(0.0, 0.01, ranks)
        stage_end = np.zeros(job.pp_stages)
        next_peer = np.full(ranks, -1, dtype=np.int64)
        prev_peer = np.full(ranks, -1, dtype=np.int64)
        conn = np.zeros(ranks)  # duration of the connection r -> next_peer[r]
        for st in range(job.pp_stages):
            members = np.flatnonzero((stages == st) & job.active)
            if members.size == 0:
                continue
            last = float(arrive[members].max())
            for rail in range(self.config.gpus_per_node):
                ring = members[gpus[members] == rail]
                if ring.size > 1:
                    nxt = np.roll(ring, -1)
                    next_peer[ring] = nxt
                    prev_peer[nxt] = ring
                    slow_link = np.maximum(
                        link_slow[nodes[ring], rail], link_slow[nodes[nxt], rail]
                    )
                    conn[ring] = conn_nominal * (1.0 + slow_link) * comm * conn_noise[ring]
                    if paths is not None:
                        conn[ring] *= paths[ring]
                    for node, flap_gpu in flapped_nodes:
                        if flap_gpu == rail:
                            hit = (nodes[ring] == node) | (nodes[nxt] == node)
                            conn[ring[hit]] += hang
            duration = (
                float(conn[members].max())
                if (next_peer[members] >= 0).any()
                else conn_nominal * 0.3
            )
            stage_end[st] = last + duration
        return stage_end, next_peer, prev_peer, conn

    def _step_messages(
        self,
        job: RunningJob,
        step_s: float,
        end: float,
        arrive: np.ndarray,
        compute: np.ndarray,
        conn: np.ndarray,
        stage_end: np.ndarray,
        next_peer: np.ndarray,
        prev_peer: np.ndarray,
        out: list[tuple[float, Any]],
    ) -> None:
        peer_bytes = _GRADIENT_BYTES // max(1, self.config.gpus_per_node)
        conn_l = conn.tolist()
        stage_end_l = stage_end.tolist()
        gaps = {
            node
            for node, start, stop, everything in self.scenario.gaps
            if everything and start <= end < stop
        }
        ooo = {
            node: self.scenario.delay(node, end)
            for node, start, stop, _ in self.scenario.ooo
            if start <= end < stop
        }
        skews = self.scenario.skew_list
        offsets = self.scenario.offset_list
        step, seq = job.step, job.seq
        step_templates, coll_templates = self._rank_templates(job)
        rows = zip(
            job.rank_node.tolist(),
            job.rank_stage.tolist(),
            job.active.tolist(),
            arrive.tolist(),
            compute.tolist(),
            next_peer.tolist(),
            prev_peer.tolist(),
            strict=True,
        )
        for r, (node, stage, active, arrive_r, compute_r, nxt, prv) in enumerate(rows):
            if not active or node in gaps:
                continue
            skew = skews[node]
            offset = offsets[node]  # the host's clock: in its timestamps, not in arrival
            delay = ooo.get(node, 0.0)
            rank_end = end + skew + 0.0005 * (r % 7)
            coll_end = stage_end_l[stage] + skew
            c = coll_templates[r].copy()
            c["ts"] = coll_end + offset
            c["seq"] = seq
            c["arrive_ts"] = arrive_r + skew + offset
            c["end_ts"] = coll_end + offset
            c["peers"] = (
                [
                    _conn_model({"rank": nxt, "bytes": peer_bytes, "duration_s": conn_l[r]}),
                    _conn_model({"rank": prv, "bytes": peer_bytes, "duration_s": conn_l[prv]}),
                ]
                if nxt >= 0
                else []
            )
            out.append((coll_end + delay, _coll_model(c)))
            d = step_templates[r].copy()
            d["ts"] = rank_end + offset
            d["step"] = step
            d["step_s"] = step_s
            d["compute_s"] = compute_r
            out.append((rank_end + delay, _step_model(d)))

    def _world_messages(
        self, job: RunningJob, world: np.ndarray, end: float, out: list[tuple[float, Any]]
    ) -> None:
        """Each rank's view of the step's job-wide gradient-norm all-reduce."""
        gaps = {
            n
            for n, start, stop, everything in self.scenario.gaps
            if everything and start <= end < stop
        }
        skews = self.scenario.skew_list
        offsets = self.scenario.offset_list
        comm = f"{job.name}/world" + (f".g{job.layout_version}" if job.layout_version else "")
        seq = job.seq
        names = self.scenario.node_names
        rows = zip(job.rank_node.tolist(), job.active.tolist(), world.tolist(), strict=True)
        for r, (node, active, arrive_r) in enumerate(rows):
            if not active or node in gaps:
                continue
            skew = skews[node]
            offset = offsets[node]
            message = _coll_model(
                {
                    "kind": "collective",
                    "v": 1,
                    "ts": end + skew + offset,
                    "node": names[node],
                    "job": job.name,
                    "rank": r,
                    "comm": comm,
                    "op": "allreduce",
                    "seq": seq,
                    "bytes": 4,
                    "arrive_ts": arrive_r + skew + offset,
                    "end_ts": end + skew + offset,
                    "peers": None,
                }
            )
            out.append((end + skew + self.scenario.delay(node, end), message))

    def _rank_templates(self, job: RunningJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The fields of each rank's step and collective messages that stay the same."""
        cached = self._rank_cache.get(job.name)
        if cached is not None and cached[0] == job.layout_version:
            return cached[1], cached[2]
        pipelined = job.pp_stages > 1
        steps, colls = [], []
        rows = zip(
            job.rank_node.tolist(),
            job.rank_gpu.tolist(),
            job.rank_stage.tolist(),
            job.rank_dp.tolist(),
            strict=True,
        )
        for r, (node, gpu, stage, dp) in enumerate(rows):
            name = self.scenario.node_names[node]
            steps.append(
                {
                    "kind": "step",
                    "v": 1,
                    "ts": 0.0,
                    "node": name,
                    "job": job.name,
                    "rank": r,
                    "gpu": gpu,
                    "step": 0,
                    "step_s": 0.0,
                    "compute_s": None,
                    "pp_stage": stage if pipelined else None,
                    "dp_rank": dp,
                    "tokens": 8192,
                }
            )
            colls.append(
                {
                    "kind": "collective",
                    "v": 1,
                    "ts": 0.0,
                    "node": name,
                    "job": job.name,
                    "rank": r,
                    # A restart builds new communicators (NCCL ids are per launch).
                    "comm": (f"{job.name}/dp{stage}" if pipelined else f"{job.name}/dp")
                    + (f".g{job.layout_version}" if job.layout_version else ""),
                    "op": "allreduce",
                    "seq": 0,
                    "bytes": _GRADIENT_BYTES,
                    "arrive_ts": 0.0,
                    "end_ts": None,
                    "peers": None,
                }
            )
        self._rank_cache[job.name] = (job.layout_version, steps, colls)
        return steps, colls
