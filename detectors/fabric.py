"""Fabric hot spots: NICs and leaves congested far beyond their rail's peers, persistently.

Per NIC port, the increases of ``port_xmit_wait`` (ticks the port had data but no credit to
send) and of ECN marks + CNPs (``np_ecn_marked_roce_packets``, ``rp_cnp_handled``) are
summed over event-time windows of ``window_s``. When a window closes, every NIC is compared
with the other NICs on its rail (equivalent paths: the same rail of other nodes), and, with
a topology, every leaf with the other leaves of its rail (sum of its NICs). A member whose
rate is at least ``ratio`` times its group's median (and above ``floor_per_s``) is hot in
that window; hot for ``windows`` windows in a row it is reported. Congestion is the fabric's
doing, not the node's: hot spots are ``info`` observations (category ``nic`` for a NIC,
``link`` for a leaf, ``evidence.observation = "hot_spot"``), attributed to the jobs seen on
them, and withdrawn (``clear``) when the member cools down. Broken links stay with the NIC
detector's ``link`` claims. A counter that goes down was reset: that interval adds nothing.

Without a topology file the leaves are inferred (``nodes_per_leaf`` set): the nodes seen so
far in name order, ``nodes_per_leaf`` to a pod, NIC ``mlx5_r`` on leaf ``pod{p}-rail{r}`` —
:func:`~guard.schemas.topology.infer_topology`'s shape, recomputed when a new node appears.
Without either, NICs are grouped by device name and no leaf is judged.

Tiny state: per port the last sample's three numbers; per member of a window two sums; the
node names seen (inferred leaves). The topology itself is not pickled with the detector (a
10k-node fabric is megabytes): whoever restores one sets :attr:`topology` again.

Example
-------
>>> from guard.schemas import NicSample
>>> det = FabricHotSpotDetector(window_s=10.0, windows=2)
>>> def nic(ts, node, wait):
...     return NicSample(ts=ts, node=node, job="j", device="mlx5_0", port=1,
...                      counters={"port_xmit_wait": wait})
>>> out = []
>>> for t in range(0, 40, 5):
...     for i in range(4):
...         out += det.update(nic(float(t), f"n{i}", t * (10_000 if i == 2 else 1_000)))
>>> [(f.node, f.category, f.severity, f.evidence["observation"]) for f in out]
[('n2', 'nic', 'info', 'hot_spot')]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from guard.schemas import NicSample
from guard.schemas.topology import Topology, TopologyError, infer_topology

from .findings import Finding
from .nic import CONGESTION_COUNTERS
from .robust import median

__all__ = ["FabricHotSpotDetector"]

_WAIT = "port_xmit_wait"
_ECN, _CNP = CONGESTION_COUNTERS


class _Member:
    __slots__ = ("jobs", "raised", "since", "streak")

    def __init__(self) -> None:
        self.streak = 0
        self.since = 0.0
        self.raised = False
        self.jobs: set[str] = set()


class FabricHotSpotDetector:
    """Persistent congestion hot spots per NIC and per leaf, against their rail's peers."""

    name = "fabric"

    def __init__(
        self,
        topology: Topology | None = None,
        window_s: float = 60.0,
        ratio: float = 3.0,
        floor_per_s: float = 1_000.0,
        windows: int = 3,
        nodes_per_leaf: int | None = None,
    ) -> None:
        self.topology = topology
        self.nodes_per_leaf = nodes_per_leaf
        self._known: set[str] = set()  # nodes seen, for the inferred leaves
        self._inferred: Topology | None = None
        self._rails = 1
        self.window_s, self.ratio, self.floor, self.windows = window_s, ratio, floor_per_s, windows
        self._last: dict[tuple[str, str, int], tuple[float, int, int]] = {}
        self._sums: dict[tuple[str, str], list[float]] = {}  # (node, device) -> [wait, marks]
        self._jobs: dict[tuple[str, str], set[str]] = {}
        self._window: int | None = None
        self._members: dict[tuple[str, str], _Member] = {}

    def update(self, message: NicSample) -> list[Finding]:
        """A NIC sample, its increases read here (the engine hands in the NIC detector's
        instead, :meth:`add`: one reading of the counters per sample)."""
        get = message.counters.get
        wait = get(_WAIT, 0)
        marks = get(_ECN, 0) + get(_CNP, 0)
        port = (message.node, message.device, message.port)
        last = self._last.get(port)
        self._last[port] = (message.ts, wait, marks)
        if last is None or wait < last[1] or marks < last[2] or message.ts <= last[0]:
            return self.add(message, None)  # first sample or a reset: re-baseline
        return self.add(message, (wait - last[1], marks - last[2]))

    def add(self, message: NicSample, increase: tuple[int, int] | None) -> list[Finding]:
        """A NIC sample and the (xmit wait, ECN + CNP marks) it added since the port's
        previous one (None: no interval — first sample, duplicate, reset)."""
        wait, marks = increase if increase is not None else (0, 0)
        return self.add_columns(
            [message.node],
            [message.device],
            [message.job],
            np.array([message.ts]),
            np.array([increase is not None]),
            np.array([wait]),
            np.array([marks]),
            np.zeros(1, dtype=np.intp),
        )

    def add_columns(
        self,
        nodes: Sequence[str],
        devices: Sequence[str],
        jobs: Sequence[str | None],
        ts: np.ndarray,
        valid: np.ndarray,
        wait: np.ndarray,
        marks: np.ndarray,
        ports: np.ndarray,
    ) -> list[Finding]:
        """NIC samples as columns (in arrival order) with what each added since its port's
        previous sample (``valid`` false: no interval); ``ports``: each sample's port as a
        dense id (one id, one node's device and port). A sample of a later window than the
        sample before it closes that one's window first."""
        if not len(ts):
            return []
        windows = (ts // self.window_s).astype(np.int64)
        before = np.r_[windows[0] if self._window is None else self._window, windows[:-1]]
        cuts = np.flatnonzero(windows > before)  # a sample of a later window closes the last
        out: list[Finding] = []
        start = 0
        for cut in cuts.tolist():
            self._sum(nodes, devices, jobs, (valid, wait, marks, ports), start, cut)
            out += self._close(float((before[cut] + 1) * self.window_s))
            start = cut
        self._sum(nodes, devices, jobs, (valid, wait, marks, ports), start, len(ts))
        self._window = int(windows[-1])  # the latest sample's, as the clock a window follows
        return out

    def _sum(
        self,
        nodes: Sequence[str],
        devices: Sequence[str],
        jobs: Sequence[str | None],
        columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        start: int,
        stop: int,
    ) -> None:
        """Add rows ``start:stop`` with an interval to their NIC's window sums: summed per
        port over the rows as arrays, then per NIC over the ports (``columns``: valid,
        wait, marks and port id of each row)."""
        valid, wait, marks, ports = columns
        at = np.flatnonzero(valid[start:stop]) + start
        if not len(at):
            return
        port = ports[at]
        _, first, code = np.unique(port, return_index=True, return_inverse=True)
        waits = np.bincount(code, weights=wait[at].astype(float), minlength=len(first))
        marked = np.bincount(code, weights=marks[at].astype(float), minlength=len(first))
        order = np.argsort(first)  # NICs in the order their first sample came
        sums = self._sums
        for i, w, m in zip(
            at[first[order]].tolist(), waits[order].tolist(), marked[order].tolist(), strict=True
        ):
            key = (nodes[i], devices[i])
            total = sums.get(key)
            if total is None:
                sums[key] = [w, m]
            else:
                total[0] += w
                total[1] += m
        at_list = at.tolist()
        first_row = at[first].tolist()  # a row of each port, by its code
        seen = self._jobs
        for c, job in set(zip(code.tolist(), [jobs[i] for i in at_list], strict=True)):
            if job is not None:
                i = first_row[c]
                seen.setdefault((nodes[i], devices[i]), set()).add(job)

    def tick(self, now: float) -> list[Finding]:
        if self._window is None or int(now // self.window_s) <= self._window:
            return []
        return self._close(float((self._window + 1) * self.window_s))

    def flush(self) -> list[Finding]:
        if self._window is None or not self._sums:
            return []
        return self._close(float((self._window + 1) * self.window_s))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["topology"] = state["_inferred"] = None
        return state

    def _fabric(self) -> Topology | None:
        """The topology file's, else the one inferred from the nodes seen, else none."""
        if self.topology is not None or self.nodes_per_leaf is None:
            return self.topology
        seen = {node for node, _ in self._sums}
        per_node: dict[str, int] = {}
        for node, _ in self._sums:
            per_node[node] = per_node.get(node, 0) + 1
        rails = max([self._rails, *per_node.values()])
        if self._inferred is None or not seen <= self._known or rails > self._rails:
            self._known |= seen
            if not self._known:
                return None  # no NIC has counted yet (first samples, resets): nothing to place
            self._rails = rails
            self._inferred = infer_topology(
                sorted(self._known), rails=rails, nodes_per_leaf=self.nodes_per_leaf, spines=1
            )
        return self._inferred

    def _close(self, end: float) -> list[Finding]:
        fabric = self._fabric()
        groups: dict[tuple[str, str], dict[str, list[float]]] = {}
        jobs: dict[tuple[str, str], set[str]] = {}
        for (node, device), (wait, marks) in self._sums.items():
            rail, leaf = self._place(fabric, node, device)
            groups.setdefault(("nic", rail), {})[f"{node}/{device}"] = [wait, marks]
            jobs[("nic", f"{node}/{device}")] = self._jobs.get((node, device), set())
            if leaf is not None:
                total = groups.setdefault(("leaf", rail), {}).setdefault(leaf, [0.0, 0.0])
                total[0] += wait
                total[1] += marks
                jobs.setdefault(("leaf", leaf), set()).update(jobs[("nic", f"{node}/{device}")])
        self._sums, self._jobs = {}, {}
        out = []
        for (level, rail), members in groups.items():
            hot = self._hot(members)
            for name in members:
                key = (level, name)
                member = self._members.setdefault(key, _Member())
                member.jobs |= jobs.get(key, set())
                finding = self._judge(level, rail, name, member, hot.get(name), end)
                if finding is not None:
                    out.append(finding)
        return out

    @staticmethod
    def _place(fabric: Topology | None, node: str, device: str) -> tuple[str, str | None]:
        """The NIC's rail (the topology's, else its device name) and leaf (when known)."""
        if fabric is None:
            return device, None
        try:
            nic = next(n for n in fabric.node(node).nics if n.device == device)
        except (TopologyError, StopIteration):
            return device, None
        return f"rail{nic.rail}", nic.leaf

    def _hot(self, members: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        if len(members) < 3:  # no peer median worth the name
            return {}
        hot: dict[str, dict[str, float]] = {}
        for i, signal in enumerate(("xmit_wait_per_s", "ecn_cnp_per_s")):
            rates = {name: v[i] / self.window_s for name, v in members.items()}
            typical = median(list(rates.values()))
            for name, rate in rates.items():
                if rate >= self.floor and rate >= self.ratio * max(typical, 1e-9):
                    hot.setdefault(name, {})[signal] = round(rate, 1)
                    hot[name][f"rail_median_{signal}"] = round(typical, 1)
        return hot

    def _judge(
        self,
        level: str,
        rail: str,
        name: str,
        member: _Member,
        rates: dict[str, float] | None,
        end: float,
    ) -> Finding | None:
        if rates is None:
            member.streak = 0
            was, member.raised = member.raised, False
            return self._finding(level, rail, name, member, {}, end, clear=True) if was else None
        if member.streak == 0:
            member.since = end - self.window_s
        member.streak += 1
        if member.streak < self.windows or member.raised:
            return None
        member.raised = True
        return self._finding(level, rail, name, member, rates, end)

    def _finding(
        self,
        level: str,
        rail: str,
        name: str,
        member: _Member,
        rates: dict[str, Any],
        end: float,
        clear: bool = False,
    ) -> Finding:
        node, _, device = name.partition("/") if level == "nic" else (None, "", name)
        return Finding(
            detector=self.name,
            category="nic" if level == "nic" else "link",
            severity="info",
            node=node,
            ts=end,
            since=member.since,
            score=max((v for k, v in rates.items() if not k.startswith("rail")), default=0.0),
            job=next(iter(member.jobs)) if len(member.jobs) == 1 else None,
            device=device,
            window_s=self.window_s * member.streak,
            evidence={
                "observation": "hot_spot",
                "level": level,
                "rail": rail,
                "windows": member.streak,
                "jobs": sorted(member.jobs)[:32],
                **rates,
            },
            clear=clear,
        )
