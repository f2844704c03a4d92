"""Users whose requests ended: their budget handed back, their state dropped.

A user whose last request ended is told to the budget source at the next step
or idle check (with a store, its balance goes back for other engines to use).
Idle users (no live request, bucket full) are dropped from the limiter at most
every ``CLEANUP_INTERVAL_NS`` by the scheduler's clock: after a step, and on an
idle engine when the metrics heartbeat (``engine_ext.idle_stats``) asks.
Invariant: cleaning is behaviour-neutral (``OutputRateLimiter.cleanup_idle_users``)
and keeps every live or metrics-labelled user's counters, so deltas stay exact;
the counters of the users it forgets go to the next metrics payload's groups
(tiers, teams, bands) through ``Accounting.collect_forgotten``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine_ext.scheduling.users import UserBook
from pacing.shared import SharedLimiter

#: Idle users are dropped from the limiter at most this often.
CLEANUP_INTERVAL_NS = 1_000_000_000


class IdleUsers:
    """Ends users and cleans up idle ones, under the shared limiter's lock."""

    __slots__ = ("book", "cleaned_at_ns", "labelled_users", "shared")

    def __init__(
        self,
        shared: SharedLimiter,
        book: UserBook,
        labelled_users: Callable[[], Iterable[str]],
    ) -> None:
        self.shared = shared
        self.book = book
        #: Users the metrics label by name: their counters must survive.
        self.labelled_users = labelled_users
        self.cleaned_at_ns: int | None = None  # None: never (tests swap clocks)

    def due(self, now_ns: int) -> bool:
        """Whether users are tracked and the last cleanup is an interval old."""
        cleaned_at = self.cleaned_at_ns
        return (cleaned_at is None or now_ns - cleaned_at >= CLEANUP_INTERVAL_NS) and (
            self.shared.limiter.tracked_users() > 0
            or self.shared.prompt.limiter.tracked_users() > 0
        )

    def end_users(self, now_ns: int) -> None:
        """Tells the budget sources (output and prompt) of the users whose last
        request ended."""
        budget = self.shared.budget
        prompt = self.shared.prompt.budget if self.shared.prompt.active else None
        for user in self.book.take_ended():
            budget.end_user(user, now_ns)
            if prompt is not None:
                prompt.end_user(user, now_ns)

    def cleanup(self, now_ns: int) -> None:
        """Forgets users with no live request whose bucket is full."""
        self.cleaned_at_ns = now_ns
        shared = self.shared
        live = self.book.live
        for limiter, teams in (
            (shared.limiter, shared.teams),
            (shared.prompt.limiter, shared.prompt.teams),
        ):
            limiter.cleanup_idle_users(now_ns)
            teams.cells.cleanup_idle_users(now_ns)
            teams.forget_idle(live)
        keep = set(live)
        keep.update(self.labelled_users())
        self.book.forget_idle(keep)
        self.shared.accounting.forget(keep)

    def between_steps(self, now_ns: int) -> None:
        """Ends users and cleans up if due (the lock is held)."""
        if self.book.ended:
            self.end_users(now_ns)
        if self.due(now_ns):
            self.cleanup(now_ns)
