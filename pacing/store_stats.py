"""Counters of one engine's traffic with the global store (``store/``, Redis), for
the metrics (pure: no clock, no I/O, no Prometheus).

The claimer (``store.claimer``) records into a ``StoreStats`` after each round
trip, under the facade's lock (``SharedLimiter.lock``); the metrics payload
(``engine_ext.payload_builder``) reads it under the same lock, so a payload sees
the state after whole passes. ``SharedLimiter.store_stats`` holds it when a
store is configured.

Vocabulary:

- *round trip*: one claimer pass's exchange with the store (its claims, returns
  and heartbeat, pipelined); *answered* or *failed* (unreachable, a timeout, an
  error reply). A script reload after a Redis restart adds two round trips to
  one exchange; they are not counted apart.
- *latency*: how long the claimer waited on an exchange, answered or not (a
  timeout shows as the timeout), in fixed buckets (``LATENCY_BUCKETS_NS``).
- *claimed* / *granted*: the tokens the claims of an answered exchange asked for
  and the store granted (granted <= claimed); *returned*: the tokens an answered
  exchange gave back. A failed exchange's claims and returns are in no count
  (the store may or may not have applied them).
- *prompt tokens*: the prompt budgets' claims (``pacing.prompt_budget``) go
  through the same store with claimers of their own; their round trips,
  latency and the store's state count here with the rest, their tokens apart
  (``prompt_tokens_*``: another unit, which would swamp the output counts;
  not in the metrics payload yet).
- *degraded*: the store did not answer the latest exchange (``down_since_ns``
  is when the outage began); the engine paces from what it holds, then locally.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

#: Upper bounds (inclusive, nanoseconds) of the latency buckets; one more bucket
#: takes what is slower. Loopback Redis answers in well under a millisecond and
#: the client's timeouts are tens of milliseconds (50 ms by default), so the
#: bounds are log-spaced from 0.1 ms to 1 s.
LATENCY_BUCKETS_NS = (
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
)


def _zeros() -> list[int]:
    return [0] * (len(LATENCY_BUCKETS_NS) + 1)


@dataclass
class StoreStats:
    """Cumulative store traffic of one engine and the store's state as the
    engine last saw it; see the module docstring. Its owner serialises access."""

    round_trips_answered: int = 0
    round_trips_failed: int = 0
    #: Per latency bucket (``LATENCY_BUCKETS_NS``, then one past the last bound):
    #: how many round trips fell in it and their total latency (ns). Not
    #: cumulative across buckets, so each bucket's mean lies within it.
    latency_counts: list[int] = field(default_factory=_zeros)
    latency_sums_ns: list[int] = field(default_factory=_zeros)
    tokens_claimed: int = 0
    tokens_granted: int = 0
    tokens_returned: int = 0
    #: The same three for the prompt claimers' tokens.
    prompt_tokens_claimed: int = 0
    prompt_tokens_granted: int = 0
    prompt_tokens_returned: int = 0
    #: When the store stopped answering (the engine's clock); ``None`` while it
    #: answers.
    down_since_ns: int | None = None
    #: Live engines the store last reported (1 until it has reported).
    live_engines: int = 1

    @property
    def degraded(self) -> bool:
        """Whether the store did not answer the latest round trip."""
        return self.down_since_ns is not None

    def record_answered(
        self,
        latency_ns: int,
        *,
        claimed: int,
        granted: int,
        returned: int,
        live_engines: int,
        prompt: bool = False,
    ) -> None:
        """An exchange was answered after ``latency_ns``: its claims asked for
        ``claimed`` tokens and got ``granted``, it gave ``returned`` back, and
        the store counts ``live_engines`` (the last count it gave, when this
        exchange carried no heartbeat). Ends an outage. ``prompt``: the tokens
        are prompt tokens (``prompt_tokens_*``)."""
        self.round_trips_answered += 1
        self._observe(latency_ns)
        if prompt:
            self.prompt_tokens_claimed += claimed
            self.prompt_tokens_granted += granted
            self.prompt_tokens_returned += returned
        else:
            self.tokens_claimed += claimed
            self.tokens_granted += granted
            self.tokens_returned += returned
        self.down_since_ns = None
        self.live_engines = live_engines

    def record_failed(self, latency_ns: int, now_ns: int) -> None:
        """An exchange failed after ``latency_ns``, at ``now_ns`` (the first
        failure in a row starts the outage)."""
        self.round_trips_failed += 1
        self._observe(latency_ns)
        if self.down_since_ns is None:
            self.down_since_ns = now_ns

    def fingerprint(self) -> tuple[int, ...]:
        """What a metrics payload would report from this: equal fingerprints,
        nothing new (ints only, safe to read from another thread: a torn read
        only misses news that the next read sees)."""
        return (
            self.round_trips_answered,
            self.round_trips_failed,
            self.tokens_claimed,
            self.tokens_granted,
            self.tokens_returned,
            int(self.degraded),
            self.live_engines,
        )

    def _observe(self, latency_ns: int) -> None:
        # A clock that went backwards (it should not) counts as no wait.
        latency_ns = max(0, latency_ns)
        bucket = bisect_left(LATENCY_BUCKETS_NS, latency_ns)
        self.latency_counts[bucket] += 1
        self.latency_sums_ns[bucket] += latency_ns
