"""Tests for ``engine_ext.scheduling.upstream_queue``: vLLM's waiting queue in
band order.

What must hold: the queue is in band order at all times, FCFS within a band;
a request put back goes to the front of its band; an arrival waits last until
``place_arrivals``; ``rebucket`` places every request again by its band now,
stably; ``refill`` puts the queue in an order within each band; removal,
length and truthiness behave as upstream's FCFS queue's.
"""

from __future__ import annotations

import pytest

from engine_ext.scheduling.upstream import Request
from engine_ext.scheduling.upstream_queue import BandedQueue
from tools.scheduler_harness import make_request


def banded(bands: dict[str, int]) -> BandedQueue:
    """A queue whose requests' bands are ``bands`` (request id -> band)."""
    return BandedQueue(lambda request: bands[request.request_id])


def ids(queue: BandedQueue) -> list[str]:
    return [request.request_id for request in queue]


def added(queue: BandedQueue, *request_ids: str) -> dict[str, Request]:
    requests = {rid: make_request("u", request_id=rid) for rid in request_ids}
    for request in requests.values():
        queue.add_request(request)
    return requests


def test_the_queue_is_in_band_order_and_fcfs_within_a_band():
    queue = banded({"b1": 2, "i1": 0, "s1": 1, "b2": 2, "i2": 0})
    added(queue, "b1", "i1", "s1", "b2", "i2")
    assert ids(queue) == ["b1", "i1", "s1", "b2", "i2"]  # not placed yet
    queue.place_arrivals()
    assert ids(queue) == ["i1", "i2", "s1", "b1", "b2"]
    assert len(queue) == 5 and queue
    assert queue.peek_request().request_id == "i1"
    popped = [queue.pop_request().request_id for _ in range(5)]
    assert popped == ["i1", "i2", "s1", "b1", "b2"]
    assert not queue and len(queue) == 0


def test_arrivals_wait_behind_every_placed_request_until_placed():
    queue = banded({"b": 2, "i": 0})
    added(queue, "b")
    queue.place_arrivals()
    added(queue, "i")
    assert ids(queue) == ["b", "i"]
    queue.place_arrivals()
    assert ids(queue) == ["i", "b"]


def test_a_request_put_back_goes_to_the_front_of_its_band():
    queue = banded({"s1": 1, "s2": 1, "b": 2, "p": 1, "q": 2})
    added(queue, "s1", "s2", "b")
    queue.place_arrivals()
    back = {rid: make_request("u", request_id=rid) for rid in ("p", "q")}
    queue.prepend_request(back["p"])
    queue.prepend_requests([back["q"]])
    assert ids(queue) == ["p", "s1", "s2", "q", "b"]
    assert len(queue) == 5
    # vLLM puts back the requests it skipped in a step in reverse: as its FCFS
    # queue, each is prepended in turn.
    first, second = queue.pop_request(), queue.pop_request()
    queue.prepend_requests([second, first])
    assert ids(queue) == ["p", "s1", "s2", "q", "b"]


def test_rebucket_places_every_request_again_stably():
    bands = {"a": 0, "b": 1, "c": 0, "d": 1, "e": 2}
    queue = banded(bands)
    added(queue, "a", "b", "c", "d")
    queue.place_arrivals()
    added(queue, "e")
    bands.update(a=1, b=0, c=1, d=0, e=0)
    queue.rebucket()
    assert ids(queue) == ["b", "d", "e", "a", "c"]
    queue.remove_request(next(r for r in queue if r.request_id == "a"))
    assert ids(queue) == ["b", "d", "e", "c"]


def test_refill_orders_within_each_band():
    queue = banded({"i1": 0, "i2": 0, "b1": 2, "b2": 2, "s": 1, "new": 0})
    requests = added(queue, "i1", "i2", "b1", "b2", "s")
    queue.place_arrivals()
    queue.refill([requests[r] for r in ("b2", "i2", "s", "b1", "i1")])
    assert ids(queue) == ["i2", "i1", "s", "b2", "b1"]
    queue.refill([requests[r] for r in ("i1", "i2", "s", "b1", "b2")])  # in order
    assert ids(queue) == ["i1", "i2", "s", "b1", "b2"]
    requests |= added(queue, "new")
    queue.refill([requests[r] for r in ("b2", "new", "i2", "s", "b1", "i1")])
    assert ids(queue) == ["new", "i2", "i1", "s", "b2", "b1"]
    assert len(queue) == 6


def test_removal_as_upstreams_queue():
    queue = banded({"a": 0, "b": 1, "c": 1, "n": 2})
    requests = added(queue, "a", "b", "c")
    queue.place_arrivals()
    late = added(queue, "n")["n"]
    stranger = make_request("u", request_id="x")
    queue.remove_requests([requests["b"], late, stranger])  # x is not queued
    assert ids(queue) == ["a", "c"]
    assert len(queue) == 2
    queue.remove_request(requests["a"])
    assert ids(queue) == ["c"]
    with pytest.raises(ValueError):
        queue.remove_request(stranger)
    assert len(queue) == 1


def test_an_empty_queue_has_nothing_to_peek_or_pop():
    queue = banded({})
    with pytest.raises(IndexError):
        queue.peek_request()
    with pytest.raises(IndexError):
        queue.pop_request()
