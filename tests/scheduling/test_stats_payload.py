"""Tests for ``engine_ext.stats_payload``: what both sides of the metrics
payload share (pure: no vLLM, no Prometheus).

What must hold: a repeating failure is logged at powers of two only, and the
payload's trip through ``SchedulerStats`` (``attach`` on the engine side,
``take_payload`` on the API side) leaves a KV connector's data as it was.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from engine_ext.payload_builder import attach
from engine_ext.payload_parser import take_payload
from engine_ext.stats_payload import PAYLOAD_KEY, FailureLog


def test_failures_are_logged_at_powers_of_two(caplog) -> None:
    log = FailureLog(logging.getLogger("test.failures"), "thing failed")
    with caplog.at_level(logging.ERROR, logger="test.failures"):
        for _ in range(9):
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.record()
    assert log.count == 9
    assert [r.getMessage() for r in caplog.records] == [
        f"thing failed (failure {n}; logged at failures 1, 2, 4, 8, ...)"
        for n in (1, 2, 4, 8)
    ]
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in caplog.records)


def test_attach_and_take_payload_leave_connector_data_alone() -> None:
    stats = SimpleNamespace(kv_connector_stats=None)
    attach(stats, {"v": 1})
    assert stats.kv_connector_stats == {PAYLOAD_KEY: {"v": 1}}
    assert take_payload(stats) == {"v": 1}
    assert stats.kv_connector_stats is None  # as vLLM built it
    stats = SimpleNamespace(kv_connector_stats={"connector": 1})
    attach(stats, {"v": 1})
    assert take_payload(stats) == {"v": 1}
    assert stats.kv_connector_stats == {"connector": 1}
    assert take_payload(stats) is None
    assert take_payload(None) is None
