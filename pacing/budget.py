"""Where a user's tokens come from: the scheduler's one interface for spending.

The scheduler spends tokens through a ``BudgetSource`` and nothing else, so the
same step works whether a user's budget is a local GCRA cell (one engine: the
``OutputRateLimiter`` itself is the source) or a balance claimed in batches from
a global store (many engines: ``pacing.claims``). Every method is local: none
may block on I/O, as the scheduling step calls them.

The scheduler caches what a user had left after a charge as a lower bound of
its budget until its next charge, because a GCRA cell's budget only grows with
time. Whatever can shrink a budget otherwise (a limit change; with a store, a
claimed batch expiring or being returned) must bump ``limit_changes``: the
scheduler then forgets every cached bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class BudgetSource(Protocol):
    """What the scheduler spends from; all times are monotonic nanoseconds."""

    @property
    def limit_changes(self) -> int:
        """Bumped whenever a user's budget may have shrunk other than by a take
        (read-only here: a source may compute it, as ``ClaimedBalances`` does)."""
        ...

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        """Takes up to ``most`` tokens; returns ``(taken, still available)``."""
        ...

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        """Charges each user its count (the caller knows it has that much) and
        returns what each still has available."""
        ...

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Gives back ``count`` tokens taken but not dispatched."""
        ...

    def available(self, user: str, now_ns: int) -> int:
        """How many tokens ``user`` may take at ``now_ns``; changes nothing."""
        ...

    def end_user(self, user: str, now_ns: int) -> None:
        """``user``'s last request on this engine ended (what it holds here
        may go back where it came from)."""
        ...

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """The earliest time, not before ``now_ns``, at which ``user`` may be
        able to take a token (a source that learns of new budget by other means,
        such as a claim landing, wakes the engine itself)."""
        ...
