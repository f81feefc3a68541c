"""The per-sample NIC detector the columnar one replaced (issue 25), kept as the reference
of a differential test: the same samples must give the same claims. Not used by Guard."""

from __future__ import annotations

from typing import Any

from guard.detectors.findings import Finding
from guard.detectors.hold import Hold
from guard.schemas import NicSample

__all__ = ["NicDetector"]

PHYSICAL_ERRORS = (
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "port_rcv_remote_physical_errors",
)
RETRANSMITS = ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err")
CONGESTION_COUNTERS = ("np_ecn_marked_roce_packets", "rp_cnp_handled")


# counter -> group: 0 physical errors, 1 retransmits, 2 congestion marks, 3 flaps, 4 xmit wait
_GROUP = (
    *((name, 0) for name in PHYSICAL_ERRORS),
    *((name, 1) for name in RETRANSMITS),
    *((name, 2) for name in CONGESTION_COUNTERS),
    ("link_downed", 3),
    ("port_xmit_wait", 4),
)


def _increases(now: dict[str, int], before: dict[str, int]) -> list[int]:
    """Increases of the watched counters, summed per group (resets add 0)."""
    sums = [0, 0, 0, 0, 0]
    for name, group in _GROUP:
        value = now.get(name)
        if value is not None:
            old = before.get(name)
            if old is not None and value > old:
                sums[group] += value - old
    return sums


class _PortState:
    __slots__ = ("congested", "counters", "degraded", "down", "inc", "sample", "speed", "ts")

    def __init__(self, hold_args: tuple[int, int, int]) -> None:
        self.counters: dict[str, int] = {}
        self.ts: float | None = None
        self.degraded = Hold(*hold_args)
        self.down = Hold(*hold_args)
        self.congested = False
        self.speed: float | None = None
        #: the latest sample's (ts, xmit wait, congestion marks) increases; None when that
        #: sample gave no interval (first, duplicate, out of order) — the fabric reads it
        self.inc: tuple[float, int, int] | None = None
        self.sample: NicSample | None = None  # the latest one handed in (not pickled)

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__ if name not in _UNSAVED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.inc = self.sample = None


_UNSAVED = ("inc", "sample")


