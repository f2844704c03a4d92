"""The order of ``running`` for one paced step, and its undoing.

Upstream's running loop serves ``running`` in order and preempts from its
end: ``running[-1]`` under FCFS, the largest ``(priority, arrival_time)`` under
PRIORITY. For the step, each user's same-priority streams are rotated so that
the one after the last served comes first, and parked requests (sampling next,
their user without budget) go last, or have their arrival time biased under
PRIORITY so that they are the preferred victims. Invariant: after the step,
every biased arrival time is restored and ``running`` is back in its order
(``restore_order``), with the requests admitted in the step behind.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.upstream import next_step_samples

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request

#: Added to a parked request's arrival time during a step so that PRIORITY's
#: victim choice, ``max(running, key=(priority, arrival_time))``, picks it first
#: among requests of the same priority. Far beyond any real arrival time.
PRIORITY_VICTIM_BIAS_S = 1e12


def order_for_step(
    running: list[Request], step: PacedStep, *, priority_policy: bool
) -> list[Request]:
    """``running`` for this step: rotated, parked requests last (or biased under
    PRIORITY). Sets ``step.parked`` and the book's parked counts."""
    book = step.book
    groups: dict[tuple[str, int], list[int]] = {}
    for index, request in enumerate(running):
        groups.setdefault((book.user(request.request_id), request.priority), []).append(
            index
        )
    ordered = list(running)
    for (user, _), indices in groups.items():
        if len(indices) < 2:
            continue  # nothing to rotate; skip the work on the hot path
        last = book.last_served.get(user)
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
        user = book.user(request.request_id)
        if next_step_samples(request) and not step.tokens_left(user):
            parked.append(request)
            parked_counts[user] = parked_counts.get(user, 0) + 1
        else:
            active.append(request)
    book.parked_counts = parked_counts
    step.parked = parked
    if priority_policy:
        for request in parked:
            step.biased_arrival[request.request_id] = request.arrival_time
            request.arrival_time += PRIORITY_VICTIM_BIAS_S
    return active + parked


def unbias(step: PacedStep, request: Request) -> None:
    """Restores ``request``'s arrival time if the step biased it."""
    original = step.biased_arrival.pop(request.request_id, None)
    if original is not None:
        request.arrival_time = original


def restore_arrival_times(running: list[Request], step: PacedStep) -> None:
    biased = step.biased_arrival
    for request in running:
        original = biased.pop(request.request_id, None)
        if original is not None:
            request.arrival_time = original


def restore_order(running: list[Request], order: list[Request]) -> None:
    """Sorts ``running`` back into ``order``; requests admitted in the step
    (not in ``order``) stay behind, in admission order (a stable sort)."""
    rank = {id(request): i for i, request in enumerate(order)}
    running.sort(key=lambda request: rank.get(id(request), math.inf))
