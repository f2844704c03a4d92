"""Lint of ``dashboards/output_rate_dashboard.json``: importable as is (``__inputs``
with ``DS_PROMETHEUS``, the data source a template variable), every panel with a
unit, a description and the templated data source, every query filtered by
``$model_name``, windows from ``$__rate_interval``, every PromQL expression parsed
by promtool, and every metric it names one we export or record.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine_ext import metrics
from tests.prometheus_tools import require_binary

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DASHBOARD = json.loads((DASHBOARDS / "output_rate_dashboard.json").read_text())
RECORDING_RULES = yaml.safe_load(
    (DASHBOARDS / "output_rate_recording_rules.yml").read_text()
)["groups"][0]["rules"]
TEMPLATED_DS = {"type": "prometheus", "uid": "${datasource}"}

EXPORTED = {
    *metrics.USER_COUNTERS.values(),
    metrics.IDLE_WAIT_SECONDS,
    metrics.THROTTLED_REQUESTS,
    metrics.TRACKED_USERS,
    metrics.LIMIT_TOKENS_PER_SECOND,
    metrics.PROMPT_LIMIT_TOKENS_PER_SECOND,
    metrics.CEILING_TOKENS_PER_SECOND,
    metrics.BORROWING_BLOCKED,
    metrics.LIMIT_CHANGES,
    metrics.CONFIG_RELOADS,
    metrics.CONTROL_RPCS,
    metrics.MODE,
    *metrics.TIER_COUNTERS.values(),
    metrics.TIER_LIMIT_TOKENS_PER_SECOND,
    *metrics.TEAM_COUNTERS.values(),
    metrics.TEAM_LIMIT_TOKENS_PER_SECOND,
    metrics.TEAM_MEMBERS_STREAMING,
    metrics.TEAM_THROTTLED_MEMBERS,
    metrics.TEAM_MEMBER_ACTIVE_SECONDS,
    metrics.TEAM_MEMBER_THROTTLED_SECONDS,
    metrics.STORE_ROUND_TRIPS,
    metrics.STORE_ROUND_TRIP_SECONDS,
    *metrics.STORE_TOKEN_COUNTERS.values(),
    metrics.STORE_DEGRADED,
    metrics.STORE_LIVE_ENGINES,
    metrics.FAIR_SHARE_ENABLED,
    metrics.FAIR_SHARE_SERVICE_GAP,
    metrics.BAND_TOKENS,
    metrics.BAND_WAIT_SECONDS,
    metrics.BAND_WAITING_REQUESTS,
    metrics.BAND_FAIRNESS,
}
HISTOGRAMS = (metrics.IDLE_WAIT_SECONDS, metrics.STORE_ROUND_TRIP_SECONDS)
#: A histogram's series -> the histogram.
HISTOGRAM_SERIES = {
    f"{histogram}{suffix}": histogram
    for histogram in HISTOGRAMS
    for suffix in ("_bucket", "_sum", "_count")
}
RECORDED = {rule["record"]: rule["expr"] for rule in RECORDING_RULES}
# Our metric names and recorded names, as they appear in PromQL.
NAME = re.compile(
    r"(?<![\w:])(vllm:output_rate_\w+|[a-z_]+:vllm_output_rate_\w+:\w+)(?![\w:])"
)


def panels(items: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in rows."""
    for panel in DASHBOARD["panels"] if items is None else items:
        if panel.get("type") == "row":
            yield from panels(panel.get("panels", []))
        else:
            yield panel


PANELS = list(panels())
TARGETS = [(panel, target) for panel in PANELS for target in panel["targets"]]
EXPRS = [target["expr"] for _, target in TARGETS]
VARIABLES = {v["name"]: v for v in DASHBOARD["templating"]["list"]}


def series_names(expr: str) -> set[str]:
    return set(NAME.findall(expr))


