"""The kinds of step and their choice, once per ``schedule()`` with pacing on.

- *Unpaced* (mode ``off``, the kill switch): upstream alone, nothing charged.
- *Free*: every user with live requests is known to have budget for all of them
  (``UserBook.constrained`` is empty), so nobody can be refused. Upstream
  schedules alone, with its own per-request methods bound, and the dispatched
  sampling steps are charged after the fact (``settlement.charge_free_step``).
- *Sleeper*: every user that may be refused is known to have no budget until a
  later time. Its requests are set aside for the step and counted as passed
  over; the step is otherwise a free one. A user parked between two of its
  tokens costs no budget call, ordering or settlement.
- *Paced* (otherwise): ``running`` ordered when a user may lack budget at the
  step's start or a limit changed (``ordering``), parked requests yield slots
  (``slots``) or are hidden from upstream (``hiding``), upstream runs with the
  per-request hooks bound (``request_hooks``), then the step settles
  (``settlement.settle_paced``) and ``running`` is restored.

Ceilings (``spare``): at every step's start the users that wait for capacity
within their rate are handed to the borrowing budget, which lends above a
user's rate only while nobody else does.

Prompt budgets (``prompt_gate``) make a step paced while a prompt-limited user
has unpaid prompt that its known prompt headroom may not cover; every step's
computed prompt tokens are charged once upstream has scheduled it.

Invariant: a step is free or sleeper only when no per-request decision could
differ from upstream's; every other step is paced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine_ext.scheduling import ordering, settlement
from engine_ext.scheduling.band_stats import BandStats
from engine_ext.scheduling.bands import BandSteps
from engine_ext.scheduling.drafts import (
    DraftRefunds,
    free_step_charges,
    paced_step_charges,
)
from engine_ext.scheduling.fair_share import FairShareSteps
from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.hiding import Hiding, put_back
from engine_ext.scheduling.idle_users import IdleUsers
from engine_ext.scheduling.prompt_gate import PromptGate
from engine_ext.scheduling.request_hooks import RequestHooks
from engine_ext.scheduling.slots import SlotYielding
from engine_ext.scheduling.spare import SpareCapacity
from engine_ext.scheduling.step_accounting import EngineLate, ThrottleEpisodes
from engine_ext.scheduling.upstream import (
    Request,
    SchedulerOutput,
    Upstream,
    next_step_samples,
)
from engine_ext.scheduling.users import UserBook
from pacing.budget import BudgetSource
from pacing.identity import ANONYMOUS_USER
from pacing.modes import Mode
from pacing.shared import SharedLimiter

#: No users: ``free_step``'s default ``set_aside``.
_NOBODY: Mapping[str, int] = {}


class Steps:
    """Chooses and runs each step's kind (the shared limiter's lock is held)."""

    def __init__(
        self,
        upstream: Upstream,
        shared: SharedLimiter,
        book: UserBook,
        hooks: RequestHooks,
        idle: IdleUsers,
        *,
        clock: Callable[[], int],
        bind_hooks: Callable[[tuple[Callable[..., object], ...]], None],
        kv_block_sizes: tuple[int, ...] | None,
        tracing: bool,
    ) -> None:
        self.upstream = upstream
        self.shared = shared
        self.book = book
        self.hooks = hooks
        self.idle = idle
        self.clock = clock
        self._bind_hooks = bind_hooks
        self.slots = SlotYielding(upstream)
        self.slots.burst_ns = shared.limiter.burst_ns
        self.hiding = Hiding(upstream, kv_block_sizes)
        self.fair = FairShareSteps(
            upstream,
            shared.fair_share,
            book,
            shared.accounting,
            shared.limiter.tier_of,
            lambda user: shared.teams.team_of(user),
        )
        #: Prompt budgets (``prompt_gate``): what each prompt has paid.
        self.prompt = PromptGate(upstream, shared.prompt, book, shared.accounting)
        #: Priority bands (``bands``): the queue's order and preemption.
        self.bands = BandSteps(
            upstream,
            book,
            lambda: shared.bands,
            shared.limiter.tier_of,
            lambda user: shared.teams.team_of(user),
        )
        self.fair.band_of = self.bands.band_of
        #: Per-band waiting requests and wait time, for the metrics and for
        #: how long a request waited before a lower band yields to it.
        self.band_stats = BandStats(
            upstream, lambda: shared.bands, self.bands.bands_of, self.bands.band_of_id
        )
        self.bands.waited_ns = self.band_stats.waited_ns
        #: Ceilings (``spare``): who waits for capacity, so nobody borrows it.
        self.spare = SpareCapacity(upstream, book)
        self.engine_late = EngineLate()
        #: Draft tokens charged in the steps in flight, refunded once rejected.
        self.drafts = DraftRefunds()
        #: Requests' throttle totals, kept only with request tracing on.
        self.episodes = ThrottleEpisodes()
        self.tracing = tracing
        #: Whether sleeper steps may run: hiding allowed and tracing off (it
        #: records each throttled step per request).
        self.sleepers_allowed = self.hiding.allowed and not tracing
        #: Whether the paced hooks are bound (None: neither yet).
        self.hooks_bound: bool | None = None
        self.seen_limit_changes = -1  # forces the first step to order
        #: The budget source of the last step: another one (teams created or
        #: all removed, a store attached) is a limit change.
        self.seen_budget: BudgetSource | None = None
        #: When the last step scheduled nothing because of the limiter: the
        #: earliest time a refused user has budget again (for the engine loop).
        self.next_ready_ns: int | None = None

    def use_hooks(self, paced: bool) -> None:
        """Points upstream's per-request calls at the paced hooks or at
        upstream's own methods (free steps)."""
        if paced == self.hooks_bound:
            return
        self.hooks_bound = paced
        self._bind_hooks(self.hooks.paced() if paced else self.hooks.unpaced())

    def request_added(self, request: Request) -> None:
        """A request arrived (its user and objective band known)."""
        self.band_stats.added(request.request_id, self.clock())
        self.spare.joined(request.request_id)
        self.prompt.add(request)

    def preempted(self, request: Request) -> None:
        """A running request goes back to the waiting queue (any preemption)."""
        self.bands.preempted(request)
        self.band_stats.preempted(request.request_id)
        self.spare.joined(request.request_id)
        if self.shared.fair_share.enabled:
            self.fair.preempted(request)

    def request_ended(self, request_id: str) -> tuple[int, float] | None:
        """Forgets a request that ended; returns its steps passed over and
        seconds throttled if it was ever throttled (request tracing on)."""
        self.slots.yielded.discard(request_id)
        self.fair.request_ended(request_id)
        self.band_stats.request_ended(request_id, self.clock())
        self.bands.request_ended(request_id)
        self.spare.ended(request_id)
        self.prompt.ended(request_id, self.clock)
        if not self.episodes:
            return None
        return self.episodes.end(request_id, self.clock())

    def schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        output = self._step(throttle_prefills)
        if self.band_stats.step_ns is not None:
            self.band_stats.started(self.upstream.started_ids(output))
        return output

    def _step(self, throttle_prefills: bool) -> SchedulerOutput:
        book = self.book
        if book.ended:
            self.idle.end_users(self.clock())
        shared = self.shared
        mode = shared.mode
        now_ns = self.clock()
        self.band_stats.step_start(now_ns)
        self.spare.step_started()
        self.bands.step_start(mode is not Mode.OFF and self.bands.active())
        self.engine_late.record(
            now_ns,
            counted=mode is not Mode.OFF,
            burst_ns=shared.limiter.burst_ns,
            live=book.live,
            added=book.added_since_step,
            accounting=shared.accounting,
        )
        if mode is Mode.OFF:
            return self.unpaced_step(throttle_prefills)
        budget = shared.budget
        borrowing = shared.ceilings.borrowing
        if borrowing is not None:
            self.spare.lend(borrowing, now_ns)
        limit_changed = (
            self.seen_limit_changes != budget.limit_changes
            or budget is not self.seen_budget
        )
        self.slots.guaranteed = None if borrowing is None else borrowing.ceiling_of
        if limit_changed:  # every user's headroom may have shrunk
            self.seen_limit_changes = budget.limit_changes
            self.seen_budget = budget
            book.forget_headroom()
        prompt = self.prompt
        prompt_paced = prompt.active and prompt.constrained(now_ns)
        if not (
            book.constrained or self.slots.yielded or self.episodes or prompt_paced
        ):
            return self.free_step(now_ns, budget, throttle_prefills)
        if mode is Mode.ENFORCE and not prompt_paced:
            output = self.sleepers_step(now_ns, budget, throttle_prefills)
            if output is not None:
                return output
        return self.paced_step(
            now_ns,
            budget,
            throttle_prefills,
            ordered=limit_changed or bool(book.maybe_without_budget),
            shadow=mode is Mode.SHADOW,
            prompt_paced=prompt_paced,
        )

    def unpaced_step(self, throttle_prefills: bool) -> SchedulerOutput:
        """Mode ``off``: upstream alone, nothing charged or recorded. Every
        user's GCRA state is kept as it was, and budget only accrues up to a
        full bucket, so switching back hands out no more."""
        self.use_hooks(False)
        output = self.upstream.schedule(throttle_prefills)
        self.next_ready_ns = None
        if self.book.parked_counts:
            self.book.parked_counts = {}
        return output

    def free_step(
        self,
        now_ns: int,
        budget: BudgetSource,
        throttle_prefills: bool,
        set_aside: Mapping[str, int] = _NOBODY,
    ) -> SchedulerOutput:
        """Upstream schedules alone (no per-request hook, no reordering); its
        sampling steps are charged after the fact. ``set_aside``: users whose
        live requests (that many each) are out of ``running`` (sleepers)."""
        if self.hooks_bound:
            self.use_hooks(False)
        upstream = self.upstream
        fair = self.fair.active()
        banded = self.bands.active()
        if fair or banded:

            def can_start(user: str) -> bool:
                return user not in set_aside

            if banded:
                self.bands.before_step(can_start)
            if fair:
                self.fair.before_step(set_aside, can_start, banded=banded)
        output = upstream.schedule(throttle_prefills)
        if fair:
            self.fair.charge_service(output.num_scheduled_tokens, upstream.requests())
        if self.prompt.active:
            self.prompt.settle(None, output.num_scheduled_tokens, now_ns)
        scheduled_drafts = output.scheduled_spec_decode_tokens
        settlement.charge_free_step(
            self.book,
            budget,
            self.shared.accounting,
            now_ns,
            running=upstream.running,
            requests=upstream.requests(),
            dispatched=output.num_scheduled_tokens,
            set_aside=set_aside,
            scheduled_drafts=scheduled_drafts,
        )
        if scheduled_drafts:
            self.drafts.dispatched(
                output,
                free_step_charges(
                    scheduled_drafts, self.book.user_of, upstream.requests()
                ),
            )
        if self.book.parked_counts:
            self.book.parked_counts = {}
        self.next_ready_ns = None
        if self.idle.due(now_ns):
            self.cleanup(now_ns, fair)
        self.shared.on_step(now_ns)
        return output

    def cleanup(self, now_ns: int, fair: bool) -> None:
        self.idle.cleanup(now_ns)
        self.prompt.forget_idle(self.book.live)
        shared = self.shared
        borrowing = shared.ceilings.borrowing
        if borrowing is not None:
            borrowing.forget_idle(now_ns, self.book.live)
            lending = shared.team_lending
            if lending is not None:
                team_of = shared.teams.team_of
                live_teams = {
                    team for user in self.book.live if (team := team_of(user))
                }
                lending.forget_idle(now_ns, live_teams)
        if fair:
            self.fair.cleanup()

    def sleepers_step(
        self, now_ns: int, budget: BudgetSource, throttle_prefills: bool
    ) -> SchedulerOutput | None:
        """A free step for everyone but the *sleepers*, whose requests are taken
        out of ``running`` for the step and counted as passed over.

        None (the step is paced instead) unless: every constrained user sleeps,
        with headroom 0 and a wake-up time still ahead (computed once per sleep,
        exact for the limiter; a global store may learn of budget sooner, so
        only the limiter qualifies); every sleeper's request is running and its
        next step samples; nothing waits; and upstream cannot tell them gone
        (``Hiding``: no preemption possible, no active cap below the slots, no
        long-prefill threshold; tracing off)."""
        upstream = self.upstream
        if (
            not self.sleepers_allowed
            or budget is not self.shared.limiter
            or self.slots.yielded
            or self.episodes
            or throttle_prefills
            or upstream.anything_waits()
        ):
            return None
        book = self.book
        constrained = book.constrained
        asleep = book.asleep_until
        for user in constrained:
            wake_ns = asleep.get(user)
            if wake_ns is None:
                if book.headroom.get(user) != 0:
                    return None
                wake_ns = asleep[user] = budget.ready_at_ns(user, now_ns)
            if wake_ns <= now_ns:
                return None
        running = upstream.running
        user_of = book.user_of
        visible: list[Request] = []
        sleeping: dict[str, int] = {}
        for request in running:
            user = user_of.get(request.request_id, ANONYMOUS_USER)
            if user not in constrained:
                visible.append(request)
            elif next_step_samples(request):
                sleeping[user] = sleeping.get(user, 0) + 1
            else:
                return None  # a prefill chunk it may compute: a paced step's call
        live = book.live
        if len(sleeping) != len(constrained) or any(
            live[user] != count for user, count in sleeping.items()
        ):
            return None  # a sleeper's request outside ``running``
        if not self.hiding.kv_room_for(len(visible)):
            return None
        original = list(running)
        running[:] = visible
        try:
            output = self.free_step(now_ns, budget, throttle_prefills, sleeping)
        finally:
            put_back(running, original, visible)
        book.parked_counts = sleeping
        accounting = self.shared.accounting
        for user, count in sleeping.items():
            accounting.record(user, "throttled_skips", count)
        if not output.num_scheduled_tokens and sleeping:
            self.next_ready_ns = min(asleep[user] for user in sleeping)
        return output

    def paced_step(
        self,
        now_ns: int,
        budget: BudgetSource,
        throttle_prefills: bool,
        *,
        ordered: bool,
        shadow: bool,
        prompt_paced: bool = False,
    ) -> SchedulerOutput:
        """Upstream with the per-request hooks bound, then settlement. ``ordered``:
        a user may lack budget at the step's start or a limit changed, so
        ``running`` is ordered for the step (otherwise nobody can be parked at
        the start and the order would change nothing; a user running short in
        this step is ordered from the next step on). ``prompt_paced``: prompt
        budgets may hold someone (``prompt_gate``)."""
        self.use_hooks(True)
        upstream = self.upstream
        step = self.hooks.step = PacedStep(
            now_ns,
            budget,
            self.book,
            capped=upstream.max_active < upstream.slots,
            shadow=shadow,
            episodes=self.episodes if self.tracing else None,
        )
        prompt = self.prompt
        prompt_step = self.hooks.prompt = (
            prompt.begin(now_ns, shadow=shadow) if prompt_paced else None
        )
        running = upstream.running
        persistent_order: list[Request] = []
        if ordered:
            persistent_order = list(running)
            for_step = ordering.order_for_step(
                running, step, priority_policy=upstream.priority_policy
            )
            if shadow:  # what enforce would park is counted, nothing is moved
                ordered = False
                ordering.restore_arrival_times(running, step)
            else:
                running[:] = for_step
        hidden: list[Request] = []
        fair = self.fair.active()
        try:
            if not shadow:
                self.slots.yield_for_waiting(step)
            if self.bands.active():
                self.bands.before_step(
                    (lambda user: True) if shadow else step.has_budget
                )
            if fair:
                self._fair_share_start(step, shadow)
            if ordered and not throttle_prefills:
                hidden = self.hiding.hide_parked(step)
            output = upstream.schedule(throttle_prefills)
        finally:
            self.hooks.step = self.hooks.prompt = None
            upstream.set_active_cap(upstream.max_active)
            running = upstream.running
            if hidden:
                running.extend(hidden)
            if ordered:
                ordering.restore_arrival_times(running, step)
                ordering.restore_order(running, persistent_order)
        self.next_ready_ns = settlement.settle_paced(
            step,
            output.num_scheduled_tokens,
            self.shared.accounting,
            self.slots.yielded,
            self.episodes,
        )
        if prompt.active:
            prompt_ready = prompt.settle(
                prompt_step, output.num_scheduled_tokens, now_ns
            )
            if prompt_ready is not None:
                ready = self.next_ready_ns
                self.next_ready_ns = (
                    prompt_ready if ready is None else min(ready, prompt_ready)
                )
        if step.drafts:
            self.drafts.dispatched(
                output,
                paced_step_charges(
                    step.drafts,
                    step.charged,
                    output.num_scheduled_tokens,
                    upstream.requests(),
                ),
            )
        if fair:
            self.fair.charge_service(output.num_scheduled_tokens, upstream.requests())
        if self.idle.due(now_ns):
            self.cleanup(now_ns, fair)
        self.shared.on_step(now_ns)
        return output

    def _fair_share_start(self, step: PacedStep, shadow: bool) -> None:
        """Fair share's step start in a paced step: a user is eligible unless
        it was found without budget (its waiting requests: unless it has none
        in this step's grant); parked requests never yield for fair share (they
        yield to users with budget already: ``slots``)."""
        if shadow:  # nobody is throttled: everyone is eligible

            def anyone(user: str) -> bool:
                return True

            self.fair.before_step((), anyone, banded=self.bands.active())
            return

        def can_start(user: str) -> bool:
            return step.has_budget(user)

        self.fair.before_step(
            self.book.maybe_without_budget,
            can_start,
            keep={r.request_id for r in step.parked},
            banded=self.bands.active(),
        )
