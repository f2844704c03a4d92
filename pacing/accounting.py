"""Counters of what the limiter did, per user and in total (pure, no vLLM)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

#: The most distinct unknown objective names ``Accounting`` remembers (to log
#: each once): the names come from requests, so memory must not grow with them.
MAX_UNKNOWN_OBJECTIVE_NAMES = 1024


@dataclass
class UserCounters:
    """Cumulative events of one user (or, in ``Accounting.total``, of everyone)."""

    charged: int = 0  #: tokens charged (a sampling step dispatched or tried)
    refunds: int = 0  #: charges given back (charged, then not dispatched)
    throttled_skips: int = 0  #: requests passed over in a step for lack of budget
    throttled_preemptions: int = 0  #: parked requests chosen as preemption victims
    #: requests shadow mode let run uncharged where enforce would have skipped them
    shadow_skips: int = 0
    #: ns by which the gaps between scheduling steps exceeded the burst while
    #: the user had a request in the engine across them: budget that lapsed
    #: unspent because the engine came late, not because the user was paced
    engine_late_ns: int = 0
    #: weighted service received under fair share (``pacing.fair_share``):
    #: prompt and output tokens computed, priced, divided by the user's weight
    fair_share_service: float = 0.0
    #: running requests that yielded their slot to a user below its fair share
    fair_share_preemptions: int = 0
    #: uncached prompt tokens computed, charged to the prompt budget
    #: (``pacing.prompt_budget``; counted while any holder has a prompt rate)
    prompt_tokens_charged: int = 0
    #: requests held in a step for lack of prompt budget
    prompt_held_skips: int = 0
    #: requests shadow mode let compute where enforce would have held them
    prompt_shadow_holds: int = 0
    #: ns requests waited held for prompt budget, counted when each goes on
    prompt_wait_ns: int = 0
    #: output tokens taken above the user's rate, up to its ceiling, from
    #: capacity nobody else waited for (``pacing.ceilings``)
    borrowed_tokens: int = 0

    def add(self, other: UserCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Accounting:
    """Per-user and total counters; per-user entries can be forgotten (idle users)
    while the totals keep counting."""

    def __init__(self, *, keep_forgotten: bool = False) -> None:
        """With ``keep_forgotten``, ``forget`` keeps what it drops for
        ``collect_forgotten`` (for a reader of per-user deltas that calls it
        at every read: the metrics payload)."""
        self.total = UserCounters()
        self._users: dict[str, UserCounters] = {}
        #: Per user, then in total: requests whose gateway objective the
        #: policy in force maps to no band (they stayed in their user's band).
        #: Kept beside ``UserCounters``, not in it: each of its fields is
        #: exported as a metric (``engine_ext.metrics``), this one not yet.
        self.unknown_objectives: dict[str, int] = {}
        self.unknown_objectives_total = 0
        #: Unknown objective names seen, at most ``MAX_UNKNOWN_OBJECTIVE_NAMES``.
        self._unknown_objective_names: set[str] = set()
        #: Users forgotten since the last ``collect_forgotten``, with their
        #: counters then; None: nobody collects.
        self._forgotten: list[tuple[str, UserCounters]] | None = (
            [] if keep_forgotten else None
        )

    def of(self, user: str) -> UserCounters:
        """A copy of ``user``'s counters (zeros for an unknown user)."""
        counters = UserCounters()
        counters.add(self._users.get(user, UserCounters()))
        return counters

    def by_user(self) -> Mapping[str, UserCounters]:
        """A read-only live view of every user's counters (not copied: cheap
        for many users; read it only while nothing records)."""
        return MappingProxyType(self._users)

    def record(self, user: str, event: str, count: float = 1) -> None:
        """Adds ``count`` to counter ``event`` (a ``UserCounters`` field name)."""
        counters = self._users.get(user)
        if counters is None:
            counters = self._users[user] = UserCounters()
        setattr(counters, event, getattr(counters, event) + count)
        setattr(self.total, event, getattr(self.total, event) + count)

    def record_charged(self, charged: Mapping[str, int]) -> None:
        """Adds each user's charged tokens (one scheduler step's, at once)."""
        users = self._users
        for user, count in charged.items():
            counters = users.get(user)
            if counters is None:
                counters = users[user] = UserCounters()
            counters.charged += count
        self.total.charged += sum(charged.values())

    def record_unknown_objective(self, user: str, objective: str) -> bool:
        """Counts a request of ``user`` whose objective the policy maps to no
        band; whether ``objective`` is a name not seen before (to log once),
        up to ``MAX_UNKNOWN_OBJECTIVE_NAMES`` names (False beyond)."""
        self.unknown_objectives[user] = self.unknown_objectives.get(user, 0) + 1
        self.unknown_objectives_total += 1
        names = self._unknown_objective_names
        if objective in names or len(names) >= MAX_UNKNOWN_OBJECTIVE_NAMES:
            return False
        names.add(objective)
        return True

    def forget(self, keep: set[str]) -> None:
        """Drops per-user entries of users not in ``keep`` (kept for the next
        ``collect_forgotten`` with ``keep_forgotten``)."""
        users, self._users = self._users, {}
        forgotten = self._forgotten
        for user, counters in users.items():
            if user in keep:
                self._users[user] = counters
            elif forgotten is not None:
                forgotten.append((user, counters))
        self.unknown_objectives = {
            u: n for u, n in self.unknown_objectives.items() if u in keep
        }

    def collect_forgotten(self) -> list[tuple[str, UserCounters]]:
        """The users forgotten since the previous call (since start-up at the
        first), each with its counters as they were then (the objects
        ``by_user`` showed), oldest first; always empty without
        ``keep_forgotten``. A reader of per-user deltas (the metrics' groups)
        that calls it at every read loses no event of a user forgotten
        between two reads."""
        forgotten = self._forgotten
        if not forgotten:
            return []
        self._forgotten = []
        return forgotten
