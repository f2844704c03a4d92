"""``engine_ext.scheduling.settlement`` on its own, over the real limiter, the
real ``Accounting`` and real vLLM ``Request`` objects.

``settle_paced`` is the single refund point of a paced step; ``charge_free_step``
charges a free step's dispatched sampling steps after the fact. After either,
each user's recorded headroom is what the limiter says it has left.

At 100 tokens/s with the 100 ms burst a fresh user has 11 tokens, at 10 tokens/s
2, at 1 token/s 1."""

from __future__ import annotations

import pytest

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.settlement import charge_free_step, settle_paced
from engine_ext.scheduling.step_accounting import ThrottleEpisodes
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from tools.scheduler_harness import make_request

MS = 1_000_000
T0 = 1_000_000 * MS


def book_with(headroom: int | None = None, **live: int):
    """A book where each user has that many live requests (at their sampling
    position) and, unless None, that headroom; returns it and the requests by
    user."""
    book = UserBook()
    requests = {}
    for user, count in live.items():
        requests[user] = [make_request(user, prompt_len=8) for _ in range(count)]
        for request in requests[user]:
            request.num_computed_tokens = 7
            book.add(request.request_id, user, paced=True)
        if headroom is not None:
            book.set_headroom(user, headroom)
    return book, requests


def dispatched_map(requests) -> dict[str, int]:
    return {r.request_id: 1 for r in requests}


# -- settle_paced --------------------------------------------------------------

# rate, live requests of "a", which of them were charged, which dispatched ->
# accounting (charged, refunds), headroom afterwards: all by hand.
GOLDEN_PACED = {
    "all charged, all dispatched": (100, 3, [0, 1, 2], [0, 1, 2], (3, 0), 8),
    # Grant 3; a1 charged but not dispatched: refunded with the unhanded token.
    "one charged, not dispatched": (100, 3, [0, 1], [0], (2, 1), 10),
    "none charged: the whole grant back": (100, 3, [], [], (0, 0), 11),
    "nothing dispatched: every charge back": (100, 2, [0, 1], [], (2, 2), 11),
    # Grant 1 (all the bucket has) for 2 live requests.
    "the bucket spent": (1, 2, [0], [0], (1, 0), 0),
    "the last token refunded": (1, 2, [0], [], (1, 1), 1),
}


@pytest.mark.parametrize(
    ("rate", "live", "charged", "dispatched", "want_counts", "want_headroom"),
    GOLDEN_PACED.values(),
    ids=GOLDEN_PACED.keys(),
)
def test_a_paced_step_refunds_what_was_not_dispatched_and_records_what_is_left(
    rate, live, charged, dispatched, want_counts, want_headroom
):
    limiter = OutputRateLimiter(rate, {})
    accounting = Accounting()
    book, requests = book_with(a=live)
    a = requests["a"]
    step = PacedStep(T0, limiter, book, capped=False)
    step.tokens_left("a")  # the user's grant, as the first hook call takes it
    for index in charged:
        assert step.charge(a[index])
    result = settle_paced(
        step,
        dispatched_map(a[i] for i in dispatched),
        accounting,
        set(),
        ThrottleEpisodes(),
    )
    counters = accounting.of("a")
    assert (counters.charged, counters.refunds) == want_counts
    assert book.headroom["a"] == want_headroom
    assert limiter.available("a", T0) == want_headroom  # what the limiter says
    assert ("a" in book.constrained) == (want_headroom < live)
    assert ("a" in book.maybe_without_budget) == (want_headroom == 0)
    assert result is None  # nobody was refused


def test_the_last_served_stream_is_the_last_dispatched_one_in_service_order():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=3)
    a0, a1, a2 = requests["a"]
    book.last_served["a"] = "older"
    step = PacedStep(T0, limiter, book, capped=False)
    for request in (a2, a0, a1):
        step.charge(request)
    settle_paced(
        step, dispatched_map([a2, a0]), Accounting(), set(), ThrottleEpisodes()
    )
    assert book.last_served["a"] == a0.request_id  # a1 was not dispatched


