"""Tests for the priority bands' part of the metrics payload (``engine_ext.
payload_builder`` and ``payload_parser``; pure: no vLLM, no Prometheus).

What must hold: while the policy has more than one band, the payload names
every band and carries per band the output tokens charged to its users (each
user's in its band at the build: its own, its tier's, its team's or the
default) and the waits counted since the previous build, as deltas; while
pacing is on, the startable waiting requests at the last step start (every
band) and Jain's fairness index over each band's users with live requests, of
their output tokens dispatched per second over the last 10 s per weight. With
one band or none the entry is ``None``. The parser accepts that and nothing
malformed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.payload_builder import (
    BAND_FAIRNESS_WINDOW_NS,
    BAND_SNAPSHOT_INTERVAL_NS,
    BandActivity,
    PayloadBuilder,
)
from engine_ext.payload_parser import PayloadError, parse
from pacing.accounting import Accounting
from pacing.bands import MAX_BANDS, BandTable
from pacing.modes import Mode
from tests.payload_harness import build

S = 1_000_000_000
BANDS = ("interactive", "standard", "batch")
TABLE = BandTable(
    names=BANDS,
    default=1,
    users={"alice": 0, "bob": 2},
    tiers={"free": 2},
    teams={"acme": 0},
)
TIER_OF = {"carol": "free", "dave": "free"}
TEAM_OF = {"dave": "acme", "erin": "acme"}


@dataclass
class Queue:
    """What ``BandStats`` hands a build: the waiting count and the waits."""

    queued: dict[str, int] | None = None
    wait_ns: dict[str, int] = field(default_factory=dict)


def activity(
    live: Collection[str] = (),
    now_ns: int = 0,
    queue: Queue | None = None,
    table: BandTable = TABLE,
    weights: Mapping[str, float] | None = None,
) -> BandActivity:
    weights = weights or {}
    return BandActivity(
        table=table,
        tier_of=TIER_OF.get,
        team_of=TEAM_OF.get,
        weight_of=lambda user: weights.get(user, 1.0),
        live=live,
        now_ns=now_ns,
        queue=queue,
    )


def bands_of(builder: PayloadBuilder, accounting: Accounting, **kw) -> dict:
    """The bands' part of one payload (which must parse) with the bands of
    ``activity(**kw)``."""
    mode = kw.pop("mode", Mode.ENFORCE)
    raw = build(builder, accounting, {}, bands=activity(**kw), mode=mode)
    parse(raw)
    assert raw["bands"] is not None
    return raw["bands"]


def test_without_bands_the_entry_is_none() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 5)
    assert build(PayloadBuilder(), accounting, {})["bands"] is None
    one_band = BandTable(names=("only",))
    raw = build(PayloadBuilder(), accounting, {}, bands=activity(table=one_band))
    assert raw["bands"] is None
    assert parse(raw).bands is None
    raw = build(PayloadBuilder(), accounting, {}, bands=activity(table=BandTable()))
    assert raw["bands"] is None


def test_tokens_charged_go_to_each_users_band_as_deltas() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 10)  # her own: interactive
    accounting.record("bob", "charged", 7)  # his own: batch
    accounting.record("carol", "charged", 4)  # tier free: batch
    accounting.record("dave", "charged", 3)  # tier free wins over team acme
    accounting.record("erin", "charged", 2)  # team acme: interactive
    accounting.record("frank", "charged", 1)  # the default: standard
    accounting.record("frank", "refunds", 1)  # not subtracted
    part = bands_of(builder, accounting)
    assert part["names"] == list(BANDS)
    assert part["tokens"] == {"interactive": 12, "batch": 14, "standard": 1}
    accounting.record("alice", "charged", 5)
    assert bands_of(builder, accounting)["tokens"] == {"interactive": 5}
    assert bands_of(builder, accounting)["tokens"] == {}


def test_a_user_who_changes_band_takes_its_later_tokens_along() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("frank", "charged", 6)
    assert bands_of(builder, accounting)["tokens"] == {"standard": 6}
    moved = BandTable(names=BANDS, default=1, users={"frank": 2})
    accounting.record("frank", "charged", 2)
    raw = build(builder, accounting, {}, bands=activity(table=moved))
    assert raw["bands"]["tokens"] == {"batch": 2}


def test_tokens_before_bands_existed_are_nobodys_band() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    build(builder, accounting, {})  # no bands yet
    accounting.record("alice", "charged", 9)
    build(builder, accounting, {})
    accounting.record("alice", "charged", 1)
    assert bands_of(builder, accounting)["tokens"] == {}
    accounting.record("alice", "charged", 2)
    assert bands_of(builder, accounting)["tokens"] == {"interactive": 2}


def test_waits_travel_as_deltas_of_the_queues_cumulative_counts() -> None:
    builder = PayloadBuilder()
    accounting = Accounting()
    queue = Queue(dict.fromkeys(BANDS, 0), {"batch": 3 * S})
    assert bands_of(builder, accounting, queue=queue)["wait_ns"] == {"batch": 3 * S}
    queue.wait_ns = {"batch": 5 * S, "standard": 1}
    assert bands_of(builder, accounting, queue=queue)["wait_ns"] == {
        "batch": 2 * S,
        "standard": 1,
    }
    assert bands_of(builder, accounting, queue=queue)["wait_ns"] == {}
    # A band dropped and back counts again from zero: all of it is new.
    queue.wait_ns = {"batch": 4}
    assert bands_of(builder, accounting, queue=queue)["wait_ns"] == {"batch": 4}
    # Another queue (a new scheduler): from zero.
    other = Queue(None, {"batch": 7})
    assert bands_of(builder, accounting, queue=other)["wait_ns"] == {"batch": 7}


def test_waiting_requests_are_every_bands_count_while_pacing_is_on() -> None:
    builder = PayloadBuilder()
    accounting = Accounting()
    queue = Queue({"interactive": 2, "batch": 1})
    part = bands_of(builder, accounting, live={"alice": 1}, queue=queue)
    assert part["waiting"] == {"interactive": 2, "standard": 0, "batch": 1}
    assert parse(
        build(builder, accounting, {}, bands=activity({"alice": 1}, queue=queue))
    ).bands.waiting == {
        "interactive": 2,
        "standard": 0,
        "batch": 1,
    }
    # Nobody has live requests: nothing can wait, whatever the last step saw.
    assert bands_of(builder, accounting, queue=queue)["waiting"] == dict.fromkeys(
        BANDS, 0
    )
    # No step start counted yet, no queue, or pacing off: no waiting sample.
    assert (
        bands_of(builder, accounting, live={"a": 1}, queue=Queue())["waiting"] is None
    )
    assert bands_of(builder, accounting, live={"a": 1})["waiting"] is None
    off = bands_of(builder, accounting, live={"a": 1}, queue=queue, mode=Mode.OFF)
    assert (off["waiting"], off["fairness"]) == (None, {})


def fairness_steps(
    rates: Mapping[str, float],
    seconds: int,
    *,
    weights: Mapping[str, float] | None = None,
    live: Collection[str] | None = None,
) -> dict[str, float]:
    """The fairness after ``seconds`` of builds every 100 ms, each user of
    ``rates`` dispatched that many tokens per second (all of them live)."""
    accounting = Accounting()
    builder = PayloadBuilder()
    live = set(rates) if live is None else live
    part: dict = {}
    for tick in range(seconds * 10 + 1):
        if tick:
            for user, rate in rates.items():
                accounting.record(user, "charged", round(rate / 10))
        part = bands_of(
            builder, accounting, live=live, now_ns=tick * S // 10, weights=weights
        )
    return part["fairness"]


def test_fairness_is_jains_index_of_tokens_per_second_per_weight() -> None:
    # alice and erin in interactive: 10 and 30 tok/s -> 40^2 / (2 (100 + 900)).
    assert fairness_steps({"alice": 10, "erin": 30}, 5) == {"interactive": 0.8}
    # erin's weight 3: 10 and 10 per weight -> 1.
    assert fairness_steps(
        {"alice": 10, "erin": 30}, 5, weights={"erin": 3.0}
    ) == pytest.approx({"interactive": 1.0})
    # One user in a band: 1; a band whose users got nothing at all: 1.
    assert fairness_steps({"alice": 10, "bob": 0, "carol": 0}, 3) == {
        "interactive": 1.0,
        "batch": 1.0,
    }
    # One of four users gets everything: 1/n.
    four = fairness_steps({"bob": 40, "carol": 0, "dave": 0, "frank": 0}, 3)
    assert four["batch"] == pytest.approx(1 / 3)  # bob, carol, dave: batch
    assert four["standard"] == 1.0  # frank alone


def test_fairness_counts_only_users_with_live_requests() -> None:
    # bob got tokens but has no live request: not backlogged, not compared.
    assert fairness_steps({"bob": 50, "carol": 10}, 3, live={"carol"}) == {"batch": 1.0}
    assert fairness_steps({"bob": 50}, 3, live=()) == {}


def test_fairness_needs_a_snapshot_of_the_user_and_compares_rates() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    # The first build only takes a snapshot: nobody measured, no index.
    assert bands_of(builder, accounting, live={"alice"}, now_ns=0)["fairness"] == {}
    accounting.record("alice", "charged", 20)
    part = bands_of(builder, accounting, live={"alice", "erin"}, now_ns=2 * S)
    # erin joined after the snapshot: not measured yet.
    assert part["fairness"] == {"interactive": 1.0}
    # 1 s later: erin is in the snapshot taken at 2 s. alice got 20 + 10 over
    # 3 s (10 tok/s), erin 10 over 1 s (10 tok/s): equal rates.
    accounting.record("alice", "charged", 10)
    accounting.record("erin", "charged", 10)
    part = bands_of(builder, accounting, live={"alice", "erin"}, now_ns=3 * S)
    assert part["fairness"] == {"interactive": 1.0}


def test_a_late_refund_or_a_forgotten_user_is_no_windfall() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    live = {"alice", "erin"}
    accounting.record("alice", "charged", 100)
    bands_of(builder, accounting, live=live, now_ns=0)  # the snapshot
    # alice: 10 more charged, 15 of the earlier refunded -> nothing net;
    # erin: 10. Jain's index of (0, 10): 1/2.
    accounting.record("alice", "charged", 10)
    accounting.record("alice", "refunds", 15)
    accounting.record("erin", "charged", 10)
    part = bands_of(builder, accounting, live=live, now_ns=S // 2)
    assert part["fairness"] == {"interactive": 0.5}
    # alice forgotten (idle clean-up) and back: counted from zero, 10 each.
    accounting.forget({"erin"})
    accounting.record("alice", "charged", 10)
    part = bands_of(builder, accounting, live=live, now_ns=S * 3 // 4)
    assert part["fairness"] == {"interactive": 1.0}


def test_fairness_looks_back_over_the_window_only() -> None:
    """alice got 1000 tokens at the start, then both 10 tok/s: once the start
    is more than the window (and a snapshot interval) ago, they are equal."""
    accounting = Accounting()
    builder = PayloadBuilder()
    live = {"alice", "erin"}
    step_ns = BAND_SNAPSHOT_INTERVAL_NS // 2
    fairness: list[float] = []
    for tick in range(2 * BAND_FAIRNESS_WINDOW_NS // step_ns + 1):
        if tick == 1:
            accounting.record("alice", "charged", 1000)
        elif tick:
            accounting.record("alice", "charged", 5)
            accounting.record("erin", "charged", 5)
        part = bands_of(builder, accounting, live=live, now_ns=tick * step_ns)
        fairness.append(part["fairness"].get("interactive", 1.0))
    window_ticks = BAND_FAIRNESS_WINDOW_NS // step_ns
    assert min(fairness[: window_ticks + 1]) < 0.6
    assert fairness[-1] == 1.0


def test_fairness_starts_over_without_bands_or_with_pacing_off() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    bands_of(builder, accounting, live={"alice"}, now_ns=0)
    accounting.record("alice", "charged", 5)
    assert bands_of(builder, accounting, live={"alice"}, now_ns=S)["fairness"]
    build(builder, accounting, {})  # bands gone: the snapshots go
    assert bands_of(builder, accounting, live={"alice"}, now_ns=2 * S)["fairness"] == {}
    bands_of(builder, accounting, live={"alice"}, now_ns=3 * S, mode=Mode.OFF)
    assert bands_of(builder, accounting, live={"alice"}, now_ns=4 * S)["fairness"] == {}


@settings(max_examples=100, deadline=None)
@given(
    rates=st.lists(st.integers(0, 500), min_size=1, max_size=6),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 7.0]), min_size=6, max_size=6),
)
def test_fairness_is_between_one_over_n_and_one(rates, weights) -> None:
    users = [f"u{i}" for i in range(len(rates))]  # all in the default band
    fairness = fairness_steps(
        dict(zip(users, rates, strict=True)),
        2,
        weights=dict(zip(users, weights, strict=False)),
    )
    index = fairness["standard"]
    assert 1 / len(users) - 1e-9 <= index <= 1.0
    shares = [10 * round(r / 10) / w for r, w in zip(rates, weights, strict=False)]
    if len(set(shares)) == 1:
        assert index == pytest.approx(1.0)


def _valid() -> dict:
    accounting = Accounting()
    builder = PayloadBuilder()
    queue = Queue({"interactive": 1}, {"batch": 5})
    build(builder, accounting, {}, bands=activity({"alice"}, 0, queue))
    accounting.record("alice", "charged", 3)
    queue.wait_ns = {"batch": 10}
    return build(builder, accounting, {}, bands=activity({"alice"}, S, queue))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.pop("bands"), "bands must be an object or null"),
        (lambda p: p.update(bands=[]), "bands must be an object or null"),
        (lambda p: p["bands"].update(names=["one"]), "bands.names must be a list"),
        (lambda p: p["bands"].update(names=["a", "a"]), "bands.names must be a list"),
        (lambda p: p["bands"].update(names=["a", ""]), "bands.names must be a list"),
        (
            lambda p: p["bands"].update(names=[f"b{i}" for i in range(MAX_BANDS + 1)]),
            "bands.names must be a list",
        ),
        (lambda p: p["bands"].update(tokens={"gold": 1}), "not in names"),
        (lambda p: p["bands"].update(tokens={"batch": -1}), "bands.tokens"),
        (lambda p: p["bands"].update(tokens={"batch": 0.5}), "bands.tokens"),
        (lambda p: p["bands"].update(wait_ns={"gold": 1}), "not in names"),
        (lambda p: p["bands"].pop("wait_ns"), "bands.wait_ns must be an object"),
        (lambda p: p["bands"].pop("waiting"), "bands.waiting must be"),
        (lambda p: p["bands"]["waiting"].pop("batch"), "every band"),
        (lambda p: p["bands"]["waiting"].update(gold=1), "not in names"),
        (lambda p: p["bands"]["waiting"].update(batch=-1), "bands.waiting"),
        (lambda p: p["bands"].update(fairness=[]), "bands.fairness must be"),
        (lambda p: p["bands"].update(fairness={"gold": 1.0}), "not in names"),
        (lambda p: p["bands"].update(fairness={"batch": 0}), r"in \(0, 1\]"),
        (lambda p: p["bands"].update(fairness={"batch": 1.5}), r"in \(0, 1\]"),
        (lambda p: p["bands"].update(fairness={"batch": "x"}), "finite"),
    ],
)
def test_parse_rejects_a_malformed_bands_part_naming_the_field(mutate, message):
    payload = _valid()
    bands = parse(payload).bands  # the unmodified one is fine
    assert bands is not None
    assert bands.names == BANDS
    assert bands.tokens == {"interactive": 3}
    assert bands.wait_ns == {"batch": 5}
    assert bands.waiting == {"interactive": 1, "standard": 0, "batch": 0}
    assert bands.fairness == {"interactive": 1.0}
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)


def test_tokens_of_a_user_forgotten_before_the_build_still_count() -> None:
    """A user with no rate whose request ended is forgotten by the idle
    clean-up before the next build: its last tokens are in its band all the
    same, and its tokens after it came back too."""
    accounting = Accounting(keep_forgotten=True)
    builder = PayloadBuilder()
    accounting.record("frank", "charged", 22)
    assert bands_of(builder, accounting)["tokens"] == {"standard": 22}
    accounting.record("frank", "charged", 28)
    accounting.forget(set())
    assert bands_of(builder, accounting)["tokens"] == {"standard": 28}
    accounting.record("frank", "charged", 5)
    accounting.forget(set())
    accounting.record("frank", "charged", 3)  # back, counted from zero
    accounting.forget(set())
    accounting.record("frank", "charged", 1)
    assert bands_of(builder, accounting)["tokens"] == {"standard": 9}
    assert bands_of(builder, accounting)["tokens"] == {}
