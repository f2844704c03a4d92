"""Prompt budgets in the step: each user's computed prompt tokens charged as
they are scheduled, a user out of prompt budget held (``pacing.prompt_budget``).

What a chunk costs. A request's chunk ``[c, c + n)`` costs its prompt positions
not paid for yet, ``[max(c, paid), min(c + n, P))`` (``P``: its prompt tokens;
``paid``: how far its prompt is paid, kept per request). So:

- prefix-cache hits and a KV connector's tokens are never charged: upstream's
  chunk starts after them;
- recomputation after a preemption is free up to what was paid (the engine's
  choice, never the user's), and a request whose prefill ended is no longer
  tracked at all;
- output positions and speculative draft tokens cost nothing (they are not
  prompt positions); a multimodal item's placeholder positions are prompt
  positions and cost one token each (its encoder's compute is not priced);
- an aborted request keeps what its scheduled chunks cost; a request asking
  for prompt logprobs is charged what it computes, like any other.

Decisions, in paced steps (``Steps`` makes a step paced while a prompt-limited
user has unpaid prompt its known headroom may not cover; every other step
charges after the fact, ``charge_free``):

- ``admit`` (the waiting loop's skip check): a new prefill of a prompt-limited
  user is skipped for the step unless it costs nothing, or the user has no
  partial prefill and its grant covers the whole prompt or at least
  ``min_chunk`` tokens of it. One partial prefill per user is what bounds the
  KV blocks that held prefills pin: at most ``min(users, max_num_seqs) *
  ceil(max_model_len / block_size)``.
- ``allowed`` (the encoder window and ``reserve_prefill_lookahead``): a chunk
  is cut to what the user's grant covers, and a partial prefill whose grant
  is below ``min_chunk`` (or what it still needs) is held (0 tokens, in the
  running loop only). Where chunks cannot be cut (no chunked prefill, Mamba
  block alignment, multi-token-prediction lookahead: *whole* mode) a chunk
  goes whole once its user has any prompt budget and is charged at once,
  which may leave a debt of up to one chunk.
- ``reserve``: what the step will compute is taken from the grant.
- ``settle``: the one refund point: what was dispatched is charged from
  upstream's advanced positions, the rest of each grant is given back.

Bound: in any window of ``W`` seconds a user's charged prompt tokens are at
most ``(W + burst) * rate + 1`` (chunked mode), plus one chunk in whole mode.
Shadow mode cuts and holds nothing: it charges what the budget covers and
counts what enforce would have held (``prompt_shadow_holds``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine_ext.scheduling.upstream import RUNNING, Request, Upstream
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.budget import BudgetSource
from pacing.prompt_budget import PromptBudgets
from pacing.teams import TeamGrants


class PromptGate:
    """Per-request prompt payment state between steps, and the per-step
    decisions (a ``PromptStep`` while a paced step runs)."""

    __slots__ = (
        "accounting",
        "book",
        "budgets",
        "headroom",
        "held_since",
        "last_needs",
        "min_chunk",
        "paid",
        "prefilling",
        "seen_limit_changes",
        "upstream",
        "whole",
    )

    def __init__(
        self,
        upstream: Upstream,
        budgets: PromptBudgets,
        book: UserBook,
        accounting: Accounting,
    ) -> None:
        self.upstream = upstream
        self.budgets = budgets
        self.book = book
        self.accounting = accounting
        #: Whether chunks go whole (cannot be cut to a grant); see the module.
        self.whole = (
            not upstream.chunked_prefill
            or upstream.mamba_aligned
            or upstream.prefill_lookahead > 1
        )
        #: The smallest chunk a grant must cover to start or continue a
        #: prefill that it cannot finish (a KV block: no dribbling).
        self.min_chunk = max(1, upstream.block_size)
        #: request id -> request, of the live requests with unpaid prompt.
        self.prefilling: dict[str, Request] = {}
        #: request id -> prompt position up to which it is paid.
        self.paid: dict[str, int] = {}
        #: user -> prompt tokens it is known to have until its next charge.
        self.headroom: dict[str, int] = {}
        self.seen_limit_changes = -1
        #: request id -> (its user, when it was first held), while held.
        self.held_since: dict[str, tuple[str, int]] = {}
        #: ``needs()`` as ``constrained`` last found it (the step's start).
        self.last_needs: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return self.budgets.active

    def add(self, request: Request) -> None:
        """A new live request: its prompt is unpaid."""
        self.prefilling[request.request_id] = request

    def ended(self, request_id: str, clock: Callable[[], int]) -> None:
        """A request ended: what it was held counts as its user's wait."""
        if self.prefilling.pop(request_id, None) is None:
            return
        self.paid.pop(request_id, None)
        held = self.held_since.pop(request_id, None)
        if held is not None:  # the book may have forgotten the request already
            user, since = held
            self.accounting.record(user, "prompt_wait_ns", clock() - since)

    def constrained(self, now_ns: int) -> bool:
        """Whether a prompt-limited user has unpaid prompt that its headroom
        may not cover (the step must then be paced). A user's headroom is
        what it had left after its last charge, else what its budget has now."""
        budget = self.budgets.budget
        if budget.limit_changes != self.seen_limit_changes:
            self.seen_limit_changes = budget.limit_changes
            self.headroom.clear()
        needs = self.last_needs = self.needs()
        if self.held_since:
            return True
        headroom = self.headroom
        for user, need in needs.items():
            known = headroom.get(user)
            if known is None:
                known = headroom[user] = budget.available(user, now_ns)
            if need > known:
                return True
        return False

    def forget_idle(self, live: Mapping[str, int]) -> None:
        """Drops the headroom of users without live requests."""
        self.headroom = {u: h for u, h in self.headroom.items() if u in live}

    def needs(self) -> dict[str, int]:
        """Prompt-limited user -> the most its live requests may still cost.
        Forgets requests whose prefill ended uncharged (pacing off, or no
        prompt rate then)."""
        limits = self.budgets.limits
        user_of = self.book.user
        paid = self.paid
        needs: dict[str, int] = {}
        done: list[str] = []
        for request_id, request in self.prefilling.items():
            computed = request.num_computed_tokens
            prompt = request.num_prompt_tokens
            if computed >= prompt:
                done.append(request_id)
                continue
            user = user_of(request_id)
            if limits(user):
                needs[user] = (
                    needs.get(user, 0) + prompt - max(paid.get(request_id, 0), computed)
                )
        for request_id in done:
            del self.prefilling[request_id]
            paid.pop(request_id, None)
        return needs

    def begin(self, now_ns: int, *, shadow: bool) -> PromptStep:
        """The decisions of one paced step."""
        return PromptStep(self, now_ns, shadow=shadow)

    def settle(
        self,
        step: PromptStep | None,
        dispatched: Mapping[str, int],
        now_ns: int,
    ) -> int | None:
        """Charges what the step computed of each prompt (upstream has advanced
        ``num_computed_tokens`` past it), gives back what grants left and
        records headroom; returns when the earliest held user may go on if
        nothing was dispatched (None otherwise)."""
        costs = self._computed(dispatched, now_ns)
        budget = self.budgets.budget
        headroom = self.headroom
        charged: dict[str, int] = {}
        if step is not None:
            for user, granted in step.granted.items():
                cost = costs.pop(user, 0)
                remaining = step.remaining[user]
                if step.shadow and cost > granted:
                    cost = granted  # shadow: beyond the budget runs uncharged
                if cost > granted:  # whole mode: the chunk went whole
                    remaining = budget.take_each({user: cost - granted}, now_ns)[user]
                elif cost < granted:
                    budget.refund(user, now_ns, granted - cost)
                    remaining += granted - cost
                headroom[user] = remaining
                if cost:
                    charged[user] = cost
            for user, count in step.holds.items():
                self.accounting.record(
                    user,
                    "prompt_shadow_holds" if step.shadow else "prompt_held_skips",
                    count,
                )
        if costs:
            limited = self.last_needs  # only their headroom is ever read
            for user, remaining in budget.take_each(costs, now_ns).items():
                if user in limited:
                    headroom[user] = remaining
            charged.update(costs)
        for user, count in charged.items():
            self.accounting.record(user, "prompt_tokens_charged", count)
        if step is None or dispatched or not step.holds or step.shadow:
            return None
        return min(
            self.budgets.ready_for_ns(user, need, now_ns)
            for user, need in step.wanted.items()
        )

    def _computed(self, dispatched: Mapping[str, int], now_ns: int) -> dict[str, int]:
        """User -> the prompt tokens the dispatched chunks cost; advances each
        request's paid position and forgets requests whose prompt is paid."""
        prefilling = self.prefilling
        paid = self.paid
        user_of = self.book.user
        held_since = self.held_since
        costs: dict[str, int] = {}
        if len(prefilling) < len(dispatched):
            chunks = [(r, dispatched[r]) for r in prefilling if r in dispatched]
        else:
            chunks = [(r, n) for r, n in dispatched.items() if r in prefilling]
        for request_id, count in chunks:
            request = prefilling[request_id]
            end = request.num_computed_tokens
            prompt = request.num_prompt_tokens
            start = max(end - count, paid.get(request_id, 0))
            top = min(end, prompt)
            user = user_of(request_id)
            if top > start:
                costs[user] = costs.get(user, 0) + top - start
            if top >= prompt:
                del prefilling[request_id]
                paid.pop(request_id, None)
            elif top > paid.get(request_id, 0):
                paid[request_id] = top
            held = held_since.pop(request_id, None)
            if held is not None:
                self.accounting.record(user, "prompt_wait_ns", now_ns - held[1])
        return costs


