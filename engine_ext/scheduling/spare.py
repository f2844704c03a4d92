"""Whose waiting stops borrowing: the needy holders at a step's start.

A holder borrows above its rate (``pacing.ceilings``) only with capacity
nobody else waits for. What the scheduler sees at a step's start decides:
a request of user ``u`` is *needy* when

1. it is in the waiting queue and could start (waiting or preempted, not
   awaiting a KV transfer or a grammar),
2. it is waiting for capacity: it was there at the previous step's start too
   (that step did not start it: no slot, token budget or KV blocks), or no slot
   is free now, and
3. ``u`` is within its own rate: its own budget, without borrowing, has a
   token (``Borrowing.base``).

The step's needy holders are handed to ``Borrowing.lend_to``: a user may
borrow only while no other user is needy, so a borrower is back at its own
rate in the step after another holder's request starts waiting. Its requests
are then paced like any user's: refused ones are parked, and parked requests
yield their slot and KV blocks to the needy (``slots``).

A team borrows only while every needy user is one of its members
(``Borrowing.spare_for_team``). The scan stops once the needy users have two
owners (teams, or users without one: enough to tell anyone's spare), and
each user's budget is read once per step. Whether a request waited at the
previous step's start is told by the step it last joined the queue in (its
arrival or its preemption), so the queue is never copied.
"""

from __future__ import annotations

from engine_ext.scheduling.upstream import STARTABLE, Upstream
from engine_ext.scheduling.users import UserBook
from pacing.ceilings import Borrowing
from pacing.identity import ANONYMOUS_USER

#: Owners of needy users (``Borrowing.owner_of``: a team, or a user without
#: one) enough to tell whether any user or team is spare.
_ENOUGH = 2


class SpareCapacity:
    """Finds each step's needy holders (the shared limiter's lock is held)."""

    __slots__ = ("_joined", "_step", "book", "upstream")

    def __init__(self, upstream: Upstream, book: UserBook) -> None:
        self.upstream = upstream
        self.book = book
        #: Steps started so far (the current one included).
        self._step = 0
        #: request id -> the value of ``_step`` when it last joined the waiting
        #: queue (arrived or was preempted).
        self._joined: dict[str, int] = {}

    def step_started(self) -> None:
        """A step starts (every step, whether or not it lends)."""
        self._step += 1

    def joined(self, request_id: str) -> None:
        """A request arrived in the waiting queue, or went back to it."""
        self._joined[request_id] = self._step

    def ended(self, request_id: str) -> None:
        self._joined.pop(request_id, None)

    def lend(self, borrowing: Borrowing, now_ns: int) -> None:
        """Tells ``borrowing`` this step's needy holders."""
        upstream = self.upstream
        if not upstream.anything_waits():
            borrowing.lend_to(())
            return
        full = upstream.held_slots() >= upstream.slots
        joined = self._joined
        # Joined before the previous step started: it waited through it
        # (unknown: taken as waited, so nobody borrows on a guess).
        before_last = self._step - 1
        user_of = self.book.user_of
        own = borrowing.base
        owner_of = borrowing.owner_of
        within: dict[str, bool] = {}
        needy: list[str] = []
        owners: set[tuple[str, str]] = set()
        for request in upstream.waiting:
            if request.status not in STARTABLE:
                continue
            request_id = request.request_id
            if not full and joined.get(request_id, -1) >= before_last:
                continue
            user = user_of.get(request_id, ANONYMOUS_USER)
            if user in needy:
                continue
            has = within.get(user)
            if has is None:
                has = within[user] = own.available(user, now_ns) > 0
            if has:
                needy.append(user)
                owners.add(owner_of(user))
                if len(owners) >= _ENOUGH:
                    break
        borrowing.lend_to(needy)
