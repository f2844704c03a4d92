"""Output-rate metrics on vLLM's own ``/metrics`` (API-process side).

``OutputRateStatLogger`` is loaded by vLLM's ``vllm.stat_logger_plugins`` entry
point in the API process. vLLM calls its ``record()`` with every ``SchedulerStats``
that arrives from the engine core; it takes our payload out of
``kv_connector_stats`` (see ``engine_ext.stats_payload``) and applies it to
Prometheus metrics that follow vLLM's conventions: ``vllm:`` prefix, a
``model_name`` label, ``_total`` counters, ``_seconds`` histograms.

Two vLLM details shape this module:

- vLLM's ``PrometheusStatLogger`` is created after plugin loggers and, in its
  constructor, unregisters every collector on the default registry whose name
  starts with ``vllm:``. Our metrics are therefore created unregistered and
  exposed through one collector object without a name, which it leaves alone.
- Stat loggers run in list order, plugins first. We remove the payload before
  vLLM's logging stat logger sees ``kv_connector_stats``: it asserts a KV
  connector is configured when that field is non-empty, and crashes.

The store's families (``vllm:output_rate_store_*``, with a global store only)
and the fair-share gauges carry an ``engine`` label, as vLLM's own per-engine
metrics do: with data parallelism every rank is a store client of its own and
keeps a fair-share ledger of its own. So do the gauges of a team's members
with live requests (each rank holds requests of its own), the borrowing
gauge (each rank lends its own spare capacity, ``pacing.ceilings``) and the
bands' gauges (each rank has a waiting queue and requests of its own).

The bands' series (``vllm:output_rate_band_*``, label ``band``) exist only
while the policy has more than one band (at most ``pacing.bands.MAX_BANDS``):
the counters for exactly the bands in force, born at zero; the gauges for the
bands the engine last reported, while pacing is on.

With several API processes (``--api-server-count``) vLLM serves ``/metrics`` from
prometheus_client's multiprocess files; the metric objects here write to those
files too, counters add up across processes and gauges show the most recent value.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from engine_ext.payload_parser import (
    BandsPart,
    FairSharePart,
    Payload,
    PayloadError,
    StorePart,
    parse,
    take_payload,
)
from engine_ext.stats_payload import (
    COUNTER_FIELDS,
    DEFAULT_LIMIT_USER,
    OTHER_TEAM,
    OTHER_TIER,
    OTHER_USER,
    RELOAD_RESULTS,
    STORE_RESULTS,
    FailureLog,
)
from pacing.modes import Mode
from pacing.store_stats import LATENCY_BUCKETS_NS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.metrics.stats import (
        IterationStats,
        MultiModalCacheStats,
        SchedulerStats,
    )

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Our entry point: name in ``vllm.stat_logger_plugins`` and its target.
ENTRY_POINT_NAME = "output_rate"
ENTRY_POINT_VALUE = "engine_ext.metrics:OutputRateStatLogger"
STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"

#: An idle wait lasts until a user has budget again (1/limit s for a user's
#: next token), at most 1 s (``hooks.IDLE_WAIT_CAP_S``), or 50 ms while a
#: grammar compiles (``hooks.ASYNC_WORK_WAIT_CAP_S``): log-spaced buckets to 1 s.
IDLE_WAIT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
#: The engine core's latency buckets (``pacing.store_stats``), in seconds.
STORE_LATENCY_BUCKETS_S = tuple(bound / 1e9 for bound in LATENCY_BUCKETS_NS)

#: Exported names (counters as exposed, with ``_total``).
TOKENS_CHARGED = "vllm:output_rate_tokens_charged_total"
THROTTLED_SKIPS = "vllm:output_rate_throttled_skips_total"
REFUNDS = "vllm:output_rate_refunds_total"
THROTTLED_PREEMPTIONS = "vllm:output_rate_throttled_preemptions_total"
SHADOW_SKIPS = "vllm:output_rate_shadow_skips_total"
ENGINE_LATE_SECONDS = "vllm:output_rate_engine_late_seconds_total"
PROMPT_TOKENS_CHARGED = "vllm:output_rate_prompt_tokens_charged_total"
PROMPT_HELD_SKIPS = "vllm:output_rate_prompt_held_skips_total"
PROMPT_SHADOW_HOLDS = "vllm:output_rate_prompt_shadow_holds_total"
PROMPT_WAIT_SECONDS = "vllm:output_rate_prompt_wait_seconds_total"
BORROWED_TOKENS = "vllm:output_rate_borrowed_tokens_total"
IDLE_WAIT_SECONDS = "vllm:output_rate_idle_wait_seconds"
THROTTLED_REQUESTS = "vllm:output_rate_throttled_requests"
TRACKED_USERS = "vllm:output_rate_tracked_users"
LIMIT_TOKENS_PER_SECOND = "vllm:output_rate_limit_tokens_per_second"
PROMPT_LIMIT_TOKENS_PER_SECOND = "vllm:output_rate_prompt_limit_tokens_per_second"
CEILING_TOKENS_PER_SECOND = "vllm:output_rate_ceiling_tokens_per_second"
BORROWING_BLOCKED = "vllm:output_rate_borrowing_blocked"
LIMIT_CHANGES = "vllm:output_rate_limit_changes_total"
CONFIG_RELOADS = "vllm:output_rate_config_reloads_total"
CONTROL_RPCS = "vllm:output_rate_control_rpcs_total"
MODE = "vllm:output_rate_mode"
TIER_TOKENS_CHARGED = "vllm:output_rate_tier_tokens_charged_total"
TIER_THROTTLED_SKIPS = "vllm:output_rate_tier_throttled_skips_total"
TIER_REFUNDS = "vllm:output_rate_tier_refunds_total"
TIER_THROTTLED_PREEMPTIONS = "vllm:output_rate_tier_throttled_preemptions_total"
TIER_SHADOW_SKIPS = "vllm:output_rate_tier_shadow_skips_total"
TIER_ENGINE_LATE_SECONDS = "vllm:output_rate_tier_engine_late_seconds_total"
TIER_PROMPT_TOKENS_CHARGED = "vllm:output_rate_tier_prompt_tokens_charged_total"
TIER_PROMPT_HELD_SKIPS = "vllm:output_rate_tier_prompt_held_skips_total"
TIER_PROMPT_SHADOW_HOLDS = "vllm:output_rate_tier_prompt_shadow_holds_total"
TIER_PROMPT_WAIT_SECONDS = "vllm:output_rate_tier_prompt_wait_seconds_total"
TIER_BORROWED_TOKENS = "vllm:output_rate_tier_borrowed_tokens_total"
TIER_LIMIT_TOKENS_PER_SECOND = "vllm:output_rate_tier_limit_tokens_per_second"
STORE_ROUND_TRIPS = "vllm:output_rate_store_round_trips_total"
STORE_ROUND_TRIP_SECONDS = "vllm:output_rate_store_round_trip_seconds"
STORE_TOKENS_CLAIMED = "vllm:output_rate_store_tokens_claimed_total"
STORE_TOKENS_GRANTED = "vllm:output_rate_store_tokens_granted_total"
STORE_TOKENS_RETURNED = "vllm:output_rate_store_tokens_returned_total"
STORE_DEGRADED = "vllm:output_rate_store_degraded"
STORE_LIVE_ENGINES = "vllm:output_rate_store_live_engines"
FAIR_SHARE_SERVICE = "vllm:output_rate_fair_share_service_total"
FAIR_SHARE_PREEMPTIONS = "vllm:output_rate_fair_share_preemptions_total"
TIER_FAIR_SHARE_SERVICE = "vllm:output_rate_tier_fair_share_service_total"
TIER_FAIR_SHARE_PREEMPTIONS = "vllm:output_rate_tier_fair_share_preemptions_total"
FAIR_SHARE_ENABLED = "vllm:output_rate_fair_share_enabled"
TEAM_TOKENS_CHARGED = "vllm:output_rate_team_tokens_charged_total"
TEAM_THROTTLED_SKIPS = "vllm:output_rate_team_throttled_skips_total"
TEAM_REFUNDS = "vllm:output_rate_team_refunds_total"
TEAM_THROTTLED_PREEMPTIONS = "vllm:output_rate_team_throttled_preemptions_total"
TEAM_SHADOW_SKIPS = "vllm:output_rate_team_shadow_skips_total"
TEAM_ENGINE_LATE_SECONDS = "vllm:output_rate_team_engine_late_seconds_total"
TEAM_PROMPT_TOKENS_CHARGED = "vllm:output_rate_team_prompt_tokens_charged_total"
TEAM_PROMPT_HELD_SKIPS = "vllm:output_rate_team_prompt_held_skips_total"
TEAM_PROMPT_SHADOW_HOLDS = "vllm:output_rate_team_prompt_shadow_holds_total"
TEAM_PROMPT_WAIT_SECONDS = "vllm:output_rate_team_prompt_wait_seconds_total"
TEAM_BORROWED_TOKENS = "vllm:output_rate_team_borrowed_tokens_total"
TEAM_FAIR_SHARE_SERVICE = "vllm:output_rate_team_fair_share_service_total"
TEAM_FAIR_SHARE_PREEMPTIONS = "vllm:output_rate_team_fair_share_preemptions_total"
TEAM_LIMIT_TOKENS_PER_SECOND = "vllm:output_rate_team_limit_tokens_per_second"
TEAM_MEMBERS_STREAMING = "vllm:output_rate_team_members_streaming"
TEAM_THROTTLED_MEMBERS = "vllm:output_rate_team_throttled_members"
TEAM_MEMBER_ACTIVE_SECONDS = "vllm:output_rate_team_member_active_seconds_total"
TEAM_MEMBER_THROTTLED_SECONDS = "vllm:output_rate_team_member_throttled_seconds_total"
FAIR_SHARE_SERVICE_GAP = "vllm:output_rate_fair_share_service_gap"
BAND_TOKENS = "vllm:output_rate_band_tokens_total"
BAND_WAIT_SECONDS = "vllm:output_rate_band_wait_seconds_total"
BAND_WAITING_REQUESTS = "vllm:output_rate_band_waiting_requests"
BAND_FAIRNESS = "vllm:output_rate_band_fairness"

#: Payload counter field -> exported counter name.
USER_COUNTERS = {
    "charged": TOKENS_CHARGED,
    "throttled_skips": THROTTLED_SKIPS,
    "refunds": REFUNDS,
    "throttled_preemptions": THROTTLED_PREEMPTIONS,
    "shadow_skips": SHADOW_SKIPS,
    "engine_late_ns": ENGINE_LATE_SECONDS,
    "fair_share_service": FAIR_SHARE_SERVICE,
    "fair_share_preemptions": FAIR_SHARE_PREEMPTIONS,
    "prompt_tokens_charged": PROMPT_TOKENS_CHARGED,
    "prompt_held_skips": PROMPT_HELD_SKIPS,
    "prompt_shadow_holds": PROMPT_SHADOW_HOLDS,
    "prompt_wait_ns": PROMPT_WAIT_SECONDS,
    "borrowed_tokens": BORROWED_TOKENS,
}
#: Payload counter field -> exported per-tier counter name.
TIER_COUNTERS = {
    "charged": TIER_TOKENS_CHARGED,
    "throttled_skips": TIER_THROTTLED_SKIPS,
    "refunds": TIER_REFUNDS,
    "throttled_preemptions": TIER_THROTTLED_PREEMPTIONS,
    "shadow_skips": TIER_SHADOW_SKIPS,
    "engine_late_ns": TIER_ENGINE_LATE_SECONDS,
    "fair_share_service": TIER_FAIR_SHARE_SERVICE,
    "fair_share_preemptions": TIER_FAIR_SHARE_PREEMPTIONS,
    "prompt_tokens_charged": TIER_PROMPT_TOKENS_CHARGED,
    "prompt_held_skips": TIER_PROMPT_HELD_SKIPS,
    "prompt_shadow_holds": TIER_PROMPT_SHADOW_HOLDS,
    "prompt_wait_ns": TIER_PROMPT_WAIT_SECONDS,
    "borrowed_tokens": TIER_BORROWED_TOKENS,
}
#: Payload counter field -> exported per-team counter name.
TEAM_COUNTERS = {
    "charged": TEAM_TOKENS_CHARGED,
    "throttled_skips": TEAM_THROTTLED_SKIPS,
    "refunds": TEAM_REFUNDS,
    "throttled_preemptions": TEAM_THROTTLED_PREEMPTIONS,
    "shadow_skips": TEAM_SHADOW_SKIPS,
    "engine_late_ns": TEAM_ENGINE_LATE_SECONDS,
    "fair_share_service": TEAM_FAIR_SHARE_SERVICE,
    "fair_share_preemptions": TEAM_FAIR_SHARE_PREEMPTIONS,
    "prompt_tokens_charged": TEAM_PROMPT_TOKENS_CHARGED,
    "prompt_held_skips": TEAM_PROMPT_HELD_SKIPS,
    "prompt_shadow_holds": TEAM_PROMPT_SHADOW_HOLDS,
    "prompt_wait_ns": TEAM_PROMPT_WAIT_SECONDS,
    "borrowed_tokens": TEAM_BORROWED_TOKENS,
}
#: What one unit of a payload counter field is in its exported counter's unit
#: (fields not listed: 1).
COUNTER_UNITS = {"engine_late_ns": 1e-9, "prompt_wait_ns": 1e-9}
#: Payload store token field -> exported counter name.
STORE_TOKEN_COUNTERS = {
    "claimed": STORE_TOKENS_CLAIMED,
    "granted": STORE_TOKENS_GRANTED,
    "returned": STORE_TOKENS_RETURNED,
}
assert set(USER_COUNTERS) == set(COUNTER_FIELDS), "payload and metrics disagree"
assert set(TIER_COUNTERS) == set(COUNTER_FIELDS), "payload and metrics disagree"
assert set(TEAM_COUNTERS) == set(COUNTER_FIELDS), "payload and metrics disagree"

_DOCS = {
    TOKENS_CHARGED: "Output tokens charged to a user's budget (a sampling step "
    "dispatched; refunds not subtracted).",
    THROTTLED_SKIPS: "Times a running or waiting request was passed over in a "
    "scheduler step because its user had no budget.",
    REFUNDS: "Charges given back because the charged request was not dispatched "
    "(KV allocation failed or preempted).",
    THROTTLED_PREEMPTIONS: "Preemptions whose victim was a request parked for "
    "lack of budget (KV pressure from parked requests).",
    SHADOW_SKIPS: "In shadow mode: times a request ran uncharged where enforce "
    "mode would have passed it over for lack of budget.",
    ENGINE_LATE_SECONDS: "Time by which the gaps between scheduling steps "
    "exceeded the 100 ms burst while the user had a request in the engine: its "
    "budget lapsed unspent because the engine came late (slow steps, a starved "
    "process), not because of its limit. The user may fall short of its limit "
    "by up to limit times this.",
    PROMPT_TOKENS_CHARGED: "Uncached prompt tokens the engine computed for a "
    "user, charged to its prompt budget when scheduled (prefix-cache hits and "
    "recomputation after a preemption are free); counted while any holder has "
    "a prompt rate.",
    PROMPT_HELD_SKIPS: "Times a request's prefill was held in a scheduler step "
    "because its user had no prompt budget.",
    PROMPT_SHADOW_HOLDS: "In shadow mode: times a request computed its prompt "
    "where enforce mode would have held it for lack of prompt budget.",
    PROMPT_WAIT_SECONDS: "Time requests of a user waited held for prompt "
    "budget, counted when each goes on (or ends).",
    BORROWED_TOKENS: "Ceilings: output tokens a user took above its rate, up "
    "to its ceiling, from the engine's spare capacity (no other holder within "
    "its rate waited), net of refunds: a refund is taken out of later "
    "borrowing (the counter never goes down). Included in the tokens charged.",
    IDLE_WAIT_SECONDS: "Time the engine loop blocked on its input queue because "
    "every ready request was throttled.",
    THROTTLED_REQUESTS: "Requests passed over for lack of budget in the latest "
    "scheduler step.",
    TRACKED_USERS: "Users currently holding limiter state.",
    LIMIT_TOKENS_PER_SECOND: "Output-token limit in tokens per second of each "
    f"labelled user; user={DEFAULT_LIMIT_USER!r} is the default limit.",
    PROMPT_LIMIT_TOKENS_PER_SECOND: "Prompt-token limit (uncached prompt tokens "
    "computed per second) of each labelled user with a prompt rate of its own; "
    f"user={DEFAULT_LIMIT_USER!r} is the default prompt rate (no sample without "
    "one).",
    CEILING_TOKENS_PER_SECOND: "Ceiling (output tokens per second a user may "
    "borrow up to while the engine is spare for it) of each labelled user with "
    "one: its own, its tier's or the default; "
    f"user={DEFAULT_LIMIT_USER!r} is the default ceiling (no sample without "
    "one). At or below the user's limit it borrows nothing.",
    BORROWING_BLOCKED: "1 if, at the engine's last step start, a user within "
    "its limit had a request waiting for capacity, so that no other user "
    "borrowed above its limit in that step (the waiting user itself may), else "
    "0; no sample while no holder has a ceiling or pacing is off.",
    LIMIT_CHANGES: "New limits tables committed: write RPCs, and loads of the "
    "limits file that changed the table (the start-up load included).",
    CONFIG_RELOADS: "Limits config-file reloads by result (success, failure).",
    CONTROL_RPCS: "Control-plane RPCs by method and gRPC status code.",
    MODE: "Pacing mode: 1 for the current one (enforce, shadow or off), 0 for "
    "the others.",
    TIER_TOKENS_CHARGED: "Output tokens charged to the members of a tier.",
    TIER_THROTTLED_SKIPS: "Throttled skips of the members of a tier.",
    TIER_REFUNDS: "Refunds to the members of a tier.",
    TIER_THROTTLED_PREEMPTIONS: "Throttled preemptions of the members of a tier.",
    TIER_SHADOW_SKIPS: "Shadow skips (what enforce would have throttled) of the "
    "members of a tier.",
    TIER_ENGINE_LATE_SECONDS: "Engine-late time of the members of a tier, "
    "summed over them.",
    TIER_PROMPT_TOKENS_CHARGED: "Prompt tokens charged to the members of a tier.",
    TIER_PROMPT_HELD_SKIPS: "Prompt holds of the members of a tier.",
    TIER_PROMPT_SHADOW_HOLDS: "Shadow prompt holds (what enforce would have "
    "held) of the members of a tier.",
    TIER_PROMPT_WAIT_SECONDS: "Time the members of a tier waited held for "
    "prompt budget, summed over them.",
    TIER_BORROWED_TOKENS: "Output tokens the members of a tier borrowed above "
    "their limits (net of refunds).",
    TIER_LIMIT_TOKENS_PER_SECOND: "Output-token limit of each member of a tier "
    "(members without a limit of their own); no sample for an exempt tier.",
    STORE_ROUND_TRIPS: "Round trips of the engine's claimer to the global store "
    "(one pipelined exchange per pass) by result (ok, error).",
    STORE_ROUND_TRIP_SECONDS: "Time the claimer waited on a round trip to the "
    "global store, answered or not (a timeout shows as the timeout).",
    STORE_TOKENS_CLAIMED: "Tokens the engine's answered claims asked the global "
    "store for.",
    STORE_TOKENS_GRANTED: "Tokens the global store granted the engine's claims.",
    STORE_TOKENS_RETURNED: "Unspent tokens the engine gave back to the global "
    "store (a lease ended, or a user's last request on the engine did).",
    STORE_DEGRADED: "1 while the global store does not answer the engine (it "
    "paces from what it holds, then locally), else 0.",
    STORE_LIVE_ENGINES: "Live engines (heartbeats) the global store last "
    "reported: the N of the local share R / N during an outage.",
    FAIR_SHARE_SERVICE: "Weighted service a user received under fair share: "
    "prompt tokens computed times the prompt price plus output tokens times the "
    "output price, divided by the user's weight (units, not tokens).",
    FAIR_SHARE_PREEMPTIONS: "Running requests of a user that yielded their slot "
    "to a user below its fair share.",
    TIER_FAIR_SHARE_SERVICE: "Weighted service the members of a tier received "
    "under fair share, summed over them.",
    TIER_FAIR_SHARE_PREEMPTIONS: "Fair-share preemptions of the members of a tier.",
    TEAM_TOKENS_CHARGED: "Output tokens charged to the members of a team, "
    "exempt members included (their tokens count against no team's limit).",
    TEAM_THROTTLED_SKIPS: "Throttled skips of the members of a team (for lack "
    "of their own budget or the team's).",
    TEAM_REFUNDS: "Refunds to the members of a team.",
    TEAM_THROTTLED_PREEMPTIONS: "Throttled preemptions of the members of a team.",
    TEAM_SHADOW_SKIPS: "Shadow skips (what enforce would have throttled) of the "
    "members of a team.",
    TEAM_ENGINE_LATE_SECONDS: "Engine-late time of the members of a team, "
    "summed over them.",
    TEAM_FAIR_SHARE_SERVICE: "Weighted service the members of a team received "
    "under fair share, summed over them.",
    TEAM_FAIR_SHARE_PREEMPTIONS: "Fair-share preemptions of the members of a team.",
    TEAM_PROMPT_TOKENS_CHARGED: "Prompt tokens charged to the members of a team.",
    TEAM_PROMPT_HELD_SKIPS: "Prompt holds of the members of a team (for lack "
    "of their own prompt budget or the team's).",
    TEAM_PROMPT_SHADOW_HOLDS: "Shadow prompt holds (what enforce would have "
    "held) of the members of a team.",
    TEAM_PROMPT_WAIT_SECONDS: "Time the members of a team waited held for "
    "prompt budget, summed over them.",
    TEAM_BORROWED_TOKENS: "Output tokens the members of a team borrowed above "
    "their limits (net of refunds).",
    TEAM_LIMIT_TOKENS_PER_SECOND: "Output-token limit a team's members share, in "
    "tokens per second.",
    TEAM_MEMBERS_STREAMING: "Members of a team with live requests on the engine, "
    "at its latest payload.",
    TEAM_THROTTLED_MEMBERS: "Members of a team with live requests and a request "
    "parked for lack of budget (their own or the team's) at the engine's last "
    "step.",
    TEAM_MEMBER_ACTIVE_SECONDS: "Member-seconds a team's members had live "
    "requests: the members-streaming gauge integrated over time (sampled at "
    "each payload, at most 100 ms apart while requests run).",
    TEAM_MEMBER_THROTTLED_SECONDS: "Member-seconds a team's members with live "
    "requests were throttled: the throttled-members gauge integrated over time. "
    "Over the active seconds, the share of members' time throttled.",
    FAIR_SHARE_ENABLED: "1 while weighted fair share orders the engine's "
    "admissions, else 0.",
    FAIR_SHARE_SERVICE_GAP: "Largest difference in weighted service between two "
    "users backlogged (and within their limits) at the engine's last step; 0 "
    "for fewer than two. Fair share bounds it; a gap that keeps growing means "
    "a user is not getting its share.",
    BAND_TOKENS: "Priority bands: output tokens charged to the users of a band, "
    "each user's in the band it was in when the engine reported them (its own, "
    "its tier's, its team's or the default). Series exist while the policy has "
    "more than one band.",
    BAND_WAIT_SECONDS: "Time requests of a band spent in the waiting queue, "
    "from arrival (or the step that preempted it) to the start of the step that "
    "scheduled it (or its end), counted then, in the band its request was in; "
    "its rate is the average number of the band's requests waiting.",
    BAND_WAITING_REQUESTS: "Startable requests (waiting or preempted) of a band "
    "in the engine's waiting queue when the engine reported; no sample with "
    "pacing off.",
    BAND_FAIRNESS: "Jain's fairness index, (sum x)^2 / (n sum x^2), over the "
    "band's users with live requests on the engine of x = output tokens "
    "dispatched per second over the last 10 s divided by the user's weight: 1 "
    "when all got the same per weight (one user: 1), 1/n when one got "
    "everything. No sample without a user measured (live for about a second) "
    "or with pacing off.",
}

# Registry -> our collector on it, so a second logger in one process (vLLM
# rebuilds its stat loggers, tests build many) replaces the first.
_collectors: weakref.WeakKeyDictionary[CollectorRegistry, _Collector] = (
    weakref.WeakKeyDictionary()
)


def stat_logger_will_load() -> bool:
    """Whether vLLM started in this environment loads ``OutputRateStatLogger`` in
    its API process: our entry point is installed and ``VLLM_PLUGINS``, if set,
    names it."""
    from importlib.metadata import entry_points

    import vllm.envs as envs

    allowed = envs.VLLM_PLUGINS
    if allowed is not None and ENTRY_POINT_NAME not in allowed:
        return False
    return any(
        ep.name == ENTRY_POINT_NAME and ep.value == ENTRY_POINT_VALUE
        for ep in entry_points(group=STAT_LOGGER_PLUGINS_GROUP)
    )


def transport_enabled(usage_context: UsageContext | None) -> bool:
    """Whether the engine core may put the payload into ``SchedulerStats``: only
    for the OpenAI API server (an ``AsyncLLM``, which loads stat logger plugins;
    the offline ``LLM`` does not, and its logging stat logger would crash on the
    payload) and only if our stat logger will be loaded."""
    from vllm.usage.usage_lib import UsageContext

    return usage_context == UsageContext.OPENAI_API_SERVER and stat_logger_will_load()


class OutputRateMetrics:
    """The output-rate metrics of one model, exposed on ``registry``."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = REGISTRY
    ) -> None:
        self._model = model_name
        user = ["model_name", "user"]
        self._counters = {
            field: Counter(name, _DOCS[name], user, registry=None)
            for field, name in USER_COUNTERS.items()
        }
        self._idle_wait = Histogram(
            IDLE_WAIT_SECONDS,
            _DOCS[IDLE_WAIT_SECONDS],
            ["model_name"],
            buckets=IDLE_WAIT_BUCKETS_S,
            registry=None,
        )
        self._throttled = _gauge(THROTTLED_REQUESTS, ["model_name"])
        self._tracked = _gauge(TRACKED_USERS, ["model_name"])
        self._limits = _gauge(LIMIT_TOKENS_PER_SECOND, user)
        self._prompt_limits = _gauge(PROMPT_LIMIT_TOKENS_PER_SECOND, user)
        self._ceilings = _gauge(CEILING_TOKENS_PER_SECOND, user)
        self._limit_changes = Counter(
            LIMIT_CHANGES, _DOCS[LIMIT_CHANGES], ["model_name"], registry=None
        )
        self._reloads = Counter(
            CONFIG_RELOADS,
            _DOCS[CONFIG_RELOADS],
            ["model_name", "result"],
            registry=None,
        )
        self._rpcs = Counter(
            CONTROL_RPCS,
            _DOCS[CONTROL_RPCS],
            ["model_name", "method", "code"],
            registry=None,
        )
        self._mode = _gauge(MODE, ["model_name", "mode"])
        tier = ["model_name", "tier"]
        self._tier_counters = {
            field: Counter(name, _DOCS[name], tier, registry=None)
            for field, name in TIER_COUNTERS.items()
        }
        self._tier_limits = _gauge(TIER_LIMIT_TOKENS_PER_SECOND, tier)
        team = ["model_name", "team"]
        self._team_counters = {
            field: Counter(name, _DOCS[name], team, registry=None)
            for field, name in TEAM_COUNTERS.items()
        }
        #: The member-seconds counters: [active, throttled], as carried.
        self._team_member_seconds = tuple(
            Counter(name, _DOCS[name], team, registry=None)
            for name in (TEAM_MEMBER_ACTIVE_SECONDS, TEAM_MEMBER_THROTTLED_SECONDS)
        )
        self._team_limits = _gauge(TEAM_LIMIT_TOKENS_PER_SECOND, team)
        team_engine = ["model_name", "team", "engine"]
        self._team_streaming = _gauge(TEAM_MEMBERS_STREAMING, team_engine)
        self._team_throttled = _gauge(TEAM_THROTTLED_MEMBERS, team_engine)
        engine = ["model_name", "engine"]
        self._store_round_trips = Counter(
            STORE_ROUND_TRIPS,
            _DOCS[STORE_ROUND_TRIPS],
            ["model_name", "engine", "result"],
            registry=None,
        )
        self._store_latency = Histogram(
            STORE_ROUND_TRIP_SECONDS,
            _DOCS[STORE_ROUND_TRIP_SECONDS],
            engine,
            buckets=STORE_LATENCY_BUCKETS_S,
            registry=None,
        )
        self._store_tokens = {
            field: Counter(name, _DOCS[name], engine, registry=None)
            for field, name in STORE_TOKEN_COUNTERS.items()
        }
        self._store_degraded = _gauge(STORE_DEGRADED, engine)
        self._store_live_engines = _gauge(STORE_LIVE_ENGINES, engine)
        self._fair_share_enabled = _gauge(FAIR_SHARE_ENABLED, engine)
        self._fair_share_gap = _gauge(FAIR_SHARE_SERVICE_GAP, engine)
        self._borrowing_blocked = _gauge(BORROWING_BLOCKED, engine)
        #: Engines with a borrowing-blocked sample.
        self._borrowing_engines: set[str] = set()
        band = ["model_name", "band"]
        self._band_tokens = Counter(
            BAND_TOKENS, _DOCS[BAND_TOKENS], band, registry=None
        )
        self._band_wait = Counter(
            BAND_WAIT_SECONDS, _DOCS[BAND_WAIT_SECONDS], band, registry=None
        )
        band_engine = ["model_name", "band", "engine"]
        self._band_waiting = _gauge(BAND_WAITING_REQUESTS, band_engine)
        self._band_fairness = _gauge(BAND_FAIRNESS, band_engine)
        #: The bands with counter series.
        self._bands: set[str] = set()
        #: (band, engine) of the waiting and the fairness samples set.
        self._band_waiting_labels: set[tuple[str, str]] = set()
        self._band_fairness_labels: set[tuple[str, str]] = set()
        self._labelled: set[str] | None = None  # None until the first payload
        self._limit_values: dict[str, int] = {}
        self._prompt_limit_values: dict[str, int] = {}
        self._ceiling_values: dict[str, int] = {}
        self._labelled_tiers: set[str] = set()
        self._tier_limit_values: dict[str, int] = {}
        self._labelled_teams: set[str] = set()
        self._team_limit_values: dict[str, int] = {}
        #: (team label, engine) of the team member gauges set.
        self._team_gauge_labels: set[tuple[str, str]] = set()
        self._definitions: tuple[Counter | Gauge | Histogram, ...] = (
            *self._counters.values(),
            self._idle_wait,
            self._throttled,
            self._tracked,
            self._limits,
            self._prompt_limits,
            self._ceilings,
            self._limit_changes,
            self._reloads,
            self._rpcs,
            self._mode,
            *self._tier_counters.values(),
            self._tier_limits,
            *self._team_counters.values(),
            *self._team_member_seconds,
            self._team_limits,
            self._team_streaming,
            self._team_throttled,
            self._store_round_trips,
            self._store_latency,
            *self._store_tokens.values(),
            self._store_degraded,
            self._store_live_engines,
            self._fair_share_enabled,
            self._fair_share_gap,
            self._borrowing_blocked,
            self._band_tokens,
            self._band_wait,
            self._band_waiting,
            self._band_fairness,
        )
        if registry is not None:
            collector = _Collector(self._definitions)
            previous = _collectors.get(registry)
            if previous is not None:
                registry.unregister(previous)
            registry.register(collector)
            _collectors[registry] = collector

    @property
    def definitions(self) -> tuple[Counter | Gauge | Histogram, ...]:
        """Every metric this exports, as defined (name, type, labels, help);
        the reference pages read them (``tools.reference_docs``)."""
        return self._definitions

    def apply(self, payload: Payload, engine: int = 0) -> None:
        """Adds the payload's deltas and sets its gauges; ``engine`` is the
        index of the engine core that sent it."""
        model = self._model
        if self._labelled is None:
            self._start()
        self._sync_labels(set(payload.limits))
        for user, row in payload.users.items():
            for field, delta in row.items():
                if delta:
                    self._counters[field].labels(model, user).inc(
                        delta * COUNTER_UNITS.get(field, 1)
                    )
        self._limit_values = _set_limits(
            self._limits,
            model,
            self._limit_values,
            payload.limits,
            payload.default_limit,
        )
        self._prompt_limit_values = _set_limits(
            self._prompt_limits,
            model,
            self._prompt_limit_values,
            payload.prompt_limits,
            payload.default_prompt_limit,
        )
        self._ceiling_values = _set_limits(
            self._ceilings,
            model,
            self._ceiling_values,
            payload.ceiling_limits,
            payload.default_ceiling_limit,
        )
        self._throttled.labels(model).set(payload.throttled_requests)
        self._tracked.labels(model).set(payload.tracked_users)
        idle = self._idle_wait.labels(model)
        for seconds in payload.idle_waits_s:
            idle.observe(seconds)
        if payload.limit_changes:
            self._limit_changes.labels(model).inc(payload.limit_changes)
        for result, count in payload.config_reloads.items():
            self._reloads.labels(model, result).inc(count)
        for (method, code), count in payload.control_rpcs.items():
            self._rpcs.labels(model, method, code).inc(count)
        for mode in Mode:
            self._mode.labels(model, mode.value).set(int(mode is payload.mode))
        self._apply_tiers(payload)
        self._apply_teams(payload, str(engine))
        if payload.store is not None:
            self._apply_store(payload.store, str(engine))
        if payload.fair_share is not None:
            self._apply_fair_share(payload.fair_share, str(engine))
        self._apply_borrowing(payload.borrowing_blocked, str(engine))
        self._apply_bands(payload.bands, str(engine))

    def _apply_bands(self, bands: BandsPart | None, engine: str) -> None:
        """Counter series for exactly the bands in force (born at zero, gone
        with the band or with all bands); ``engine``'s gauges for exactly the
        bands it sent a value for."""
        model = self._model
        names = set() if bands is None else set(bands.names)
        if names != self._bands:
            for band in self._bands - names:
                self._band_tokens.remove(model, band)
                self._band_wait.remove(model, band)
            for band in names - self._bands:
                self._band_tokens.labels(model, band)
                self._band_wait.labels(model, band)
            self._bands = names
        waiting: Mapping[str, float] = {}
        fairness: Mapping[str, float] = {}
        if bands is not None:
            for band, tokens in bands.tokens.items():
                self._band_tokens.labels(model, band).inc(tokens)
            for band, wait_ns in bands.wait_ns.items():
                self._band_wait.labels(model, band).inc(wait_ns / 1e9)
            waiting = bands.waiting or {}
            fairness = bands.fairness
        self._band_waiting_labels = _set_engine_gauges(
            self._band_waiting, model, engine, self._band_waiting_labels, waiting
        )
        self._band_fairness_labels = _set_engine_gauges(
            self._band_fairness, model, engine, self._band_fairness_labels, fairness
        )

    def _apply_borrowing(self, blocked: bool | None, engine: str) -> None:
        """Sets the engine's borrowing gauge, or removes it (no ceilings)."""
        model = self._model
        if blocked is None:
            if engine in self._borrowing_engines:
                self._borrowing_blocked.remove(model, engine)
                self._borrowing_engines.discard(engine)
            return
        self._borrowing_blocked.labels(model, engine).set(int(blocked))
        self._borrowing_engines.add(engine)

    def _apply_fair_share(self, fair_share: FairSharePart, engine: str) -> None:
        """Sets the engine's fair-share gauges."""
        model = self._model
        self._fair_share_enabled.labels(model, engine).set(int(fair_share.enabled))
        self._fair_share_gap.labels(model, engine).set(fair_share.gap)

    def _apply_store(self, store: StorePart, engine: str) -> None:
        """Adds the store's deltas and sets its gauges. Each latency bucket is
        replayed as its count of observations of their mean, which lies in the
        bucket: bucket counts, count and sum come out as the engine measured."""
        model = self._model
        # inc(0) too: a series born at zero shows its first increase to rate().
        for result in STORE_RESULTS:
            count = store.round_trips[result]
            self._store_round_trips.labels(model, engine, result).inc(count)
        for field, counter in self._store_tokens.items():
            counter.labels(model, engine).inc(store.tokens[field])
        latency = self._store_latency.labels(model, engine)
        lower = 0.0
        for (count, total_ns), upper in zip(
            store.latency_ns, (*STORE_LATENCY_BUCKETS_S, math.inf), strict=True
        ):
            if count:
                mean = total_ns / count / 1e9
                # Over the bucket's lower bound also after rounding (not in the
                # first bucket, which holds 0).
                if lower:
                    mean = max(mean, math.nextafter(lower, math.inf))
                for _ in range(count):
                    latency.observe(mean)
            lower = upper
        self._store_degraded.labels(model, engine).set(int(store.degraded))
        self._store_live_engines.labels(model, engine).set(store.live_engines)

    def _apply_tiers(self, payload: Payload) -> None:
        """Per-tier series exist exactly for the labelled tiers, and from the
        first tier on for ``OTHER_TIER`` (tiers beyond the cap); limits only for
        the tiers that are not exempt."""
        model = self._model
        labelled = set(payload.tiers)
        if labelled != self._labelled_tiers:
            if not self._labelled_tiers:  # at zero before its first increase
                for counter in self._tier_counters.values():
                    counter.labels(model, OTHER_TIER)
            for tier in self._labelled_tiers - labelled:
                for counter in self._tier_counters.values():
                    counter.remove(model, tier)
            for tier in labelled - self._labelled_tiers:
                for counter in self._tier_counters.values():
                    counter.labels(model, tier)
            self._labelled_tiers = labelled
        for tier, row in payload.tier_counters.items():
            for field, delta in row.items():
                if delta:
                    self._tier_counters[field].labels(model, tier).inc(
                        delta * COUNTER_UNITS.get(field, 1)
                    )
        limits = {tier: rate for tier, rate in payload.tiers.items() if rate}
        if limits != self._tier_limit_values:
            for tier in set(self._tier_limit_values) - set(limits):
                self._tier_limits.remove(model, tier)
            for tier, rate in limits.items():
                self._tier_limits.labels(model, tier).set(rate)
            self._tier_limit_values = limits

    def _apply_teams(self, payload: Payload, engine: str) -> None:
        """Per-team counters and limits as the tiers' (``_apply_tiers``); the
        member gauges of ``engine`` for exactly the team labels it sent."""
        model = self._model
        counters = (*self._team_counters.values(), *self._team_member_seconds)
        labelled = set(payload.teams)
        if labelled != self._labelled_teams:
            if not self._labelled_teams:  # at zero before its first increase
                for counter in counters:
                    counter.labels(model, OTHER_TEAM)
            for team in self._labelled_teams - labelled:
                for counter in counters:
                    counter.remove(model, team)
            for team in labelled - self._labelled_teams:
                for counter in counters:
                    counter.labels(model, team)
            self._labelled_teams = labelled
        for team, row in payload.team_counters.items():
            for field, delta in row.items():
                if delta:
                    self._team_counters[field].labels(model, team).inc(
                        delta * COUNTER_UNITS.get(field, 1)
                    )
        for team, pair in payload.team_member_ns.items():
            for counter, delta_ns in zip(self._team_member_seconds, pair, strict=True):
                counter.labels(model, team).inc(delta_ns / 1e9)
        if payload.teams != self._team_limit_values:
            for team in set(self._team_limit_values) - set(payload.teams):
                self._team_limits.remove(model, team)
            for team, rate in payload.teams.items():
                self._team_limits.labels(model, team).set(rate)
            self._team_limit_values = dict(payload.teams)
        gauges = {(team, engine) for team in payload.team_members}
        for team, other_engine in self._team_gauge_labels - gauges:
            if other_engine == engine:
                self._team_streaming.remove(model, team, engine)
                self._team_throttled.remove(model, team, engine)
                self._team_gauge_labels.discard((team, engine))
        for team, (streaming, throttled) in payload.team_members.items():
            self._team_streaming.labels(model, team, engine).set(streaming)
            self._team_throttled.labels(model, team, engine).set(throttled)
        self._team_gauge_labels |= gauges

    def _start(self) -> None:
        """Creates the series every alert and panel relies on, at zero: a counter
        born at 1 hides its first increase from ``rate()``/``increase()``."""
        model = self._model
        for counter in self._counters.values():
            counter.labels(model, OTHER_USER)
        self._idle_wait.labels(model)
        self._limit_changes.labels(model)
        for result in RELOAD_RESULTS:
            self._reloads.labels(model, result)
        self._labelled = set()

    def _sync_labels(self, labelled: set[str]) -> None:
        """Per-user series exist exactly for the labelled users (and
        ``OTHER_USER``): this is what bounds the ``user`` label's cardinality."""
        assert self._labelled is not None
        if labelled == self._labelled:
            return
        model = self._model
        for user in self._labelled - labelled:
            for counter in self._counters.values():
                counter.remove(model, user)
        for user in labelled - self._labelled:
            for counter in self._counters.values():
                counter.labels(model, user)
        self._labelled = labelled


