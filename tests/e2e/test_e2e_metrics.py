"""End to end: the limiter's metrics on the vLLM server's own ``/metrics``, scraped
by a real Prometheus while a throttled load runs; recording rules and every
dashboard query evaluated there. And control-plane changes reaching ``/metrics``
on an idle server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tests.e2e_prometheus import PrometheusServer
from tests.prometheus_tools import require_binary
from tools.measure import run_streams
from tools.server_metrics import metric_value

pytestmark = pytest.mark.server

DASHBOARD = (
    Path(__file__).resolve().parents[2] / "dashboards" / "output_rate_dashboard.json"
)
RATIO = "model_name_user:vllm_output_rate_throttle_ratio:rate5m"


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    flat = [p for panel in panels for p in [panel, *panel.get("panels", [])]]
    return [
        (panel["title"], target["expr"])
        for panel in flat
        for target in panel.get("targets", [])
    ]


def substitute(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$model_name", ".*")
        .replace("$user", ".*")
    )


def control_plane_events(server) -> None:
    """A few RPCs (one refused), and an edit of the config file that is refused."""
    with grpc.insecure_channel(server.control_address) as channel:
        stub = pb_grpc.OutputRateControlStub(channel)
        stub.GetDefaultLimit(pb.GetDefaultLimitRequest(name="defaultLimit"))
        with pytest.raises(grpc.RpcError) as error:
            stub.GetLimit(pb.GetLimitRequest(name="limits/nobody"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    config = Path(server.log_path).parent / "limits.json"
    good = config.read_text()
    config.write_text("{not json")
    return good


def test_metrics_reach_vllm_metrics_and_prometheus(vllm_server):
    require_binary("prometheus")
    good_config = control_plane_events(vllm_server)
    target = vllm_server.base_url.removeprefix("http://")
    with PrometheusServer(target) as prometheus:
        prometheus.wait_for('up{job="target"} == 1')
        # Counters are born with the first step's events; let Prometheus see
        # every series once before the load, so rate() counts all of it.
        warm_up = [("user-a", 2), ("user-fast", 2), ("team-a", 2)]
        asyncio.run(run_streams(vllm_server.base_url, vllm_server.model, warm_up))
        prometheus.wait_for(
            'vllm:output_rate_tokens_charged_total{user="user-fast"} > 0'
        )
        streams = [("user-a", 60)] * 4 + [("user-fast", 60), ("user-c", 60)]
        streams += [("team-a", 60)]  # the team panels' members' time
        asyncio.run(run_streams(vllm_server.base_url, vllm_server.model, streams))
        config = Path(vllm_server.log_path).parent / "limits.json"
        config.write_text(good_config)

        throttled = prometheus.wait_for(f'{RATIO}{{user="user-a"}} > 0')
        unthrottled = prometheus.wait_for(f'{RATIO}{{user="user-fast"}}')
        print(f"\nthrottle ratio user-a {throttled[0]['value'][1]}, "
              f"user-fast {unthrottled[0]['value'][1]}")  # fmt: skip
        assert float(unthrottled[0]["value"][1]) == 0.0

        # Tier and team series exist only while (limits) or since (counters)
        # the server had a tier or team, and other tests on this shared server
        # may add and remove them: such a panel must have data when every tier
        # or team series it reads is exported (a team member streamed in the
        # warm-up, so the teams' do). Store series exist only with a store
        # configured, ceiling and band series only while the policy has
        # ceilings or bands, which this server's has not: the same rule.
        metrics_text = httpx.get(vllm_server.base_url + "/metrics", timeout=10).text
        samples = [
            sample
            for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples
        ]
        exported = {sample.name for sample in samples}
        # The default's limit series have a sample only while the default
        # sets that limit (this server's default has no prompt rate).
        defaults = {s.name for s in samples if s.labels.get("user") == "__default__"}
        empty = []
        for title, expr in dashboard_queries():
            optional = set(
                re.findall(
                    r"vllm:output_rate_(?:tier|team|store|band|ceiling|borrow)\w+",
                    expr,
                )
            )
            if optional - exported:
                continue
            if 'user="__default__"' in expr and not any(
                name in expr for name in defaults
            ):
                continue
            try:
                prometheus.wait_for(substitute(expr), timeout_s=20)
            except Exception as exc:
                empty.append(f"{title}: {expr} ({exc})")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    text = httpx.get(vllm_server.base_url + "/metrics", timeout=10).text
    users = set(re.findall(r'vllm:output_rate_\w+\{[^}]*user="([^"]*)"', text))
    allowed = set(json.loads(json.dumps(list(vllm_server_users())))) | {
        "__other__",
        "__default__",
    }
    assert users <= allowed, f"raw user ids leaked into labels: {users - allowed}"
    assert "user-c" not in users
    for name in (
        "vllm:output_rate_tokens_charged_total",
        "vllm:output_rate_throttled_skips_total",
        "vllm:output_rate_tracked_users",
        "vllm:output_rate_idle_wait_seconds_bucket",
        "vllm:output_rate_control_rpcs_total",
        "vllm:output_rate_config_reloads_total",
    ):
        assert name in text, name


def vllm_server_users() -> list[str]:
    from tests.conftest import SERVER_LIMITS

    return list(SERVER_LIMITS["users"])


#: Not in SERVER_LIMITS: the users other tests rely on keep their limits.
IDLE_USER = "user-idle-metrics"
#: Far above the heartbeat's ~2 s: the test proves freshness, not its speed.
IDLE_DEADLINE_S = 30.0
LIMIT_GAUGE = "vllm:output_rate_limit_tokens_per_second"
RELOADS = "vllm:output_rate_config_reloads_total"


def seconds_until(
    server, name: str, holds: Callable[[float | None], bool], **labels: str
) -> float:
    """Polls ``/metrics`` until ``holds(value)``; returns how long it took."""
    started = time.monotonic()
    while True:
        value = metric_value(server.base_url, name, **labels)
        if holds(value):
            return time.monotonic() - started
        assert time.monotonic() - started < IDLE_DEADLINE_S, (
            f"{name}{labels} still {value} after {IDLE_DEADLINE_S:.0f} s"
        )
        time.sleep(0.05)


def replace_file(path: Path, text: str) -> None:
    """Writes ``path`` at once: the server's watcher never reads half of it."""
    edit = path.with_name(path.name + ".edit")
    edit.write_text(text)
    os.replace(edit, path)


