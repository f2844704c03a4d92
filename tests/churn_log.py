"""Bookkeeping of the churn proof (``tests/e2e/test_e2e_churn.py``): the change log,
the limit state each logged change leaves every user in, and each measured
interval's GCRA bound. Pure: no gRPC, no clock; the derivation of the bound is
in the test's docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pacing.limiter import DEFAULT_BURST_NS, NS_PER_S

ENFORCE, SHADOW, OFF = "enforce", "shadow", "off"

#: A user's limit state between two changes: (pacing mode, limit in tokens/s),
#: the limit 0 when the user is exempt (as ``UserState`` reports it).
State = tuple[str, int]


@dataclass(frozen=True)
class Change:
    """One control-plane change. ``kind`` and ``value``:

    - ``"tier_rate"``: ``target`` tier's rate (int);
    - ``"tier_exempt"``: ``target`` tier's exemption (bool);
    - ``"membership"``: ``target`` user's tier (str);
    - ``"user_exempt"``: ``target`` user's exemption (bool);
    - ``"mode"``: the pacing mode (str; ``target`` is empty).
    """

    kind: str
    target: str
    value: int | bool | str


@dataclass
class Table:
    """The part of the limits table the churn changes, for users that are
    all members of a tier and have no limit of their own: resolved as
    ``pacing.limits`` does (user exempt, then tier exempt, then the tier's
    rate)."""

    tier_rates: dict[str, int]
    memberships: dict[str, str]
    exempt_tiers: set[str] = field(default_factory=set)
    exempt_users: set[str] = field(default_factory=set)
    mode: str = ENFORCE

    def apply(self, change: Change) -> None:
        """Makes ``change``; raises ValueError for one the server would refuse
        (an unknown tier, a rate out of range, an unknown mode)."""
        kind, target, value = change.kind, change.target, change.value
        if kind == "mode":
            if value not in (ENFORCE, SHADOW, OFF):
                raise ValueError(f"unknown mode {value!r}")
            self.mode = str(value)
        elif kind == "membership":
            if value not in self.tier_rates:
                raise ValueError(f"unknown tier {value!r}")
            self.memberships[target] = str(value)
        elif kind == "user_exempt":
            _toggle(self.exempt_users, target, bool(value))
        elif target not in self.tier_rates:
            raise ValueError(f"unknown tier {target!r}")
        elif kind == "tier_exempt":
            _toggle(self.exempt_tiers, target, bool(value))
        elif kind == "tier_rate":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"bad rate {value!r}")
            self.tier_rates[target] = value
        else:
            raise ValueError(f"unknown change {kind!r}")

    def limit(self, user: str) -> int:
        """``user``'s limit in tokens/s; 0 when exempt."""
        tier = self.memberships[user]
        if user in self.exempt_users or tier in self.exempt_tiers:
            return 0
        return self.tier_rates[tier]

    def states(self, users: Iterable[str]) -> dict[str, State]:
        """Every one of ``users``' state now."""
        return {user: (self.mode, self.limit(user)) for user in users}


def _toggle(marked: set[str], name: str, on: bool) -> None:
    if on:
        marked.add(name)
    else:
        marked.discard(name)


def measured(state: State) -> bool:
    """Whether the bound applies: pacing enforced and the user limited."""
    mode, limit = state
    return mode == ENFORCE and limit > 0


def gcra_bound(rate: int, window_ns: int, burst_ns: int = DEFAULT_BURST_NS) -> int:
    """The most tokens GCRA at ``rate`` (tokens/s) grants in takes that all lie
    within ``window_ns``: ``floor(rate * (window + burst) / 1 s) + 1``, in exact
    integers."""
    return rate * (window_ns + burst_ns) // NS_PER_S + 1


@dataclass(frozen=True)
class Read:
    """One read of every user's counters at a single server instant, which lies
    between ``sent_ns`` and ``received_ns`` (the client's monotonic clock)."""

    sent_ns: int
    received_ns: int
    #: user -> tokens charged minus refunds (the tokens dispatched to it).
    net: Mapping[str, int]


@dataclass(frozen=True)
class Interval:
    """Reads ``first``..``last`` of one user, all in one measured state."""

    user: str
    rate: int
    first: int
    last: int
    window_ns: int  #: from sending read ``first`` to receiving read ``last``
    tokens: int  #: net charged between the two reads

    @property
    def bound(self) -> int:
        return gcra_bound(self.rate, self.window_ns)

    @property
    def ratio(self) -> float:
        return self.tokens / self.bound


@dataclass
class Measurement:
    """Every measured interval, and the read-to-read windows cut out."""

    intervals: list[Interval] = field(default_factory=list)
    #: Consecutive reads in one measured state whose net count shrank: the
    #: engine forgot the user's counters in between (it had no live request).
    resets: int = 0
    #: Consecutive reads in one measured state where such a forget could not
    #: be ruled out: the first read's count was within what the pair's window
    #: can hold, so the second could not show it shrinking.
    unproven: int = 0
    #: Pairs of consecutive reads in one measured state, and how many of them
    #: lie inside a measured interval (the others were cut).
    pairs: int = 0
    covered: int = 0


def measure(
    reads: Sequence[Read], expected: Sequence[Mapping[str, State]], users: Iterable[str]
) -> Measurement:
    """Each user's intervals: maximal runs of consecutive reads in one
    measured state (``expected[j]`` is the state the log says held at read
    ``j``), cut wherever the counters may have been forgotten between two
    reads (counted in ``resets`` and ``unproven``)."""
    if len(reads) != len(expected):
        raise ValueError(f"{len(reads)} reads but {len(expected)} states")
    result = Measurement()
    for user in users:
        start = 0
        for j in range(1, len(reads) + 1):
            state = expected[j - 1][user]
            cut = j == len(reads) or expected[j][user] != state
            if not cut and measured(state):
                result.pairs += 1
                before, after = reads[j - 1].net[user], reads[j].net[user]
                window = reads[j].received_ns - reads[j - 1].sent_ns
                if after < before:
                    result.resets += 1
                    cut = True
                elif before <= gcra_bound(state[1], window):
                    result.unproven += 1
                    cut = True
            if not cut:
                continue
            last = j - 1
            if last > start and measured(state):
                result.covered += last - start
                first_read, last_read = reads[start], reads[last]
                result.intervals.append(
                    Interval(
                        user=user,
                        rate=state[1],
                        first=start,
                        last=last,
                        window_ns=last_read.received_ns - first_read.sent_ns,
                        tokens=last_read.net[user] - first_read.net[user],
                    )
                )
            start = j
    return result
