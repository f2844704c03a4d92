"""Tests for the fair-share part of the metrics payload (``engine_ext.
payload_builder`` and ``payload_parser``; pure: no vLLM, no Prometheus).

What must hold: weighted service travels as a float delta per labelled user
(the rest under ``__other__``) and per tier, fair-share preemptions as whole
deltas, and the ledger's switch and gap as gauges; the parser accepts that and
nothing malformed.
"""

from __future__ import annotations

import pytest

from engine_ext.payload_builder import PayloadBuilder
from engine_ext.payload_parser import FairSharePart, PayloadError, parse
from engine_ext.stats_payload import OTHER_USER
from pacing.accounting import Accounting
from pacing.fair_share import FairShare
from pacing.limiter import OutputRateLimiter
from tests.payload_harness import build


def ledger(enabled: bool, counters: dict[str, float], backlogged: set[str]):
    fair_share = FairShare(enabled=enabled)
    fair_share.counter.update(counters)
    fair_share.backlogged = frozenset(backlogged)
    return fair_share


def test_weighted_service_and_preemptions_travel_as_deltas_per_user_and_tier():
    accounting = Accounting()
    limiter = OutputRateLimiter(10, {"alice": 50}, tier_rates={"pro": 200})
    limiter.set_membership("bob", "pro", now_ns=0)
    builder = PayloadBuilder()
    accounting.record("alice", "fair_share_service", 1.5)
    accounting.record("bob", "fair_share_service", 0.25)
    accounting.record("bob", "fair_share_preemptions", 2)
    first = build(builder, accounting, {"alice": 50}, limiter=limiter)
    assert first["users"]["alice"] == {"fair_share_service": 1.5}
    assert first["users"][OTHER_USER] == {
        "fair_share_service": 0.25,
        "fair_share_preemptions": 2,
    }
    assert first["tier_counters"] == {
        "pro": {"fair_share_service": 0.25, "fair_share_preemptions": 2}
    }
    accounting.record("alice", "fair_share_service", 0.75)
    second = build(builder, accounting, {"alice": 50}, limiter=limiter)
    assert second["users"] == {"alice": {"fair_share_service": 0.75}}
    assert second["tier_counters"] == {}
    assert parse(second).users == {"alice": {"fair_share_service": 0.75}}


def test_the_gauges_are_the_ledgers_switch_and_gap_among_the_backlogged():
    fair_share = ledger(True, {"a": 10.0, "b": 250.5, "idle": 9999.0}, {"a", "b"})
    raw = build(PayloadBuilder(), Accounting(), {}, fair_share=fair_share)
    assert raw["fair_share"] == {"enabled": 1, "gap": 240.5}
    assert parse(raw).fair_share == FairSharePart(enabled=True, gap=240.5)
    fair_share.backlogged = frozenset({"a"})
    raw = build(PayloadBuilder(), Accounting(), {}, fair_share=fair_share)
    assert parse(raw).fair_share == FairSharePart(enabled=True, gap=0.0)


def test_switched_off_the_gap_is_zero_not_the_last_steps():
    fair_share = ledger(False, {"a": 10.0, "b": 250.5}, {"a", "b"})
    raw = build(PayloadBuilder(), Accounting(), {}, fair_share=fair_share)
    assert parse(raw).fair_share == FairSharePart(enabled=False, gap=0.0)


def test_without_a_ledger_the_payload_has_no_fair_share_part():
    raw = build(PayloadBuilder(), Accounting(), {})
    assert raw["fair_share"] is None
    assert parse(raw).fair_share is None


def _valid() -> dict:
    accounting = Accounting()
    accounting.record("alice", "fair_share_service", 2.5)
    return build(
        PayloadBuilder(), accounting, {"alice": 5}, fair_share=ledger(True, {}, set())
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.pop("fair_share"), "fair_share must be an object or null"),
        (lambda p: p.update(fair_share=[]), "fair_share must be an object or null"),
        (lambda p: p["fair_share"].update(enabled=True), "fair_share.enabled"),
        (lambda p: p["fair_share"].update(enabled=2), "fair_share.enabled"),
        (lambda p: p["fair_share"].update(gap=-1.0), "fair_share.gap"),
        (lambda p: p["fair_share"].update(gap=float("inf")), "fair_share.gap"),
        (lambda p: p["fair_share"].pop("gap"), "fair_share.gap"),
        (
            lambda p: p["users"]["alice"].update(fair_share_service=-0.5),
            "'fair_share_service'.* finite non-negative",
        ),
        (
            lambda p: p["users"]["alice"].update(fair_share_service=float("nan")),
            "'fair_share_service'.* finite non-negative",
        ),
        (
            lambda p: p["users"]["alice"].update(fair_share_preemptions=1.5),
            "'fair_share_preemptions'.* non-negative integer",
        ),
        (lambda p: p["users"]["alice"].update(charged=0.5), "non-negative integer"),
        (lambda p: p["users"].update(alice=[]), "must be an object"),
    ],
)
def test_parse_rejects_a_malformed_fair_share_part_naming_the_field(mutate, message):
    payload = _valid()
    parse(payload)  # the unmodified payload is fine
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)
