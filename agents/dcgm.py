"""dcgm-exporter as an alternative GPU source: its Prometheus text → :class:`GpuSample`.

dcgm-exporter (``:9400/metrics``) publishes one line per GPU per field, e.g.
``DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-…",Hostname="h100-07",…} 34``. The records carry
the agent's configured node (``--node``), as its NIC records do, never the exporter's
``Hostname``/``hostname`` label: under Kubernetes that label is the exporter pod's name
(``nvidia-dcgm-exporter-cwbcm``) unless the exporter is given ``NODE_NAME``, and it would
rename the node's GPUs away from its NICs, its step timings and its cordon. An agent scrapes
its own node's exporter, so a GPU is keyed by its index alone. DCGM marks a value
it does not have with "blank" sentinels (``0x7ffffff0`` and up for 32-bit integers,
``0x7ffffffffffffff0`` and up for 64-bit ones, ``1.40737488355328e14`` and up for floats);
those, NaN and infinities are dropped (the field stays null), never published as readings.

``DCGM_FI_DEV_XID_ERRORS`` is sticky: it holds the *last* Xid the GPU reported, for as long
as the exporter runs, and the exporter refreshes its readings only every collect interval
(30 s by default), however often it is scraped. :class:`DcgmCollector` turns that gauge into
events: the first reading of each GPU is a baseline (an Xid from before the agent started is
logged, never published: it would claim a node for something long past), after which an Xid
is published once, in the scrape where the value changes; a scrape identical to the previous
one (the exporter has not refreshed yet) publishes nothing. A later Xid with the *same* code
as the previous one cannot be told apart from the old reading through this gauge; NVML's
event stream (``--gpu-source nvml``) sees every occurrence.

The fields Guard reads are listed in ``deploy/dcgm/counters.csv``: run dcgm-exporter with
``-f counters.csv``, since its stock counters file leaves power limit, max SM clock,
clock-event reasons and ECC commented out.
"""

from __future__ import annotations

import logging
import math
import re
import urllib.request
from typing import Any

from guard.schemas import GpuSample

__all__ = ["DCGM_FIELDS", "DcgmCollector", "fetch_dcgm", "parse_dcgm_metrics"]

log = logging.getLogger(__name__)

#: dcgm-exporter metric → GpuSample field (both names of renamed fields are accepted).
DCGM_FIELDS: dict[str, str] = {
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MAX_SM_CLOCK": "sm_clock_max_mhz",
    "DCGM_FI_DEV_MEM_CLOCK": "mem_clock_mhz",
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "mem_util_pct",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "clock_event_reasons",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "clock_event_reasons",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "ecc_sbe_total",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "ecc_dbe_total",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay_total",
}
_INTEGER_FIELDS = {
    "clock_event_reasons",
    "ecc_sbe_total",
    "ecc_dbe_total",
    "xid",
    "pcie_replay_total",
}

_INT32_BLANK = 0x7FFFFFF0
_FP64_BLANK = 140737488355328.0

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return (
        value.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n").replace("\x00", "\\")
    )


def _labels(text: str | None) -> dict[str, str] | None:
    if not text:
        return {}
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            return None
        labels[match.group(1)] = _unescape(match.group(2))
        pos = match.end()
    return labels


def _available(raw: str) -> float | None:
    """A reading, or None for DCGM's blank / not-found sentinels, NaN and infinities.

    >>> _available("34"), _available("2147483632"), _available("9223372036854775794")
    (34.0, None, None)
    >>> _available("140737488355328"), _available("NaN"), _available("n/a")
    (None, None, None)
    """
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value >= _FP64_BLANK:  # also covers the int64 blanks
        return None
    if _INT32_BLANK <= value < 2**31:
        return None
    return value


