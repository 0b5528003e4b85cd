"""The shipped Prometheus rules: promtool accepts them, their unit tests pass, every alert is
tested firing and not firing, and every alert says what it means and where its runbook is."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "dashboards" / "prometheus" / "alerts_test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (make test installs the Debian package prometheus)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_unit_tests_pass() -> None:
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout and "FAILED" not in r.stdout, r.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), f"never tested firing: {sorted(names - fires)}"
    assert names - quiet == set(), f"never tested not firing: {sorted(names - quiet)}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_every_alert_has_summary_description_and_a_runbook_section() -> None:
    anchors = _anchors(RUNBOOK.read_text())
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        ann = rule.get("annotations", {})
        assert ann.get("summary") and ann.get("description"), rule["alert"]
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), rule["alert"]
        path, _, anchor = ann.get("runbook_url", "").partition("#")
        assert path == "docs/runbook.md", rule["alert"]
        assert anchor == rule["alert"].lower() and anchor in anchors, (rule["alert"], anchor)