class PromptStep:
    """One paced step's prompt grants, holds and partial prefills."""

    __slots__ = (
        "budget",
        "gate",
        "granted",
        "held",
        "holds",
        "left",
        "needs",
        "now_ns",
        "partials",
        "remaining",
        "shadow",
        "wanted",
    )

    def __init__(self, gate: PromptGate, now_ns: int, *, shadow: bool) -> None:
        self.gate = gate
        self.now_ns = now_ns
        self.shadow = shadow
        self.budget: BudgetSource = gate.budgets.budget
        self.left: dict[str, int] = {}  #: user -> grant not yet reserved
        self.granted: dict[str, int] = {}  #: user -> its grant
        self.remaining: dict[str, int] = {}  #: user -> available beyond it
        self.holds: dict[str, int] = {}  #: user -> requests held
        self.held: set[str] = set()  #: the requests held
        #: user -> the smallest grant that lets its first held request go on.
        self.wanted: dict[str, int] = {}
        #: Prompt-limited user -> the most its live requests may cost (found
        #: at the step's start).
        self.needs = gate.last_needs
        #: user -> its running requests with a partial prefill.
        self.partials: dict[str, int] = {}
        user_of = gate.book.user
        for request_id, request in gate.prefilling.items():
            if request.status == RUNNING and request.num_computed_tokens:
                user = user_of(request_id)
                self.partials[user] = self.partials.get(user, 0) + 1

    def _left(self, user: str) -> int:
        """``user``'s grant not yet reserved; takes it at first use (once per
        user and step), as much as its live requests may cost, with those of
        its team's other members."""
        left = self.left.get(user)
        if left is None:
            budget = self.budget
            team = budget.team_of(user) if isinstance(budget, TeamGrants) else None
            if team is None:
                taken, remaining = budget.take_up_to(
                    user, self.needs.get(user, 0), self.now_ns
                )
                left = self.left[user] = self.granted[user] = taken
                self.remaining[user] = remaining
                return left
            self._grant_team(team)
            left = self.left[user]
        return left

    def _grant_team(self, team: str) -> None:
        """Grants every member of ``team`` with unpaid prompt at once, so that
        the team's prompt tokens are split among them by weight (the team's
        fair queue, ``pacing.teams``) rather than by who asks first."""
        budget = self.budget
        assert isinstance(budget, TeamGrants)
        demands = {
            member: need
            for member, need in self.needs.items()
            if member not in self.left and budget.team_of(member) == team
        }
        for member, (taken, remaining) in budget.take_team(
            team, demands, self.now_ns
        ).items():
            self.left[member] = self.granted[member] = taken
            self.remaining[member] = remaining

    def _cost(self, request: Request, start: int, count: int) -> int:
        """What computing ``[start, start + count)`` of ``request`` costs."""
        paid = self.gate.paid.get(request.request_id, 0)
        return max(0, min(start + count, request.num_prompt_tokens) - max(start, paid))

    def _hold(self, request: Request, user: str, wanted: int) -> None:
        if request.request_id in self.held:
            return
        self.held.add(request.request_id)
        self.holds[user] = self.holds.get(user, 0) + 1
        if user not in self.wanted:
            self.wanted[user] = wanted
        if not self.shadow:
            self.gate.held_since.setdefault(request.request_id, (user, self.now_ns))

    def admit(self, request: Request, prefix_hit: Callable[[Request], int]) -> bool:
        """Whether a waiting request may be scheduled in this step."""
        gate = self.gate
        request_id = request.request_id
        if request_id not in gate.prefilling:
            return True
        user = gate.book.user(request_id)
        if not gate.budgets.limits(user):
            return True
        start = request.num_computed_tokens
        cost = self._cost(request, start, request.num_prompt_tokens)
        if cost == 0:
            return True
        left = self._left(user)
        if self.partials.get(user, 0):
            self._hold(request, user, 1)
            return self.shadow
        if cost > left and not start and not gate.whole:
            cost = self._cost(request, prefix_hit(request), request.num_prompt_tokens)
        wanted = 1 if gate.whole else min(cost, gate.min_chunk)
        if cost == 0 or left >= wanted:
            return True
        self._hold(request, user, wanted)
        return self.shadow

    def allowed(self, request: Request, start: int, count: int) -> int:
        """``count`` tokens from ``start`` cut to what the grant covers (0: the
        request is held for the step)."""
        gate = self.gate
        request_id = request.request_id
        if request_id not in gate.prefilling:
            return count
        cost = self._cost(request, start, count)
        if cost == 0:
            return count
        user = gate.book.user(request_id)
        if not gate.budgets.limits(user):
            return count
        left = self._left(user)
        if left >= cost:
            return count
        if gate.whole:
            if left:
                return count
            self._hold(request, user, 1)
            return count if self.shadow else 0
        still = self._cost(request, start, request.num_prompt_tokens)
        wanted = min(still, gate.min_chunk)
        if left < wanted:
            self._hold(request, user, wanted)
            return count if self.shadow else 0
        if self.shadow:
            return count
        paid = gate.paid.get(request_id, 0)
        return max(start, paid) + left - start

    def reserve(self, request: Request, start: int, count: int) -> None:
        """``count`` tokens from ``start`` will be computed: taken from the grant
        (settled against what is dispatched)."""
        gate = self.gate
        request_id = request.request_id
        if request_id not in gate.prefilling:
            return
        user = gate.book.user(request_id)
        left = self.left.get(user)
        if left is None:
            return  # not limited: charged when settled
        cost = self._cost(request, start, count)
        self.left[user] = max(0, left - cost)
        ends = start + count >= request.num_prompt_tokens
        if request.status == RUNNING:
            if ends and request.num_computed_tokens:
                self.partials[user] -= 1
        elif not ends:
            self.partials[user] = self.partials.get(user, 0) + 1
