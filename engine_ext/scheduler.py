"""The vLLM adapter: per-user output-token pacing inside the V1 scheduler.

One mixin, applied to both ``Scheduler`` and ``AsyncScheduler``; this module is the
only place that knows vLLM's scheduler internals. It overrides these
``Scheduler`` methods (vLLM 0.32) and relies on how ``schedule()`` calls them:

- ``schedule()``: one clock reading (which also times the gap since the previous
  step: ``_record_engine_late``), then one of two kinds of step.

  A *free* step: every user with live requests is known to have budget for all
  of them (``_headroom``: what a user had left after its last charge, a lower
  bound until its next one, since budget only grows with time), so nobody can
  be refused. Upstream schedules alone and the dispatched sampling steps (upstream
  sets ``is_prefill_chunk = False`` on them) are charged after the fact in one
  limiter batch. When every live request samples (all decoding, none waiting),
  each user's count is its live requests, kept as requests are added and freed:
  no per-request work but one check of the flag.

  A *sleeper* step: every user that may be refused is known to have no
  budget until a later time (it was left with none and its next token is not
  yet due). Its requests are set aside for the step and counted as passed
  over, and the step is otherwise a free one (``_sleepers_step``): a user
  parked between two of its tokens costs no limiter call, ordering or
  settlement.

  A *paced* step (otherwise): orders ``running`` when a user may lack budget at
  the step's start or a limit changed (rotation, parked requests last), calls
  upstream with the per-request hooks below bound, then settles the step: the
  single refund point, "last served" bookkeeping, order restored. Each user
  with demand is granted up to its live requests in one limiter call and the
  grant is handed out one token per sampling request in service order.
  Parked requests (the tail of ``running`` once ordered) are taken out of
  ``running`` for upstream's loops whenever no preemption can occur in the step
  (``_hide_parked``): each costs O(1), not a hook call and a pass of upstream's
  loop body, which would only refuse it.
- ``_reserve_prefill_lookahead()`` (paced steps): called once per candidate
  request in the running and the waiting loop after the token budget is applied
  and before KV allocation. Here a step that will *sample* takes 1 token of its
  user's grant; a refused request gets 0 tokens (the running loop
  ``continue``s) or, with chunked prefill, a prefill up to its second-to-last
  position.
- ``_handle_blocked_waiting_request()`` (paced steps): the waiting loop's own
  "skip this one for now" hook. A waiting request of a user with no budget is
  skipped here, because returning 0 from ``_reserve_prefill_lookahead`` would
  ``break`` the waiting loop and block every other user's new requests.

The two per-request hooks are instance attributes, pointed at our methods in
paced steps and back at upstream's in free steps: with pacing off or in a free
step upstream pays nothing per request.
- ``_preempt_request()``: counts preempted parked requests and undoes the
  PRIORITY victim bias before the request re-enters the waiting heap. Also
  called by us, before upstream's loops, to make parked requests yield their
  slots (see "Slots go to users with budget" below).
- ``add_request()`` / ``_free_request()``: resolve the user once per request.

Upstream reads ``max_num_active_reqs`` only in the waiting loop, so raising it by
the number of throttled running requests lets new requests take their place
(running - throttled < max_num_active_seqs, and never above max_num_seqs).

``update_from_output()`` is deliberately not overridden: charges are settled at
dispatch, never against model results, which is what keeps async scheduling
possible (a request that stops at step N was already charged for N+1).

Slots go to users with budget. A parked request keeps its model-runner slot
and KV cache, but never at the expense of a user with budget: when
waiting requests of users with budget cannot start because every slot
(``max_num_seqs``) or the KV cache is held and some holders are parked, parked
requests are preempted first, before upstream's loops run, with vLLM's own
preemption (recomputed when they resume; prefix caching makes that cheap):

- as many as the waiting requests need, never more than the active cap lets
  start in this step, one at a time for the KV cache (head request only);
- victims in order: lowest priority, then the user furthest from budget (latest
  ``ready_at``), then that user's most recently served stream first;
- a request that yielded is not a victim again until it has been dispatched
  a sampling step (each readmission earns at least one token: no thrashing);
- while users with budget wait for slots, no request of a user without budget
  is admitted, not even for a prefill that stops short of sampling.

A yielded request re-enters the waiting queue at its front, so it is the next
to start once a slot is spare or its user has budget again: no user is
starved.

With the feature off (no default rate) every override defers to upstream
unchanged and no per-request hook is bound.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import Request, RequestStatus

from engine_ext import stats_payload
from engine_ext.request_tracing import with_throttle_headers
from pacing import attachments
from pacing.accounting import Accounting
from pacing.budget import BudgetSource
from pacing.identity import ANONYMOUS_USER, user_from_extra_args
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.settings import OutputRateSettings
from pacing.shared import SharedLimiter

# Under vLLM's logger so that its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Idle users are dropped from the limiter at most this often, by the scheduler's
#: clock: after a step, and on an idle engine when the metrics heartbeat
#: (``engine_ext.idle_stats``) asks. Cheap and behaviour-neutral: see
#: ``OutputRateLimiter.cleanup_idle_users``.
CLEANUP_INTERVAL_NS = 1_000_000_000

#: Metrics payloads are built at most this often (by the scheduler's clock), not
#: every step: a build costs ~0.2 ms, a tiny model's whole step ~1 ms, and
#: Prometheus scrapes every few seconds. Counters are deltas since the previous
#: build, so nothing is lost; the idle heartbeat (``engine_ext.idle_stats``)
#: sends what the last steps left once the engine is idle.
PAYLOAD_INTERVAL_NS = 100_000_000

#: Added to a parked request's arrival time during a step so that PRIORITY's
#: victim choice, ``max(running, key=(priority, arrival_time))``, picks it first
#: among requests of the same priority. Far beyond any real arrival time.
_PRIORITY_VICTIM_BIAS_S = 1e12

#: No users: ``_free_step``'s default ``set_aside``.
_NOBODY: Mapping[str, int] = {}


@dataclass
class _Throttling:
    """One request's time spent throttled (reported on its trace span)."""

    steps: int = 0  #: steps in which it was passed over for lack of budget
    total_ns: int = 0  #: closed throttled episodes, refusal to next dispatch
    since_ns: int | None = None  #: start of the open episode


