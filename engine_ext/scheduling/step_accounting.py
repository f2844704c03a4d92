"""Per-user and per-request accounting around steps (pure: no vLLM).

- ``EngineLate``: budget that lapsed because the engine came late, not because
  of the limit. GCRA absorbs a late step up to the burst (the spec's "burst
  must cover one engine step"); beyond it, a waiting user's budget lapses
  unspent. Invariant: only users with a request in the engine across the whole
  gap are counted, by how much the gap exceeded the burst.
- ``ThrottleEpisodes``: with request tracing on, each request's steps passed
  over and time throttled (from a refusal to its next dispatch), for its span.
  Invariant: an episode is open from the first refusal until the request is
  next dispatched a sampling step or ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pacing.accounting import Accounting


class EngineLate:
    """Counts, per user, the time by which gaps between steps exceeded the burst."""

    __slots__ = ("stepped_at_ns",)

    def __init__(self) -> None:
        #: When the last paced step started (None: none yet).
        self.stepped_at_ns: int | None = None

    def record(
        self,
        now_ns: int,
        *,
        counted: bool,
        burst_ns: int,
        live: dict[str, int],
        added: dict[str, str],
        accounting: Accounting,
    ) -> None:
        """A step starts at ``now_ns``: every user with more live requests than
        live ones added since the previous step (``added``: request id -> user)
        had one waiting across the gap and is charged ``engine_late_ns`` for
        what exceeded the burst. ``added`` is cleared for the next gap."""
        previous, self.stepped_at_ns = self.stepped_at_ns, now_ns
        if counted and previous is not None:
            late_ns = now_ns - previous - burst_ns
            if late_ns > 0:
                new = Counter(added.values())
                for user, count in live.items():
                    if count > new.get(user, 0):
                        accounting.record(user, "engine_late_ns", late_ns)
        if added:
            added.clear()


@dataclass
class Throttling:
    """One request's time spent throttled (reported on its trace span)."""

    steps: int = 0  #: steps in which it was passed over for lack of budget
    total_ns: int = 0  #: closed throttled episodes, refusal to next dispatch
    since_ns: int | None = None  #: start of the open episode


class ThrottleEpisodes:
    """Throttle totals of requests throttled at least once (tracing only)."""

    __slots__ = ("by_request",)

    def __init__(self) -> None:
        self.by_request: dict[str, Throttling] = {}

    def __bool__(self) -> bool:
        return bool(self.by_request)

    def passed_over(self, request_id: str, now_ns: int) -> None:
        """The request was refused in the step starting at ``now_ns``."""
        throttling = self.by_request.setdefault(request_id, Throttling())
        throttling.steps += 1
        if throttling.since_ns is None:
            throttling.since_ns = now_ns

    def dispatched(self, request_id: str, now_ns: int) -> None:
        """The request was dispatched a sampling step: its episode closes."""
        throttling = self.by_request.get(request_id)
        if throttling is not None and throttling.since_ns is not None:
            throttling.total_ns += now_ns - throttling.since_ns
            throttling.since_ns = None

    def end(self, request_id: str, now_ns: int) -> tuple[int, float] | None:
        """The request ended: its steps passed over and seconds throttled, or
        None if it never was."""
        throttling = self.by_request.pop(request_id, None)
        if throttling is None:
            return None
        if throttling.since_ns is not None:
            throttling.total_ns += now_ns - throttling.since_ns
        return throttling.steps, throttling.total_ns / 1e9
