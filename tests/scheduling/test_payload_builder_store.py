"""Tests for ``engine_ext.payload_builder``: the store's part of the payload
(pure: no vLLM, no Prometheus).

What must hold: the store's counters travel as deltas that add up to its
totals, every latency bucket's mean lies in its bucket, and the gauges are
current values.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.payload_builder import PayloadBuilder
from engine_ext.payload_parser import parse
from pacing.accounting import Accounting
from pacing.store_stats import LATENCY_BUCKETS_NS, StoreStats
from tests.payload_harness import MS, build


def test_without_a_store_the_payload_has_no_store_part() -> None:
    raw = build(PayloadBuilder(), Accounting(), {})
    assert raw["store"] is None
    assert parse(raw).store is None


def test_the_store_part_carries_deltas_and_current_gauges() -> None:
    stats = StoreStats()
    builder = PayloadBuilder()
    stats.record_answered(
        300_000, claimed=12, granted=10, returned=0, live_engines=3
    )  # 0.3 ms: in (0.25, 0.5] ms
    stats.record_answered(2 * MS, claimed=5, granted=5, returned=4, live_engines=3)
    first = parse(build(builder, Accounting(), {}, store=stats)).store
    assert first is not None
    assert first.round_trips == {"ok": 2, "error": 0}
    assert first.tokens == {"claimed": 17, "granted": 15, "returned": 4}
    assert (first.degraded, first.live_engines) == (False, 3)
    nonzero = {
        LATENCY_BUCKETS_NS[i]: bucket
        for i, bucket in enumerate(first.latency_ns)
        if bucket != (0, 0)
    }
    assert nonzero == {500_000: (1, 300_000), 2_500_000: (1, 2 * MS)}

    stats.record_failed(50 * MS, now_ns=7)  # a timeout: degraded from now on
    second = parse(build(builder, Accounting(), {}, store=stats)).store
    assert second is not None
    assert second.round_trips == {"ok": 0, "error": 1}
    assert second.tokens == {"claimed": 0, "granted": 0, "returned": 0}
    assert second.degraded
    assert second.latency_ns[LATENCY_BUCKETS_NS.index(50 * MS)] == (1, 50 * MS)
    assert sum(count for count, _ in second.latency_ns) == 1

    stats.record_answered(MS, claimed=1, granted=1, returned=0, live_engines=2)
    third = parse(build(builder, Accounting(), {}, store=stats)).store
    assert third is not None
    assert (third.degraded, third.live_engines) == (False, 2)


def test_a_new_store_stats_object_is_reported_from_zero() -> None:
    builder = PayloadBuilder()
    old = StoreStats()
    old.record_answered(MS, claimed=9, granted=9, returned=0, live_engines=1)
    build(builder, Accounting(), {}, store=old)
    new = StoreStats()
    new.record_answered(MS, claimed=2, granted=1, returned=0, live_engines=1)
    part = parse(build(builder, Accounting(), {}, store=new)).store
    assert part is not None
    assert part.tokens == {"claimed": 2, "granted": 1, "returned": 0}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("answered"),
                st.integers(0, 3 * 10**9),
                st.integers(0, 50),
                st.integers(0, 50),
                st.integers(0, 50),
            ),
            st.tuples(st.just("failed"), st.integers(0, 3 * 10**9)),
            st.just(("build",)),
        ),
        max_size=40,
    )
)
def test_store_deltas_add_up_and_every_bucket_mean_lies_in_its_bucket(ops) -> None:
    """Whatever the latencies (bounds exactly included), every payload parses
    (which checks each bucket's mean against its bounds) and the deltas add
    up to the totals."""
    stats = StoreStats()
    builder = PayloadBuilder()
    counts = [0] * (len(LATENCY_BUCKETS_NS) + 1)
    sums = [0] * (len(LATENCY_BUCKETS_NS) + 1)
    trips = {"ok": 0, "error": 0}
    tokens = {"claimed": 0, "granted": 0, "returned": 0}

    def collect() -> None:
        part = parse(build(builder, Accounting(), {}, store=stats)).store
        assert part is not None
        for i, (count, total) in enumerate(part.latency_ns):
            counts[i] += count
            sums[i] += total
        for key in trips:
            trips[key] += part.round_trips[key]
        for key in tokens:
            tokens[key] += part.tokens[key]

    for op in ops:
        if op[0] == "answered":
            _, latency, claimed, granted, returned = op
            stats.record_answered(
                latency,
                claimed=claimed,
                granted=granted,
                returned=returned,
                live_engines=1,
            )
        elif op[0] == "failed":
            stats.record_failed(op[1], now_ns=1)
        else:
            collect()
    collect()
    assert counts == stats.latency_counts
    assert sums == stats.latency_sums_ns
    assert trips == {
        "ok": stats.round_trips_answered,
        "error": stats.round_trips_failed,
    }
    assert tokens == {
        "claimed": stats.tokens_claimed,
        "granted": stats.tokens_granted,
        "returned": stats.tokens_returned,
    }