class _Step:
    """Bookkeeping of one ``schedule()`` call.

    Each user with demand is asked once per step for a *grant*: up to as many
    tokens as it has live requests (``OutputRateLimiter.take_up_to``). The
    grant is handed out one token per sampling request in service order, and
    whatever is left or was handed to a request that was not dispatched is
    given back when the step settles: the single refund point.
    """

    __slots__ = (
        "biased_arrival",
        "capped",
        "charged",
        "granted",
        "left",
        "needy_pending",
        "now_ns",
        "parked",
        "refused",
        "remaining",
        "running_granted",
        "running_throttled",
        "shadow",
        "shadow_skips",
        "skips",
        "spare_slots",
    )

    def __init__(self, now_ns: int, capped: bool, shadow: bool = False) -> None:
        self.now_ns = now_ns
        self.left: dict[str, int] = {}  #: user -> tokens of its grant not handed out
        self.granted: dict[str, int] = {}  #: user -> its grant
        #: user -> tokens it had beyond its grant (0: the grant took them all).
        self.remaining: dict[str, int] = {}
        self.charged: dict[str, str] = {}  #: request id -> user, in service order
        self.refused: set[str] = set()  #: users refused a token in this step
        self.skips: dict[str, int] = {}  #: user -> requests passed over
        #: Whether the active cap is below the slot count (only then does the
        #: running loop count granted and throttled requests).
        self.capped = capped
        self.running_granted = 0  # running requests given tokens this step
        self.running_throttled = 0  # running requests skipped for lack of budget
        #: Shadow mode: a refusal is counted in ``shadow_skips`` (user -> n) and
        #: the request runs uncharged.
        self.shadow = shadow
        self.shadow_skips: dict[str, int] = {}
        self.biased_arrival: dict[str, float] = {}
        self.parked: list[Request] = []  # in rotated order
        #: Slots a refused user's waiting request may take for a prefill that stops
        #: short of sampling; None: no user with budget is waiting for a slot.
        self.spare_slots: int | None = None
        #: Waiting requests of users with budget that the waiting loop has yet to
        #: reach; no refused user's request is admitted ahead of them.
        self.needy_pending: set[str] = set()


