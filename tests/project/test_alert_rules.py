"""Prometheus rule files in ``dashboards/``: promtool's own checks and unit tests,
plus the house rules promtool does not know (kubernetes-mixin style): every alert
has ``for``, ``severity``, ``summary``, ``description`` and a ``runbook_url`` that
resolves to a README section; every alert is unit-tested on both sides of its
``for`` boundary, never fires on absent series, and every recording rule has an
expression test.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus_tools import require_binary

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
RECORDING_RULES = DASHBOARDS / "output_rate_recording_rules.yml"
ALERTS = DASHBOARDS / "output_rate_alerts.yml"
UNIT_TESTS = sorted((DASHBOARDS / "tests").glob("*.yml"))
README = DASHBOARDS / "README.md"
SEVERITIES = {"info", "warning", "critical"}


def rules(path: Path) -> list[dict[str, Any]]:
    return [
        rule
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


ALERT_RULES = {rule["alert"]: rule for rule in rules(ALERTS)}
RECORDED = [rule["record"] for rule in rules(RECORDING_RULES)]
UNIT_TEST_CASES = [
    case for path in UNIT_TESTS for case in yaml.safe_load(path.read_text())["tests"]
]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=DASHBOARDS,
    )


def minutes(duration: str) -> int:
    """``"15m"``, ``"1h"``, ``"90s"`` (whole minutes only) in minutes."""
    match = re.fullmatch(r"(\d+)([smh])", duration)
    assert match, f"unsupported duration {duration!r}"
    value, unit = int(match[1]), match[2]
    seconds = value * {"s": 1, "m": 60, "h": 3600}[unit]
    assert seconds % 60 == 0, f"{duration!r} is not whole minutes"
    return seconds // 60


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_unit_test_files_exist() -> None:
    assert UNIT_TESTS, f"no promtool unit tests in {DASHBOARDS / 'tests'}"


def test_rule_files_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RECORDING_RULES), str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(ALERT_RULES))
def test_alert_has_for_severity_and_annotations(name: str) -> None:
    rule = ALERT_RULES[name]
    assert minutes(rule.get("for", "0m")) > 0, f"{name}: needs a `for`"
    assert rule.get("labels", {}).get("severity") in SEVERITIES, name
    annotations = rule.get("annotations", {})
    for key in ("summary", "description"):
        assert annotations.get(key, "").strip(), f"{name}: empty {key}"
    assert annotations.get("runbook_url") == (f"dashboards/README.md#{name.lower()}"), (
        f"{name}: runbook_url must point at its README section"
    )


def test_every_runbook_url_resolves_to_a_readme_section() -> None:
    anchors = {
        github_anchor(line.lstrip("#"))
        for line in README.read_text().splitlines()
        if line.startswith("#")
    }
    for name, rule in ALERT_RULES.items():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in anchors, f"{name}: README has no section #{anchor}"


@pytest.mark.parametrize("name", sorted(ALERT_RULES))
def test_alert_is_tested_on_both_sides_of_its_for_boundary(name: str) -> None:
    """Some unit test expects the alert silent one minute before a time at which
    it expects it firing, on the same input series."""
    for case in UNIT_TEST_CASES:
        checks = [c for c in case.get("alert_rule_test", []) if c["alertname"] == name]
        silent = {minutes(c["eval_time"]) for c in checks if not c.get("exp_alerts")}
        firing = {minutes(c["eval_time"]) for c in checks if c.get("exp_alerts")}
        if any(t - 1 in silent for t in firing):
            return
    pytest.fail(f"{name}: no unit test checks both sides of its `for` boundary")


@pytest.mark.parametrize("name", sorted(ALERT_RULES))
def test_alert_has_a_negative_case_with_output_rate_data(name: str) -> None:
    """Besides absent series, some input with our metrics must not fire it."""
    for case in UNIT_TEST_CASES:
        checks = [c for c in case.get("alert_rule_test", []) if c["alertname"] == name]
        has_data = any("vllm:output_rate_" in s["series"] for s in case["input_series"])
        if checks and has_data and not any(c.get("exp_alerts") for c in checks):
            return
    pytest.fail(f"{name}: no unit test with output-rate data where it stays silent")


def test_absent_series_fire_nothing_and_record_nothing() -> None:
    for case in UNIT_TEST_CASES:
        if any("vllm:output_rate_" in s["series"] for s in case["input_series"]):
            continue
        silent_alerts = {
            c["alertname"]
            for c in case.get("alert_rule_test", [])
            if not c.get("exp_alerts")
        }
        empty_rules = {
            e["expr"]
            for e in case.get("promql_expr_test", [])
            if not e.get("exp_samples")
        }
        if silent_alerts >= set(ALERT_RULES) and empty_rules >= set(RECORDED):
            return
    pytest.fail("no unit test covers every alert and rule with absent series")


@pytest.mark.parametrize("record", RECORDED)
def test_recording_rule_has_an_expression_test_with_values(record: str) -> None:
    tested = {
        e["expr"]
        for case in UNIT_TEST_CASES
        for e in case.get("promql_expr_test", [])
        if e.get("exp_samples")
    }
    assert record in tested, f"{record}: no promql_expr_test expecting samples"


@pytest.mark.parametrize("rule", rules(RECORDING_RULES), ids=lambda r: r["record"])
def test_recording_rule_name_is_level_metric_operation(rule: dict) -> None:
    """kubernetes-mixin naming: the level is the labels the rule aggregates by."""
    level, metric, operation = rule["record"].split(":")
    assert re.fullmatch(r"[a-z][a-z0-9_]*", metric), metric
    assert re.fullmatch(r"[a-z][a-z0-9_]*", operation), operation
    by = re.search(r"\bby \(([^)]*)\)", rule["expr"])
    assert by, f"{rule['record']}: expression aggregates by no labels"
    assert level == "_".join(label.strip() for label in by[1].split(","))