def test_control_plane_changes_reach_metrics_on_an_idle_server(vllm_server):
    assert metric_value(vllm_server.base_url, "vllm:num_requests_running") == 0
    config = Path(vllm_server.log_path).parent / "limits.json"
    channel = grpc.insecure_channel(vllm_server.control_address)
    stub = pb_grpc.OutputRateControlStub(channel)
    good: str | None = None
    try:
        limit = pb.Limit(name=f"limits/{IDLE_USER}", tokens_per_second=7)
        stub.UpdateLimit(pb.UpdateLimitRequest(limit=limit, allow_missing=True))
        limit_s = seconds_until(
            vllm_server, LIMIT_GAUGE, lambda v: v == 7, user=IDLE_USER
        )

        good = config.read_text()
        failures = metric_value(vllm_server.base_url, RELOADS, result="failure") or 0
        replace_file(config, "{not json: an edit the server must refuse")
        failure_s = seconds_until(
            vllm_server, RELOADS, lambda v: (v or 0) > failures, result="failure"
        )
    finally:
        if good is not None:
            replace_file(config, good)  # the table the server still holds
        stub.DeleteLimit(
            pb.DeleteLimitRequest(name=f"limits/{IDLE_USER}", allow_missing=True)
        )
        channel.close()
    gone_s = seconds_until(
        vllm_server, LIMIT_GAUGE, lambda v: v is None, user=IDLE_USER
    )
    print(
        f"\non an idle server, /metrics showed: a limit set over gRPC after "
        f"{limit_s:.2f} s, a refused limits-file edit after {failure_s:.2f} s "
        f"(the file is polled every second), a deleted limit gone after "
        f"{gone_s:.2f} s"
    )
    assert metric_value(vllm_server.base_url, "vllm:num_requests_running") == 0
