"""``engine_ext.scheduling.hiding`` on its own: ``put_back`` restores
``running`` (the requests hidden or still there in their order, then any the step
admitted), and ``Hiding`` decides over a real vLLM scheduler's ``Upstream`` when
parked requests may be left out of ``running`` unnoticed: only with the settings
that let it (``allowed``), and only with KV room for every visible request's
growth (``kv_room_for``)."""

from __future__ import annotations

import pytest

from engine_ext.scheduling import ordering
from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.hiding import Hiding, put_back
from engine_ext.scheduling.upstream import Upstream
from tools.scheduler_harness import (
    SETTINGS_THAT_READ_RUNNING,
    driven_scheduler,
    make_request,
    make_scheduler,
)

T0 = 1_000_000_000_000

# -- put_back ------------------------------------------------------------------


def requests(count: int) -> list:
    return [make_request("a") for _ in range(count)]


def test_put_back_restores_the_hidden_requests_in_their_places():
    a, hidden, b, hidden_too = requests(4)
    original = [a, hidden, b, hidden_too]
    running = [a, b]
    put_back(running, original, [a, b])
    assert running == original


def test_put_back_restores_the_list_upstream_holds_not_a_copy():
    a, hidden = requests(2)
    running = [a]
    held = running
    put_back(running, [a, hidden], [a])
    assert held is running
    assert held == [a, hidden]


def test_put_back_keeps_requests_admitted_in_the_step_behind():
    a, hidden, new1, new2 = requests(4)
    running = [a, new1, new2]
    put_back(running, [hidden, a], [a])
    assert running == [hidden, a, new1, new2]


def test_put_back_leaves_out_a_shown_request_that_left_running_in_the_step():
    a, hidden, b, new = requests(4)
    running = [new, b]  # a was preempted, new admitted, and the order changed
    put_back(running, [a, hidden, b], [a, b])
    assert running == [hidden, b, new]


def test_put_back_without_anything_hidden_restores_the_original_order():
    a, b, c = requests(3)
    running = [c, a, b]  # reordered by upstream (e.g. a PRIORITY preemption)
    put_back(running, [a, b, c], [a, b, c])
    assert running == [a, b, c]


# -- allowed -------------------------------------------------------------------


def test_hiding_is_allowed_with_the_active_cap_at_the_slots_and_no_threshold(
    tiny_model_dir,
):
    for settings in ({}, {"max_num_seqs": 8, "max_num_active_seqs": 8}):
        scheduler = make_scheduler(tiny_model_dir, **settings)
        assert Hiding(Upstream(scheduler, scheduler.schedule), (16,)).allowed


@SETTINGS_THAT_READ_RUNNING
def test_hiding_is_not_allowed_where_upstream_reads_running(tiny_model_dir, setting):
    scheduler = make_scheduler(tiny_model_dir, **setting)
    assert not Hiding(Upstream(scheduler, scheduler.schedule), (16,)).allowed


# -- kv_room_for ---------------------------------------------------------------

# 512 tokens a step, 16-token blocks, no lookahead: n running requests may claim
# 512 // 16 + 2n blocks of one group. vLLM keeps one of num_blocks as null.


@pytest.mark.parametrize(
    ("num_blocks", "block_sizes", "requests_", "room"),
    [
        (39, (16,), 3, True),  # 38 free, 32 + 6 needed
        (39, (16,), 4, False),  # 38 free, 32 + 8 needed
        (33, (16,), 0, True),  # 32 free: the step's tokens alone
        (32, (16,), 0, False),
        (57, (16, 32), 2, True),  # 56 free, (32 + 4) + (16 + 4) needed
        (57, (16, 32), 3, False),  # 56 free, (32 + 6) + (16 + 6) needed
    ],
)
def test_kv_room_for_bounds_what_the_visible_requests_can_claim_in_one_step(
    tiny_model_dir, num_blocks, block_sizes, requests_, room
):
    scheduler = make_scheduler(tiny_model_dir, num_blocks=num_blocks)
    hiding = Hiding(Upstream(scheduler, scheduler.schedule), block_sizes)
    assert hiding.kv_room_for(requests_) is room


