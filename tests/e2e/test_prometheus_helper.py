"""``tests/e2e_prometheus.py`` against a real Prometheus server.

The scrape target is a prometheus_client HTTP server in this process exposing the
real ``OutputRateMetrics``, fed with payloads from the real ``PayloadBuilder``:
alice is charged 3 tokens and skipped once per tick (throttle ratio 1/4), bob is
charged 2 tokens per tick and never skipped (ratio 0).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from engine_ext.metrics import OutputRateMetrics
from engine_ext.payload_builder import PayloadBuilder
from engine_ext.payload_parser import parse
from pacing.accounting import Accounting
from tests.e2e_prometheus import PrometheusError, PrometheusServer
from tests.prometheus_tools import require_binary

TICK_S = 0.05
RATES = {"alice": 20, "bob": 50}


@pytest.fixture
def target() -> Iterator[str]:
    """``host:port`` of a metrics endpoint whose counters grow every tick."""
    registry = CollectorRegistry()
    metrics = OutputRateMetrics("m", registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def feed() -> None:
        accounting, builder = Accounting(), PayloadBuilder()
        while not stop.wait(TICK_S):
            accounting.record("alice", "charged", 3)
            accounting.record("alice", "throttled_skips", 1)
            accounting.record("bob", "charged", 2)
            payload = builder.build(
                accounting=accounting,
                user_rates=RATES,
                default_rate=10,
                throttled_requests=1,
                tracked_users=2,
            )
            metrics.apply(parse(payload))

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        stop.set()
        feeder.join(timeout=5)
        server.shutdown()
        thread.join(timeout=5)


def by_user(result: list[dict]) -> dict[str, float]:
    return {sample["metric"]["user"]: float(sample["value"][1]) for sample in result}


def test_recording_rule_gives_the_throttle_ratio_of_scraped_metrics(
    target: str,
) -> None:
    require_binary("prometheus")
    ratio = "model_name_user:vllm_output_rate_throttle_ratio:rate5m"
    with PrometheusServer(target) as prometheus:
        prometheus.wait_for('up{job="target"} == 1', timeout_s=30)
        # rate() needs two scrapes; a few more make one tick's skew negligible.
        prometheus.wait_for('count_over_time(up{job="target"}[1m]) >= 6', 30)
        prometheus.wait_for(f'{ratio}{{user="bob"}}', timeout_s=15)
        ratios = by_user(prometheus.query(ratio))
        limits = by_user(prometheus.query("vllm:output_rate_limit_tokens_per_second"))
        output = by_user(
            prometheus.query("model_name_user:vllm_output_rate_output_tokens:rate5m")
        )
    assert ratios["alice"] == pytest.approx(0.25, abs=0.03)
    assert ratios["bob"] == 0
    assert "__other__" not in ratios  # nobody unlabelled asked for anything
    assert limits == {"alice": 20, "bob": 50, "__default__": 10}
    # rate() over a 5m window holding a few seconds of samples is scaled down,
    # alike for every user: compare users (3 vs 2 tokens per tick, no refunds).
    assert output["alice"] / output["bob"] == pytest.approx(1.5, abs=0.1)


def test_stop_ends_the_server_and_removes_its_storage(target: str) -> None:
    require_binary("prometheus")
    prometheus = PrometheusServer(target).start()
    storage = prometheus._dir
    assert storage is not None and storage.is_dir()
    assert prometheus.query("vector(1)")[0]["value"][1] == "1"
    prometheus.stop()
    assert not storage.exists()
    with pytest.raises(OSError):
        prometheus.query("vector(1)")


def test_a_broken_rule_file_fails_start_with_prometheus_own_message(
    tmp_path: Path,
) -> None:
    require_binary("prometheus")
    broken = tmp_path / "broken.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - record: a\n")
    with pytest.raises(PrometheusError, match="Prometheus did not start"):
        PrometheusServer("127.0.0.1:1", rule_files=[broken], start_timeout_s=20).start()


def test_a_query_error_is_raised(target: str) -> None:
    require_binary("prometheus")
    with (
        PrometheusServer(target) as prometheus,
        pytest.raises(PrometheusError, match="parse error"),
    ):
        prometheus.query("sum by (")