if TYPE_CHECKING:
    # The mixin always precedes a Scheduler in the bases: this lets the type
    # checker see the attributes and methods it uses and overrides.
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class OutputRateSchedulerMixin(_SchedulerBase):
    """Per-user GCRA pacing of sampled tokens; see the module docstring.

    Must precede a vLLM ``Scheduler`` class in the bases.
    """

    #: Monotonic clock in ns; tests replace it on the instance.
    clock: Callable[[], int] = staticmethod(time.monotonic_ns)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = OutputRateSettings.from_additional_config(
            self.vllm_config.additional_config
        )
        self._base_max_active = self.max_num_active_reqs
        self._user_of: dict[str, str] = {}
        #: user -> its live requests: the most it can be charged in one step.
        self._live: dict[str, int] = {}
        #: Users whose last live request ended since the last step: told to the
        #: budget source under the lock (requests end outside it).
        self._ended: list[str] = []
        self._last_served: dict[str, str] = {}  # user -> request id
        #: Users that may have no budget at the next step's start; while none
        #: may (and no limit changed), a step leaves ``running`` as it is.
        self._maybe_without_budget: set[str] = set()
        self._seen_limit_changes = -1  # forces the first step to order
        #: user -> tokens it is known to have at any time until its next charge
        #: or a limit change (budget only grows with time); absent: unknown.
        self._headroom: dict[str, int] = {}
        #: Users with live requests whose headroom is unknown or below their
        #: live requests. While there are none, nobody can be refused a token:
        #: a step is *free* (see ``_free_step``).
        self._constrained: set[str] = set()
        #: user -> requests parked at the last step's start.
        self._parked_counts: dict[str, int] = {}
        #: user -> when a user found with no budget (headroom 0) may take a token
        #: again; valid until its headroom is next set (see ``_sleepers_step``).
        self._asleep_until: dict[str, int] = {}
        #: When the last paced step started (None: none yet), and user -> its
        #: requests added since: what ``_record_engine_late`` compares.
        self._stepped_at_ns: int | None = None
        self._added_since_step: dict[str, int] = {}
        self._upstream_reserve_prefill_lookahead = super()._reserve_prefill_lookahead
        self._upstream_handle_blocked_waiting_request = (
            super()._handle_blocked_waiting_request
        )
        #: Whether the per-request hooks are bound (see ``_use_step_hooks``).
        self._step_hooks_bound: bool | None = None
        #: Block size of each KV cache group when every group is full attention
        #: (one block per ``block_size`` tokens a request grows): what
        #: ``_kv_room_for`` bounds; None otherwise.
        self._kv_block_sizes = _full_attention_block_sizes(self.kv_cache_config)
        #: Requests preempted to yield their slot, until next dispatched to sample.
        self._yielded: set[str] = set()
        self._step: _Step | None = None
        self._cleaned_at_ns: int | None = None  # None: never (tests swap clocks)
        #: When the last step scheduled nothing because of the limiter: the
        #: earliest time a refused user has budget again (for the engine loop).
        self.next_ready_ns: int | None = None
        #: The limiter and its counters, shared with whatever attaches (the
        #: control plane): the lock is held for every whole step.
        self.output_rate_shared = SharedLimiter(
            settings.build_limiter(),
            Accounting(),
            lambda: self.clock(),
            request_counts=self._request_counts,
            mode=settings.mode,
        )
        #: What attached through the core's registration point (the control
        #: plane, when the settings ask for one); stopped at shutdown.
        self.output_rate_attachments: list[attachments.Attachment] = []
        #: Whether the engine-loop hook has yet to bind ``wake`` to the engine's
        #: input queue (only with pacing on).
        self.output_rate_needs_wake_binding = False
        #: Throttle totals of requests throttled at least once, kept only when
        #: request tracing is on (they end up on the request's span).
        self._tracing = bool(self.vllm_config.observability_config.otlp_traces_endpoint)
        self._throttling: dict[str, _Throttling] = {}
        #: Whether the settings let a step take requests out of ``running``
        #: unnoticed by upstream (``_hide_parked``): no active cap below the
        #: slots (whose accounting ``_reserve_under_active_cap`` keeps), no
        #: long-prefill threshold (``get_request_counts()`` reads ``running``).
        self._may_hide_from_upstream = not (
            self._base_max_active < self.max_num_running_reqs
            or self.scheduler_config.long_prefill_token_threshold
        )
        #: Whether sleeper steps may run (``_sleepers_step``): hiding allowed
        #: and tracing off (it records each throttled step per request).
        self._sleepers_allowed = self._may_hide_from_upstream and not self._tracing
        metrics = settings.metrics
        #: Builds the metrics payload carried to the API process in the step's
        #: SchedulerStats; None unless our stat logger is there to take it out.
        self.output_rate_stats = (
            stats_payload.PayloadBuilder(metrics.max_labelled_users)
            if metrics.emit and self.limiter.enabled
            else None
        )
        #: Payloads whose build has started (counted first): the idle-metrics
        #: heartbeat (``engine_ext.idle_stats``) compares it between checks.
        self.output_rate_payloads_built = 0
        self._payload_built_at_ns: int | None = None
        if self.limiter.enabled:
            logger.info(
                "per-user output pacing on (%s): mode %s, default %d tok/s, "
                "%d user limits, %d tiers",
                type(self).__name__,
                settings.mode,
                settings.default_rate,
                len(settings.user_rates),
                len(settings.tier_rates),
            )
            # The data-parallel index survives vLLM resetting the rank of
            # independent (non-MoE) ranks to 0.
            self.output_rate_shared.engine_index = (
                self.vllm_config.parallel_config.data_parallel_index
            )
            self.output_rate_attachments = attachments.attach_all(
                self.output_rate_shared, settings
            )
            self.output_rate_needs_wake_binding = True
            self._use_step_hooks(False)

    @property
    def limiter(self) -> OutputRateLimiter:
        """The limiter; the facade (``output_rate_shared``) holds it."""
        return self.output_rate_shared.limiter

    @property
    def budget(self) -> BudgetSource:
        """What the step spends tokens from (``pacing.budget``): the limiter
        itself on one engine, claimed balances with a global store."""
        return self.output_rate_shared.budget

    @property
    def accounting(self) -> Accounting:
        """The per-user counters; the facade (``output_rate_shared``) holds them."""
        return self.output_rate_shared.accounting

    # -- identity ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if request.request_id not in self._user_of:
            user = self._user_of[request.request_id] = self._resolve_user(request)
            live = self._live[user] = self._live.get(user, 0) + 1
            if self.limiter.enabled:
                added = self._added_since_step
                added[user] = added.get(user, 0) + 1
            if self._headroom.get(user, -1) < live:
                self._constrained.add(user)

    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        user = self._user_of.pop(request.request_id, None)
        if user is not None:
            live = self._live[user] - 1
            if live:
                self._live[user] = live
                if self._headroom.get(user, -1) >= live:
                    self._constrained.discard(user)
            else:
                del self._live[user]
                self._headroom.pop(user, None)
                self._asleep_until.pop(user, None)
                self._constrained.discard(user)
                if self.limiter.enabled:
                    self._ended.append(user)
        self._yielded.discard(request.request_id)
        throttling = self._throttling.pop(request.request_id, None)
        if throttling is not None:
            if throttling.since_ns is not None:
                throttling.total_ns += self.clock() - throttling.since_ns
            # Read back by the API process when it builds the request's span.
            request.trace_headers = with_throttle_headers(
                request.trace_headers, throttling.steps, throttling.total_ns / 1e9
            )
        return super()._free_request(request, delay_free_blocks)

    def user_of(self, request: Request) -> str:
        """The user ``request`` is charged to."""
        return self._user_of.get(request.request_id, ANONYMOUS_USER)

    @staticmethod
    def _resolve_user(request: Request) -> str:
        params = request.sampling_params
        try:
            return user_from_extra_args(params.extra_args if params else None)
        except ValueError as exc:
            # The HTTP guard rejects these with 400; only offline callers get here.
            logger.warning(
                "request %s: %s; charging it as %s",
                request.request_id,
                exc,
                ANONYMOUS_USER,
            )
            return ANONYMOUS_USER

    # -- the step ----------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        # Upstream's own signature (not *args, **kwargs): forwarding through
        # the step's three calls would cost every step a tuple, a dict and a
        # slower call each.
        if not self.limiter.enabled:
            return super().schedule(throttle_prefills)
        # The control plane reads and changes limits only between steps.
        with self.output_rate_shared.lock:
            output = self._paced_schedule(throttle_prefills)
        return output

    def shutdown(self) -> None:
        attached, self.output_rate_attachments = self.output_rate_attachments, []
        attachments.stop_all(attached)
        super().shutdown()

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self.output_rate_stats is not None:
            now_ns = self.clock()
            built_at = self._payload_built_at_ns
            if built_at is not None and 0 <= now_ns - built_at < PAYLOAD_INTERVAL_NS:
                return stats  # counters are cumulative: the next payload has it
            self._payload_built_at_ns = now_ns
            self.output_rate_payloads_built += 1
            try:
                with self.output_rate_shared.lock:
                    payload = self.output_rate_stats.build(
                        accounting=self.accounting,
                        user_rates=self.limiter.user_rates,
                        default_rate=self.limiter.default_rate,
                        throttled_requests=sum(self._parked_counts.values()),
                        tracked_users=self.limiter.tracked_users(),
                        control=self.output_rate_shared.control_snapshot(),
                        mode=self.output_rate_shared.mode,
                        limiter=self.limiter,
                        store=self.output_rate_shared.store_stats,
                    )
                stats_payload.attach(stats, payload)
            except Exception:
                # Raising here would end vLLM's engine-core loop: this step's
                # metrics are lost instead, pacing goes on.
                self.output_rate_stats.failures.record()
        return stats

    def make_stats_with_payload(self) -> SchedulerStats | None:
        """``make_stats`` with our payload whenever the last was built: for the
        idle heartbeat, which asks only when no step has built one for a while
        and must not be turned away by ``PAYLOAD_INTERVAL_NS``."""
        self._payload_built_at_ns = None
        return self.make_stats()

    def awaits_asynchronous_work(self) -> bool:
        """Whether a waiting request depends on work that completes without any
        input reaching the engine (a structured-output grammar compiling in a
        thread pool, a KV transfer): only a later step notices it is done."""
        return any(
            request.status in _ASYNC_READY
            for queue in (self.waiting, self.kv_holding_waiting)
            for request in queue
        )

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """Lets control-plane changes end the engine's idle wait at once."""
        self.output_rate_shared.set_wake(wake)

    def _paced_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        if self._ended:
            self._end_users(self.clock())
        mode = self.output_rate_shared.mode
        now_ns = self.clock()
        self._record_engine_late(now_ns, counted=mode is not Mode.OFF)
        if mode is Mode.OFF:
            return self._unpaced_step(throttle_prefills)
        budget = self.budget
        limit_changed = self._seen_limit_changes != budget.limit_changes
        if limit_changed:  # every user's headroom may have shrunk
            self._seen_limit_changes = budget.limit_changes
            self._headroom.clear()
            self._asleep_until.clear()
            self._constrained = set(self._live)
        if not (self._constrained or self._yielded or self._throttling):
            return self._free_step(now_ns, budget, throttle_prefills)
        if mode is Mode.ENFORCE:
            output = self._sleepers_step(now_ns, budget, throttle_prefills)
            if output is not None:
                return output
        shadow = mode is Mode.SHADOW
        self._use_step_hooks(True)
        step = self._step = _Step(
            now_ns,
            capped=self._base_max_active < self.max_num_running_reqs,
            shadow=shadow,
        )
        # Nobody can be parked at the step's start, so nothing needs ordering:
        # running stays as it is (rotation and "parked last" change nothing when
        # every user has budget; a user running short in this step is ordered
        # from the next step on, with its last served stream remembered).
        ordered = limit_changed or bool(self._maybe_without_budget)
        persistent_order: list[Request] = []
        if ordered:
            persistent_order = list(self.running)
            for_step = self._order_for_step(step)
            if shadow:  # what enforce would park is counted, nothing is moved
                ordered = False
                self._restore_arrival_times(step)
            else:
                self.running[:] = for_step
        hidden: list[Request] = []
        try:
            if not shadow:
                self._yield_slots(step)
            if ordered and not throttle_prefills:
                hidden = self._hide_parked(step)
            output = super().schedule(throttle_prefills)
        finally:
            self._step = None
            self.max_num_active_reqs = self._base_max_active
            if hidden:
                self.running.extend(hidden)
            if ordered:
                self._restore_arrival_times(step)
                rank = {id(req): i for i, req in enumerate(persistent_order)}
                # Stable: requests admitted this step stay behind, in admission
                # order.
                self.running.sort(key=lambda req: rank.get(id(req), math.inf))
        self._settle(step, output)
        self.output_rate_shared.on_step(now_ns)
        return output

    def _record_engine_late(self, now_ns: int, counted: bool) -> None:
        """Counts, in ``engine_late_ns`` of every user with a request in the
        engine since the previous step, by how much the gap between the two
        steps' starts exceeded the burst. GCRA absorbs a late step up to the
        burst (the spec's "burst must cover one engine step"); beyond it, a
        waiting user's budget lapses unspent: a slow or starved engine, not
        pacing, held the user below its limit."""
        previous, self._stepped_at_ns = self._stepped_at_ns, now_ns
        added = self._added_since_step
        if counted and previous is not None:
            late_ns = now_ns - previous - self.limiter.burst_ns
            if late_ns > 0:
                for user, live in self._live.items():
                    if live > added.get(user, 0):
                        self.accounting.record(user, "engine_late_ns", late_ns)
        if added:
            added.clear()

    def _unpaced_step(self, throttle_prefills: bool) -> SchedulerOutput:
        """Mode ``off``, the kill switch: upstream alone, nothing charged or
        recorded. Every user's GCRA state is kept as it was, and budget only
        accrues up to a full bucket, so switching back hands out no more."""
        self._use_step_hooks(False)
        output = super().schedule(throttle_prefills)
        self.next_ready_ns = None
        if self._parked_counts:
            self._parked_counts = {}
        return output

    def _free_step(
        self,
        now_ns: int,
        budget: BudgetSource,
        throttle_prefills: bool,
        set_aside: Mapping[str, int] = _NOBODY,
    ) -> SchedulerOutput:
        """A step in which every user with live requests has budget for all of
        them, so none can be refused: upstream schedules alone (no per-request
        hook, no reordering) and the dispatched sampling steps, which upstream
        marks ``is_prefill_chunk = False``, are charged after the fact, one
        limiter batch for all users. Preempted requests were never charged, so
        there is nothing to refund. ``set_aside``: users whose live requests
        (that many each) are out of ``running`` for the step (sleepers)."""
        if self._step_hooks_bound:
            self._use_step_hooks(False)
        output = super().schedule(throttle_prefills)
        dispatched = output.num_scheduled_tokens
        running = self.running
        counts: Mapping[str, int]
        # Dispatched and running requests are live, so when there are as many
        # of each as live ones shown, ``running`` is exactly the dispatched
        # requests.
        shown = len(self._user_of) - (sum(set_aside.values()) if set_aside else 0)
        if (
            len(dispatched) == shown == len(running)
            and _first_prefill_chunk(running) is None
        ):
            # Every live request shown samples once (decoding, nothing waits):
            # each user is charged its live requests, with no per-request work
            # left but the check above. With all of its streams served, nothing
            # is left to rotate (``_order_for_step`` starts at each user's
            # first stream, as it does without an entry).
            if set_aside:
                counts = {u: n for u, n in self._live.items() if u not in set_aside}
                for user in counts:
                    self._last_served.pop(user, None)
            else:
                counts = self._live
                self._last_served.clear()
        else:
            requests = self.requests
            sampled = [
                request_id
                for request_id in dispatched
                if not requests[request_id].is_prefill_chunk
            ]
            # Every request reached add_request, so every one has a user.
            # Counted and remembered in C (Counter, dict.update).
            users = list(map(self._user_of.__getitem__, sampled))
            counts = Counter(users)
            self._last_served.update(zip(users, sampled, strict=True))
        if counts:
            headroom = self._headroom
            live = self._live
            for user, remaining in budget.take_each(counts, now_ns).items():
                if remaining >= live.get(user, 0) > 0:
                    headroom[user] = remaining  # still unconstrained: the common case
                else:
                    self._set_headroom(user, remaining)
            self.output_rate_shared.accounting.record_charged(counts)
        if self._parked_counts:
            self._parked_counts = {}
        self.next_ready_ns = None
        if self.cleanup_due(now_ns):
            self._cleanup_idle_users(now_ns)
        self.output_rate_shared.on_step(now_ns)
        return output

    def _sleepers_step(
        self, now_ns: int, budget: BudgetSource, throttle_prefills: bool
    ) -> SchedulerOutput | None:
        """A free step for everyone but the *sleepers*: users known to have no
        budget until a later time. Their requests are taken out of ``running``
        for the step and counted as passed over; nobody else can be refused, so
        upstream schedules alone and the rest is charged as in ``_free_step``.
        A user parked between two of its tokens costs a step O(its requests),
        not a paced step's ordering, limiter call and settlement.

        None (the step is paced instead) unless: every constrained user sleeps,
        with headroom 0 and a wake-up time still ahead (computed once per sleep,
        exact for the limiter; a global store may learn of budget sooner, so
        only the limiter qualifies); every sleeper's request is running and its
        next step samples; nothing waits; and upstream cannot tell them gone
        (no preemption possible, no active cap below the slots, no long-prefill
        threshold, tracing off: see ``_hide_parked``)."""
        if (
            not self._sleepers_allowed
            or budget is not self.limiter
            or self._yielded
            or self._throttling
            or throttle_prefills
            or self.waiting
            or self.kv_holding_waiting
        ):
            return None
        constrained = self._constrained
        asleep = self._asleep_until
        for user in constrained:
            wake_ns = asleep.get(user)
            if wake_ns is None:
                if self._headroom.get(user) != 0:
                    return None
                wake_ns = asleep[user] = budget.ready_at_ns(user, now_ns)
            if wake_ns <= now_ns:
                return None
        running = self.running
        user_of = self._user_of
        visible: list[Request] = []
        sleeping: dict[str, int] = {}
        for request in running:
            user = user_of.get(request.request_id, ANONYMOUS_USER)
            if user not in constrained:
                visible.append(request)
            elif _next_step_samples(request):
                sleeping[user] = sleeping.get(user, 0) + 1
            else:
                return None  # a prefill chunk it may compute: a paced step's call
        live = self._live
        if len(sleeping) != len(constrained) or any(
            live[user] != count for user, count in sleeping.items()
        ):
            return None  # a sleeper's request outside ``running``
        if not self._kv_room_for(len(visible)):
            return None
        original = list(running)
        running[:] = visible
        try:
            output = self._free_step(now_ns, budget, throttle_prefills, sleeping)
        finally:
            _put_back(running, original, visible)
        self._parked_counts = sleeping
        accounting = self.accounting
        for user, count in sleeping.items():
            accounting.record(user, "throttled_skips", count)
        if not output.num_scheduled_tokens and sleeping:
            self.next_ready_ns = min(asleep[user] for user in sleeping)
        return output

    def _set_headroom(self, user: str, headroom: int) -> None:
        """Records what ``user`` has left after a step (or now): whether it is
        constrained, and whether it may lack budget at the next step's start."""
        self._asleep_until.pop(user, None)
        live = self._live.get(user, 0)
        if not live:
            self._headroom.pop(user, None)
            self._constrained.discard(user)
            self._maybe_without_budget.discard(user)
            return
        self._headroom[user] = headroom
        if headroom < live:
            self._constrained.add(user)
        else:
            self._constrained.discard(user)
        if headroom:
            self._maybe_without_budget.discard(user)
        else:
            self._maybe_without_budget.add(user)

    def _use_step_hooks(self, paced: bool) -> None:
        """Points upstream's per-request calls at our hooks (paced steps) or at
        upstream's own methods (free steps), through instance attributes set
        up once with pacing on: a class-level override would cost every
        request of every step even with pacing off, and adding or deleting
        instance attributes per step would slow every other attribute access
        of the scheduler (CPython stops sharing the instance's key layout)."""
        if paced == self._step_hooks_bound:
            return
        self._step_hooks_bound = paced
        hooks: tuple[Callable[..., Any], ...] = (
            (
                self._paced_reserve_prefill_lookahead,
                self._paced_handle_blocked_waiting_request,
            )
            if paced
            else (
                self._upstream_reserve_prefill_lookahead,
                self._upstream_handle_blocked_waiting_request,
            )
        )
        for name, hook in zip(_STEP_HOOK_NAMES, hooks, strict=True):
            setattr(self, name, hook)

    def _order_for_step(self, step: _Step) -> list[Request]:
        """``running`` for this step: each user's same-priority streams rotated so
        the one after the last served comes first, parked requests moved last
        (FCFS preempts ``running[-1]``) or biased (PRIORITY preempts the largest
        ``(priority, arrival_time)``)."""
        groups: dict[tuple[str, int], list[int]] = {}
        for index, request in enumerate(self.running):
            groups.setdefault((self.user_of(request), request.priority), []).append(
                index
            )
        ordered = list(self.running)
        for (user, _), indices in groups.items():
            if len(indices) < 2:
                continue  # nothing to rotate; skip the work on the hot path
            last = self._last_served.get(user)
            ids = [ordered[i].request_id for i in indices]
            if last not in ids:
                continue
            start = ids.index(last) + 1
            members = [ordered[i] for i in indices]
            for index, request in zip(
                indices, members[start:] + members[:start], strict=True
            ):
                ordered[index] = request

        parked_counts: dict[str, int] = {}
        active: list[Request] = []
        parked: list[Request] = []
        for request in ordered:
            user = self.user_of(request)
            if _next_step_samples(request) and not self._tokens_left(step, user):
                parked.append(request)
                parked_counts[user] = parked_counts.get(user, 0) + 1
            else:
                active.append(request)
        self._parked_counts = parked_counts
        step.parked = parked
        if self.policy == SchedulingPolicy.PRIORITY:
            for request in parked:
                step.biased_arrival[request.request_id] = request.arrival_time
                request.arrival_time += _PRIORITY_VICTIM_BIAS_S
        return active + parked

    def _tokens_left(self, step: _Step, user: str) -> int:
        """Tokens of ``user``'s grant not yet handed out in this step; takes the
        grant on first use (one limiter call per user and step)."""
        left = step.left.get(user)
        if left is None:
            left, remaining = self.budget.take_up_to(
                user, self._live.get(user, 1), step.now_ns
            )
            step.left[user] = step.granted[user] = left
            step.remaining[user] = remaining
        return left

    def _has_budget(self, step: _Step, user: str) -> bool:
        """Whether ``user`` could be charged another token now (its grant is
        capped by its live requests, so an empty grant alone does not say)."""
        return bool(self._tokens_left(step, user)) or bool(step.remaining[user])

    def _request_counts(self) -> dict[str, tuple[int, int]]:
        """Per user (running, parked) requests: running now, parked as of the
        last step's start. For the control plane, under the shared lock."""
        counts: dict[str, int] = {}
        for request in list(self.running):  # one atomic copy: see SharedLimiter
            user = self.user_of(request)
            counts[user] = counts.get(user, 0) + 1
        parked = self._parked_counts
        return {user: (n, parked.get(user, 0)) for user, n in counts.items()}

    # -- slots go to users with budget (see the module docstring) -------------

    def _yield_slots(self, step: _Step) -> None:
        """Preempts parked requests so that waiting requests of users with budget
        can start in this step; sets ``step.spare_slots``."""
        if not self.waiting:
            return
        held = len(self.running) + self.num_waiting_for_streaming_input
        free = max(0, self.max_num_running_reqs - held)
        parked = step.parked
        # Upstream admits at most this many (active cap, raised by the parked).
        admissible = self._base_max_active - (held - len(parked))
        wanted = min(admissible, free + len(parked))
        if wanted <= 0 or (not parked and free >= len(self.waiting)):
            return  # nobody can start, or everyone fits: nothing to yield
        needy = self._waiting_with_budget(step, limit=wanted)
        victims = self._victims(step, parked)
        yielded = 0
        for request in needy[free:wanted]:
            victim = _first_yielding_to(victims, request)
            if victim is None:
                break
            self._yield(victim)
            yielded += 1
        admitted = min(len(needy), free + yielded)
        if admitted and victims:
            # KV cache: free enough blocks for the first one that will start.
            self._yield_blocks_for(needy[0], victims)
        if needy:
            step.spare_slots = free + yielded - admitted
            step.needy_pending = {r.request_id for r in needy[:admitted]}

    def _hide_parked(self, step: _Step) -> list[Request]:
        """Takes the parked requests (the tail of ``running``, after
        ``_yield_slots``) out of ``running`` for upstream's loops and returns
        them, passed over for lack of budget; [] when upstream must see them.

        Each would only be refused, one hook call and one pass of upstream's
        loop body apiece, every step it stays parked. Hidden, upstream sees
        what it would do with them refused, provided that:

        - no preemption can happen (``_kv_room_for``): upstream's victim is
          then ``running``'s tail, or the biased parked request under PRIORITY;
        - they keep their slots: the active cap drops by their number (only
          without ``max_num_active_seqs`` below ``max_num_seqs``, whose
          accounting ``_reserve_under_active_cap`` keeps);
        - no per-request budget split counts them (``long_prefill_token_threshold``
          relaxes for a lone request);
        - a waiting request still sees running ones when any hold the KV cache
          (upstream applies its watermark only then).
        """
        if not self._may_hide_from_upstream:
            return []
        running = self.running
        remaining = [r for r in step.parked if r.status == RequestStatus.RUNNING]
        visible = len(running) - len(remaining)
        if not remaining or running[visible] is not remaining[0]:
            return []
        if not visible and (self.waiting or self.kv_holding_waiting):
            return []
        if not self._kv_room_for(visible):
            return []
        del running[visible:]
        self.max_num_active_reqs = self._base_max_active - len(remaining)
        for request in remaining:
            user = self._user_of.get(request.request_id, ANONYMOUS_USER)
            step.refused.add(user)
            self._record_skip(step, request, user)
        return remaining

    def _kv_room_for(self, requests: int) -> bool:
        """Whether the KV cache has free blocks for the most that ``requests``
        running requests can claim in one step, so that upstream's running loop
        cannot preempt: each needs at most its new and lookahead tokens' worth
        of blocks plus one, the step's tokens are at most its token budget."""
        if self._kv_block_sizes is None:
            return False  # a cache kind whose growth this bound does not cover
        tokens = self.max_num_scheduled_tokens + requests * self.num_lookahead_tokens
        needed = sum(tokens // size + 2 * requests for size in self._kv_block_sizes)
        return self.kv_cache_manager.block_pool.get_num_free_blocks() >= needed

    def _waiting_with_budget(self, step: _Step, limit: int) -> list[Request]:
        """Up to ``limit`` waiting requests, in admission order, that could start
        now and whose user has budget."""
        found: list[Request] = []
        for request in self.waiting:
            if request.status in _STARTABLE and self._tokens_left(
                step, self.user_of(request)
            ):
                found.append(request)
                if len(found) >= limit:
                    break
        return found

    def _victims(self, step: _Step, parked: list[Request]) -> list[Request]:
        """Parked requests that may yield, best victim first: lowest priority,
        then the user furthest from budget, then the user's most recently served
        stream (``parked`` is rotated, so later means served more recently)."""
        position = {id(r): i for i, r in enumerate(parked)}
        ready = {
            user: self.budget.ready_at_ns(user, step.now_ns)
            for user in {self.user_of(r) for r in parked}
        }
        candidates = [
            r
            for r in parked
            if r.request_id not in self._yielded
            and self._request_blocks_can_be_freed(r)
        ]
        candidates.sort(
            key=lambda r: (-r.priority, -ready[self.user_of(r)], -position[id(r)])
        )
        return candidates

    def _yield(self, victim: Request) -> None:
        self.running.remove(victim)
        self._yielded.add(victim.request_id)
        self._preempt_request(victim, time.monotonic())

    def _yield_blocks_for(self, request: Request, victims: list[Request]) -> None:
        """Yields victims until the KV cache has the blocks ``request``'s first
        chunk needs (an estimate that ignores prefix-cache hits)."""
        tokens = min(
            request.num_tokens - request.num_computed_tokens,
            self.max_num_scheduled_tokens,
        )
        needed = -(-(tokens + self.num_lookahead_tokens) // self.block_size)
        free_blocks = self.kv_cache_manager.block_pool.get_num_free_blocks()
        while free_blocks < needed:
            victim = _first_yielding_to(victims, request)
            if victim is None:
                return
            self._yield(victim)
            free_blocks = self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _restore_arrival_times(self, step: _Step) -> None:
        for request in self.running:
            original = step.biased_arrival.pop(request.request_id, None)
            if original is not None:
                request.arrival_time = original

    def _settle(self, step: _Step, output: SchedulerOutput) -> None:
        """The single refund point, and what the next step needs to know."""
        now_ns = step.now_ns
        budget = self.budget
        dispatched = output.num_scheduled_tokens
        last_served = self._last_served
        refunds: dict[str, int] = {}
        for request_id, user in step.charged.items():
            if request_id in dispatched:
                last_served[user] = request_id
            else:  # KV allocation failed, or preempted after being charged
                refunds[user] = refunds.get(user, 0) + 1
        charged: dict[str, int] = {}
        for user, left in step.left.items():
            if left != step.granted[user]:
                charged[user] = step.granted[user] - left
            unused = left + refunds.get(user, 0)
            if unused:
                budget.refund(user, now_ns, unused)
            self._set_headroom(user, step.remaining[user] + unused)
        for user in self._constrained - step.left.keys():
            self._set_headroom(user, budget.available(user, now_ns))
        if self._yielded or self._throttling:
            self._close_throttled_episodes(step, dispatched)
        accounting = self.accounting
        accounting.record_charged(charged)
        for event, counts in (
            ("refunds", refunds),
            ("throttled_skips", step.skips),
            ("shadow_skips", step.shadow_skips),
        ):
            for user, count in counts.items():
                accounting.record(user, event, count)
        self.next_ready_ns = None
        if not dispatched and step.refused:
            self.next_ready_ns = min(
                budget.ready_at_ns(user, now_ns) for user in step.refused
            )
        if self.cleanup_due(now_ns):
            self._cleanup_idle_users(now_ns)

    def _close_throttled_episodes(self, step: _Step, dispatched: Any) -> None:
        """A dispatched sampling step ends a request's yielded state and its
        open throttled episode."""
        for request_id in step.charged:
            if request_id not in dispatched:
                continue
            self._yielded.discard(request_id)
            throttling = self._throttling.get(request_id)
            if throttling is not None and throttling.since_ns is not None:
                throttling.total_ns += step.now_ns - throttling.since_ns
                throttling.since_ns = None

    def cleanup_due(self, now_ns: int) -> bool:
        """Whether users are tracked and the last cleanup is an interval old."""
        cleaned_at = self._cleaned_at_ns
        return (
            cleaned_at is None or now_ns - cleaned_at >= CLEANUP_INTERVAL_NS
        ) and self.limiter.tracked_users() > 0

    def cleanup_when_idle(self) -> None:
        """Drops idle users if due; for the engine thread between steps."""
        with self.output_rate_shared.lock:
            now_ns = self.clock()
            if self._ended:
                self._end_users(now_ns)
            if self.cleanup_due(now_ns):
                self._cleanup_idle_users(now_ns)

    def _end_users(self, now_ns: int) -> None:
        """Tells the budget source of the users whose last request ended (with a
        store, their balance goes back for other engines to use); the shared
        limiter's lock is held."""
        ended, self._ended = self._ended, []
        budget = self.budget
        for user in ended:
            if user not in self._live:  # not back since
                budget.end_user(user, now_ns)

    def _cleanup_idle_users(self, now_ns: int) -> None:
        """Forgets users with no live request whose bucket is full (the shared
        limiter's lock is held)."""
        self._cleaned_at_ns = now_ns
        self.limiter.cleanup_idle_users(now_ns)
        live_users = set(self._live)
        if self.output_rate_stats is not None:
            # Labelled users' counters must survive for exact deltas.
            live_users.update(self.output_rate_stats.labelled_users)
        self._last_served = {
            user: rid for user, rid in self._last_served.items() if user in live_users
        }
        self.accounting.forget(live_users)

    # -- per-request decisions (called from inside upstream schedule()) -----

    def _paced_reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """``_reserve_prefill_lookahead`` while pacing is on: a step that samples
        takes one token of its user's grant, or is refused. Called for every
        scheduled request of a paced step (free steps call upstream's own)."""
        num_new_tokens = self._upstream_reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        step = self._step
        if step is None or num_new_tokens == 0:
            return num_new_tokens
        if step.capped:
            return self._reserve_under_active_cap(
                step, request, num_computed_tokens, num_new_tokens
            )
        if num_computed_tokens + num_new_tokens < request.num_tokens:
            return num_new_tokens  # samples nothing: nothing to charge
        if self._charge(step, request):
            return num_new_tokens
        return self._refused_tokens(step, request, num_computed_tokens, num_new_tokens)

    def _reserve_under_active_cap(
        self,
        step: _Step,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
    ) -> int:
        """As above, when ``max_num_active_seqs`` is below ``max_num_seqs``: the
        cap also bounds the running loop, and throttled running requests make
        room for new ones (upstream reads the cap only in the waiting loop)."""
        in_running_loop = request.status == RequestStatus.RUNNING
        if in_running_loop and step.running_granted >= self._base_max_active:
            return 0
        samples = num_computed_tokens + num_new_tokens >= request.num_tokens
        if not samples or self._charge(step, request):
            step.running_granted += in_running_loop
            return num_new_tokens
        allowed = self._refused_tokens(
            step, request, num_computed_tokens, num_new_tokens
        )
        if in_running_loop:
            if allowed:
                step.running_granted += 1
            else:
                step.running_throttled += 1
                self.max_num_active_reqs = min(
                    self.max_num_running_reqs,
                    self._base_max_active + step.running_throttled,
                )
        return allowed

    def _charge(self, step: _Step, request: Request) -> bool:
        """Hands the request one token of its user's grant for this step (a
        request is charged at most once per step)."""
        request_id = request.request_id
        if request_id in step.charged:
            return True
        user = self._user_of.get(request_id, ANONYMOUS_USER)
        left = step.left.get(user)
        if left is None:
            left = self._tokens_left(step, user)
        if left:
            step.left[user] = left - 1
            step.charged[request_id] = user
            return True
        if step.shadow:
            step.shadow_skips[user] = step.shadow_skips.get(user, 0) + 1
            return True
        step.refused.add(user)
        self._record_skip(step, request, user)
        return False

    def _refused_tokens(
        self,
        step: _Step,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
    ) -> int:
        """Tokens a refused request may still compute: with chunked prefill, a
        prefill up to its second-to-last position; otherwise none."""
        if not self.scheduler_config.enable_chunked_prefill:
            return 0
        return max(0, min(num_new_tokens, request.num_tokens - 1 - num_computed_tokens))

    def _paced_handle_blocked_waiting_request(self, request: Request) -> bool:
        """``_handle_blocked_waiting_request`` while pacing is on: a waiting
        request of a user without budget is skipped here, because returning 0
        from ``_reserve_prefill_lookahead`` would end the whole waiting loop."""
        if not self._upstream_handle_blocked_waiting_request(request):
            return False
        step = self._step
        if step is None or step.shadow:
            return True  # shadow: counted when it samples, if it would be refused
        user = self.user_of(request)
        if self._tokens_left(step, user):
            step.needy_pending.discard(request.request_id)
            return True
        step.refused.add(user)
        if self._may_prefill_without_budget(step, request):
            return True  # admitted; _reserve_prefill_lookahead stops it short
        self._record_skip(step, request, user)
        return False

    def _may_prefill_without_budget(self, step: _Step, request: Request) -> bool:
        """Whether a waiting request of a refused user may take a slot for a
        prefill that stops short of sampling: only a slot no user with budget
        is waiting for."""
        if not self._prefill_can_stop_short(request):
            return False
        if step.spare_slots is None:
            return True
        if step.spare_slots <= 0 or step.needy_pending:
            return False
        step.spare_slots -= 1
        return True

    def _record_skip(self, step: _Step, request: Request, user: str) -> None:
        """Counts a request passed over for lack of budget in this step."""
        step.skips[user] = step.skips.get(user, 0) + 1
        if self._tracing:
            throttling = self._throttling.setdefault(request.request_id, _Throttling())
            throttling.steps += 1
            if throttling.since_ns is None:
                throttling.since_ns = step.now_ns

    def _prefill_can_stop_short(self, request: Request) -> bool:
        """Whether a waiting request of a refused user can still be admitted for a
        prefill that ends before its sampling position.

        If not, it must be skipped here: handing it 0 tokens in
        ``_reserve_prefill_lookahead`` would end the whole waiting loop.
        """
        if not self.scheduler_config.enable_chunked_prefill:
            return False
        if request.num_tokens - request.num_computed_tokens <= 1:
            return False
        # A prefix-cache hit covers whole blocks and at most num_tokens - 1
        # positions, so it leaves only the sampling position to compute exactly
        # when num_tokens - 1 is block-aligned.
        return not (
            self.cache_config.enable_prefix_caching
            and request.num_computed_tokens == 0
            and (request.num_tokens - 1) % self.block_size == 0
        )

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        step = self._step
        if step is not None:
            original = step.biased_arrival.pop(request.request_id, None)
            if original is not None:
                request.arrival_time = original
            user = self.user_of(request)
            if (
                not step.shadow  # nothing is parked in shadow mode
                and _next_step_samples(request)
                and not self._has_budget(step, user)
            ):
                self.accounting.record(user, "throttled_preemptions")
        super()._preempt_request(request, *args, **kwargs)


#: Upstream methods ``schedule()`` calls per request that paced steps hook.
_STEP_HOOK_NAMES = ("_reserve_prefill_lookahead", "_handle_blocked_waiting_request")

#: Waiting states upstream can admit in this step (others wait for a grammar,
#: a KV transfer or streamed input).
_STARTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
#: Waiting states that end without input to the engine (see
#: ``awaits_asynchronous_work``); streamed input arrives as input and wakes it.
_ASYNC_READY = (
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
)


def _first_yielding_to(victims: list[Request], request: Request) -> Request | None:
    """Pops the best victim that may yield to ``request``: never one of a
    higher priority (a smaller value) than the request's own."""
    for index, victim in enumerate(victims):
        if victim.priority >= request.priority:
            return victims.pop(index)
    return None


def _put_back(
    running: list[Request], original: list[Request], shown: list[Request]
) -> None:
    """Restores ``running`` after a step that showed upstream only ``shown`` of
    ``original``: ``original``'s order for the requests hidden or still there,
    then any the step admitted. (Steps that hide requests admit and preempt
    nothing; this keeps every request right even if one did, or raised midway.)"""
    if running == shown:  # the usual case: nothing came or went
        running[:] = original
        return
    present = {id(request) for request in running}
    visible = {id(request) for request in shown}
    known = {id(request) for request in original}
    running[:] = [
        *(r for r in original if id(r) in present or id(r) not in visible),
        *(r for r in running if id(r) not in known),
    ]


def _full_attention_block_sizes(config: KVCacheConfig) -> tuple[int, ...] | None:
    """Each KV cache group's block size, or None unless every group is full
    attention."""
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    if not specs or not all(isinstance(spec, FullAttentionSpec) for spec in specs):
        return None
    return tuple(spec.block_size for spec in specs)


def _first_prefill_chunk(requests: list[Request]) -> Request | None:
    """The first scheduled request whose step ends inside its prefill (upstream
    sets ``is_prefill_chunk`` on each request it schedules), or None. A plain
    loop: CPython runs it twice as fast as ``any()`` over a generator."""
    for request in requests:
        if request.is_prefill_chunk:
            return request
    return None


def _next_step_samples(request: Request) -> bool:
    """Whether the request's next computed position is a sampling one (it is
    decoding, or one position short of the end of its prefill)."""
    return request.num_computed_tokens >= request.num_tokens - 1


class OutputRateScheduler(OutputRateSchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with per-user output pacing."""


class OutputRateAsyncScheduler(OutputRateSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with per-user output pacing."""


def scheduler_class_for(async_scheduling: bool | None) -> type[Scheduler]:
    """The variant matching vLLM's resolved ``async_scheduling`` setting."""
    return OutputRateAsyncScheduler if async_scheduling else OutputRateScheduler
