"""The floor of a paced rate measured on the server's own counters.

A client's first-to-last-token span stretches by however late the last tokens
are delivered, so on a loaded machine it under-reports the rate the server
paced. The engine's ``tokens_charged`` (read over the control plane) does not:
``ChargedReads`` polls it while users stream, and ``assert_at_least_the_limit``
bounds the server's interval between two reads from below by the client's time
between the first read's reply and the second's sending. Over several engines
(scale-out) a read sums the engines' counters, and the same argument holds for
the sum: each engine's counter only grows.

The floor is what the server promises for the time its engine steps within the
limiter's burst of each other. Where the machine starves the engine (a shared
CI runner), a paced user's budget lapses unspent, and the engine says by how
much: ``UserState.engine_late``, read with each count. The floor allows for the
limit times the engine-late time that grew over the reads' interval, and on an
engine that kept up that is zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc

#: How often ``ChargedReads`` reads the counters.
POLL_PERIOD_S = 0.25
#: The shortest server interval a floor is asserted over: shorter ones are
#: dominated by the one-token granularity of a count.
MIN_INTERVAL_S = 2.0


def user_state(control_address: str, user: str) -> pb.UserState | None:
    """The engine's state of ``user``; None when the engine never saw it."""
    with grpc.insecure_channel(control_address) as channel:
        stub = pb_grpc.OutputRateControlStub(channel)
        try:
            return stub.GetUserState(pb.GetUserStateRequest(name=f"userStates/{user}"))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return None


@dataclass(frozen=True)
class Count:
    """One user's counters on the server at one read."""

    charged: int
    #: ``UserState.engine_late`` in seconds: how much of the user's budget lapsed
    #: because the engine's steps came later than the limiter's burst.
    engine_late_s: float = 0.0


def count(control_address: str, user: str) -> Count:
    state = user_state(control_address, user)
    if state is None:
        return Count(0)
    return Count(state.tokens_charged, state.engine_late.ToNanoseconds() / 1e9)


def charged(control_address: str, user: str) -> int:
    return count(control_address, user).charged


@dataclass(frozen=True)
class Read:
    """The users' counters, read by the server somewhere between ``sent`` and
    ``received`` (client clock)."""

    sent: float
    received: float
    charged: dict[str, int]
    #: user -> its engine-late seconds (absent: 0).
    engine_late_s: dict[str, float] = field(default_factory=dict)


def on_engines(control_addresses: Iterable[str]) -> Callable[[str], Count]:
    """A user's counters summed over the engines at ``control_addresses``."""
    addresses = tuple(control_addresses)

    def summed(user: str) -> Count:
        counts = [count(address, user) for address in addresses]
        return Count(
            sum(c.charged for c in counts), sum(c.engine_late_s for c in counts)
        )

    return summed


class ChargedReads:
    """Reads ``users``' counters with ``count`` (e.g. ``on_engines``) every
    ``POLL_PERIOD_S`` in a thread while the ``with`` block runs, and once more
    as it ends; ``before`` is read before the block starts."""

    def __init__(self, count: Callable[[str], Count], users: Iterable[str]) -> None:
        self._count = count
        self._users = tuple(users)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.reads: list[Read] = []
        self.before: dict[str, int] = {}

    def __enter__(self) -> ChargedReads:
        self.before = self._read().charged
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        # Engine-late time is counted when the late step comes: a read after
        # the users' last sees any lateness that the last one fell into.
        self.reads.append(self._read())

    def _read(self) -> Read:
        sent = time.monotonic()
        counts = {user: self._count(user) for user in self._users}
        return Read(
            sent,
            time.monotonic(),
            {user: c.charged for user, c in counts.items()},
            {user: c.engine_late_s for user, c in counts.items()},
        )

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.reads.append(self._read())
            self._stop.wait(POLL_PERIOD_S)

    def assert_at_least_the_limit(
        self, user: str, total: int, limit: float, share: float = 0.97
    ) -> None:
        assert_at_least_the_limit(
            self.reads, user, self.before[user], total, limit, share=share
        )


def assert_at_least_the_limit(
    reads: list[Read],
    user: str,
    before: int,
    total: int,
    limit: float,
    *,
    share: float = 0.97,
    allowance: float = 0.0,
) -> None:
    """At least ``share`` of the limit, less ``allowance`` tokens (what the
    caller knows may be lost, e.g. a killed engine's balance) and less the
    limit times the engine-late time the server counted meanwhile, on the
    server's counters. Between the first
    read that saw one of the user's ``total`` tokens charged and the last that
    saw fewer than all, the user had a request waiting every moment (a request
    ends only after its last token is charged), and the server's interval
    between the two reads is at least from the first's reply to the last's
    sending. Engine-late time is taken up to the read after the last (if any),
    which has counted a late step that the last read fell into."""
    started = [r for r in reads if r.charged[user] - before >= 1]
    unfinished = [r for r in reads if r.charged[user] - before < total]
    assert started and unfinished, f"{user}: no read while it was paced"
    first, last = started[0], unfinished[-1]
    closing = reads[min(reads.index(last) + 1, len(reads) - 1)]
    interval = last.sent - first.received
    got = last.charged[user] - first.charged[user]
    late_s = closing.engine_late_s.get(user, 0.0) - first.engine_late_s.get(user, 0.0)
    floor = share * limit * interval - allowance - limit * late_s
    report = (
        f"{user}: {got} tokens charged over at least {interval:.3f} s of the "
        f"server's time = {got / max(interval, 1e-9):.2f} tok/s (at least "
        f"{floor:.1f} needed: {share:.0%} of the limit less {allowance:g} and "
        f"less the limit times {late_s:.3f} s the engine came late); limit {limit}"
    )
    print(f"\n{report}")
    assert interval >= MIN_INTERVAL_S, report  # long enough to say something
    assert got >= floor, report


def all_streaming(
    reads: list[Read], totals: dict[str, int], settle_s: float = 0.0
) -> tuple[Read, Read]:
    """The first read ``settle_s`` after the first one that saw every user of
    ``totals`` charged, and the last before any user's ``totals[user]`` tokens
    were all charged: every user had a request waiting in between (a request
    ends only after its last token is charged)."""
    started = [r for r in reads if all(r.charged[u] >= 1 for u in totals)]
    assert started, "no read saw every user charged"
    settled = [r for r in started if r.sent >= started[0].received + settle_s]
    streaming = [r for r in reads if all(r.charged[u] < totals[u] for u in totals)]
    assert settled and streaming, "no read while every user streamed"
    return settled[0], streaming[-1]