def test_a_constrained_user_not_asked_in_the_step_gets_its_headroom_from_the_budget():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=1, quiet=2)
    limiter.take_up_to("quiet", 4, T0)  # 7 left
    assert "quiet" in book.constrained  # headroom unknown
    step = PacedStep(T0, limiter, book, capped=False)
    step.charge(requests["a"][0])
    settle_paced(
        step, dispatched_map(requests["a"]), Accounting(), set(), ThrottleEpisodes()
    )
    assert book.headroom["quiet"] == 7
    assert "quiet" not in book.constrained
    assert limiter.available("quiet", T0) == 7  # asked, not charged


def test_a_step_that_dispatched_nothing_because_of_refusals_says_when_to_retry():
    limiter = OutputRateLimiter(10, {})
    book, requests = book_with(a=1, b=1)
    limiter.take_up_to("a", 2, T0)  # TAT at +200 ms: ready at +100 ms
    limiter.take_each({"b": 4}, T0)  # TAT at +400 ms: ready at +300 ms
    step = PacedStep(T0, limiter, book, capped=False)
    assert not step.charge(requests["b"][0])
    assert not step.charge(requests["a"][0])
    result = settle_paced(step, {}, Accounting(), set(), ThrottleEpisodes())
    assert result == T0 + 100 * MS == limiter.ready_at_ns("a", T0)


def test_a_step_that_dispatched_something_gives_no_retry_time_despite_refusals():
    limiter = OutputRateLimiter(10, {})
    book, requests = book_with(a=1, b=1)
    limiter.take_up_to("a", 2, T0)
    step = PacedStep(T0, limiter, book, capped=False)
    assert not step.charge(requests["a"][0])
    assert step.charge(requests["b"][0])
    result = settle_paced(
        step, dispatched_map(requests["b"]), Accounting(), set(), ThrottleEpisodes()
    )
    assert result is None


def test_refusals_and_shadow_skips_are_recorded_per_user():
    limiter = OutputRateLimiter(10, {})  # 2 tokens each
    accounting = Accounting()
    book, requests = book_with(a=3, s=3)
    enforce = PacedStep(T0, limiter, book, capped=False)
    for request in requests["a"]:
        enforce.charge(request)
    settle_paced(
        enforce,
        dispatched_map(requests["a"][:2]),
        accounting,
        set(),
        ThrottleEpisodes(),
    )
    shadow = PacedStep(T0, limiter, book, capped=False, shadow=True)
    for request in requests["s"]:
        shadow.charge(request)
    settle_paced(
        shadow, dispatched_map(requests["s"]), accounting, set(), ThrottleEpisodes()
    )
    assert accounting.of("a").throttled_skips == 1
    assert accounting.of("a").shadow_skips == 0
    assert accounting.of("s").shadow_skips == 1
    assert accounting.of("s").throttled_skips == 0
    assert accounting.of("s").charged == 2  # the uncharged third ran for free


def test_a_dispatched_sampling_step_ends_the_yielded_state_and_the_open_episode():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=2)
    a0, a1 = requests["a"]
    yielded = {a0.request_id, a1.request_id}
    episodes = ThrottleEpisodes()
    episodes.passed_over(a0.request_id, T0 - 40 * MS)
    episodes.passed_over(a1.request_id, T0 - 40 * MS)
    step = PacedStep(T0, limiter, book, capped=False)
    step.charge(a0)
    step.charge(a1)
    settle_paced(step, dispatched_map([a0]), Accounting(), yielded, episodes)
    assert yielded == {a1.request_id}  # a1 was charged but not dispatched
    assert episodes.by_request[a0.request_id].since_ns is None
    assert episodes.by_request[a0.request_id].total_ns == 40 * MS
    assert episodes.by_request[a1.request_id].since_ns == T0 - 40 * MS


