"""Weighted fair share in the step: who is served when the engine is saturated.

With fair share on (``pacing.fair_share``: the ledger, its counters and the
lift) every step, free or paced, does these around upstream's ``schedule()``;
caps are untouched (a user without budget is not eligible):

- *Lift* (step start): users that became backlogged and eligible since the last
  step are lifted to the smallest counter of the others.
- *Slots* (step start, only when eligible requests wait that the free slots
  cannot take): a running request of user ``v`` yields its slot (vLLM's
  preemption, recomputed on resume) to a waiting request of user ``u`` when

  1. ``counter[v] - counter[u] > hysteresis`` (``v`` is ahead by more than the
     hysteresis: small differences never move a slot),
  2. ``held[v] / weight[v] > held[u] / weight[u]`` (``v`` holds more slots per
     weight than ``u``, counting the moves of this step: a step never swaps a
     slot back and forth, nor takes ``v`` below ``u``),
  3. the request has sampled ``min_run_tokens`` since it was last admitted
     (``run_floor``): every admission earns that many tokens before the
     request may yield again, so no request thrashes.

  Free slots go to the first receivers in fair order; then slots move one at
  a time, to the receiving user with the fewest slots per weight, from the
  user with the most (the one furthest ahead among equals), its request with
  the fewest computed tokens first (the cheapest recompute).
- *Order* (step start, when a slot is free or was freed): the waiting queue in
  VTC's admission order (the users' counters, each user's requests in their
  order, a request's projected prompt cost added to its user as it is
  placed), the receivers a slot was freed for first and the requests that
  yielded last (none is readmitted in the step it yielded). Requests in
  upstream's KV-holding queue are not moved.
- *Service* (step end): each scheduled request's positions computed for the
  first time are charged to its user: prompt positions at ``prompt_price``,
  positions from the last prompt token on (each samples an output token) at
  ``output_price``, over the user's weight. A prefix-cache hit is never
  computed; positions recomputed after a preemption are below the request's
  high-water mark (``high_water``), so they are not charged again.

*Teams* (``pacing.teams``) make it hierarchical: teams share the engine by
team weight, and the members of a team share its part by user weight. A
member's counter is charged over its effective weight ``w_team * w_user /
(sum of w over the team's backlogged members)``, so the team's backlogged
members together weigh ``w_team``; a user without a team is a team of one
(its own weight), which makes the one-level rules above the case without
teams. The effective weight is taken from the backlog at the step's start.

Only FCFS scheduling (``Upstream.priority_policy`` false): under PRIORITY the
queue's order is the priorities', and fair share refuses to run
(``FairShare.refusal``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator, Mapping
from itertools import pairwise, takewhile
from operator import itemgetter
from typing import TYPE_CHECKING

from engine_ext.scheduling.upstream import STARTABLE, Upstream
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.fair_share import FairShare
from pacing.identity import ANONYMOUS_USER

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request

#: Why fair share does not run under PRIORITY scheduling.
PRIORITY_REFUSAL = (
    "fair share orders admission by weighted service; --scheduling-policy "
    "priority orders it by priority: run fair share with the default fcfs policy"
)


class FairShareSteps:
    """Fair share around one scheduler's steps (the shared lock is held)."""

    __slots__ = (
        "accounting",
        "backlogged",
        "band_of",
        "banded",
        "book",
        "high_water",
        "ledger",
        "run_floor",
        "team_of",
        "team_weights",
        "tier_of",
        "upstream",
        "was_enabled",
    )

    def __init__(
        self,
        upstream: Upstream,
        ledger: FairShare,
        book: UserBook,
        accounting: Accounting,
        tier_of: Callable[[str], str | None],
        team_of: Callable[[str], str | None],
    ) -> None:
        self.upstream = upstream
        self.ledger = ledger
        self.book = book
        self.accounting = accounting
        self.tier_of = tier_of
        self.team_of = team_of
        #: team -> the summed weights of its backlogged members this step
        #: (None: not summed yet).
        self.team_weights: dict[str, float] | None = None
        if upstream.priority_policy:
            if ledger.enabled:
                raise ValueError(PRIORITY_REFUSAL)
            ledger.refusal = PRIORITY_REFUSAL
        #: request id -> positions computed at least once (charged).
        self.high_water: dict[str, int] = {}
        #: request id -> output tokens it must reach before it may yield for
        #: fair share again (absent: ``min_run_tokens``, a first admission).
        self.run_floor: dict[str, int] = {}
        #: Users backlogged and eligible at the last step's start.
        self.backlogged: set[str] = set()
        self.was_enabled = False
        #: A request's priority band (``bands``; 0 the highest), set by the
        #: steps; used while the policy has more than one band.
        self.band_of: Callable[[Request], int] | None = None
        self.banded = False

    def active(self) -> bool:
        """Whether fair share runs in this step; a switch on starts every
        counter afresh."""
        enabled = self.ledger.enabled
        if enabled and not self.was_enabled:
            self.ledger.counter.clear()
            self.backlogged = set()
        self.was_enabled = enabled
        return enabled

    def request_ended(self, request_id: str) -> None:
        self.high_water.pop(request_id, None)
        self.run_floor.pop(request_id, None)

    def preempted(self, request: Request) -> None:
        """Any preemption: the request must sample ``min_run_tokens`` after it
        resumes before it may yield for fair share."""
        self.run_floor[request.request_id] = (
            request.num_output_tokens + self.ledger.settings.min_run_tokens
        )

    # -- step start ------------------------------------------------------------

    def before_step(
        self,
        ineligible: Collection[str],
        can_start: Callable[[str], bool],
        keep: Collection[str] = (),
        *,
        banded: bool = False,
    ) -> None:
        """Lifts, yields slots and orders the waiting queue for this step.
        ``ineligible``: users that do not count as eligible while backlogged
        (for the lift and the gap); ``can_start(user)``: whether a waiting
        request of the user can start now; ``keep``: running request ids that
        never yield here."""
        book = self.book
        ledger = self.ledger
        backlogged = book.live.keys() - ineligible
        entering = backlogged - self.backlogged
        if entering:
            ledger.lift(entering, backlogged)
        self.backlogged = backlogged
        self.team_weights = None
        self.banded = banded and self.band_of is not None
        ledger.backlogged = frozenset(backlogged)
        upstream = self.upstream
        if upstream.waiting_count() == 0:
            return
        free = upstream.slots - upstream.held_slots()
        if free <= 0 and not self._slot_may_move(can_start):
            return  # nothing to admit and no slot can move: order changes nothing
        order = self._fair_order()
        user_of = book.user_of
        receivers = [
            r
            for r in order
            if r.status in STARTABLE
            and can_start(user_of.get(r.request_id, ANONYMOUS_USER))
        ]
        if not receivers:
            return
        if len(receivers) <= free:
            if free > 0:
                upstream.reorder_waiting(order)
            return
        chosen, yielded = self._yield_slots(receivers, free, keep)
        if free > 0 or yielded:
            # The slots go where they were freed for; a request that yielded
            # is not readmitted in the step it yielded.
            first = {id(r) for r in chosen}
            rest = [r for r in order if id(r) not in first]
            upstream.reorder_waiting(chosen + rest + yielded)

    def _slot_may_move(self, can_start: Callable[[str], bool]) -> bool:
        """Whether a running user is more than the hysteresis ahead of a user
        with a waiting request that can start: rule 1 for some pair, checked
        without ordering the queue (in a saturated engine most steps fail it)."""
        counter = self.ledger.counter
        user_of = self.book.user_of
        waiting_users = {
            user_of.get(r.request_id, ANONYMOUS_USER)
            for r in self.upstream.waiting
            if r.status in STARTABLE
        }
        behind = min(
            (counter.get(u, 0.0) for u in waiting_users if can_start(u)),
            default=None,
        )
        if behind is None:
            return False
        lead = max(
            (
                counter.get(user_of.get(r.request_id, ANONYMOUS_USER), 0.0)
                for r in self.upstream.running
            ),
            default=None,
        )
        return lead is not None and lead - behind > self.ledger.settings.hysteresis

    def _weight(self, user: str) -> float:
        """``user``'s effective weight: its own, or its part of its team's."""
        weights = self.ledger.weights
        weight = weights.of(user, self.tier_of(user))
        team = self.team_of(user)
        if team is None:
            return weight
        sums = self.team_weights
        if sums is None:
            sums = self.team_weights = {}
            for member in self.backlogged:
                member_team = self.team_of(member)
                if member_team is not None:
                    sums[member_team] = sums.get(member_team, 0.0) + weights.of(
                        member, self.tier_of(member)
                    )
        total = sums.get(team, 0.0)
        if user not in self.backlogged:
            total += weight
        return weights.team(team) * weight / total

    def _yield_slots(
        self, receivers: list[Request], free: int, keep: Collection[str]
    ) -> tuple[list[Request], list[Request]]:
        """Hands the free slots to the first receivers, then preempts running
        requests for the others under rules 1-3 of the module docstring, one
        slot at a time to the receiving user with the fewest slots per weight;
        returns the receivers given a slot, in that order, and the requests
        that yielded."""
        ledger = self.ledger
        counter = ledger.counter
        hysteresis = ledger.settings.hysteresis
        min_run = ledger.settings.min_run_tokens
        user_of = self.book.user_of
        upstream = self.upstream
        held: dict[str, int] = {}
        candidates: dict[str, list[Request]] = {}
        for request in upstream.running:
            request_id = request.request_id
            user = user_of.get(request_id, ANONYMOUS_USER)
            held[user] = held.get(user, 0) + 1
            floor = self.run_floor.get(request_id, min_run)
            if (
                request.num_output_tokens >= floor
                and request_id not in keep
                and upstream.blocks_can_be_freed(request)
            ):
                candidates.setdefault(user, []).append(request)
        chosen = receivers[: max(0, free)]
        if not candidates or len(chosen) == len(receivers):
            return chosen, []
        rest = receivers[len(chosen) :]
        if self.banded:
            # Slots move for fair share within the best waiting band only
            # (bands preempt across bands: ``bands``).
            band_of = self.band_of
            assert band_of is not None
            best = band_of(rest[0])
            rest = [r for r in rest if band_of(r) == best]
            candidates = {
                user: kept
                for user, requests in candidates.items()
                if (kept := [r for r in requests if band_of(r) == best])
            }
            if not candidates:
                return chosen, []
        # Counters do not change here: unless a candidate is more than the
        # hysteresis ahead of some receiver, no slot can move (rule 1).
        lead = max(counter.get(v, 0.0) for v in candidates)
        behind = min(
            counter.get(user_of.get(r.request_id, ANONYMOUS_USER), 0.0) for r in rest
        )
        if lead - behind <= hysteresis:
            return chosen, []
        pending: dict[str, list[Request]] = {}
        for request in reversed(rest):  # pop(): fair order
            pending.setdefault(
                user_of.get(request.request_id, ANONYMOUS_USER), []
            ).append(request)
        for request in chosen:
            user = user_of.get(request.request_id, ANONYMOUS_USER)
            held[user] = held.get(user, 0) + 1
        for requests in candidates.values():
            requests.sort(key=lambda r: -r.num_computed_tokens)  # pop(): fewest
        weights = {user: self._weight(user) for user in held.keys() | pending.keys()}

        def per_weight(user: str) -> float:
            return held.get(user, 0) / weights[user]

        # The receiving users by (slots per weight, counter, position in
        # ``pending``): a user is pushed again when its slots change, and an
        # entry that no longer holds its user's slots per weight, or whose user
        # left ``pending``, is skipped.
        rank = {user: i for i, user in enumerate(pending)}

        def entry(user: str) -> tuple[float, float, int, str]:
            return per_weight(user), counter.get(user, 0.0), rank[user], user

        heap = [entry(user) for user in pending]
        heapq.heapify(heap)
        # Furthest ahead first, equal counters in ``candidates``' order.
        ahead = sorted(candidates, key=lambda v: -counter.get(v, 0.0))

        def ahead_of(mine: float) -> Iterator[str]:
            """The candidates more than the hysteresis ahead of ``mine``."""
            return takewhile(lambda v: counter.get(v, 0.0) - mine > hysteresis, ahead)

        yielded: list[Request] = []
        while heap:
            weighted, mine, _, user = heapq.heappop(heap)
            if user not in pending or weighted != per_weight(user):
                continue
            victim_user = max(
                (
                    v
                    for v in ahead_of(mine)
                    if candidates[v] and v != user and per_weight(v) > weighted
                ),
                key=lambda v: (per_weight(v), counter.get(v, 0.0)),
                default=None,
            )
            if victim_user is None:
                del pending[user]
                continue
            victim = candidates[victim_user].pop()
            upstream.preempt(victim)
            self.accounting.record(victim_user, "fair_share_preemptions")
            yielded.append(victim)
            held[victim_user] -= 1
            held[user] = held.get(user, 0) + 1
            chosen.append(pending[user].pop())
            if not pending[user]:
                del pending[user]
            for moved in (user, victim_user):
                if moved in pending:
                    heapq.heappush(heap, entry(moved))
        return chosen, yielded

    def _fair_order(self) -> list[Request]:
        """The waiting queue in VTC's admission order: the user with the
        smallest projected counter first (among equals, the user whose first
        request waits first), each user's requests in their order, a request's
        prompt cost added to its user as it is placed."""
        ledger = self.ledger
        user_of = self.book.user_of
        queues: dict[str, list[Request]] = {}
        for request in self.upstream.waiting:
            user = user_of.get(request.request_id, ANONYMOUS_USER)
            queues.setdefault(user, []).append(request)
        if len(queues) < 2 and not self.banded:
            return next(iter(queues.values()), [])
        # A request's key is its user's counter projected up to it. Costs are
        # >= 0, so each user's keys never decrease and placing the smallest
        # head first is sorting on the keys; the sort is stable and ``keyed``
        # lists users by first position, each user's requests in order.
        counter = ledger.counter
        keyed: list[tuple[float, Request]] = []
        for user, requests in queues.items():
            projected = counter.get(user, 0.0)
            keyed.append((projected, requests[0]))
            if len(requests) > 1:
                weight = self._weight(user)
                for placed, request in pairwise(requests):
                    prompt_left = placed.num_prompt_tokens - placed.num_computed_tokens
                    projected += ledger.cost(max(0, prompt_left), 0, weight)
                    keyed.append((projected, request))
        if self.banded:
            band_of = self.band_of
            assert band_of is not None
            keyed.sort(key=lambda item: (band_of(item[1]), item[0]))
        else:
            keyed.sort(key=itemgetter(0))
        return [request for _, request in keyed]

    # -- step end --------------------------------------------------------------

    def charge_service(
        self, scheduled: Mapping[str, int], requests: Mapping[str, Request]
    ) -> None:
        """Charges the positions each scheduled request computed for the first
        time (upstream has advanced ``num_computed_tokens`` past them)."""
        high_water = self.high_water
        user_of = self.book.user_of
        tokens: dict[str, list[int]] = {}
        for request_id, count in scheduled.items():
            request = requests.get(request_id)
            if request is None:
                continue
            end = request.num_computed_tokens
            start = max(end - count, high_water.get(request_id, 0))
            if end <= start:
                continue
            high_water[request_id] = end
            prompt_end = request.num_prompt_tokens
            prompt = max(0, min(end, prompt_end) - start)
            output = end - max(start, prompt_end - 1)
            user = user_of.get(request_id, ANONYMOUS_USER)
            counts = tokens.get(user)
            if counts is None:
                tokens[user] = [prompt, max(0, output)]
            else:
                counts[0] += prompt
                counts[1] += max(0, output)
        ledger = self.ledger
        record = self.accounting.record
        for user, (prompt, output) in tokens.items():
            units = ledger.cost(prompt, output, self._weight(user))
            ledger.charge(user, units)
            record(user, "fair_share_service", units)

    def cleanup(self) -> None:
        """Drops idle users' counters that the lift would replace anyway."""
        self.ledger.cleanup(self.backlogged)