def test_kv_room_for_reads_the_free_blocks_as_they_are_now(tiny_model_dir):
    scheduler, driver = driven_scheduler(tiny_model_dir, False, num_blocks=41)
    hiding = Hiding(Upstream(scheduler, scheduler.schedule), (16,))
    assert hiding.kv_room_for(4)  # 40 free, 40 needed
    driver.add([make_request("a", prompt_len=8)])
    driver.step()  # its prompt takes one block
    assert not hiding.kv_room_for(4)
    assert hiding.kv_room_for(3)


def test_kv_room_for_refuses_a_cache_kind_its_bound_does_not_cover(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir)
    hiding = Hiding(Upstream(scheduler, scheduler.schedule), None)
    assert not hiding.kv_room_for(0)


# -- hide_parked, on a scheduler whose requests run ------------------------------


def running_with_parked(tiny_model_dir, *, fast: int = 2, slow: int = 2, **settings):
    """A scheduler with ``fast`` then ``slow`` requests running at their sampling
    position, "slow" without budget; the step, ordered for it (parked last)."""
    scheduler, driver = driven_scheduler(tiny_model_dir, False, **settings)
    fast_requests = [make_request("fast") for _ in range(fast)]
    slow_requests = [make_request("slow") for _ in range(slow)]
    driver.add([*fast_requests, *slow_requests])
    driver.step()
    now = scheduler.clock()
    scheduler.limiter.take_up_to("slow", 1_000, now)
    step = PacedStep(now, scheduler.budget, scheduler._users, capped=False)
    ordered = ordering.order_for_step(scheduler.running, step, priority_policy=False)
    return scheduler, step, ordered, fast_requests, slow_requests


def test_parked_requests_at_the_tail_are_hidden_counted_and_put_back(tiny_model_dir):
    scheduler, step, ordered, fast, slow = running_with_parked(tiny_model_dir)
    running = scheduler.running
    running[:] = ordered
    hiding = scheduler._steps.hiding
    hidden = hiding.hide_parked(step)
    assert hidden == slow
    assert scheduler.running == fast
    # They keep their slots: the active cap drops by their number.
    assert scheduler.max_num_active_reqs == 16 - 2
    assert step.refused == {"slow"}
    assert step.skips == {"slow": 2}
    shown = list(running)
    output = scheduler._steps.upstream.schedule(False)
    assert set(output.num_scheduled_tokens) == {r.request_id for r in fast}
    put_back(running, ordered, shown)
    assert scheduler.running == ordered


def test_parked_requests_not_at_the_tail_of_running_stay(tiny_model_dir):
    scheduler, step, _, fast, slow = running_with_parked(tiny_model_dir)
    running = scheduler.running
    running[:] = [*slow, *fast]  # not in the step's order
    assert scheduler._steps.hiding.hide_parked(step) == []
    assert running == [*slow, *fast]
    assert step.skips == {}


def test_parked_requests_stay_when_upstream_reads_running(tiny_model_dir):
    scheduler, step, ordered, _, _ = running_with_parked(
        tiny_model_dir, max_num_active_seqs=8
    )
    scheduler.running[:] = ordered
    assert scheduler._steps.hiding.hide_parked(step) == []
    assert scheduler.running == ordered
    assert scheduler.max_num_active_reqs == 8


def test_all_running_parked_stay_while_a_request_waits(tiny_model_dir):
    scheduler, step, ordered, _, slow = running_with_parked(tiny_model_dir, fast=0)
    scheduler.running[:] = ordered
    scheduler.add_request(make_request("new"))
    assert scheduler._steps.hiding.hide_parked(step) == []
    assert scheduler.running == slow


def test_parked_requests_stay_without_kv_room_for_the_visible_ones(tiny_model_dir):
    # 30 blocks: 29 free, 4 taken by the prompts; 2 visible need 32 + 4.
    scheduler, step, ordered, _, _ = running_with_parked(tiny_model_dir, num_blocks=30)
    scheduler.running[:] = ordered
    assert scheduler._steps.hiding.hide_parked(step) == []
    assert scheduler.running == ordered
