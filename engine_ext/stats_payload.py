"""The output-rate metrics payload's wire format: what the engine-core scheduler
adds to each ``SchedulerStats`` for the API process to export, and the
definitions both sides share (pure: no vLLM, no Prometheus).

The engine core builds the payload (``engine_ext.payload_builder``); the API
process takes it out and validates it (``engine_ext.payload_parser``). This
module holds what both sides agree on: the key, the version, the label values
and the names carried, and the failure log both use where vLLM calls them.
Invariant: every payload the builder makes is one the parser accepts; a change
to the payload's shape bumps ``PAYLOAD_VERSION``, which the parser checks first.

Transport: vLLM sends ``SchedulerStats`` from the engine core to the API process
inside every ``EngineCoreOutputs`` (msgpack). Its ``kv_connector_stats`` field is an
untyped ``dict[str, Any]`` that only KV connectors fill, with keys of their own, so
the payload travels there beside them under ``PAYLOAD_KEY``. The API process's stat
logger (``engine_ext.metrics``) removes it again before vLLM's own loggers look at
the field, leaving a connector's stats as the connector made them: vLLM's logging
stat logger crashes on a non-empty ``kv_connector_stats`` when no connector is
configured, and with one it hands the whole field to the connector's
``build_kv_connector_stats`` (tests/e2e/test_e2e_pd_disaggregation.py runs a connector
that reports stats and refuses any key but its own).

Semantics: counters are *deltas* since the previous payload, exactly like vLLM's own
prefix-cache stats. vLLM hands each step's stats to one API process only, so with
several API processes only deltas add up right (Prometheus sums them); a payload is
built once per engine step. Gauges are current values.

Cardinality: a ``user`` label exists only for users with an explicit limit (the
operator's limits table, never ids taken from requests), at most
``max_labelled_users`` of them; every other user's events are reported under
``OTHER_USER``. The labelled set is sticky: a labelled user keeps the label while
their explicit limit exists, new ones are admitted in name order while room is left.
The prompt limits (``pacing.prompt_budget``) travel for the labelled users with a
prompt rate of their own, and the default prompt rate, if any. The ceilings
(``pacing.ceilings``) travel for the labelled users with one (their own, their
tier's or the default: what each borrows up to), and the default ceiling, if
any; with any holder's ceiling set, the payload says whether borrowing was
blocked at the engine's last step (a holder within its rate waited, so no
other holder borrowed), a gauge of the engine that sent it.
Tiers are labelled the same way (every tier that exists, at most
``MAX_LABELLED_TIERS``; the rest under ``OTHER_TIER``); a tier's counters sum its
members' events, each event counted in the tier its user belongs to when the
payload is built, and users in no tier are in no tier's counters.
Teams are labelled like users (at most ``max_labelled_users`` of them, the rest
under ``OTHER_TEAM``) and their counters sum their members' events the same way
(exempt members included: they are members). A team's members with live
requests, and those of them with a request parked for lack of budget at the
engine's last step, are gauges of the engine that sent them; their integrals
over time are counters in member-nanoseconds (each build adds the time since
the previous one times the counts the previous one saw).

Store: with a global store configured (``SharedLimiter.store_stats``), the
payload carries the engine's store traffic (``pacing.store_stats``): round trips
by result, their latency per fixed bucket as (count, total ns) deltas (each
bucket's mean lies within it, so the API process can replay the bucket exactly),
tokens claimed, granted and returned as deltas, and the degraded flag and live
engines as gauges. Without a store the entry is ``None`` and no store series
exist.

Net counters (``NET_COUNTER_FIELDS``): a counter that refunds take back
(``borrowed_tokens``, net of refunds) may go down between payloads, but an
exported counter never does. Its delta is what its series' net count rose
above the highest it reached before (0 while below): the exported count is
the highest the net count reached, never less than it, above it only by
tokens refunded and not yet borrowed again.

Bands: while the policy has more than one band (``pacing.bands``), the payload
carries the bands' names (at most ``MAX_BANDS``: the label is bounded by the
policy), the output tokens charged per band (each user's tokens in the band it
is in when the payload is built, like a tier's), the seconds requests waited in
the waiting queue per band (counted when each starts or ends, in the band its
request was in: ``engine_ext.scheduling.band_stats``) as deltas, and two gauges
of the engine that sent them, while pacing is on: the startable requests
waiting per band at its last step start, and Jain's fairness index per band over
the band's users with live requests (``engine_ext.payload_builder``). Without
bands the entry is ``None`` and no band series exist.

Fair share: with the ledger passed (``pacing.fair_share``), the payload carries
whether fair share is on and the service gap among the users backlogged at the
last step, both gauges of this engine (fair share is per engine). Weighted
service is a per-user counter like the others, but a float
(``FLOAT_COUNTER_FIELDS``): service units are fractions when weights are.

Encoding: the payload holds plain data only (dicts, lists, str, int, float, None)
and every string in it encodes as strict UTF-8, because vLLM's msgpack encoder
raises on anything else and that would end its output thread. User ids are
validated at every entry point (``pacing.identity``); as a second line, a user
whose id does not encode is never labelled (counted under ``OTHER_USER``) and an
RPC method name that does not encode counts as ``OTHER_METHOD``.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from pacing.accounting import UserCounters

#: Key of the payload inside ``SchedulerStats.kv_connector_stats``.
PAYLOAD_KEY = "output_rate"
#: Bumped whenever the payload's shape changes; a mismatch is rejected.
PAYLOAD_VERSION = 8
#: The ``user`` label value of every user without a label of their own.
OTHER_USER = "__other__"
#: The ``tier`` label value of every tier without a label of its own.
OTHER_TIER = "__other__"
#: Most tiers with a ``tier`` label of their own. Tiers are the operator's, so
#: few; the cap holds should a control-plane client create many.
MAX_LABELLED_TIERS = 100
#: The ``team`` label value of every team without a label of its own.
OTHER_TEAM = "__other__"
#: The ``user`` label value of the default limit in the limits gauge.
DEFAULT_LIMIT_USER = "__default__"
#: The ``method`` label value of an RPC method name that does not encode.
OTHER_METHOD = "__other__"
#: gRPC status code names (``grpc.StatusCode.X.name``); anything else is UNKNOWN.
GRPC_CODES = frozenset(
    {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)
#: Results of a config reload, as carried and exported.
RELOAD_RESULTS = ("success", "failure")
#: Results of a store round trip, as carried and exported.
STORE_RESULTS = ("ok", "error")
#: Store token counters, as carried and exported.
STORE_TOKENS = ("claimed", "granted", "returned")
#: The per-user counters carried, in ``UserCounters`` field names.
COUNTER_FIELDS = tuple(f.name for f in fields(UserCounters))
#: The counters that may go down (refunds take them back); carried as
#: non-negative deltas all the same (see "Net counters" above).
NET_COUNTER_FIELDS = frozenset({"borrowed_tokens"})
assert set(COUNTER_FIELDS) >= NET_COUNTER_FIELDS, "a net counter is not carried"
#: The counters carried as floats (any other is a whole number).
FLOAT_COUNTER_FIELDS = frozenset(
    f.name for f in fields(UserCounters) if isinstance(f.default, float)
)


class FailureLog:
    """Reports failures of our code where vLLM calls it (a step's stats, the API
    process's stat logger), which must be caught there rather than raised into
    vLLM's thread. A failure may repeat on every engine step, so the traceback is
    logged at the 1st, 2nd, 4th, 8th, ... failure: log2(n) lines for n."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        #: Failures so far.
        self.count = 0

    def record(self) -> None:
        """Counts one failure; logs the exception being handled (call it from an
        ``except`` block) when the count is a power of two."""
        self.count += 1
        if self.count & (self.count - 1) == 0:
            self._log.exception(
                "%s (failure %d; logged at failures 1, 2, 4, 8, ...)",
                self._what,
                self.count,
            )
