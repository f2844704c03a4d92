"""The pure helpers behind ``benchmarks.fair_share`` and
``tests/e2e/test_e2e_fair_share.py``: when the flood has arrived, the windows read
off the server's counters, normalized shares and Jain's index."""

from __future__ import annotations

import pytest

from tools.fair_share_workload import (
    Sizes,
    WorkloadRun,
    all_served_window,
    backlogged_window,
    flood_arrived,
    jain_index,
    normalized_shares,
)

USERS = ["f", "a", "b", "c"]
DEMAND = 100


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_takes_all():
    assert jain_index([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([4.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([2.0, 1.0]) == pytest.approx(0.9)


def test_shares_are_normalized_to_an_equal_split():
    assert normalized_shares([0.25, 0.25, 0.25, 0.25]) == [1.0] * 4
    assert normalized_shares([0.4, 0.2, 0.2, 0.2]) == pytest.approx(
        [1.6, 0.8] + [0.8] * 2
    )


def test_the_served_window_runs_from_all_light_charged_to_one_done():
    reads = [
        {"f": 50},
        {"f": 60, "a": 5, "b": 5},
        {"f": 70, "a": 10, "b": 10, "c": 10},  # first: every light user charged
        {"f": 80, "a": 20, "b": 20, "c": 20},
        {"f": 90, "a": 30, "b": 30, "c": 25},  # last
        {"f": 95, "a": DEMAND, "b": 40, "c": 30},  # a has all its tokens
        {"f": 99, "a": 40, "b": 50, "c": 40},
    ]
    window = all_served_window(reads, USERS, DEMAND)
    assert window is not None
    assert (window.first, window.last) == (2, 4)
    assert window.counts == {"f": 20, "a": 20, "b": 20, "c": 15}
    assert window.shares["c"] == pytest.approx(15 / 75)


def test_the_served_window_ends_before_a_user_is_gone():
    reads = [
        {"f": 10, "a": 1, "b": 1, "c": 1},
        {"f": 20, "a": 2, "b": 2, "c": 2},
        {"a": 3, "b": 3, "c": 3},  # the flooder's counters dropped
    ]
    window = all_served_window(reads, USERS, DEMAND)
    assert window is not None and window.last == 1


def test_no_served_window_when_the_light_users_are_served_one_after_another():
    reads = [{"f": 10, "a": 5}, {"f": 10, "a": 9, "b": 3}, {"b": 9, "c": 2}]
    assert all_served_window(reads, USERS, DEMAND) is None


def test_the_backlogged_window_starts_at_the_first_read_taken_after_the_light_sent():
    reads = [{"f": 10}, {"f": 20}, {"f": 30}, {"f": 40, "a": 1}, {"a": 9, "b": 1}]
    run = WorkloadRun(
        [], 1.0, reads, [0.0, 1.0, 2.0, 3.0, 4.0], light_sent_at=0.5, sizes=Sizes()
    )
    window = backlogged_window(run, USERS, DEMAND)
    assert (window.first, window.last) == (1, 3)
    assert window.counts == {"f": 20, "a": 1, "b": 0, "c": 0}


def metrics(running: int, waiting: int, finished: tuple[int, int]) -> str:
    """vLLM's Prometheus text with these gauges, and ``finished`` requests
    by reason (length, stop)."""
    engine = 'engine="0",model_name="tiny"'
    length, stop = finished
    return "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{engine}}} {running}.0",
            f"vllm:num_requests_waiting{{{engine}}} {waiting}.0",
            f'vllm:num_requests_waiting_by_reason{{{engine},reason="x"}} 99.0',
            f'vllm:request_success_total{{{engine},finished_reason="length"}} {length}',
            f'vllm:request_success_total{{{engine},finished_reason="stop"}} {stop}',
            f'vllm:request_success_created{{{engine},finished_reason="stop"}} 1.7e9',
        ]
    )


@pytest.mark.parametrize(
    ("running", "waiting", "finished", "arrived"),
    [
        (0, 0, (1, 2), False),  # only requests from before the flood
        (8, 10, (1, 2), False),  # 18 of 24 in the server
        (8, 16, (1, 2), True),  # all 24 queued
        (8, 8, (9, 2), True),  # 8 done: no longer 16 waiting, still arrived
        (0, 0, (25, 2), True),  # the flood is over
    ],
)
def test_the_flood_has_arrived_once_all_its_requests_reached_the_server(
    running: int, waiting: int, finished: tuple[int, int], arrived: bool
):
    assert flood_arrived(metrics(running, waiting, finished), 3.0) is arrived
