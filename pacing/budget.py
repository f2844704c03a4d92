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

A source backed by a global store can also say how a user stands there
(``StoreViews``), for the control plane's reads.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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


class Health(enum.Enum):
    """Where an engine with a global store takes its tokens from now."""

    GLOBAL = "global"  #: claimed from the store
    LOCAL_SHARE = "local_share"  #: held tokens, then R / N_live locally
    FAIL_OPEN = "fail_open"  #: no limit
    FAIL_CLOSED = "fail_closed"  #: nothing for limited users


@dataclass(frozen=True)
class StoreView:
    """One user's global budget as this engine sees it; times in nanoseconds."""

    #: Tokens held here for the user: claimed, not spent, lease not ended.
    held_tokens: int
    #: The store cell's TAT lead as this engine last read it, decayed since.
    global_tat_lead_ns: int
    #: How long ago that reading came back; ``None``: no reading held.
    read_age_ns: int | None
    #: The engine's state (anything but ``GLOBAL`` is degraded).
    health: Health


@runtime_checkable
class StoreViews(Protocol):
    """A budget source backed by a global store (``isinstance`` tells)."""

    def store_view(self, user: str, now_ns: int) -> StoreView:
        """``user``'s global budget as seen at ``now_ns``. Local, no I/O; call
        under the lock that guards the source."""
        ...
