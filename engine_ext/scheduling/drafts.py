"""Speculative draft tokens: charged at dispatch, given back once rejected.

A speculative step verifies a request's draft tokens and emits 1 + the accepted
ones, so its user is charged, when the step is dispatched, for all that it may
receive: 1 + the drafts scheduled (``grants.PacedStep.charge_drafts`` cuts the
drafts to the grant; a free step's users have headroom for every draft). When
the step's output has been applied, each request's charge beyond the tokens it
actually received (drafts rejected, tokens cut by a stop condition, a step
whose request ended before its output came) is given back: the user pays for
exactly what it received. The per-user counters (``tokens charged``) count a
step's first token at dispatch, as without drafts, and its drafts once
received, so they equal the output tokens.

Invariant: every draft charge of a dispatched step is settled exactly once, by
the output of that step (steps are matched by identity, in order); a step whose
output never comes (the engine stopped) is dropped when a later step's output
arrives.

Bound: with the synchronous scheduler a step's refund is made before the next
step is charged, so the refunded state equals charging only the received tokens
at dispatch and the GCRA bound holds unchanged. With async scheduling the next
step is charged before the refund; if the user's bucket filled up in between,
the refund can leave it up to the refunded tokens above a full bucket once: at
most ``num_speculative_tokens`` per request of the user in that step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from engine_ext.scheduling.upstream import Request, SchedulerOutput
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.budget import BudgetSource


class StepCharges:
    """One dispatched step's requests charged for drafts: (request, user,
    tokens charged)."""

    __slots__ = ("charges", "outputs_before")

    def __init__(self, charges: list[tuple[Request, str, int]]) -> None:
        self.charges = charges
        #: Output tokens each request had before the step's output was applied.
        self.outputs_before: list[int] = []

    def before_output(self) -> None:
        self.outputs_before = [charge[0].num_output_tokens for charge in self.charges]

    def settle(
        self,
        budget: BudgetSource,
        accounting: Accounting,
        book: UserBook,
        now_ns: int,
    ) -> dict[str, int]:
        """Gives back what each request was charged beyond what it received,
        and counts its received drafts as charged (its first token was counted
        at dispatch; when it received nothing, that one counts as refunded).
        Returns the tokens given back per user."""
        refunds: dict[str, int] = {}
        received_drafts: dict[str, int] = {}
        for (request, user, charged), before in zip(
            self.charges, self.outputs_before, strict=True
        ):
            received = min(charged, request.num_output_tokens - before)
            if received < charged:
                refunds[user] = refunds.get(user, 0) + charged - received
            if received > 1:
                received_drafts[user] = received_drafts.get(user, 0) + received - 1
            elif received <= 0:
                accounting.record(user, "refunds")
        for user, count in refunds.items():
            budget.refund(user, now_ns, count)
            # It may have budget sooner than the wake-up time computed before.
            book.asleep_until.pop(user, None)
        accounting.record_charged(received_drafts)
        return refunds


class DraftRefunds:
    """The draft charges of the steps in flight (one, or two with async
    scheduling), in dispatch order."""

    __slots__ = ("_in_flight",)

    def __init__(self) -> None:
        self._in_flight: deque[tuple[SchedulerOutput, StepCharges]] = deque()

    def dispatched(
        self, output: SchedulerOutput, charges: list[tuple[Request, str, int]]
    ) -> None:
        """Records a dispatched step's requests charged for drafts."""
        if charges:
            self._in_flight.append((output, StepCharges(charges)))

    def take(self, output: SchedulerOutput) -> StepCharges | None:
        """The draft charges of the step whose output is about to be applied
        (None: it charged none), with each request's output tokens read now."""
        in_flight = self._in_flight
        while in_flight:
            dispatched, charges = in_flight[0]
            if dispatched is output:
                in_flight.popleft()
                charges.before_output()
                return charges
            if not _dispatched_before(in_flight, output):
                return None
            in_flight.popleft()  # its output never came
        return None

    def __len__(self) -> int:
        return len(self._in_flight)


def _dispatched_before(
    in_flight: deque[tuple[SchedulerOutput, StepCharges]], output: SchedulerOutput
) -> bool:
    """Whether ``output`` is among the steps recorded (so the ones ahead of it
    in the queue will never see their output)."""
    return any(dispatched is output for dispatched, _ in in_flight)


def paced_step_charges(
    drafts: Mapping[str, int],
    charged: Mapping[str, str],
    dispatched: Mapping[str, int],
    requests: Mapping[str, Request],
) -> list[tuple[Request, str, int]]:
    """A paced step's dispatched requests charged for drafts: 1 + the drafts."""
    return [
        (requests[request_id], charged[request_id], 1 + extra)
        for request_id, extra in drafts.items()
        if request_id in dispatched
    ]


def free_step_charges(
    scheduled_drafts: Mapping[str, list[int]],
    user_of: Mapping[str, str],
    requests: Mapping[str, Request],
) -> list[tuple[Request, str, int]]:
    """A free step's requests with draft rows scheduled: each is charged 1 + its
    rows (a waiting request's padding rows too: they are then all refunded)."""
    return [
        (requests[request_id], user_of[request_id], 1 + len(rows))
        for request_id, rows in scheduled_drafts.items()
        if rows
    ]
