"""What a step charged, refunded and left each user, once upstream has scheduled.

- A paced step settles in ``settle_paced``: the single refund point. Every
  request charged in the step but not dispatched (KV allocation failed,
  preempted) gets its token back, with the part of each user's grant that was
  not handed out.
- A free step is charged after the fact in ``charge_free_step``: the dispatched
  sampling steps (upstream marks them ``is_prefill_chunk = False``) and their
  draft tokens, one budget batch for all users. Preempted requests were never
  charged, so it never refunds.

Rejected draft tokens are given back later, once the step's output is known
(``engine_ext.scheduling.drafts``).

Invariant: after either, each user's recorded headroom is what its budget
source said it had left, so the next step's kind is chosen on known facts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.step_accounting import ThrottleEpisodes
from engine_ext.scheduling.upstream import Request, first_prefill_chunk
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.budget import BudgetSource

#: No speculative drafts: ``charge_free_step``'s default.
_NO_DRAFTS: Mapping[str, list[int]] = {}


def settle_paced(
    step: PacedStep,
    dispatched: Mapping[str, int],
    accounting: Accounting,
    yielded: set[str],
    episodes: ThrottleEpisodes,
) -> int | None:
    """Refunds, charges and headroom after a paced step; returns when the
    earliest refused user has budget again if nothing was dispatched because
    of the limiter (None otherwise)."""
    now_ns = step.now_ns
    budget = step.budget
    book = step.book
    last_served = book.last_served
    refunds: dict[str, int] = {}
    drafts = step.drafts
    for request_id, user in step.charged.items():
        if request_id in dispatched:
            last_served[user] = request_id
        else:  # KV allocation failed, or preempted after being charged
            refunds[user] = refunds.get(user, 0) + 1 + drafts.get(request_id, 0)
    charged: dict[str, int] = {}
    for user, left in step.left.items():
        if left != step.granted[user]:
            charged[user] = step.granted[user] - left
        unused = left + refunds.get(user, 0)
        if unused:
            budget.refund(user, now_ns, unused)
        book.set_headroom(user, step.remaining[user] + unused)
    # Draft tokens count as charged once received (``drafts``); a request not
    # dispatched counts one token charged and refunded, as without drafts.
    for request_id, extra in drafts.items():
        user = step.charged[request_id]
        charged[user] -= extra
        if request_id not in dispatched:
            refunds[user] -= extra
    for user in book.constrained - step.left.keys():
        book.set_headroom(user, budget.available(user, now_ns))
    if yielded or episodes:
        # A dispatched sampling step ends a request's yielded state and its
        # open throttled episode.
        for request_id in step.charged:
            if request_id in dispatched:
                yielded.discard(request_id)
                episodes.dispatched(request_id, now_ns)
    accounting.record_charged(charged)
    for event, counts in (
        ("refunds", refunds),
        ("throttled_skips", step.skips),
        ("shadow_skips", step.shadow_skips),
    ):
        for user, count in counts.items():
            accounting.record(user, event, count)
    if not dispatched and step.refused:
        return min(budget.ready_at_ns(user, now_ns) for user in step.refused)
    return None


def charge_free_step(
    book: UserBook,
    budget: BudgetSource,
    accounting: Accounting,
    now_ns: int,
    *,
    running: list[Request],
    requests: Mapping[str, Request],
    dispatched: Mapping[str, int],
    set_aside: Mapping[str, int],
    scheduled_drafts: Mapping[str, list[int]] = _NO_DRAFTS,
) -> None:
    """Charges a free step's dispatched sampling steps, each 1 + its draft rows
    (``scheduled_drafts``: upstream's spec tokens scheduled per request).
    ``set_aside``: users whose live requests (that many each) were out of
    ``running`` for the step."""
    counts: Mapping[str, int]
    # Dispatched and running requests are live, so when there are as many of
    # each as live ones shown, ``running`` is exactly the dispatched requests.
    shown = len(book.user_of) - (sum(set_aside.values()) if set_aside else 0)
    if (
        len(dispatched) == shown == len(running)
        and first_prefill_chunk(running) is None
    ):
        # Every live request shown samples once (decoding, nothing waits): each
        # user is charged its live requests, with no per-request work left but
        # the check above. With all of its streams served, nothing is left to
        # rotate (ordering starts at each user's first stream, as it does
        # without an entry).
        if set_aside:
            counts = {u: n for u, n in book.live.items() if u not in set_aside}
            for user in counts:
                book.last_served.pop(user, None)
        else:
            counts = book.live
            book.last_served.clear()
    else:
        sampled = [
            request_id
            for request_id in dispatched
            if not requests[request_id].is_prefill_chunk
        ]
        # Every request reached add_request, so every one has a user. Counted
        # and remembered in C (Counter, dict.update).
        users = list(map(book.user_of.__getitem__, sampled))
        counts = Counter(users)
        book.last_served.update(zip(users, sampled, strict=True))
    # Draft rows are taken from the budget now and count as charged once
    # received (``drafts``).
    taken = counts
    if scheduled_drafts:
        with_drafts = Counter(counts)
        user_of = book.user_of
        for request_id, rows in scheduled_drafts.items():
            with_drafts[user_of[request_id]] += len(rows)
        taken = with_drafts
    if taken:
        headroom = book.headroom
        live = book.live
        step_tokens = book.step_tokens
        for user, remaining in budget.take_each(taken, now_ns).items():
            if remaining >= live.get(user, 0) * step_tokens > 0:
                headroom[user] = remaining  # still unconstrained: the common case
            else:
                book.set_headroom(user, remaining)
        accounting.record_charged(counts)
