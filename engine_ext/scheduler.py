"""The vLLM adapter: per-user output-token pacing inside the V1 scheduler.

One mixin, applied to both ``Scheduler`` and ``AsyncScheduler``; this module is the
only place that knows vLLM's scheduler internals. It overrides these
``Scheduler`` methods (vLLM 0.32) and relies on how ``schedule()`` calls them:

- ``schedule()``: opens a step (one clock reading), orders ``running`` for the
  step (rotation, parked requests last), calls upstream, then settles the step:
  the single refund point, "last served" bookkeeping, order restored.
- ``_reserve_prefill_lookahead()``: called once per candidate request in the
  running and the waiting loop after the token budget is applied and before KV
  allocation. Here a step that will *sample* is charged 1 token; a refused
  request gets 0 tokens (the running loop ``continue``s) or, with chunked
  prefill, a prefill up to its second-to-last position.
- ``_handle_blocked_waiting_request()``: the waiting loop's own "skip this one
  for now" hook. A waiting request of a user with no budget is skipped here,
  because returning 0 from ``_reserve_prefill_lookahead`` would ``break`` the
  waiting loop and block every other user's new requests.
- ``_preempt_request()``: counts preempted parked requests and undoes the
  PRIORITY victim bias before the request re-enters the waiting heap.
- ``add_request()`` / ``_free_request()``: resolve the user once per request.

Upstream reads ``max_num_active_reqs`` only in the waiting loop, so raising it by
the number of throttled running requests lets new requests take their place
(running - throttled < max_num_active_seqs, and never above max_num_seqs).

``update_from_output()`` is deliberately not overridden: charges are settled at
dispatch, never against model results, which is what keeps async scheduling
possible (a request that stops at step N was already charged for N+1).

With the feature off (no default rate) every override defers to upstream
unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from control.host import LimiterHost
from control.runner import ControlPlane, serve_from_additional_config
from control.settings import ADDITIONAL_CONFIG_KEY as CONTROL_CONFIG_KEY
from engine_ext import stats_payload
from engine_ext.accounting import Accounting
from engine_ext.config import OutputRateConfig
from engine_ext.identity import ANONYMOUS_USER, user_from_extra_args
from engine_ext.limiter import OutputRateLimiter
from engine_ext.request_tracing import with_throttle_headers

# Under vLLM's logger so that its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Idle users are dropped from the limiter every this many steps (cheap, and
#: behaviour-neutral: see ``OutputRateLimiter.cleanup_idle_users``).
CLEANUP_EVERY_STEPS = 256

#: Added to a parked request's arrival time during a step so that PRIORITY's
#: victim choice, ``max(running, key=(priority, arrival_time))``, picks it first
#: among requests of the same priority. Far beyond any real arrival time.
_PRIORITY_VICTIM_BIAS_S = 1e12


@dataclass
class _Throttling:
    """One request's time spent throttled (reported on its trace span)."""

    steps: int = 0  #: steps in which it was passed over for lack of budget
    total_ns: int = 0  #: closed throttled episodes, refusal to next dispatch
    since_ns: int | None = None  #: start of the open episode


@dataclass
class _Step:
    """Bookkeeping of one ``schedule()`` call."""

    now_ns: int
    charged: dict[str, str] = field(default_factory=dict)  # request id -> user
    refused_users: set[str] = field(default_factory=set)
    wake_at_ns: int | None = None  # earliest ready time among refused users
    running_granted: int = 0  # running requests given tokens this step
    running_throttled: int = 0  # running requests skipped for lack of budget
    biased_arrival: dict[str, float] = field(default_factory=dict)


