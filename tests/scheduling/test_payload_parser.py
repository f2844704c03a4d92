"""Tests for ``engine_ext.payload_parser`` (pure: no vLLM, no Prometheus).

What must hold: ``parse`` accepts what the builder builds and rejects a
malformed payload with a ``PayloadError`` naming the offending field.
"""

from __future__ import annotations

import pytest

from engine_ext.payload_builder import PayloadBuilder
from engine_ext.payload_parser import PayloadError, parse
from engine_ext.stats_payload import OTHER_USER, PAYLOAD_VERSION
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.store_stats import LATENCY_BUCKETS_NS, StoreStats
from tests.payload_harness import MS, build


def _valid() -> dict:
    limiter = OutputRateLimiter(10, {}, tier_rates={"free": 20})
    return build(PayloadBuilder(), Accounting(), {"alice": 5}, limiter=limiter)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(v=1), f"payload version 1 is not {PAYLOAD_VERSION}"),
        (lambda p: p.update(users={"mallory": {"charged": 1}}), "'mallory'"),
        (lambda p: p.update(users={OTHER_USER: {"bogus": 1}}), "unknown counters"),
        (lambda p: p.update(users={OTHER_USER: {"charged": -1}}), "non-negative"),
        (lambda p: p.update(limits=[]), "limits must be an object"),
        (lambda p: p.update(prompt_limits={"mallory": 5}), "not labelled"),
        (lambda p: p.update(prompt_limits={"alice": -1}), "prompt_limits"),
        (lambda p: p.pop("prompt_limits"), "prompt_limits must be an object"),
        (lambda p: p.update(default_prompt_limit=-1), "default_prompt_limit"),
        (lambda p: p.pop("ceiling_limits"), "ceiling_limits must be an object"),
        (lambda p: p.update(ceiling_limits={"mallory": 5}), "not labelled"),
        (lambda p: p.update(default_ceiling_limit=-1), "default_ceiling_limit"),
        (lambda p: p.pop("borrowing_blocked"), "borrowing_blocked must be"),
        (lambda p: p.update(users={OTHER_USER: {"borrowed_tokens": -1}}), "negative"),
        (lambda p: p.update(throttled_requests=True), "throttled_requests"),
        (lambda p: p.update(idle_waits_s=[-0.1]), "idle_waits_s"),
        (lambda p: p.update(config_reloads={"maybe": 1}), "config_reloads"),
        (lambda p: p.update(control_rpcs=[["m", "NOPE", 1]]), "control_rpcs entry"),
        (lambda p: p.pop("tracked_users"), "tracked_users"),
        (lambda p: p.update(mode="fast"), "mode must be one of"),
        (lambda p: p.pop("mode"), "mode must be one of"),
        (lambda p: p.update(tiers={"free": -1}), "tiers\\['free'\\]"),
        (lambda p: p.update(tier_counters={"pro": {"charged": 1}}), "'pro'"),
        (
            lambda p: p.update(tier_counters={"free": {"bogus": 1}}),
            "unknown counters",
        ),
        (lambda p: p.update(tier_counters=[]), "tier_counters must be an object"),
    ],
)
def test_parse_rejects_malformed_payloads_naming_the_field(mutate, message) -> None:
    payload = _valid()
    parse(payload)  # the unmodified payload is fine
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)


def test_parse_rejects_a_non_object() -> None:
    with pytest.raises(PayloadError, match="must be an object"):
        parse([1, 2])


def _with_store() -> dict:
    stats = StoreStats()
    stats.record_answered(MS, claimed=2, granted=1, returned=0, live_engines=2)
    return build(PayloadBuilder(), Accounting(), {}, store=stats)


def _set_bucket(payload: dict, index: int, value: list) -> None:
    payload["store"]["latency_ns"][index] = value


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.pop("store"), "store must be an object or null"),
        (lambda p: p.update(store=[]), "store must be an object or null"),
        (lambda p: p["store"]["round_trips"].pop("error"), "store.round_trips keys"),
        (lambda p: p["store"]["tokens"].update(spent=1), "store.tokens keys"),
        (lambda p: p["store"]["tokens"].update(granted=-1), "non-negative"),
        (lambda p: p["store"]["latency_ns"].pop(), "store.latency_ns must be"),
        (lambda p: _set_bucket(p, 0, [1]), "store.latency_ns\\[0\\] must be a"),
        # 0.1 ms is the first bucket's bound: in it, but not in the second.
        (lambda p: _set_bucket(p, 1, [1, 100_000]), "not in its bucket"),
        (lambda p: _set_bucket(p, 0, [2, 200_001]), "not in its bucket"),
        (lambda p: _set_bucket(p, 2, [0, 5]), "not in its bucket"),
        (lambda p: p["store"].update(degraded=True), "store.degraded must be 0"),
        (lambda p: p["store"].update(degraded=2), "store.degraded must be 0"),
        (lambda p: p["store"].pop("live_engines"), "store.live_engines"),
    ],
)
def test_parse_rejects_a_malformed_store_part_naming_the_field(mutate, message) -> None:
    payload = _with_store()
    parse(payload)  # the unmodified payload is fine
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)


def test_a_bucket_holding_its_bounds_parses() -> None:
    payload = _with_store()
    _set_bucket(payload, 0, [2, 200_000])  # twice 0.1 ms: the bound, included
    _set_bucket(payload, 1, [1, 250_000])
    _set_bucket(payload, len(LATENCY_BUCKETS_NS), [1, 10**10])  # past 1 s
    store = parse(payload).store
    assert store is not None
    assert store.latency_ns[0] == (2, 200_000)
