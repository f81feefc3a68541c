"""DCGM diagnostics (``dcgmi diag -r LEVEL -j``) as a sweep check, one result per DCGM test.

NVIDIA's own active health checks: level 1 the deployment/software checks (seconds), 2 adds
PCIe and memory (~2 min), 3 the stress, power and bandwidth tests (~15 min). ``dcgmi``'s JSON
has changed shape between releases, and both shapes are read:

- DCGM 4.x: ``{"DCGM Diagnostic": {"test_categories": [{"category", "tests": [{"name",
  "results": [{"entity_group": "GPU", "entity_id": 3, "status": "Fail", "warnings":
  [{"warning", "error_id", ...}], "info": [...]}], "test_summary": {"status"}}]}]}``, plus
  ``entity_groups`` and ``metadata`` (``version``, ``Driver Version Detected``) at the top;
- DCGM 2.x/3.x: the same tree under ``"DCGM GPU Diagnostic"``, results keyed by ``gpu_id``
  (a string) or ``gpu_ids`` (``"0,1,2"``), a deployment test's one result covering every GPU.

A test passes only when every GPU the node should have has a ``Pass`` for it. ``Fail`` and
``Warn`` fail the node, ``Skip`` and a GPU without a result (``dcgmi`` leaves out what it did
not run) are untested and fail it too, unless the site declared that test allowed to skip
(``sweep.dcgm_skip_ok``). A document with no test, a ``runtime_error``, output that is not
JSON and a non-zero exit without a failing test are failed results that say so.

Example
-------
>>> doc = '''{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
...   {"name": "memory", "results": [
...     {"entity_group": "GPU", "entity_id": 0, "status": "Pass"},
...     {"entity_group": "GPU", "entity_id": 1, "status": "Fail",
...      "warnings": [{"warning": "Uncorrectable ECC", "error_id": 45}]}]}]}]},
...   "metadata": {"version": "4.2.3"}}'''
>>> [(r.name, r.value, r.passed) for r in judge_diag(parse_diag(doc), gpus=2, level=2)]
[('dcgm:memory', 1.0, False)]
>>> judge_diag(parse_diag(doc), gpus=2, level=2)[0].detail
'level 2, DCGM 4.2.3: gpu1 Fail (Uncorrectable ECC [error 45]); gpu0 Pass'
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import CheckContext, CheckError, CheckResult

__all__ = ["DcgmDiag", "DcgmDiagCheck", "DcgmTest", "judge_diag", "parse_diag"]

#: Seconds ``dcgmi diag -r LEVEL`` may take before it is stopped (NVIDIA's guide: level 1
#: seconds, 2 about two minutes, 3 about fifteen, 4 longer).
TIMEOUT_S = {1: 300.0, 2: 900.0, 3: 3600.0, 4: 3 * 3600.0}
_WHOLE_NODE = -1  # a result that names no GPU covers every GPU (3.x deployment tests)


@dataclass(slots=True)
class DcgmTest:
    """One DCGM test: its status per GPU (``_WHOLE_NODE``: every GPU) and what DCGM said."""

    name: str
    category: str = ""
    status: dict[int, str] = field(default_factory=dict)
    said: dict[int, list[str]] = field(default_factory=dict)


@dataclass(slots=True)
class DcgmDiag:
    """What one ``dcgmi diag -j`` document holds."""

    tests: list[DcgmTest]
    version: str = ""
    runtime_error: str = ""


def _slug(name: str) -> str:
    """``'Targeted Stress'`` → ``targeted_stress`` (3.x names tests for display, 4.x by plugin)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unnamed"


def _gpu_ids(result: dict[str, Any]) -> list[int]:
    """The GPUs a result is about; ``[_WHOLE_NODE]`` when it names none."""
    if "entity_id" in result:
        group = str(result.get("entity_group", "GPU"))
        return [int(result["entity_id"])] if group.upper() == "GPU" else []
    for key in ("gpu_id", "gpu_ids"):
        if key in result and result[key] not in (None, ""):
            raw = result[key]
            if isinstance(raw, int):
                return [raw]
            return [int(part) for part in str(raw).split(",") if part.strip()]
    return [_WHOLE_NODE]


def _messages(result: dict[str, Any]) -> list[str]:
    said = []
    for warning in result.get("warnings") or []:
        if isinstance(warning, dict):
            text = warning.get("warning") or warning.get("warnings") or ""
            code = warning.get("error_id")
            said.append(f"{text} [error {code}]" if code is not None else str(text))
        elif warning:
            said.append(str(warning))
    return said