def test_import_asks_for_a_prometheus_data_source() -> None:
    assert DASHBOARD["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": DASHBOARD["__inputs"][0]["description"],
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    assert DASHBOARD["id"] is None  # Grafana assigns one on import
    assert DASHBOARD["uid"]


def test_data_source_is_a_template_variable_defaulting_to_the_import_input() -> None:
    variable = VARIABLES["datasource"]
    assert variable["type"] == "datasource"
    assert variable["query"] == "prometheus"
    assert variable["current"]["value"] == "${DS_PROMETHEUS}"


@pytest.mark.parametrize("name", ["model_name", "user"])
def test_model_name_and_user_variables_query_our_metrics(name: str) -> None:
    variable = VARIABLES[name]
    assert variable["type"] == "query"
    assert variable["datasource"] == TEMPLATED_DS
    query = variable["query"]["query"]
    assert re.fullmatch(rf"label_values\((.+), {name}\)", query), query
    assert series_names(query) <= EXPORTED, query


def test_user_variable_allows_all_and_several_users() -> None:
    user = VARIABLES["user"]
    assert (user["includeAll"], user["multi"], user["allValue"]) == (True, True, ".*")
    assert '{model_name=~"$model_name"}' in user["query"]["query"]


@pytest.mark.parametrize("panel", PANELS, ids=lambda p: p["title"])
def test_panel_has_unit_description_and_templated_data_source(panel: dict) -> None:
    assert panel["fieldConfig"]["defaults"].get("unit"), "no unit"
    assert len(panel.get("description", "")) >= 40, "no real description"
    assert panel["datasource"] == TEMPLATED_DS
    assert panel["targets"], "no queries"
    for target in panel["targets"]:
        assert target["datasource"] == TEMPLATED_DS, target["refId"]
        assert target["expr"].strip(), target["refId"]


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    ids = [panel["id"] for panel in PANELS]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in PANELS:
        g = panel["gridPos"]
        area = {
            (x, y)
            for x in range(g["x"], g["x"] + g["w"])
            for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        assert g["x"] + g["w"] <= 24, panel["title"]
        cells |= area


@pytest.mark.parametrize("expr", EXPRS)
def test_every_selector_is_filtered_by_model_name(expr: str) -> None:
    for name in series_names(expr):
        for selector in re.findall(rf"{re.escape(name)}(\{{[^}}]*\}})?", expr):
            assert 'model_name=~"$model_name"' in selector, (name, expr)


@pytest.mark.parametrize("expr", EXPRS)
def test_range_windows_come_from_rate_interval(expr: str) -> None:
    for window in re.findall(r"\[([^\]]+)\]", expr):
        assert window == "$__rate_interval", expr


@pytest.mark.parametrize("expr", EXPRS)
def test_every_metric_is_exported_or_recorded(expr: str) -> None:
    unknown = series_names(expr) - EXPORTED - set(HISTOGRAM_SERIES) - set(RECORDED)
    assert not unknown, f"unknown series {sorted(unknown)} in {expr}"


def test_dashboard_shows_every_exported_metric() -> None:
    shown: set[str] = set()
    for expr in EXPRS:
        for name in series_names(expr):
            shown |= series_names(RECORDED[name]) if name in RECORDED else {name}
    shown = {HISTOGRAM_SERIES.get(name, name) for name in shown}
    assert shown >= EXPORTED, f"not shown: {sorted(EXPORTED - shown)}"


def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses each panel expression and each variable's series selector
    as a recording rule, after Grafana's variables are replaced by what Grafana
    would send."""
    substitutions = {
        "$__rate_interval": "5m",
        "$model_name": ".*",
        "$user": ".*",
    }
    selectors = [
        re.fullmatch(r"label_values\((.+), \w+\)", v["query"]["query"])[1]
        for v in VARIABLES.values()
        if v["type"] == "query"
    ]
    rules = []
    for index, expr in enumerate([*EXPRS, *selectors]):
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unsubstituted variable in {expr}"
        rules.append({"record": f"dashboard:expr_{index}:check", "expr": expr})
    rule_file = tmp_path / "dashboard_exprs.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]}))
    result = subprocess.run(
        [require_binary("promtool"), "check", "rules", str(rule_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
