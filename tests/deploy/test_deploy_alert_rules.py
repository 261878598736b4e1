"""deploy/observability/alerts.yaml, evaluated by Prometheus's own promtool: the rules load, and
each alert fires on the series it is written for and stays quiet on its near misses
(deploy/observability/alerts_test.yaml)."""

from __future__ import annotations

import subprocess

import yaml
from deploy_tools import REPO, require_tool

OBSERVABILITY = REPO / "deploy" / "observability"
RULES = OBSERVABILITY / "alerts.yaml"
UNIT_TESTS = OBSERVABILITY / "alerts_test.yaml"


def _alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=120)


def test_promtool_loads_every_rule():
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_names())} rules found" in result.stdout


def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say():
    result = _promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    firing, quiet = set(), set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = set(_alert_names())
    assert alerts - firing == set(), f"alerts never shown firing: {sorted(alerts - firing)}"
    assert alerts - quiet == set(), f"alerts never shown quiet: {sorted(alerts - quiet)}"
    assert (firing | quiet) <= alerts, f"unit tests of unknown alerts: {sorted((firing | quiet) - alerts)}"