class NicDetector:
    """Per-node detector over the node's NIC ports."""

    name = "nic"

    def __init__(
        self,
        phys_per_s: float = 0.5,
        retrans_per_s: float = 5.0,
        speed_ratio: float = 0.9,
        congestion_per_s: float = 100.0,
        raise_after: int = 2,
        within: int = 3,
        clear_after: int = 10,
    ) -> None:
        self.phys_per_s = phys_per_s
        self.retrans_per_s = retrans_per_s
        self.speed_ratio = speed_ratio
        self.congestion_per_s = congestion_per_s
        self.hold_args = (raise_after, within, clear_after)
        self.ports: dict[tuple[str, int], _PortState] = {}
        self.nominal_gbps = 0.0
        self.first_port: tuple[str, int] | None = None
        self.congestion = Hold(raise_after, within, clear_after)  # the node's, over its ports
        self.latest: _PortState | None = None  # the port of the latest sample, for increase()

    def update(self, message: NicSample) -> list[Finding]:
        """Rates since the port's previous sample; findings of the port (and the node's
        congestion verdict, once per round)."""
        s = message
        key = (s.device, s.port)
        st = self.ports.get(key)
        if st is None:
            st = self.ports[key] = _PortState(self.hold_args)
        self.latest, st.sample = st, s
        speed = s.speed_gbps
        if speed is not None:
            st.speed = speed
            self.nominal_gbps = max(self.nominal_gbps, speed)
        prev, prev_ts = st.counters, st.ts
        st.inc = None
        ts = s.ts
        if prev_ts is not None and ts <= prev_ts:
            return []  # duplicate or out of order: rates need increasing time
        counters = s.counters
        st.counters = counters  # messages are not mutated: keep a reference, not a copy
        st.ts = ts
        if prev_ts is None:
            return []
        dt = ts - prev_ts
        phys_n, retrans_n, marks, flaps, wait = _increases(counters, prev)
        st.inc = (ts, wait, marks)
        down = st.down  # the common case, a port up without flaps or history, costs no call
        if flaps or s.link_up is False or down.bits or down.active:
            found = self._link(s, st, flaps, dt)
        else:
            found = []
        phys, retrans = phys_n / dt, retrans_n / dt
        errors = phys >= self.phys_per_s or retrans >= self.retrans_per_s
        speed, nominal = st.speed, self.nominal_gbps
        slow = speed is not None and nominal > 0.0 and speed < self.speed_ratio * nominal
        held = st.degraded
        if errors or slow or held.bits or held.active:
            degraded = self._degraded(s, st, phys, retrans, errors, slow)
            if degraded is not None:
                found.append(degraded)
        congestion = marks / dt
        st.congested = congestion >= self.congestion_per_s and phys_n == 0 and retrans_n == 0
        first = self.first_port
        if first is None or key < first:
            self.first_port = first = key
        if key == first:  # one node-level verdict per sampling round
            congested = self._congestion(s, congestion, wait / dt)
            if congested is not None:
                found.append(congested)
        return found

    def increase(self, message: NicSample) -> tuple[int, int] | None:
        """The xmit-wait and congestion-mark (ECN + CNP) increases that ``message``, the
        port's latest sample, added (resets count 0); None: it gave no interval."""
        st = self.latest  # the engine asks right after update(): no key to build
        if st is None or st.sample is not message:
            st = self.ports.get((message.device, message.port))
        inc = None if st is None else st.inc
        return None if inc is None or inc[0] != message.ts else (inc[1], inc[2])

    def _link(self, s: NicSample, st: _PortState, flaps: int, dt: float) -> list[Finding]:
        """A flap (``link_downed`` rose) at once; a port held down through its hold."""
        found: list[Finding] = []
        if flaps:
            found.append(
                self._finding(
                    s,
                    "link",
                    "critical" if flaps >= 3 else "warning",
                    s.ts,
                    {"signal": "link_downed", "increase": flaps, "interval_s": dt},
                )
            )
        down = st.down
        event = (
            down.update(s.link_up is False, s.ts)
            if (s.link_up is False or down.bits or down.active)
            else None
        )
        if event is not None:
            found.append(
                self._finding(
                    s,
                    "link",
                    "warning",
                    st.down.since,
                    {"signal": "link_up", "link_up": s.link_up},
                    clear=event == "clear",
                )
            )
        return found

    def _degraded(
        self, s: NicSample, st: _PortState, phys: float, retrans: float, errors: bool, slow: bool
    ) -> Finding | None:
        """Error or retransmit rates (per second) too high (``errors``), or the link slower
        than nominal (``slow``); :meth:`update` calls it when one holds or the port's hold
        has history."""
        event = st.degraded.update(errors or slow, s.ts)
        if event is None:
            return None
        return self._finding(
            s,
            "nic",
            "warning",
            st.degraded.since,
            {
                "signal": "errors" if errors else "speed",
                "physical_errors_per_s": round(phys, 3),
                "retransmits_per_s": round(retrans, 3),
                "speed_gbps": st.speed,
                "nominal_gbps": self.nominal_gbps,
            },
            clear=event == "clear",
        )

    def _congestion(self, s: NicSample, marks_per_s: float, wait_per_s: float) -> Finding | None:
        """The node's verdict: half its ports congested (marks without errors) is an info."""
        ports = self.ports.values()
        share = sum(1 for p in ports if p.congested) / len(ports)
        event = self.congestion.update(share >= 0.5, s.ts)
        if event is None:
            return None
        return self._finding(
            s,
            "nic",
            "info",
            self.congestion.since,
            {
                "signal": "congestion",
                "observation": "congestion",
                "ports_congested_pct": round(100.0 * share),
                "ecn_cnp_per_s": round(marks_per_s, 1),
                "xmit_wait_per_s": round(wait_per_s, 1),
            },
            clear=event == "clear",
            device=None,
        )

    def tick(self, now: float) -> list[Finding]:
        return []  # every rule runs on a port's own samples

    def flush(self) -> list[Finding]:
        return []

    def _finding(
        self,
        s: NicSample,
        category: str,
        severity: str,
        since: float,
        evidence: dict[str, Any],
        clear: bool = False,
        device: str | None = "",
    ) -> Finding:
        return Finding(
            detector=self.name,
            category=category,
            severity=severity,
            node=s.node,
            ts=s.ts,
            since=since,
            score=1.0,
            job=s.job,
            device=s.device if device == "" else device,
            evidence={"port": s.port, **evidence},
            clear=clear,
        )