class OutputRateStatLogger(AggregateStatLoggerBase):
    """vLLM stat logger plugin: exports the output-rate payload of each
    ``SchedulerStats`` and removes it from the stats before vLLM's loggers."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_indexes: list[int] | None = None,
        *,
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.metrics = OutputRateMetrics(
            str(vllm_config.model_config.served_model_name), registry
        )
        self._warned = False
        self._failures = FailureLog(
            logger, "output-rate stats not exported; vLLM's stats go on without them"
        )

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        """Takes our payload out of ``scheduler_stats`` and exports it. Never
        raises: vLLM calls this from its output handler, and an exception there
        ends the handler and hangs every request."""
        try:
            raw = take_payload(scheduler_stats)
            if raw is None:
                return
            payload = parse(raw)
            self.metrics.apply(payload, engine_idx)
        except PayloadError as exc:
            if not self._warned:
                logger.warning("dropping malformed output-rate stats: %s", exc)
                self._warned = True
        except Exception:
            self._failures.record()

    def log_engine_initialized(self) -> None:
        """Nothing to log: the metrics appear with the first payload."""


def _set_limits(
    gauge: Gauge,
    model: str,
    shown: dict[str, int],
    limits: Mapping[str, int],
    default: int | None,
) -> dict[str, int]:
    """Makes ``gauge`` show exactly ``limits`` and the default (as
    ``DEFAULT_LIMIT_USER``), given it shows ``shown``; returns what it shows."""
    wanted = dict(limits)
    if default is not None:
        wanted[DEFAULT_LIMIT_USER] = default
    if wanted != shown:
        for user in set(shown) - set(wanted):
            gauge.remove(model, user)
        for user, rate in wanted.items():
            gauge.labels(model, user).set(rate)
    return wanted


def _set_engine_gauges(
    gauge: Gauge,
    model: str,
    engine: str,
    shown: set[tuple[str, str]],
    values: Mapping[str, float],
) -> set[tuple[str, str]]:
    """Makes ``gauge`` (labels model, label, engine) show exactly ``values``
    for ``engine``, leaving other engines' samples; given it shows ``shown``
    ((label, engine) pairs), returns what it shows."""
    wanted = {(label, engine) for label in values}
    for label, other in shown - wanted:
        if other == engine:
            gauge.remove(model, label, engine)
    for label, value in values.items():
        gauge.labels(model, label, engine).set(value)
    return {pair for pair in shown if pair[1] != engine} | wanted


def _gauge(name: str, labels: list[str]) -> Gauge:
    # "mostrecent": with several API processes, the latest value wins (as vLLM's).
    return Gauge(
        name, _DOCS[name], labels, registry=None, multiprocess_mode="mostrecent"
    )


class _Collector:
    """Exposes the given metrics on a registry, those with samples only (so a
    server with pacing off shows none). It has no ``_name``, so vLLM's
    ``unregister_vllm_metrics()`` (which removes collectors named ``vllm:*``)
    keeps it."""

    def __init__(self, metrics: Iterable[Counter | Gauge | Histogram]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            for family in metric.collect():
                if family.samples:
                    yield family
