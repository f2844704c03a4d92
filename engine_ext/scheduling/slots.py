"""Slots go to users with budget: parked requests yield their slot or KV cache.

A parked request keeps its model-runner slot and KV cache, but never at the
expense of a user with budget: when waiting requests of users with budget
cannot start because every slot (``max_num_seqs``) or the KV cache is held and
some holders are parked, parked requests are preempted first, before upstream's
loops run, with vLLM's own preemption (recomputed when they resume; prefix
caching makes that cheap):

- as many as the waiting requests need, never more than the active cap lets
  start in this step, one at a time for the KV cache (head request only);
- victims in order: lowest priority, then the user furthest from budget (latest
  ``ready_at``), then that user's most recently served stream first;
- a request that yielded is not a victim again until it has been dispatched a
  sampling step (each readmission earns at least one token: no thrashing);
- while users with budget wait for slots, no request of a user without budget is
  admitted, not even for a prefill that stops short of sampling
  (``step.spare_slots``, ``step.needy_pending``; see ``request_hooks``).

A yielded request re-enters the waiting queue at its front, so it is the next to
start once a slot is spare or its user has budget again: no user is starved.

A user whose rate is guaranteed (it has a ceiling) keeps its last running
request's slot while its next token is due within its burst: held to its rate
while others wait, it is not starved of the slot its rate needs.

Invariant: only parked requests yield, never to a request of a higher priority
value (a lower priority), and a request in ``yielded`` is never a victim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.upstream import STARTABLE, Upstream

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request


class SlotYielding:
    """Preempts parked requests for waiting requests of users with budget."""

    __slots__ = ("burst_ns", "guaranteed", "upstream", "yielded")

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        #: Requests preempted to yield their slot, until next dispatched to sample.
        self.yielded: set[str] = set()
        #: A user's ceiling (``pacing.ceilings``): nonzero, its rate is
        #: guaranteed; None: nobody's is.
        self.guaranteed: Callable[[str], int] | None = None
        #: The rate's burst: a next token due within it keeps the slot.
        self.burst_ns = 0

    def yield_for_waiting(self, step: PacedStep) -> None:
        """Preempts parked requests so that waiting requests of users with
        budget can start in this step; sets ``step.spare_slots``."""
        upstream = self.upstream
        waiting = upstream.waiting
        if not waiting:
            return
        held = upstream.held_slots()
        free = max(0, upstream.slots - held)
        parked = step.parked
        # Upstream admits at most this many (active cap, raised by the parked).
        admissible = upstream.max_active - (held - len(parked))
        wanted = min(admissible, free + len(parked))
        if wanted <= 0 or (not parked and free >= upstream.waiting_count()):
            return  # nobody can start, or everyone fits: nothing to yield
        needy = waiting_with_budget(step, waiting, limit=wanted)
        victims = self.victims(step, parked)
        yielded = 0
        for request in needy[free:wanted]:
            victim = first_yielding_to(victims, request)
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

    def victims(self, step: PacedStep, parked: list[Request]) -> list[Request]:
        """Parked requests that may yield, best victim first: lowest priority,
        then the user furthest from budget, then the user's most recently served
        stream (``parked`` is rotated, so later means served more recently)."""
        user = step.book.user
        position = {id(r): i for i, r in enumerate(parked)}
        ready = {
            name: step.budget.ready_at_ns(name, step.now_ns)
            for name in {user(r.request_id) for r in parked}
        }
        kept = self._kept_slots(step, parked, ready)
        candidates = [
            r
            for r in parked
            if r.request_id not in self.yielded
            and r.request_id not in kept
            and self.upstream.blocks_can_be_freed(r)
        ]
        candidates.sort(
            key=lambda r: (-r.priority, -ready[user(r.request_id)], -position[id(r)])
        )
        return candidates

    def _kept_slots(
        self, step: PacedStep, parked: list[Request], ready: dict[str, int]
    ) -> set[str]:
        """Parked requests that keep their slot: one of each user whose rate
        is guaranteed, whose next token is due within its burst and that has
        no other request running unparked (paced at its rate, it needs a slot
        again in a few steps)."""
        guaranteed = self.guaranteed
        if guaranteed is None:
            return set()
        user = step.book.user
        due_by = step.now_ns + self.burst_ns
        unparked = {user(r.request_id) for r in self.upstream.running} - {
            user(r.request_id) for r in parked
        }
        kept: dict[str, str] = {}
        for request in parked:  # the least recently served first
            name = user(request.request_id)
            if (
                name not in kept
                and name not in unparked
                and ready[name] <= due_by
                and guaranteed(name)
            ):
                kept[name] = request.request_id
        return set(kept.values())

    def _yield(self, victim: Request) -> None:
        self.yielded.add(victim.request_id)
        self.upstream.preempt(victim)

    def _yield_blocks_for(self, request: Request, victims: list[Request]) -> None:
        """Yields victims until the KV cache has the blocks ``request``'s first
        chunk needs (an estimate that ignores prefix-cache hits)."""
        upstream = self.upstream
        tokens = min(
            request.num_tokens - request.num_computed_tokens, upstream.token_budget
        )
        needed = -(-(tokens + upstream.lookahead_tokens) // upstream.block_size)
        while upstream.free_kv_blocks() < needed:
            victim = first_yielding_to(victims, request)
            if victim is None:
                return
            self._yield(victim)


def waiting_with_budget(
    step: PacedStep, waiting: Iterable[Request], limit: int
) -> list[Request]:
    """Up to ``limit`` waiting requests, in admission order, that could start
    now and whose user has budget."""
    user = step.book.user
    found: list[Request] = []
    for request in waiting:
        if request.status in STARTABLE and step.tokens_left(user(request.request_id)):
            found.append(request)
            if len(found) >= limit:
                break
    return found


def first_yielding_to(victims: list[Request], request: Request) -> Request | None:
    """Pops the best victim that may yield to ``request``: never one of a
    higher priority (a smaller value) than the request's own."""
    for index, victim in enumerate(victims):
        if victim.priority >= request.priority:
            return victims.pop(index)
    return None
