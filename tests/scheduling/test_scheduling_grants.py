"""``engine_ext.scheduling.grants.PacedStep`` on its own, over the real
``OutputRateLimiter`` and real vLLM ``Request`` objects: each user with demand
is asked once per step for a grant of at most its live requests, handed out one
token per sampling request, and a request is charged at most once per step.

At 100 tokens/s with the 100 ms burst a fresh user has 11 tokens, at 10 tokens/s
2, at 1 token/s 1 (``(burst * rate) // 1 s + 1``)."""

from __future__ import annotations

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.step_accounting import ThrottleEpisodes
from engine_ext.scheduling.users import UserBook
from pacing.identity import ANONYMOUS_USER
from pacing.limiter import OutputRateLimiter
from tools.scheduler_harness import make_request

T0 = 1_000_000_000_000


def book_with(**live: int):
    """A book where each user has that many live requests; returns it and the
    requests by user."""
    book = UserBook()
    requests = {}
    for user, count in live.items():
        requests[user] = [make_request(user) for _ in range(count)]
        for request in requests[user]:
            book.add(request.request_id, user, paced=True)
    return book, requests


def test_a_users_grant_is_at_most_its_live_requests_and_taken_once_per_step():
    limiter = OutputRateLimiter(100, {})
    book, _ = book_with(a=3)
    step = PacedStep(T0, limiter, book, capped=False)
    assert step.tokens_left("a") == 3
    assert (step.granted["a"], step.remaining["a"]) == (3, 8)
    assert limiter.available("a", T0) == 8  # 11 - 3: taken from the limiter
    assert step.tokens_left("a") == 3
    assert limiter.available("a", T0) == 8  # no second budget call


def test_a_grant_is_cut_to_what_the_user_has():
    limiter = OutputRateLimiter(10, {})
    book, _ = book_with(a=5)
    step = PacedStep(T0, limiter, book, capped=False)
    assert step.tokens_left("a") == 2
    assert (step.granted["a"], step.remaining["a"]) == (2, 0)
    assert limiter.available("a", T0) == 0


def test_a_user_without_live_requests_is_granted_at_most_one_token():
    limiter = OutputRateLimiter(100, {})
    step = PacedStep(T0, limiter, UserBook(), capped=False)
    assert step.tokens_left("nobody") == 1
    assert limiter.available("nobody", T0) == 10


def test_each_sampling_request_takes_one_token_of_its_users_grant_in_service_order():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=2, b=1)
    step = PacedStep(T0, limiter, book, capped=False)
    a0, a1 = requests["a"]
    (b0,) = requests["b"]
    assert step.charge(b0)
    assert step.charge(a1)
    assert step.charge(a0)
    assert list(step.charged.items()) == [
        (b0.request_id, "b"),
        (a1.request_id, "a"),
        (a0.request_id, "a"),
    ]
    assert step.left == {"b": 0, "a": 0}
    assert step.refused == set()


def test_a_request_is_charged_at_most_once_per_step():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=2)
    step = PacedStep(T0, limiter, book, capped=False)
    a0, _ = requests["a"]
    assert step.charge(a0)
    assert step.charge(a0)  # e.g. scheduled again after a preemption
    assert step.left["a"] == 1
    assert list(step.charged) == [a0.request_id]


def test_a_request_beyond_the_grant_is_refused_and_passed_over():
    limiter = OutputRateLimiter(10, {})  # 2 tokens
    book, requests = book_with(a=3)
    episodes = ThrottleEpisodes()
    step = PacedStep(T0, limiter, book, capped=False, episodes=episodes)
    a0, a1, a2 = requests["a"]
    assert step.charge(a0)
    assert step.charge(a1)
    assert not step.charge(a2)
    assert a2.request_id not in step.charged
    assert step.refused == {"a"}
    assert step.skips == {"a": 1}
    assert episodes.by_request[a2.request_id].since_ns == T0
    assert step.shadow_skips == {}


def test_in_shadow_mode_a_refusal_is_counted_and_the_request_runs_uncharged():
    limiter = OutputRateLimiter(10, {})  # 2 tokens
    book, requests = book_with(a=3)
    step = PacedStep(T0, limiter, book, capped=False, shadow=True)
    a0, a1, a2 = requests["a"]
    assert step.charge(a0)
    assert step.charge(a1)
    assert step.charge(a2)
    assert a2.request_id not in step.charged
    assert step.shadow_skips == {"a": 1}
    assert step.refused == set()
    assert step.skips == {}


def test_a_request_the_book_does_not_know_is_charged_to_the_anonymous_user():
    limiter = OutputRateLimiter(100, {})
    step = PacedStep(T0, limiter, UserBook(), capped=False)
    request = make_request(None)
    assert step.charge(request)
    assert step.charged == {request.request_id: ANONYMOUS_USER}
    assert limiter.available(ANONYMOUS_USER, T0) == 10


def test_a_user_whose_grant_is_spent_still_has_budget_while_tokens_remain():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=1)
    step = PacedStep(T0, limiter, book, capped=False)
    assert step.charge(requests["a"][0])
    assert step.tokens_left("a") == 0
    assert step.has_budget("a")  # 10 more beyond its grant of 1


def test_a_user_with_nothing_granted_and_nothing_remaining_has_no_budget():
    limiter = OutputRateLimiter(10, {})
    limiter.take_up_to("a", 2, T0)  # the whole bucket
    book, _ = book_with(a=1)
    step = PacedStep(T0, limiter, book, capped=False)
    assert not step.has_budget("a")
    assert (step.granted["a"], step.remaining["a"]) == (0, 0)


def test_every_request_passed_over_is_counted_for_its_user():
    limiter = OutputRateLimiter(100, {})
    book, requests = book_with(a=2, b=1)
    episodes = ThrottleEpisodes()
    step = PacedStep(T0, limiter, book, capped=False, episodes=episodes)
    for request in [*requests["a"], *requests["b"]]:
        step.passed_over(request, book.user(request.request_id))
    assert step.skips == {"a": 2, "b": 1}
    assert set(episodes.by_request) == {
        r.request_id for r in [*requests["a"], *requests["b"]]
    }
