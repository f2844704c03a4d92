"""``engine_ext.scheduling.idle_users.IdleUsers`` on its own, over the real
``SharedLimiter``, limiter and ``Accounting``: users whose last request ended are
told to the budget source, and idle users are dropped at most every
``CLEANUP_INTERVAL_NS``, keeping every live or metrics-labelled user's counters,
without changing what any user may take."""

from __future__ import annotations

from engine_ext.scheduling.idle_users import CLEANUP_INTERVAL_NS, IdleUsers
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.shared import SharedLimiter

MS = 1_000_000
T0 = 1_000_000 * MS


class EndRecordingLimiter(OutputRateLimiter):
    """The real limiter, recording the users it is told ended (its own
    ``end_user`` has nothing to give back)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ended: list[tuple[str, int]] = []

    def end_user(self, user: str, now_ns: int) -> None:
        self.ended.append((user, now_ns))
        super().end_user(user, now_ns)


def idle_users(labelled: tuple[str, ...] = (), rate: int = 10):
    limiter = EndRecordingLimiter(rate, {})
    shared = SharedLimiter(limiter, Accounting(), lambda: T0)
    book = UserBook()
    return IdleUsers(shared, book, lambda: labelled), limiter, book, shared.accounting


def test_no_cleanup_is_due_while_no_user_is_tracked():
    idle, _, _, _ = idle_users()
    assert not idle.due(T0)


def test_cleanup_is_due_at_once_and_then_once_per_interval():
    idle, limiter, _, _ = idle_users()
    limiter.try_take("a", T0)
    assert idle.due(T0)  # never cleaned
    idle.cleanup(T0 + 150 * MS)
    limiter.try_take("b", T0 + 150 * MS)  # tracked again
    assert idle.cleaned_at_ns == T0 + 150 * MS
    assert not idle.due(T0 + 150 * MS + CLEANUP_INTERVAL_NS - 1)
    assert idle.due(T0 + 150 * MS + CLEANUP_INTERVAL_NS)


def test_ended_users_are_told_to_the_budget_source_once():
    idle, limiter, book, _ = idle_users()
    book.add("r1", "a", paced=True)
    book.add("r2", "b", paced=True)
    book.remove("r1", paced=True)
    book.remove("r2", paced=True)
    idle.end_users(T0)
    idle.end_users(T0 + MS)
    assert limiter.ended == [("a", T0), ("b", T0)]


def test_a_user_back_before_the_check_is_not_ended():
    idle, limiter, book, _ = idle_users()
    book.add("r1", "a", paced=True)
    book.remove("r1", paced=True)
    book.add("r2", "a", paced=True)
    idle.end_users(T0)
    assert limiter.ended == []


def test_cleanup_drops_from_the_limiter_only_users_whose_bucket_is_full():
    idle, limiter, _, _ = idle_users(rate=10)
    limiter.try_take("idle", T0)  # full again 100 ms later
    limiter.try_take("busy", T0 + 50 * MS)  # full again at +150 ms
    idle.cleanup(T0 + 100 * MS)
    assert limiter.tracked_users() == 1
    assert limiter.lead_ns("busy", T0 + 100 * MS) == 50 * MS


def test_cleanup_keeps_the_counters_and_streams_of_live_and_labelled_users_only():
    idle, _, book, accounting = idle_users(labelled=("labelled",))
    book.add("r1", "live", paced=True)
    for user in ("live", "labelled", "gone"):
        accounting.record(user, "throttled_skips", 2)
        book.last_served[user] = f"{user}-stream"
    idle.cleanup(T0)
    assert set(accounting.by_user()) == {"live", "labelled"}
    assert accounting.of("live").throttled_skips == 2
    assert accounting.of("labelled").throttled_skips == 2
    assert accounting.total.throttled_skips == 6  # totals keep counting
    assert book.last_served == {"live": "live-stream", "labelled": "labelled-stream"}


def test_cleaning_never_changes_what_a_returning_user_may_take():
    cleaned, cleaned_limiter, _, _ = idle_users(rate=10)
    kept = OutputRateLimiter(10, {})
    for limiter in (cleaned_limiter, kept):
        limiter.take_up_to("a", 2, T0)  # TAT at +200 ms
    # At +200 ms the bucket is full again: "a" is dropped from one limiter only.
    cleaned.cleanup(T0 + 200 * MS)
    assert cleaned_limiter.tracked_users() == 0
    assert kept.tracked_users() == 1
    for now in (T0 + 200 * MS, T0 + 250 * MS, T0 + 1000 * MS):
        assert cleaned_limiter.available("a", now) == kept.available("a", now)
        assert cleaned_limiter.take_up_to("a", 5, now) == kept.take_up_to("a", 5, now)


def test_between_steps_ends_users_and_cleans_up_when_due():
    idle, limiter, book, accounting = idle_users()
    book.add("r1", "a", paced=True)
    limiter.try_take("a", T0)
    accounting.record("a", "throttled_skips")
    book.remove("r1", paced=True)
    idle.between_steps(T0 + 100 * MS)
    assert limiter.ended == [("a", T0 + 100 * MS)]
    assert limiter.tracked_users() == 0
    assert set(accounting.by_user()) == set()
    assert idle.cleaned_at_ns == T0 + 100 * MS


def test_between_steps_does_not_clean_up_before_the_interval():
    idle, limiter, _, _ = idle_users()
    limiter.try_take("a", T0)
    idle.cleanup(T0)  # "a" still has a token's lead: kept
    assert limiter.tracked_users() == 1
    idle.between_steps(T0 + 500 * MS)  # "a" is idle by now, but it is too soon
    assert limiter.tracked_users() == 1
    assert idle.cleaned_at_ns == T0
    idle.between_steps(T0 + CLEANUP_INTERVAL_NS)
    assert limiter.tracked_users() == 0