def parse_dcgm_metrics(
    text: str, node: str, ts: float, job: str | None = None
) -> tuple[list[GpuSample], list[str]]:
    """Samples (one per GPU, all of ``node``: the exporter's host label is not used) from an
    exposition, and the problems found.

    Lines that are not valid exposition format, or metrics we do not use, are skipped; a
    problem is reported for malformed lines (at most 20), never raised.
    """
    per_gpu: dict[int, dict[str, Any]] = {}
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            if len(problems) < 20:
                problems.append(f"line {number}: not Prometheus text format: {line[:80]!r}")
            continue
        name, label_text, raw = match.groups()
        field = DCGM_FIELDS.get(name)
        if field is None:
            continue
        labels = _labels(label_text)
        if labels is None:
            if len(problems) < 20:
                problems.append(f"line {number}: bad labels in {line[:80]!r}")
            continue
        try:
            gpu = int(labels.get("gpu", ""))
        except ValueError:
            if len(problems) < 20:
                problems.append(f"line {number}: {name} has no numeric gpu label")
            continue
        entry = per_gpu.setdefault(gpu, {})
        if labels.get("UUID"):
            entry["uuid"] = labels["UUID"]
        value = _available(raw)
        if value is None or value < 0:
            continue
        entry[field] = int(value) if field in _INTEGER_FIELDS else value
    samples = []
    for gpu, values in sorted(per_gpu.items()):
        if values.get("xid") == 0:
            values["xid"] = None  # 0: no Xid in the interval
        try:
            samples.append(GpuSample(ts=ts, node=node, job=job, gpu=gpu, **values))
        except ValueError as exc:
            problems.append(f"{node} GPU {gpu}: {exc}")
    return samples, problems


def fetch_dcgm(
    url: str, node: str, ts: float, job: str | None = None, timeout_s: float = 2.0
) -> list[GpuSample]:
    """Scrape dcgm-exporter once; an unreachable exporter gives no samples and a log line."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read(16 << 20).decode("utf-8", errors="replace")
    except OSError as exc:
        log.warning("dcgm-exporter at %s did not answer: %s", url, exc)
        return []
    samples, problems = parse_dcgm_metrics(text, node, ts, job)
    for problem in problems[:3]:
        log.warning("dcgm-exporter at %s: %s", url, problem)
    return samples


class DcgmCollector:
    """One node's dcgm-exporter as a sampler: the sticky Xid gauge as events, stale scrapes
    dropped.

    >>> text = 'DCGM_FI_DEV_GPU_TEMP{gpu="0"} 50\\nDCGM_FI_DEV_XID_ERRORS{gpu="0"} 79\\n'
    >>> dcgm = DcgmCollector("http://unused", "n1")
    >>> [s.xid for s in dcgm.events(parse_dcgm_metrics(text, "n1", 1.0)[0])]  # old: baseline
    [None]
    >>> dcgm.events(parse_dcgm_metrics(text, "n1", 31.0)[0])  # not refreshed: nothing new
    []
    >>> text = text.replace(" 79", " 48").replace(" 50", " 51")
    >>> [s.xid for s in dcgm.events(parse_dcgm_metrics(text, "n1", 61.0)[0])], dcgm.xid_changes
    ([48], 1)
    """

    def __init__(self, url: str, node: str, timeout_s: float = 2.0) -> None:
        self.url = url
        self.node = node
        self.timeout_s = timeout_s
        #: the exporter's last Xid reading per (host, GPU); a key absent: no baseline yet
        self.last_xid: dict[tuple[str, int], int | None] = {}
        self.last_readings: dict[tuple[str, int], dict[str, Any]] = {}
        self.xid_changes = 0
        self.stale_scrapes = 0

    def sample(self, ts: float, job: str | None) -> list[GpuSample]:
        """Scrape once; the samples to publish (none when the exporter has not refreshed)."""
        return self.events(fetch_dcgm(self.url, self.node, ts, job, self.timeout_s))

    def events(self, samples: list[GpuSample]) -> list[GpuSample]:
        """``samples`` of one scrape with the Xid reported only where it changed."""
        readings = {(s.node, s.gpu): s.model_dump(exclude={"ts", "job"}) for s in samples}
        if readings and readings == self.last_readings:
            self.stale_scrapes += 1
            return []  # a GPU's silence is left to the lost-GPU check, not faked here
        self.last_readings = readings
        out = []
        for s in samples:
            key = (s.node, s.gpu)
            if key not in self.last_xid:
                if s.xid is not None:
                    log.info(
                        "%s GPU %d: dcgm-exporter's last Xid %d predates the agent; "
                        "taken as the baseline, not reported",
                        s.node,
                        s.gpu,
                        s.xid,
                    )
                new = None
            else:
                new = s.xid if s.xid != self.last_xid[key] else None
            self.last_xid[key] = s.xid
            if new is not None:
                self.xid_changes += 1
            out.append(s if new == s.xid else s.model_copy(update={"xid": new}))
        return out
