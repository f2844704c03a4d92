"""The vLLM adapter: per-user output-token pacing inside the V1 scheduler.

One mixin, applied to both ``Scheduler`` and ``AsyncScheduler``. It overrides
``Scheduler`` methods (vLLM 0.32) and delegates each to the concern modules of
``engine_ext.scheduling``, which reach vLLM only through
``engine_ext.scheduling.upstream``:

- ``schedule()``: under the shared limiter's lock (the control plane reads and
  changes limits only between steps), one step of the kind ``Steps`` chooses.
- ``_reserve_prefill_lookahead()`` / ``_handle_blocked_waiting_request()``:
  instance attributes pointed at ``RequestHooks`` in paced steps and back at
  upstream's own methods otherwise, so that pacing off and free steps pay
  nothing per request.
- ``_try_schedule_encoder_inputs()`` (multimodal requests only):
  ``RequestHooks.encoder_window`` first, so that a refused request's encoder
  inputs are scheduled for the prefill it still computes.
- ``_preempt_request()``: ``RequestHooks.preempting`` first (the PRIORITY bias
  undone, a preempted parked request counted), then upstream.
- ``add_request()`` / ``_free_request()``: the user is resolved once per request
  and kept in the ``UserBook``; a finished request's throttle totals go on its
  trace headers, and its end is reported to ``RequestIdentity`` (which keeps
  an attestation valid while its chain of requests lives).
- ``make_stats()``: the metrics payload, at most every ``PAYLOAD_INTERVAL_NS``.

- ``update_from_output()``: with speculative decoding, the draft tokens a step
  was charged for and did not emit are given back once its output is applied
  (``engine_ext.scheduling.drafts``). Every other charge is settled at dispatch,
  never against model results, which is what keeps async scheduling possible
  (a request that stops at step N was already charged for N+1).

With the feature off (no default rate) every override defers to upstream
unchanged and no per-request hook is bound.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from engine_ext import payload_builder
from engine_ext.request_tracing import with_throttle_headers
from engine_ext.scheduling.band_stats import BandStats
from engine_ext.scheduling.idle_users import IdleUsers
from engine_ext.scheduling.request_hooks import RequestHooks
from engine_ext.scheduling.steps import Steps
from engine_ext.scheduling.upstream import (
    STEP_HOOK_NAMES,
    Upstream,
    full_attention_block_sizes,
)
from engine_ext.scheduling.users import UserBook
from pacing import attachments
from pacing.accounting import Accounting
from pacing.attestation import RequestIdentity
from pacing.budget import BudgetSource
from pacing.identity import XARGS_SOURCE
from pacing.limiter import OutputRateLimiter
from pacing.settings.model import OutputRateSettings
from pacing.shared import SharedLimiter

# Under vLLM's logger so that its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Metrics payloads are built at most this often (by the scheduler's clock), not
#: every step: a build costs ~0.2 ms, a tiny model's whole step ~1 ms, and
#: Prometheus scrapes every few seconds. Counters are deltas since the previous
#: build, so nothing is lost; the idle heartbeat (``engine_ext.idle_stats``)
#: sends what the last steps left once the engine is idle.
PAYLOAD_INTERVAL_NS = 100_000_000


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
    #: Unix seconds, to judge attestations' age; tests replace it on the instance.
    wall_clock: Callable[[], float] = staticmethod(time.time)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = OutputRateSettings.from_additional_config(
            self.vllm_config.additional_config
        )
        # vLLM's make_stats returns nothing without log_stats: no payload then.
        emit_payloads = settings.metrics.emit and settings.enabled and self.log_stats
        #: The limiter and its counters, shared with whatever attaches (the
        #: control plane): the lock is held for every whole step.
        self.output_rate_shared = SharedLimiter(
            settings.build_limiter(),
            # The payload's groups count the events of users forgotten
            # between two builds.
            Accounting(keep_forgotten=emit_payloads),
            lambda: self.clock(),
            request_counts=self._request_counts,
            mode=settings.mode,
            fair_share=settings.build_fair_share(),
            teams=settings.build_teams(),
            policy=settings.policy,
        )
        #: Who each request is charged to (``pacing.attestation``); refuses to
        #: start in the attested mode without the guard's key. With pacing off
        #: no guard runs, and nothing is charged.
        self._identity = RequestIdentity.for_settings(
            settings.user_source if settings.enabled else XARGS_SOURCE,
            settings.require_user and settings.enabled,
            os.environ,
            lambda: self.clock(),
            lambda: self.wall_clock(),
        )
        #: Requests refused for want of a checked user id, finished but not yet
        #: reported to their client (the next ``update_from_output`` does).
        self._refused: list[Request] = []
        #: Requests charged to the team their gateway named
        #: (``pacing.teams.Teams.join_request``) until they end.
        self._gateway_team_requests: set[str] = set()
        #: What attached through the core's registration point (the control
        #: plane, when the settings ask for one); stopped at shutdown.
        self.output_rate_attachments: list[attachments.Attachment] = []
        #: Whether the engine-loop hook has yet to bind ``wake`` to the engine's
        #: input queue (only with pacing on).
        self.output_rate_needs_wake_binding = False
        #: Builds the metrics payload carried to the API process in the step's
        #: SchedulerStats; None unless our stat logger is there to take it out.
        self.output_rate_stats = (
            payload_builder.PayloadBuilder(settings.metrics.max_labelled_users)
            if emit_payloads
            else None
        )
        #: Payloads whose build has started (counted first): the idle-metrics
        #: heartbeat (``engine_ext.idle_stats``) compares it between checks.
        self.output_rate_payloads_built = 0
        self._payload_built_at_ns: int | None = None
        upstream = self._upstream = Upstream(self, super().schedule)
        self._users = UserBook(step_tokens=1 + upstream.draft_tokens)
        self._request_hooks = RequestHooks(
            upstream,
            self.output_rate_shared,
            super()._reserve_prefill_lookahead,
            super()._handle_blocked_waiting_request,
        )
        self._idle_users = IdleUsers(
            self.output_rate_shared, self._users, self._labelled_users
        )
        #: Whether request tracing is on: throttle totals then go on each
        #: request's span.
        self._tracing = bool(self.vllm_config.observability_config.otlp_traces_endpoint)
        self._steps = Steps(
            upstream,
            self.output_rate_shared,
            self._users,
            self._request_hooks,
            self._idle_users,
            clock=lambda: self.clock(),
            bind_hooks=self._bind_step_hooks,
            kv_block_sizes=full_attention_block_sizes(self.kv_cache_config),
            tracing=self._tracing,
        )
        if settings.enabled:
            policy = settings.policy
            logger.info(
                "per-user output pacing on (%s): mode %s, default %s tok/s, "
                "%d users, %d tiers, %d teams in the start-up policy%s",
                type(self).__name__,
                settings.mode,
                policy.default_rate,
                len(policy.users),
                len(policy.groups["tier"]),
                len(policy.groups["team"]),
                "" if settings.config_path is None else ", then the limits file",
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
            self._steps.use_hooks(False)

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

    @property
    def output_rate_band_stats(self) -> BandStats:
        """The bands' waiting requests and wait time (for the metrics)."""
        return self._steps.band_stats

    @property
    def next_ready_ns(self) -> int | None:
        """When the last step scheduled nothing because of the limiter: the
        earliest time a refused user has budget again (for the engine loop)."""
        return self._steps.next_ready_ns

    # -- identity ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        request_id = request.request_id
        if request_id in self._users.user_of:
            return
        params = request.sampling_params
        identity = self._identity.identify(
            request_id, params.extra_args if params else None
        )
        if identity is not None and identity.team is not None:
            shared = self.output_rate_shared
            with shared.lock:
                refusal = shared.teams.join_request(identity.user, identity.team)
            if refusal is None:
                self._gateway_team_requests.add(request_id)
            else:
                logger.warning("request %s refused: %s", request_id, refusal)
                identity = None
        if identity is None:
            # Finished before any step: it is never scheduled.
            self.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
            self._refused.append(request)
            return
        self._users.add(request_id, identity.user, paced=self.limiter.enabled)
        objective = identity.objective
        if objective is not None:
            # The band the policy in force maps the gateway's objective to. One
            # it maps to none (the policy may have changed since the gateway
            # was set up) leaves the request in its user's band, counted and
            # logged once per name: an unknown name never moves a request.
            shared = self.output_rate_shared
            with shared.lock:
                band = shared.bands.objectives.get(objective)
                first = band is None and self.accounting.record_unknown_objective(
                    identity.user, objective
                )
            if band is not None:
                self._steps.bands.request_band[request_id] = band
            elif first:
                logger.warning(
                    "request %s names objective %r, which the policy in force "
                    "maps to no band: it stays in its user's band (logged once "
                    "per objective)",
                    request_id,
                    objective,
                )
        self._steps.request_added(request)

    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        request_id = request.request_id
        if request_id in self._gateway_team_requests:
            self._gateway_team_requests.remove(request_id)
            with self.output_rate_shared.lock:
                self.output_rate_shared.teams.leave_request(self.user_of(request))
        # The steps first: a request's band is its user's (``BandSteps``).
        throttled = self._steps.request_ended(request_id)
        self._users.remove(request_id, paced=self.limiter.enabled)
        self._identity.request_ended(request_id)
        if throttled is not None:
            # Read back by the API process when it builds the request's span.
            request.trace_headers = with_throttle_headers(
                request.trace_headers, *throttled
            )
        return super()._free_request(request, delay_free_blocks)

    def user_of(self, request: Request) -> str:
        """The user ``request`` is charged to."""
        return self._users.user(request.request_id)

    # -- the step ----------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        # Upstream's own signature (not *args, **kwargs): forwarding through
        # the step's three calls would cost every step a tuple, a dict and a
        # slower call each.
        if not self.limiter.enabled:
            return super().schedule(throttle_prefills)
        # The control plane reads and changes limits only between steps.
        with self.output_rate_shared.lock:
            output = self._steps.schedule(throttle_prefills)
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        drafts = self._steps.drafts
        charges = drafts.take(scheduler_output) if drafts else None
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._refused:
            self._report_refused(outputs)
        if charges is not None:
            with self.output_rate_shared.lock:
                charges.settle(self.budget, self.accounting, self._users, self.clock())
        return outputs

    def _report_refused(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Tells each refused request's client that it ended in an error."""
        refused, self._refused = self._refused, []
        for request in refused:
            ended = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
            )
            outputs.setdefault(
                request.client_index, EngineCoreOutputs()
            ).outputs.append(ended)

    def _try_schedule_encoder_inputs(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> tuple[list[int], int, int, list[int], list[int]]:
        num_new_tokens = self._request_hooks.encoder_window(
            request, num_computed_tokens, num_new_tokens
        )
        return super()._try_schedule_encoder_inputs(
            request,
            num_computed_tokens,
            num_new_tokens,
            encoder_compute_budget,
            shift_computed_tokens,
        )

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        self._request_hooks.preempting(request)
        self._steps.preempted(request)
        super()._preempt_request(request, *args, **kwargs)

    def _bind_step_hooks(self, hooks: tuple[Callable[..., object], ...]) -> None:
        """Points upstream's per-request calls at ``hooks``, through instance
        attributes set up once with pacing on: a class-level override would
        cost every request of every step even with pacing off, and adding or
        deleting instance attributes per step would slow every other attribute
        access of the scheduler (CPython stops sharing the instance's key
        layout)."""
        for name, hook in zip(STEP_HOOK_NAMES, hooks, strict=True):
            setattr(self, name, hook)

    def shutdown(self) -> None:
        attached, self.output_rate_attachments = self.output_rate_attachments, []
        attachments.stop_all(attached)
        super().shutdown()

    # -- between steps -------------------------------------------------------

    def cleanup_due(self, now_ns: int) -> bool:
        """Whether users are tracked and the last cleanup is an interval old."""
        return self._idle_users.due(now_ns)

    def cleanup_when_idle(self) -> None:
        """Drops idle users if due; for the engine thread between steps."""
        with self.output_rate_shared.lock:
            self._idle_users.between_steps(self.clock())

    def awaits_asynchronous_work(self) -> bool:
        """Whether a waiting request depends on work that completes without any
        input reaching the engine: only a later step notices it is done."""
        return self._upstream.awaits_asynchronous_work()

    def awaits_kv_transfer(self) -> bool:
        """Whether a waiting request's KV cache is still being received by a KV
        connector (only a step's output says when it is done)."""
        return self._upstream.awaits_kv_transfer()

    def bind_wake(self, wake: Callable[[], None]) -> None:
        """Lets control-plane changes end the engine's idle wait at once."""
        self.output_rate_shared.set_wake(wake)

    def _request_counts(self) -> dict[str, tuple[int, int]]:
        """Per user (running, parked) requests: running now, parked as of the
        last step's start. For the control plane, under the shared lock."""
        counts: dict[str, int] = {}
        for request in list(self.running):  # one atomic copy: see SharedLimiter
            user = self.user_of(request)
            counts[user] = counts.get(user, 0) + 1
        parked = self._users.parked_counts
        return {user: (n, parked.get(user, 0)) for user, n in counts.items()}

    # -- metrics ---------------------------------------------------------------

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
                        throttled_requests=sum(self._users.parked_counts.values()),
                        tracked_users=self.limiter.tracked_users(),
                        control=self.output_rate_shared.control_snapshot(),
                        mode=self.output_rate_shared.mode,
                        limiter=self.limiter,
                        store=self.output_rate_shared.store_stats,
                        fair_share=self.output_rate_shared.fair_share,
                        teams=payload_builder.TeamActivity(
                            table=self.output_rate_shared.teams.table,
                            live=self._users.live,
                            throttled=self._users.parked_counts,
                            now_ns=now_ns,
                            gateway_teams=self.output_rate_shared.teams.gateway_teams,
                        ),
                        prompt_user_rates=(
                            self.output_rate_shared.prompt.limiter.user_rates
                        ),
                        default_prompt_rate=(
                            self.output_rate_shared.prompt.limiter.default_rate
                        ),
                        ceilings=self.output_rate_shared.ceilings,
                        bands=payload_builder.BandActivity(
                            table=self.output_rate_shared.bands,
                            tier_of=self.limiter.tier_of,
                            team_of=self.output_rate_shared.teams.team_of,
                            weight_of=lambda user: (
                                self.output_rate_shared.fair_share.weights.of(
                                    user, self.limiter.tier_of(user)
                                )
                            ),
                            live=self._users.live,
                            now_ns=now_ns,
                            queue=self.output_rate_band_stats,
                        ),
                    )
                payload_builder.attach(stats, payload)
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

    def _labelled_users(self) -> Iterable[str]:
        """Users the metrics label by name (their counters must survive cleanup)."""
        stats = self.output_rate_stats
        return stats.labelled_users if stats is not None else ()


class OutputRateScheduler(OutputRateSchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with per-user output pacing."""


class OutputRateAsyncScheduler(OutputRateSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with per-user output pacing."""


def scheduler_class_for(async_scheduling: bool | None) -> type[Scheduler]:
    """The variant matching vLLM's resolved ``async_scheduling`` setting."""
    return OutputRateAsyncScheduler if async_scheduling else OutputRateScheduler
