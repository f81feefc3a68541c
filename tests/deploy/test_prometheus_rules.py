"""deploy/prometheus/guard-rules.yml: valid for Prometheus, its alerts fire when they should.

``promtool`` (Debian's ``prometheus`` package, installed by deploy/tools/debian-tool.sh when
missing) checks the rules and runs their unit tests (guard-rules.test.yml: each alert fires on
the series that should raise it and stays quiet on near misses).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from ..tools import debian_tool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "guard-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "guard-rules.test.yml"
#: Where the services declare what they export.
EXPORTERS = ("guard/metrics.py", "streams/metrics.py", "sweeps/metrics.py", "agents/metrics.py")
#: The alerts issue 30 asks for, by what they watch.
ALERTS = {
    "GuardServiceDown",  # a worker down
    "GuardServiceStalled",  # a worker up but stuck
    "GuardConsumerLagHigh",
    "GuardCordonCapHeld",
    "GuardSweepFailureRate",
    "GuardWebhookFailing",
    "GuardSinkInsertsFailing",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = debian_tool("promtool", "prometheus")
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False
    )


def _rules() -> list[dict[str, str]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def test_promtool_checks_the_rules() -> None:
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    done = _promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_unit_tested_and_says_what_to_do() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} == ALERTS
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]  # a test that it fires, not only that it stays quiet
    }
    assert tested == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_the_rules_watch_metrics_the_services_export() -> None:
    exported = " ".join((ROOT / path).read_text() for path in EXPORTERS)
    for rule in _rules():
        for name in re.findall(r"\bguard_[a-z_]+", rule["expr"]):
            assert f'"{name}"' in exported, f"{rule['alert']}: no service exports {name}"