# -- charge_free_step ----------------------------------------------------------


def charge_free(book, limiter, accounting, running, dispatched, set_aside=None):
    everyone = {r.request_id: r for r in running}
    everyone.update({r.request_id: r for r in dispatched})
    charge_free_step(
        book,
        limiter,
        accounting,
        T0,
        running=running,
        requests=everyone,
        dispatched=dispatched_map(dispatched),
        set_aside=set_aside or {},
    )


def test_a_free_step_where_every_request_samples_charges_each_user_its_live_requests():
    limiter = OutputRateLimiter(100, {})
    accounting = Accounting()
    book, requests = book_with(headroom=11, a=2, b=3)  # nobody constrained
    running = [*requests["a"], *requests["b"]]
    book.last_served.update(a=requests["a"][0].request_id)
    charge_free(book, limiter, accounting, running, running)
    assert limiter.available("a", T0) == 9
    assert limiter.available("b", T0) == 8
    assert book.headroom == {"a": 9, "b": 8}
    assert book.constrained == set()
    assert (accounting.of("a").charged, accounting.of("b").charged) == (2, 3)
    assert book.last_served == {}  # every stream served: nothing to rotate


def test_a_free_step_charges_only_dispatched_sampling_steps():
    limiter = OutputRateLimiter(100, {})
    accounting = Accounting()
    book, requests = book_with(headroom=11, a=3)
    a0, a1, a2 = requests["a"]
    a1.is_prefill_chunk = True  # upstream marks a step that ends in the prefill
    charge_free(book, limiter, accounting, [a0, a1, a2], [a0, a1])
    assert accounting.of("a").charged == 1  # a0 only; a2 was not dispatched
    assert limiter.available("a", T0) == 10
    assert book.headroom["a"] == 10
    assert book.last_served["a"] == a0.request_id


def test_a_free_step_leaves_a_user_short_of_its_live_requests_constrained():
    limiter = OutputRateLimiter(10, {})  # 2 tokens
    accounting = Accounting()
    book, requests = book_with(headroom=2, a=2)
    charge_free(book, limiter, accounting, requests["a"], requests["a"])
    assert book.headroom["a"] == 0 == limiter.available("a", T0)
    assert book.constrained == {"a"}
    assert book.maybe_without_budget == {"a"}


def test_a_free_step_does_not_charge_the_users_set_aside_nor_forget_their_streams():
    limiter = OutputRateLimiter(100, {})
    accounting = Accounting()
    book, requests = book_with(headroom=11, a=2)
    _, sleepers = book_with(sleeper=2)
    for request in sleepers["sleeper"]:  # asleep: headroom 0, out of running
        book.add(request.request_id, "sleeper", paced=True)
    book.set_headroom("sleeper", 0)
    book.last_served.update(
        a=requests["a"][0].request_id, sleeper=sleepers["sleeper"][1].request_id
    )
    charge_free(book, limiter, accounting, requests["a"], requests["a"], {"sleeper": 2})
    assert accounting.of("sleeper").charged == 0
    assert limiter.tracked_users() == 1  # the sleeper's budget untouched
    assert accounting.of("a").charged == 2
    assert limiter.available("a", T0) == 9 == book.headroom["a"]
    assert book.headroom["sleeper"] == 0
    assert book.last_served == {"sleeper": sleepers["sleeper"][1].request_id}


def test_a_free_step_with_a_prefill_chunk_running_charges_it_nothing():
    limiter = OutputRateLimiter(100, {})
    accounting = Accounting()
    book, requests = book_with(headroom=11, a=1, b=1)
    (a0,), (b0,) = requests["a"], requests["b"]
    b0.is_prefill_chunk = True  # as many dispatched as live, but b0 samples nothing
    charge_free(book, limiter, accounting, [a0, b0], [a0, b0])
    assert accounting.of("a").charged == 1
    assert accounting.of("b").charged == 0
    assert limiter.available("b", T0) == 11
