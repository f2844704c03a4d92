"""``engine_ext.scheduling.users.UserBook`` on its own (pure: no vLLM).

Golden tables of operations walked in order with the book's state after them,
worked out by hand from the invariants of the module docstring, and a
hypothesis property that ``constrained`` is exactly the live users whose
headroom is unknown or below their live requests after any sequence of calls.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.scheduling.users import UserBook
from pacing.identity import ANONYMOUS_USER


class Op(NamedTuple):
    """One call on the book: ``add`` (request of user), ``remove`` (request),
    ``headroom`` (user, tokens), ``forget`` (forget_headroom)."""

    name: str
    args: tuple = ()
    paced: bool = True


def add(request_id: str, user: str, paced: bool = True) -> Op:
    return Op("add", (request_id, user), paced)


def remove(request_id: str, paced: bool = True) -> Op:
    return Op("remove", (request_id,), paced)


def headroom(user: str, tokens: int) -> Op:
    return Op("headroom", (user, tokens))


FORGET = Op("forget")


def apply(book: UserBook, op: Op) -> None:
    if op.name == "add":
        book.add(*op.args, paced=op.paced)
    elif op.name == "remove":
        book.remove(*op.args, paced=op.paced)
    elif op.name == "headroom":
        book.set_headroom(*op.args)
    elif op.name == "forget":
        book.forget_headroom()
    else:
        raise AssertionError(op.name)


class Want(NamedTuple):
    live: dict[str, int]
    headroom: dict[str, int]
    constrained: set[str]
    maybe_without_budget: set[str]


# (ops, state after them), each worked out by hand.
GOLDEN = {
    "a new user is constrained (headroom unknown)": (
        [add("r1", "a")],
        Want({"a": 1}, {}, {"a"}, set()),
    ),
    "the same request id twice counts once": (
        [add("r1", "a"), add("r1", "a")],
        Want({"a": 1}, {}, {"a"}, set()),
    ),
    "headroom equal to live requests: unconstrained": (
        [add("r1", "a"), add("r2", "a"), headroom("a", 2)],
        Want({"a": 2}, {"a": 2}, set(), set()),
    ),
    "headroom one below live requests: constrained": (
        [add("r1", "a"), add("r2", "a"), headroom("a", 1)],
        Want({"a": 2}, {"a": 1}, {"a"}, set()),
    ),
    "headroom 0: constrained and may lack budget": (
        [add("r1", "a"), headroom("a", 0)],
        Want({"a": 1}, {"a": 0}, {"a"}, {"a"}),
    ),
    "budget again: no longer without budget": (
        [add("r1", "a"), headroom("a", 0), headroom("a", 5)],
        Want({"a": 1}, {"a": 5}, set(), set()),
    ),
    "a new request beyond the headroom constrains again": (
        [add("r1", "a"), headroom("a", 1), add("r2", "a")],
        Want({"a": 2}, {"a": 1}, {"a"}, set()),
    ),
    "a new request within the headroom stays unconstrained": (
        [add("r1", "a"), headroom("a", 3), add("r2", "a")],
        Want({"a": 2}, {"a": 3}, set(), set()),
    ),
    "a request ending brings the live count down to the headroom": (
        [add("r1", "a"), add("r2", "a"), headroom("a", 1), remove("r2")],
        Want({"a": 1}, {"a": 1}, set(), set()),
    ),
    "a request ending leaves a user still below its headroom constrained": (
        [
            add("r1", "a"),
            add("r2", "a"),
            add("r3", "a"),
            headroom("a", 1),
            remove("r3"),
        ],
        Want({"a": 2}, {"a": 1}, {"a"}, set()),
    ),
    "the last request ending drops the user's headroom": (
        [add("r1", "a"), headroom("a", 4), remove("r1")],
        Want({}, {}, set(), set()),
    ),
    "the last request ending unconstrains the user": (
        [add("r1", "a"), remove("r1")],
        Want({}, {}, set(), set()),
    ),
    "the last request ending while without budget leaves nothing behind": (
        [add("r1", "a"), headroom("a", 0), remove("r1")],
        Want({}, {}, set(), set()),
    ),
    "headroom of a user without live requests is not kept": (
        [headroom("a", 3)],
        Want({}, {}, set(), set()),
    ),
    "a limit change constrains every live user": (
        [add("r1", "a"), add("r2", "b"), headroom("a", 9), headroom("b", 9), FORGET],
        Want({"a": 1, "b": 1}, {}, {"a", "b"}, set()),
    ),
    "removing an unknown request changes nothing": (
        [add("r1", "a"), headroom("a", 1), remove("nope")],
        Want({"a": 1}, {"a": 1}, set(), set()),
    ),
    "users are kept apart": (
        [add("r1", "a"), add("r2", "b"), headroom("a", 0), headroom("b", 1)],
        Want({"a": 1, "b": 1}, {"a": 0, "b": 1}, {"a"}, {"a"}),
    ),
}


@pytest.mark.parametrize(("ops", "want"), GOLDEN.values(), ids=GOLDEN.keys())
def test_book_state_after_each_golden_sequence(ops, want):
    book = UserBook()
    for op in ops:
        apply(book, op)
    assert book.live == want.live
    assert book.headroom == want.headroom
    assert book.constrained == want.constrained
    assert book.maybe_without_budget == want.maybe_without_budget


def test_requests_are_charged_to_their_user_and_unknown_ones_to_anonymous():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.add("r2", "b", paced=True)
    assert book.user("r1") == "a"
    assert book.user("r2") == "b"
    assert book.user("never-added") == ANONYMOUS_USER
    book.remove("r1", paced=True)
    assert book.user("r1") == ANONYMOUS_USER


def test_a_request_added_twice_is_not_counted_for_a_second_user():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.add("r1", "b", paced=True)
    assert book.user("r1") == "a"
    assert book.live == {"a": 1}
    assert book.added_since_step == {"r1": "a"}


def test_only_paced_additions_count_towards_the_engine_late_gap():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.add("r2", "a", paced=True)
    book.add("r3", "b", paced=False)
    assert book.added_since_step == {"r1": "a", "r2": "a"}
    assert book.live == {"a": 2, "b": 1}


def test_a_request_added_and_ended_within_a_gap_is_not_counted_as_added():
    """Otherwise a user with a request waiting across the gap, and another
    added and aborted in it, would look as if its only waiting request was new."""
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.added_since_step.clear()  # a step starts: r1 waits across the gap
    book.add("r2", "a", paced=True)
    book.remove("r2", paced=True)
    assert book.added_since_step == {}
    assert book.live == {"a": 1}


def test_a_users_last_request_ending_is_reported_once_when_paced():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.add("r2", "a", paced=True)
    book.remove("r1", paced=True)
    assert book.ended == []  # "a" still has r2
    book.remove("r2", paced=True)
    assert book.take_ended() == ["a"]
    assert book.take_ended() == []


def test_a_user_ending_without_pacing_is_not_reported():
    book = UserBook()
    book.add("r1", "a", paced=False)
    book.remove("r1", paced=False)
    assert book.ended == []
    assert book.live == {}


def test_a_user_that_is_back_before_the_next_step_is_not_reported_ended():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.add("r2", "b", paced=True)
    book.remove("r1", paced=True)
    book.remove("r2", paced=True)
    book.add("r3", "a", paced=True)  # "a" is back
    assert book.take_ended() == ["b"]
    assert book.ended == []


def test_the_last_request_ending_ends_the_users_sleep():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.add("r2", "b", paced=True)
    book.asleep_until.update(a=5, b=7)
    book.remove("r1", paced=True)
    assert book.asleep_until == {"b": 7}


def test_setting_headroom_ends_the_users_sleep():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.asleep_until["a"] = 5
    book.set_headroom("a", 0)
    assert "a" not in book.asleep_until


def test_a_limit_change_ends_every_sleep_and_forgets_every_headroom():
    book = UserBook()
    book.add("r1", "a", paced=True)
    book.set_headroom("a", 10)
    book.asleep_until["a"] = 5
    book.forget_headroom()
    assert book.headroom == {}
    assert book.asleep_until == {}
    assert book.constrained == {"a"}


def test_forget_idle_keeps_only_the_last_served_stream_of_kept_users():
    book = UserBook()
    book.last_served.update(a="r1", b="r2", c="r3")
    book.forget_idle({"a", "c", "not-served"})
    assert book.last_served == {"a": "r1", "c": "r3"}


# -- the invariant, over any sequence of calls --------------------------------

USERS = ("a", "b", "c")
REQUEST_IDS = tuple(f"r{i}" for i in range(6))

ops = st.lists(
    st.one_of(
        st.builds(add, st.sampled_from(REQUEST_IDS), st.sampled_from(USERS)),
        st.builds(remove, st.sampled_from(REQUEST_IDS)),
        st.builds(headroom, st.sampled_from(USERS), st.integers(0, 4)),
        st.just(FORGET),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_a_user_is_constrained_exactly_while_its_headroom_is_below_its_live_requests(
    sequence,
):
    book = UserBook()
    for op in sequence:
        apply(book, op)
        counts: dict[str, int] = {}
        for user in book.user_of.values():
            counts[user] = counts.get(user, 0) + 1
        assert book.live == counts
        assert book.headroom.keys() <= book.live.keys()
        assert book.constrained == {
            user for user, n in book.live.items() if book.headroom.get(user, -1) < n
        }
