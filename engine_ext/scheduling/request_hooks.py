"""Per-request decisions of a paced step, called from inside upstream's loops.

- ``reserve_prefill_lookahead`` (upstream's ``_reserve_prefill_lookahead``,
  called once per candidate request in the running and the waiting loop after
  the token budget is applied and before KV allocation): a step that will
  *sample* takes 1 token of its user's grant; a refused request gets 0 tokens
  (the running loop ``continue``s) or, with chunked prefill, a prefill up to its
  second-to-last position. With speculative decoding, a running request's step
  is cut to the draft tokens its user's grant covers (upstream then schedules
  only that many of its drafts).
- ``handle_blocked_waiting_request`` (the waiting loop's own "skip this one for
  now" check): a waiting request of a user with no budget is skipped here,
  because returning 0 from ``reserve_prefill_lookahead`` would ``break`` the
  waiting loop and block every other user's new requests.
- ``preempting`` (from ``_preempt_request``): undoes the PRIORITY victim bias
  before the request re-enters the waiting heap and counts preempted parked
  requests.

Invariant: outside a paced step (``step`` None) each defers to upstream alone.
Upstream reads ``max_num_active_reqs`` only in the waiting loop, so raising it
by the number of throttled running requests lets new requests take their place
(running - throttled < max_num_active_seqs, never above max_num_seqs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.ordering import unbias
from engine_ext.scheduling.prompt_gate import PromptStep
from engine_ext.scheduling.upstream import (
    RUNNING,
    Upstream,
    next_step_samples,
    refused_prefill_end,
)
from pacing.shared import SharedLimiter

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request


class RequestHooks:
    """The per-request hooks of paced steps, and upstream's own methods."""

    __slots__ = (
        "prompt",
        "shared",
        "step",
        "upstream",
        "upstream_handle_blocked_waiting_request",
        "upstream_reserve_prefill_lookahead",
    )

    def __init__(
        self,
        upstream: Upstream,
        shared: SharedLimiter,
        upstream_reserve_prefill_lookahead: Callable[[Request, int, int], int],
        upstream_handle_blocked_waiting_request: Callable[[Request], bool],
    ) -> None:
        self.upstream = upstream
        self.shared = shared
        self.upstream_reserve_prefill_lookahead = upstream_reserve_prefill_lookahead
        self.upstream_handle_blocked_waiting_request = (
            upstream_handle_blocked_waiting_request
        )
        #: The paced step in progress, if any.
        self.step: PacedStep | None = None
        #: Its prompt decisions, while prompt budgets may hold someone.
        self.prompt: PromptStep | None = None

    def paced(self) -> tuple[Callable[..., int], Callable[..., bool]]:
        """The hooks bound in paced steps, in ``STEP_HOOK_NAMES`` order."""
        return self.reserve_prefill_lookahead, self.handle_blocked_waiting_request

    def unpaced(self) -> tuple[Callable[..., int], Callable[..., bool]]:
        """Upstream's own methods, bound in free steps."""
        return (
            self.upstream_reserve_prefill_lookahead,
            self.upstream_handle_blocked_waiting_request,
        )

    def reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """A chunk cut to its user's prompt grant (``prompt_gate``), then a
        step that samples takes one token of its user's grant, or is refused.
        Called for every scheduled request of a paced step."""
        num_new_tokens = self.upstream_reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        prompt = self.prompt
        if prompt is None or num_new_tokens == 0:
            return self._reserve_output(request, num_computed_tokens, num_new_tokens)
        num_new_tokens = prompt.allowed(request, num_computed_tokens, num_new_tokens)
        if num_new_tokens == 0:
            return 0
        num_new_tokens = self._reserve_output(
            request, num_computed_tokens, num_new_tokens
        )
        if num_new_tokens:
            prompt.reserve(request, num_computed_tokens, num_new_tokens)
        return num_new_tokens

    def _reserve_output(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        step = self.step
        if step is None or num_new_tokens == 0:
            return num_new_tokens
        if step.capped:
            return self._reserve_under_active_cap(
                step, request, num_computed_tokens, num_new_tokens
            )
        if num_computed_tokens + num_new_tokens < request.num_tokens:
            return num_new_tokens  # samples nothing: nothing to charge
        if step.charge(request):
            if step.served is None:  # no speculative decoding
                return num_new_tokens
            return _with_drafts(step, request, num_computed_tokens, num_new_tokens)
        return self._refused_tokens(request, num_computed_tokens, num_new_tokens)

    def _reserve_under_active_cap(
        self,
        step: PacedStep,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
    ) -> int:
        """As above, when ``max_num_active_seqs`` is below ``max_num_seqs``: the
        cap also bounds the running loop, and throttled running requests make
        room for new ones (upstream reads the cap only in the waiting loop)."""
        upstream = self.upstream
        in_running_loop = request.status == RUNNING
        if in_running_loop and step.running_granted >= upstream.max_active:
            return 0
        samples = num_computed_tokens + num_new_tokens >= request.num_tokens
        if not samples or step.charge(request):
            step.running_granted += in_running_loop
            if samples and step.served is not None:
                return _with_drafts(step, request, num_computed_tokens, num_new_tokens)
            return num_new_tokens
        allowed = self._refused_tokens(request, num_computed_tokens, num_new_tokens)
        if in_running_loop:
            if allowed:
                step.running_granted += 1
            else:
                step.running_throttled += 1
                upstream.set_active_cap(
                    min(upstream.slots, upstream.max_active + step.running_throttled)
                )
        return allowed

    def _refused_tokens(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """Tokens a refused request may still compute: with chunked prefill, a
        prefill up to its second-to-last position, cut as upstream cuts chunks
        of a hybrid model (ending on a Mamba block boundary); otherwise none."""
        upstream = self.upstream
        if not upstream.chunked_prefill:
            return 0
        allowed = max(
            0,
            min(
                num_new_tokens,
                refused_prefill_end(request, num_computed_tokens) - num_computed_tokens,
            ),
        )
        if allowed and upstream.mamba_aligned:
            return upstream.mamba_aligned_split(request, num_computed_tokens, allowed)
        return allowed

    def encoder_window(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """The tokens upstream schedules a multimodal request's encoder inputs
        for (called just before it does): a step that would sample but will be
        refused is cut here to its refused prefill, so that no encoder budget,
        compute or cache goes to items the step leaves out. The refusal is
        counted here; ``reserve_prefill_lookahead`` then sees a step that
        samples nothing. A step refused outright (0 tokens) is left whole:
        upstream drops its encoder inputs with it. A chunk is first cut to
        its user's prompt grant, for the same reason."""
        prompt = self.prompt
        if prompt is not None and num_new_tokens:
            num_new_tokens = (
                prompt.allowed(request, num_computed_tokens, num_new_tokens)
                or num_new_tokens
            )
        step = self.step
        if (
            step is None
            or step.shadow
            or num_computed_tokens + num_new_tokens < request.num_tokens
            or (
                step.capped
                and request.status == RUNNING
                and step.running_granted >= self.upstream.max_active
            )
            or step.tokens_left(step.book.user(request.request_id))
        ):
            return num_new_tokens
        allowed = self._refused_tokens(request, num_computed_tokens, num_new_tokens)
        if allowed and not step.charge(request):
            return allowed
        return num_new_tokens

    def handle_blocked_waiting_request(self, request: Request) -> bool:
        """A waiting request of a user without budget is skipped here (False),
        unless it may take a slot for a prefill that stops short of sampling."""
        if not self.upstream_handle_blocked_waiting_request(request):
            return False
        prompt = self.prompt
        if prompt is not None and not prompt.admit(
            request, self.upstream.prefix_hit_tokens
        ):
            return False
        step = self.step
        if step is None or step.shadow:
            return True  # shadow: counted when it samples, if it would be refused
        user = step.book.user(request.request_id)
        if step.tokens_left(user):
            step.needy_pending.discard(request.request_id)
            return True
        step.refused.add(user)
        if self._may_prefill_without_budget(step, request):
            return True  # admitted; reserve_prefill_lookahead stops it short
        step.passed_over(request, user)
        return False

    def _may_prefill_without_budget(self, step: PacedStep, request: Request) -> bool:
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

    def _prefill_can_stop_short(self, request: Request) -> bool:
        """Whether a waiting request of a refused user can still be admitted for a
        prefill that ends before its sampling position.

        If not, it must be skipped here: handing it 0 tokens in
        ``reserve_prefill_lookahead`` would end the whole waiting loop.
        """
        upstream = self.upstream
        if not upstream.chunked_prefill:
            return False
        if request.num_tokens - request.num_computed_tokens <= 1:
            return False
        if upstream.mamba_aligned:
            # Hybrid: the chunk must end on a block boundary past the prefix-cache
            # hit (upstream's lookup, which it repeats right after).
            start = request.num_computed_tokens + upstream.prefix_hit_tokens(request)
            short = request.num_tokens - 1 - start
            return short > 0 and upstream.mamba_aligned_split(request, start, short) > 0
        # A prefix-cache hit covers whole blocks and at most num_tokens - 1
        # positions, so it leaves only the sampling position to compute exactly
        # when num_tokens - 1 is block-aligned.
        return not (
            upstream.prefix_caching
            and request.num_computed_tokens == 0
            and (request.num_tokens - 1) % upstream.block_size == 0
        )

    def preempting(self, request: Request) -> None:
        """``request`` is about to be preempted: its arrival time is restored and,
        if parked (sampling next, its user without budget), it is counted."""
        step = self.step
        if step is None:
            return
        unbias(step, request)
        user = step.book.user(request.request_id)
        if (
            not step.shadow  # nothing is parked in shadow mode
            and next_step_samples(request)
            and not step.has_budget(user)
        ):
            self.shared.accounting.record(user, "throttled_preemptions")


def _with_drafts(
    step: PacedStep, request: Request, num_computed_tokens: int, num_new_tokens: int
) -> int:
    """A charged request's tokens for the step, its draft tokens cut to what its
    user's grant covers (shadow mode charges what it can and cuts nothing).

    Drafts are counted as upstream counts the spec tokens it schedules. Only the
    running loop schedules real drafts: a waiting request's extra rows are
    padding, which never becomes output."""
    drafts = (
        num_computed_tokens
        + num_new_tokens
        - request.num_tokens
        - request.num_output_placeholders
    )
    if drafts <= 0 or request.status != RUNNING:
        return num_new_tokens
    given = step.charge_drafts(request, drafts)
    if step.shadow:
        return num_new_tokens
    return num_new_tokens - drafts + given
