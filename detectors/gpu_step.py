"""A step's GPU samples of many nodes through their GPU rules, as array operations.

The core hands in the GPU samples of a step (a poll or a tick of a partition) as
:class:`~guard.detectors.gpu_round.GpuColumns` with the node each row belongs to.
:func:`update_gpus` then

1. runs the GPU error rules over every row at once
   (:func:`~guard.detectors.gpu_errors.update_errors`);
2. assembles each node's rounds: its open round (carried from the step before) and its new
   samples in arrival order, a round closing when a GPU reports again;
3. judges every closed round of every node at once (:func:`judge_rounds`): thermal, power
   and clocks as array operations over :class:`~guard.detectors.gpu_round.Rounds`, a node's
   holds stacked with the others' for the step; a node with several rounds in the step has
   them judged in order, one wave per round;
4. adds a round every ``sample_s`` to the node's window features for its job's river model
   (:class:`~guard.detectors.peer_anomaly.GpuWindows`).

The findings come in the order the per-sample rules gave them: a sample's errors, then the
findings of the round it closed.

Example
-------
>>> import numpy as np
>>> from guard.schemas import GpuSample
>>> from guard.detectors.engine import NodeDetectors
>>> from guard.detectors.gpu_round import GpuColumns
>>> nodes = [NodeDetectors("n1"), NodeDetectors("n2")]
>>> found = []
>>> for t in range(4):  # a step: both nodes' rounds; n2's GPU 5 runs 500 MHz low
...     samples = [GpuSample(ts=10.0 * t, node=n.node, gpu=g, util_pct=97,
...                          sm_clock_mhz=1400 if (n.node, g) == ("n2", 5) else 1980)
...                for n in nodes for g in range(8)]
...     owner = np.repeat([0, 1], 8)
...     found += update_gpus(nodes, owner, GpuColumns.of_samples(samples))
>>> [(f.node, f.gpu, f.category, f.ts) for f in found]
[('n2', 5, 'clock', 10.0)]

The round of t = 10 s closes when t = 20 s reports: its claim comes then, at the round's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from .findings import Finding
from .gpu_errors import update_errors_at
from .gpu_round import GpuColumns, Rounds
from .hold import CLEAR, HOLD_FIELDS, arrival_rank

if TYPE_CHECKING:
    from .engine import NodeDetectors

__all__ = ["HOLD_SLOTS", "judge_rounds", "update_gpus"]

#: holds per GPU row of a node's state: thermal (claim, info), power (claim, info, CUSUM,
#: its claim), clocks (claim, CUSUM, its claim)
HOLD_SLOTS = 9
#: the sort key of a round closed at the end of input (after every sample)
_AT_END = 1 << 62
#: an open round without samples (shared: never changed, a step skips it)
_NO_ROUND = GpuColumns.empty()


def update_gpus(
    nodes: Sequence[NodeDetectors], owner: np.ndarray, cols: GpuColumns
) -> list[Finding]:
    """The step's GPU samples ``cols``, row ``i`` of ``nodes[owner[i]]`` (a node once in
    ``nodes``); its findings."""
    errors = update_errors_at([det.errors for det in nodes], owner, cols)  # sets cols.row
    found = [(3 * i, 0, 0, 0, 0, f) for i, f in errors]
    pending = [det.open_round for det in nodes]
    parts = [p for p in pending if len(p)]
    every = GpuColumns.concat([*parts, cols]) if parts else cols
    offsets = np.cumsum([0, *(len(p) for p in parts)])
    gpu = every.gpu.tolist()
    new = len(every) - len(cols)
    rounds: list[list[int]] = []
    round_owner: list[int] = []
    round_job: list[str | None] = []
    round_key: list[int] = []
    at = 0
    by_node = _positions(owner, len(nodes))

    def close(rows: list[int], k: int, job: str | None, key: int) -> None:
        rounds.append(rows)
        round_owner.append(k)
        round_job.append(job)
        round_key.append(key)

    for k, det in enumerate(nodes):
        carried = len(pending[k])
        seq = list(range(offsets[at], offsets[at] + carried)) if carried else []
        at += carried > 0
        current: list[int] = []
        seen: set[int] = set()
        job = det.job
        for i in seq + [new + p for p in by_node[k]]:
            g = gpu[i]
            if (j := every.job[i]) is not None:
                job = j  # the closing sample's job is the round's (as it was per sample)
            if g in seen:
                close(current, k, job, 3 * (i - new) + 1)
                current, seen = [], set()
            current.append(i)
            seen.add(g)
        det.job = det.errors.job = job
        det.open_round = every.take(np.array(current, dtype=np.intp)) if current else _NO_ROUND
    if rounds:
        closed = Rounds.of(every, rounds, round_owner, round_job)
        found += judge_rounds(nodes, closed, np.array(round_key))
    found.sort(key=lambda item: item[:5])
    return [f for *_, f in found]


def _positions(owner: np.ndarray, n: int) -> list[list[int]]:
    """The row positions of each node, in arrival order."""
    if n == 1:
        return [list(range(len(owner)))]
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(n + 1))
    return [order[bounds[k] : bounds[k + 1]].tolist() for k in range(n)]


def judge_rounds(
    nodes: Sequence[NodeDetectors], rounds: Rounds, keys: np.ndarray | None = None
) -> list[tuple[int, int, int, int, int, Finding]]:
    """Closed ``rounds`` of ``nodes`` (in order within each node) through thermal, power,
    clocks and the river feed; each finding with its sort key (the position of the sample
    that closed its round, ``keys``: at the end if None)."""
    keys = np.full(len(rounds), _AT_END) if keys is None else keys
    names = [det.node for det in nodes]
    base = np.zeros(len(nodes) + 1, dtype=np.intp)
    base[1:] = np.cumsum([len(det.errors.gpus) for det in nodes])
    state = np.zeros((base[-1], HOLD_SLOTS, len(HOLD_FIELDS)))
    for k, det in enumerate(nodes):
        if det.holds is not None:
            rows, values = det.holds
            state[base[k] + rows] = values
    cols = rounds.cols
    rows = np.where(rounds.valid, base[rounds.owner][:, None] + cols.row[rounds.at], -1)
    cfg = nodes[0]
    # each rule's conditions over every round at once; only the holds go round by round
    rules = [
        (order, rule, first, *rule.conditions(rounds))
        for order, rule, first in ((0, cfg.thermal, 0), (1, cfg.power, 2), (2, cfg.clocks, 6))
    ]
    wave = arrival_rank(rounds.owner)  # a node's rounds in order, one per pass
    found: list[tuple[int, int, int, int, int, Finding]] = []
    for w in range(int(wave.max()) + 1 if len(wave) else 0):
        pick = np.flatnonzero(wave == w)
        part = _subset(rounds, pick)
        part_rows = rows[pick]
        for order, rule, first, holds, seen in rules:
            view = state[:, first : first + rule.slots]  # the rule's holds: its slots
            picked: list[Any] = [
                (slot, cond[pick], None if look is None else look[pick], None)
                for slot, cond, look in holds
            ]
            if rule.test is not None:  # after the holds: it defers to an active claim
                picked.append(partial(rule.sequential, view, seen, part, part_rows, pick))
            for entry in picked:
                slot, cond, cells, args = entry() if callable(entry) else entry
                rs, js, events = rule.held(view[:, slot], part, part_rows, cond, cells, args)
                for r, j, event in zip(rs.tolist(), js.tolist(), events.tolist(), strict=True):
                    since = float(view[part_rows[r, j], slot, 3])
                    at = int(pick[r])
                    f = rule.finding_of(seen, rounds, names, (at, j, slot, since, event == CLEAR))
                    found.append((int(keys[at]), 1, order, j, rule.slots - 1 - slot, f))
    going = np.asarray(state.reshape(len(state), -1).any(axis=1))  # rows with a hold's state
    for k, det in enumerate(nodes):
        rows = np.flatnonzero(going[base[k] : base[k + 1]])
        det.holds = (rows, state[base[k] + rows]) if len(rows) else None
    for r in range(len(rounds)):
        det = nodes[int(rounds.owner[r])]
        if det.anomaly is not None:
            det.anomaly.update(rounds, r)  # its windows go to the job's model (the core sends)
    return found


def _subset(rounds: Rounds, pick: np.ndarray) -> Rounds:
    if len(pick) == len(rounds):
        return rounds
    return Rounds(
        rounds.cols, rounds.at[pick], rounds.owner[pick], [rounds.job[r] for r in pick.tolist()]
    )