def parse_diag(output: str) -> DcgmDiag:
    """The tests of ``dcgmi diag -j``'s output (text before the document is ignored, as
    dcgmi prints warnings there). Raises :class:`CheckError` when there is no document."""
    start, end = output.find("{"), output.rfind("}")
    if start < 0 or end <= start:
        raise CheckError(f"dcgmi printed no JSON document: {output.strip()[-300:]!r}")
    try:
        doc = json.loads(output[start : end + 1])
    except ValueError as exc:
        raise CheckError(f"dcgmi's output is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckError("dcgmi's JSON is not an object")
    root = doc.get("DCGM Diagnostic", doc.get("DCGM GPU Diagnostic", {}))
    if not isinstance(root, dict):
        root = {}
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    version = str(meta.get("version") or root.get("version") or doc.get("version") or "")
    tests = []
    for category in root.get("test_categories") or []:
        if not isinstance(category, dict):
            continue
        for raw in category.get("tests") or []:
            if not isinstance(raw, dict):  # DCGM 3.1 leaves nulls between tests
                continue
            test = DcgmTest(_slug(str(raw.get("name", ""))), str(category.get("category", "")))
            for result in raw.get("results") or []:
                if not isinstance(result, dict):
                    continue
                status = str(result.get("status", "")).strip().capitalize()
                for gpu in _gpu_ids(result):
                    test.status[gpu] = status
                    test.said.setdefault(gpu, []).extend(_messages(result))
            tests.append(test)
    return DcgmDiag(tests, version, str(root.get("runtime_error") or ""))


def _verdict(statuses: list[str], skip_ok: bool) -> str:
    """The worst of a GPU's statuses: fail, untested or pass."""
    if any(s in ("Fail", "Warn") for s in statuses):
        return "fail"
    if not statuses or any(s != "Pass" and not (s == "Skip" and skip_ok) for s in statuses):
        return "untested"
    return "pass"


def judge_diag(
    diag: DcgmDiag, gpus: int, level: int, skip_ok: Collection[str] = (), exit_code: int = 0
) -> list[CheckResult]:
    """One result per test (``dcgm:<test>``: value = GPUs that did not pass it)."""
    where = f"level {level}" + (f", DCGM {diag.version}" if diag.version else "")
    if diag.runtime_error:
        return [CheckResult("dcgm", None, passed=False, detail=f"{where}: {diag.runtime_error}")]
    if not diag.tests:
        return [
            CheckResult(
                "dcgm",
                None,
                passed=False,
                detail=f"untested: {where}: dcgmi reported no test (exit {exit_code})",
            )
        ]
    out = []
    for test in diag.tests:
        allowed = test.name in skip_ok
        verdicts: dict[int, tuple[str, str, list[str]]] = {}
        for gpu in range(gpus):
            got = [test.status[g] for g in (gpu, _WHOLE_NODE) if g in test.status]
            said = [m for g in (gpu, _WHOLE_NODE) for m in test.said.get(g, [])]
            shown = "/".join(got) or "no result"
            verdicts[gpu] = (_verdict(got, allowed), shown, said)
        others = sorted(g for g in test.status if g != _WHOLE_NODE and not 0 <= g < gpus)
        bad = {g: v for g, v in verdicts.items() if v[0] != "pass"}
        parts = []
        for gpu, (verdict, shown, said) in sorted(bad.items(), key=lambda kv: kv[1][0] != "fail"):
            why = f" ({'; '.join(said)})" if said else ""
            untested = " — untested" if verdict == "untested" else ""
            parts.append(f"gpu{gpu} {shown}{why}{untested}")
        good = [g for g in verdicts if g not in bad]
        if good:
            parts.append(
                _gpu_list(good) + (" Skip, allowed" if allowed and _skipped(test) else " Pass")
            )
        if others:
            parts.append(f"results for GPUs not declared: {others}")
        out.append(
            CheckResult(
                f"dcgm:{test.name}",
                float(len(bad)),
                "gpus",
                passed=not bad and not others,
                baseline=0.0,
                detail=f"{where}: " + "; ".join(parts),
            )
        )
    if exit_code != 0 and all(r.passed for r in out):
        out.append(
            CheckResult(
                "dcgm",
                None,
                passed=False,
                detail=f"{where}: dcgmi exited {exit_code} although every test it reported "
                "passed: see nv-hostengine.log and nvvs.log under /var/log/nvidia-dcgm",
            )
        )
    return out


def _skipped(test: DcgmTest) -> bool:
    return any(s == "Skip" for s in test.status.values())


def _gpu_list(gpus: Sequence[int]) -> str:
    ordered = sorted(gpus)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"gpu{ordered[0]}-{ordered[-1]}"
    return ", ".join(f"gpu{g}" for g in ordered)


class DcgmDiagCheck:
    """``dcgmi diag -r ctx.dcgm_level -j`` on every GPU, judged per test and GPU.

    In the default check set only when ``dcgmi`` is installed; asked for by name
    (``--checks dcgm``) on a host without it, it fails as untested.
    """

    name = "dcgm"

    def run(self, ctx: CheckContext) -> list[CheckResult]:
        level = ctx.dcgm_level
        if ctx.expected_gpus is None or ctx.expected_gpus == 0:
            raise CheckError("untested: DCGM diagnostics judge GPUs and this node declares none")
        exe = shutil.which(ctx.dcgmi)
        if exe is None:
            raise CheckError(
                f"untested: {ctx.dcgmi} not found on PATH: install DCGM (datacenter-gpu-manager) "
                "and start nv-hostengine, or leave dcgm out of --checks"
            )
        argv = [exe, "diag", "-r", str(level), "-j"]
        ctx.progress(f"dcgmi diag -r {level} (up to {TIMEOUT_S[level]:.0f} s)")
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=TIMEOUT_S[level], check=False
            )
        except subprocess.TimeoutExpired:
            why = f"dcgmi diag -r {level} did not finish in {TIMEOUT_S[level]:.0f} s"
            raise CheckError(why) from None
        try:
            diag = parse_diag(done.stdout)
        except CheckError as exc:
            tail = done.stderr.strip()[-300:]
            why = f"{exc} (exit {done.returncode}{': ' + tail if tail else ''})"
            raise CheckError(why) from None
        return judge_diag(diag, ctx.expected_gpus, level, ctx.dcgm_skip_ok, done.returncode)