class OutputRateSchedulerMixin:
    """Per-user GCRA pacing of sampled tokens; see the module docstring.

    Must precede a vLLM ``Scheduler`` class in the bases.
    """

    #: Monotonic clock in ns; tests replace it on the instance.
    clock: Callable[[], int] = staticmethod(time.monotonic_ns)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = OutputRateConfig.from_additional_config(
            self.vllm_config.additional_config
        )
        self.limiter = OutputRateLimiter(config.default_rate, dict(config.user_rates))
        self._base_max_active = self.max_num_active_reqs
        self._user_of: dict[str, str] = {}
        self._last_served: dict[str, str] = {}  # user -> request id
        self._step: _Step | None = None
        self._steps_since_cleanup = 0
        #: When the last step scheduled nothing because of the limiter: the
        #: earliest time a refused user has budget again (for the engine loop).
        self.next_ready_ns: int | None = None
        self.accounting = Accounting()
        #: Per user (running, throttled) requests, as of the last step's start.
        self._request_counts: dict[str, tuple[int, int]] = {}
        #: Shared with the control plane: the lock held for every whole step.
        self.output_rate_host = LimiterHost(
            self.limiter,
            self.accounting,
            lambda: self.clock(),
            request_counts=lambda: self._request_counts,
        )
        self.output_rate_control: ControlPlane | None = None
        #: Set until the engine loop hook binds ``wake`` to the engine's queue.
        self.output_rate_wake_unbound = False
        #: Throttle totals of requests throttled at least once, kept only when
        #: request tracing is on (they end up on the request's span).
        self._tracing = bool(self.vllm_config.observability_config.otlp_traces_endpoint)
        self._throttling: dict[str, _Throttling] = {}
        metrics = stats_payload.MetricsSettings.from_additional_config(
            self.vllm_config.additional_config
        )
        #: Builds the metrics payload carried to the API process in the step's
        #: SchedulerStats; None unless our stat logger is there to take it out.
        self.output_rate_stats = (
            stats_payload.PayloadBuilder(metrics.max_labelled_users)
            if metrics.emit and self.limiter.enabled
            else None
        )
        if self.limiter.enabled:
            logger.info(
                "per-user output pacing on (%s): default %d tok/s, %d user limits",
                type(self).__name__,
                config.default_rate,
                len(config.user_rates),
            )
            # The CLI always configures a control plane (address "off" disables
            # it); an offline LLM(additional_config=...) gets one only if asked.
            additional = self.vllm_config.additional_config or {}
            if CONTROL_CONFIG_KEY in additional:
                self.output_rate_control = serve_from_additional_config(
                    self.output_rate_host, additional
                )
            self.output_rate_wake_unbound = True

    # -- identity ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if request.request_id not in self._user_of:
            self._user_of[request.request_id] = self._resolve_user(request)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        self._user_of.pop(request.request_id, None)
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

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        if not self.limiter.enabled:
            return super().schedule(*args, **kwargs)
        # The control plane reads and changes limits only between steps.
        with self.output_rate_host.lock:
            output = self._paced_schedule(*args, **kwargs)
        return output

    def shutdown(self) -> None:
        if self.output_rate_control is not None:
            self.output_rate_control.stop()
            self.output_rate_control = None
        super().shutdown()

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self.output_rate_stats is not None:
            try:
                with self.output_rate_host.lock:
                    payload = self.output_rate_stats.build(
                        accounting=self.accounting,
                        user_rates=self.limiter.user_rates,
                        default_rate=self.limiter.default_rate,
                        throttled_requests=sum(
                            t for _, t in self._request_counts.values()
                        ),
                        tracked_users=self.limiter.tracked_users(),
                        control=self._control_snapshot(),
                    )
                stats_payload.attach(stats, payload)
            except Exception:
                # Raising here would end vLLM's engine-core loop: this step's
                # metrics are lost instead, pacing goes on.
                self.output_rate_stats.failures.record()
        return stats

    def _control_snapshot(self) -> stats_payload.ControlPlaneSnapshot | None:
        control = self.output_rate_control
        if control is None:
            return None
        watcher = control.watcher
        return stats_payload.ControlPlaneSnapshot(
            limit_changes=control.service.limit_changes,
            config_reloads=(
                {}
                if watcher is None
                else {"success": watcher.successes, "failure": watcher.failures}
            ),
            rpcs=control.server.rpc_counts.snapshot(),
        )

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """Lets control-plane changes end the engine's idle wait at once."""
        self.output_rate_host.set_wake(wake)

    def _paced_schedule(self, *args, **kwargs) -> SchedulerOutput:
        step = self._step = _Step(now_ns=self.clock())
        persistent_order = list(self.running)
        self.running[:] = self._order_for_step(step)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._step = None
            self.max_num_active_reqs = self._base_max_active
            self._restore_arrival_times(step)
            rank = {id(req): i for i, req in enumerate(persistent_order)}
            # Stable: requests admitted this step stay behind, in admission order.
            self.running.sort(key=lambda req: rank.get(id(req), math.inf))
        self._settle(step, output)
        self.output_rate_host.on_step(step.now_ns)
        return output

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

        has_budget: dict[str, bool] = {}
        counts: dict[str, tuple[int, int]] = {}
        active, parked = [], []
        for request in ordered:
            user = self.user_of(request)
            if user not in has_budget:
                has_budget[user] = (
                    self.limiter.ready_at_ns(user, step.now_ns) <= step.now_ns
                )
            is_parked = not has_budget[user] and _next_step_samples(request)
            (parked if is_parked else active).append(request)
            running, throttled = counts.get(user, (0, 0))
            counts[user] = (running + 1, throttled + is_parked)
        self._request_counts = counts
        if self.policy == SchedulingPolicy.PRIORITY:
            for request in parked:
                step.biased_arrival[request.request_id] = request.arrival_time
                request.arrival_time += _PRIORITY_VICTIM_BIAS_S
        return active + parked

    def _restore_arrival_times(self, step: _Step) -> None:
        for request in self.running:
            original = step.biased_arrival.pop(request.request_id, None)
            if original is not None:
                request.arrival_time = original

    def _settle(self, step: _Step, output: SchedulerOutput) -> None:
        """The single refund point, and what the next step needs to know."""
        dispatched = output.num_scheduled_tokens
        for request_id, user in step.charged.items():
            if request_id in dispatched:
                self._last_served[user] = request_id
                throttling = self._throttling.get(request_id)
                if throttling is not None and throttling.since_ns is not None:
                    throttling.total_ns += step.now_ns - throttling.since_ns
                    throttling.since_ns = None
            else:  # KV allocation failed, or preempted after being charged
                self.limiter.refund(user, step.now_ns)
                self.accounting.record(user, "refunds")
        self.next_ready_ns = step.wake_at_ns if not dispatched else None
        self._steps_since_cleanup += 1
        if self._steps_since_cleanup >= CLEANUP_EVERY_STEPS:
            self._steps_since_cleanup = 0
            self.limiter.cleanup_idle_users(step.now_ns)
            live_users = set(self._user_of.values())
            if self.output_rate_stats is not None:
                # Labelled users' counters must survive for exact deltas.
                live_users.update(self.output_rate_stats.labelled_users)
            self._last_served = {
                user: rid
                for user, rid in self._last_served.items()
                if user in live_users
            }
            self.accounting.forget(live_users)

    # -- per-request decisions (called from inside upstream schedule()) -----

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        step = self._step
        if step is None or num_new_tokens == 0:
            return num_new_tokens
        in_running_loop = request.status == RequestStatus.RUNNING
        if in_running_loop and step.running_granted >= self._base_max_active:
            return 0  # the active cap also bounds the running loop
        samples = num_computed_tokens + num_new_tokens >= request.num_tokens
        if (
            not samples
            or request.request_id in step.charged
            or self._charge(step, request)
        ):
            step.running_granted += in_running_loop
            return num_new_tokens
        # Refused: a prefill may still advance up to its second-to-last position.
        allowed = 0
        if self.scheduler_config.enable_chunked_prefill:
            allowed = max(
                0, min(num_new_tokens, request.num_tokens - 1 - num_computed_tokens)
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
        """Charges one token to the request's user; remembers refusals so the
        limiter is asked at most once per refused user and step."""
        user = self.user_of(request)
        if user not in step.refused_users and self.limiter.try_take(user, step.now_ns):
            step.charged[request.request_id] = user
            self.accounting.record(user, "charged")
            return True
        self._refuse(step, user)
        self._record_skip(step, request, user)
        return False

    def _refuse(self, step: _Step, user: str) -> None:
        if user in step.refused_users:
            return
        step.refused_users.add(user)
        ready = self.limiter.ready_at_ns(user, step.now_ns)
        if step.wake_at_ns is None or ready < step.wake_at_ns:
            step.wake_at_ns = ready

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        step = self._step
        if step is None:
            return True
        user = self.user_of(request)
        if user not in step.refused_users:
            if self.limiter.ready_at_ns(user, step.now_ns) <= step.now_ns:
                return True
            self._refuse(step, user)
        if self._prefill_can_stop_short(request):
            return True  # admitted; _reserve_prefill_lookahead stops it short
        self._record_skip(step, request, user)
        return False

    def _record_skip(self, step: _Step, request: Request, user: str) -> None:
        """Counts a request passed over for lack of budget in this step."""
        self.accounting.record(user, "throttled_skips")
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

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        step = self._step
        if step is not None:
            original = step.biased_arrival.pop(request.request_id, None)
            if original is not None:
                request.arrival_time = original
            user = self.user_of(request)
            if _next_step_samples(request) and (
                user in step.refused_users
                or self.limiter.ready_at_ns(user, step.now_ns) > step.now_ns
            ):
                self.accounting.record(user, "throttled_preemptions")
        super()._preempt_request(request, *args, **kwargs)


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
