"""Per-user knowledge the scheduler keeps between steps (pure: no vLLM).

Invariants, kept by ``add``, ``remove`` and ``set_headroom``:

- ``live[user]`` is the number of the user's requests between ``add_request``
  and ``_free_request``; ``live[user] * step_tokens`` is the most it can be
  charged in one step (``step_tokens``: 1, or 1 + the draft tokens a
  speculative step may verify);
- ``headroom[user]`` is a number of tokens the user is known to have at any
  time until its next charge or a limit change (budget only grows with time);
- ``constrained`` is exactly the users with live requests whose headroom is
  unknown or below that most. While it is empty nobody can be refused a token,
  so a step is free.
"""

from __future__ import annotations

from pacing.identity import ANONYMOUS_USER


class UserBook:
    """Who each request belongs to and what each user is known to have."""

    __slots__ = (
        "added_since_step",
        "asleep_until",
        "constrained",
        "ended",
        "headroom",
        "last_served",
        "live",
        "maybe_without_budget",
        "parked_counts",
        "step_tokens",
        "user_of",
    )

    def __init__(self, step_tokens: int = 1) -> None:
        #: Tokens one request may be charged in one step: 1 + the speculative
        #: draft tokens a step may schedule for it.
        self.step_tokens = step_tokens
        self.user_of: dict[str, str] = {}  #: request id -> user
        #: user -> its live requests: the most it can be charged in one step.
        self.live: dict[str, int] = {}
        #: Users whose last live request ended since the last step: told to the
        #: budget source under the lock (requests end outside it).
        self.ended: list[str] = []
        self.last_served: dict[str, str] = {}  #: user -> request id
        #: Users that may have no budget at the next step's start; while none
        #: may (and no limit changed), a step leaves ``running`` as it is.
        self.maybe_without_budget: set[str] = set()
        #: user -> tokens it is known to have until its next charge or a limit
        #: change; absent: unknown.
        self.headroom: dict[str, int] = {}
        #: Users with live requests whose headroom is unknown or below the most
        #: their live requests may be charged in one step.
        self.constrained: set[str] = set()
        #: user -> requests parked at the last step's start.
        self.parked_counts: dict[str, int] = {}
        #: user -> when a user found with no budget (headroom 0) may take a token
        #: again; valid until its headroom is next set (sleeper steps).
        self.asleep_until: dict[str, int] = {}
        #: request id -> user, of the live requests added since the last paced
        #: step's start (engine-late accounting counts only users that had a
        #: request waiting across the whole gap).
        self.added_since_step: dict[str, str] = {}

    def user(self, request_id: str) -> str:
        """The user ``request_id`` is charged to."""
        return self.user_of.get(request_id, ANONYMOUS_USER)

    def add(self, request_id: str, user: str, *, paced: bool) -> None:
        """Records a new request of ``user`` (once per request id)."""
        if request_id in self.user_of:
            return
        self.user_of[request_id] = user
        live = self.live[user] = self.live.get(user, 0) + 1
        if paced:
            self.added_since_step[request_id] = user
        if self.headroom.get(user, -1) < live * self.step_tokens:
            self.constrained.add(user)

    def remove(self, request_id: str, *, paced: bool) -> None:
        """Forgets a request that ended; a user's last one ends the user
        (reported through ``ended`` when pacing is on)."""
        user = self.user_of.pop(request_id, None)
        if user is None:
            return
        if self.added_since_step:
            self.added_since_step.pop(request_id, None)
        live = self.live[user] - 1
        if live:
            self.live[user] = live
            if self.headroom.get(user, -1) >= live * self.step_tokens:
                self.constrained.discard(user)
            return
        del self.live[user]
        self.headroom.pop(user, None)
        self.asleep_until.pop(user, None)
        self.constrained.discard(user)
        self.maybe_without_budget.discard(user)
        if paced:
            self.ended.append(user)

    def take_ended(self) -> list[str]:
        """The users whose last request ended since the last call, and not back."""
        ended, self.ended = self.ended, []
        return [user for user in ended if user not in self.live]

    def forget_headroom(self) -> None:
        """After a limit change every user's headroom may have shrunk."""
        self.headroom.clear()
        self.asleep_until.clear()
        self.constrained = set(self.live)

    def set_headroom(self, user: str, headroom: int) -> None:
        """Records what ``user`` has left after a step (or now): whether it is
        constrained, and whether it may lack budget at the next step's start."""
        self.asleep_until.pop(user, None)
        live = self.live.get(user, 0)
        if not live:
            self.headroom.pop(user, None)
            self.constrained.discard(user)
            self.maybe_without_budget.discard(user)
            return
        self.headroom[user] = headroom
        if headroom < live * self.step_tokens:
            self.constrained.add(user)
        else:
            self.constrained.discard(user)
        if headroom:
            self.maybe_without_budget.discard(user)
        else:
            self.maybe_without_budget.add(user)

    def forget_idle(self, keep: set[str]) -> None:
        """Drops the last-served stream of users outside ``keep``."""
        self.last_served = {
            user: rid for user, rid in self.last_served.items() if user in keep
        }
