"""What the scheduler relies on in vLLM (``engine_ext.scheduling.upstream``):
every internal it names exists in the installed vLLM and behaves as relied on,
and no concern module of ``engine_ext.scheduling`` names a vLLM scheduler
internal or a ``Request`` field other than through that one module."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

import engine_ext.scheduling
from engine_ext.scheduling.upstream import (
    REQUEST_FIELDS,
    STEP_HOOK_NAMES,
    Upstream,
    next_step_samples,
)
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler, make_request, make_scheduler

CONCERN_MODULES = sorted(
    path
    for path in Path(engine_ext.scheduling.__file__).parent.glob("*.py")
    if path.name != "upstream.py"
)


def _attributes(path: Path) -> list[ast.Attribute]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
    ]


def _scheduler_names() -> set[str]:
    """Attribute and method names of vLLM's schedulers: their class members and
    whatever their methods set or read on ``self``."""
    names = set(dir(Scheduler)) | set(dir(AsyncScheduler))
    for cls in (Scheduler, AsyncScheduler):
        for node in ast.walk(ast.parse(inspect.getsource(cls))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return {name for name in names if not name.startswith("__")}


def _on_upstream(node: ast.Attribute) -> bool:
    """Whether ``node`` reads an attribute of an ``Upstream`` (``upstream.x`` or
    ``self.upstream.x``), the concern modules' name for it."""
    value = node.value
    if isinstance(value, ast.Name):
        return value.id == "upstream"
    return isinstance(value, ast.Attribute) and value.attr == "upstream"


def test_concern_modules_reach_vllms_scheduler_only_through_upstream():
    scheduler_names = _scheduler_names()
    facade = {name for name in dir(Upstream) if not name.startswith("_")}
    assert CONCERN_MODULES
    for path in CONCERN_MODULES:
        for node in _attributes(path):
            if node.attr in scheduler_names:
                assert node.attr in facade and _on_upstream(node), (
                    f"{path.name}:{node.lineno} names vLLM's Scheduler.{node.attr}"
                )
            assert node.attr != "_scheduler", f"{path.name}:{node.lineno}"


def test_concern_modules_read_only_the_request_fields_upstream_lists():
    request = make_request("u")
    request_names = {
        name
        for name in set(vars(request)) | set(dir(Request))
        if not name.startswith("__")
    }
    for path in CONCERN_MODULES:
        used = {node.attr for node in _attributes(path)} & request_names
        assert used <= set(REQUEST_FIELDS), (path.name, used - set(REQUEST_FIELDS))


def test_every_request_field_relied_on_exists_on_vllms_request():
    request = make_request("u")
    for field in REQUEST_FIELDS:
        assert hasattr(request, field), field
    assert request.status == RequestStatus.WAITING


def test_requests_hash_by_identity():
    first, second = make_request("u", request_id="r"), make_request("u", request_id="r")
    assert Request.__hash__ is object.__hash__
    assert Request.__eq__ is object.__eq__
    assert len({first, second}) == 2


def test_the_hooked_methods_exist_with_the_signatures_relied_on():
    expected = {
        "_reserve_prefill_lookahead": [
            "self",
            "request",
            "num_computed_tokens",
            "num_new_tokens",
        ],
        "_handle_blocked_waiting_request": ["self", "request"],
    }
    assert set(STEP_HOOK_NAMES) == set(expected)
    for name, parameters in expected.items():
        signature = inspect.signature(getattr(Scheduler, name))
        assert list(signature.parameters) == parameters, name
    preempt = inspect.signature(Scheduler._preempt_request)
    assert list(preempt.parameters)[:3] == ["self", "request", "timestamp"]


def test_settings_fixed_for_a_schedulers_life_are_read_from_it(tiny_model_dir):
    scheduler = make_scheduler(
        tiny_model_dir,
        max_num_seqs=6,
        max_num_active_seqs=4,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        policy="priority",
    )
    upstream = Upstream(scheduler, scheduler.schedule)
    assert upstream.slots == 6
    assert upstream.max_active == 4
    assert upstream.token_budget == 64
    assert upstream.block_size == scheduler.block_size
    assert upstream.lookahead_tokens == scheduler.num_lookahead_tokens
    assert upstream.priority_policy
    assert upstream.chunked_prefill
    assert upstream.long_prefill_threshold
    assert not upstream.prefix_caching


@MODES
def test_running_is_read_through_when_upstream_replaces_it(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(tiny_model_dir, async_scheduling)
    upstream = Upstream(scheduler, scheduler.schedule)
    requests = [make_request("u", max_tokens=3) for _ in range(2)]
    driver.add(requests)
    driver.run(1)
    assert upstream.running is scheduler.running
    assert upstream.running == requests
    driver.run(8)  # both finish: update_from_output replaces ``running``
    assert upstream.running is scheduler.running
    assert upstream.running == []


def test_counts_and_caps_are_those_of_the_scheduler(tiny_model_dir):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, False, max_num_seqs=2, num_blocks=40
    )
    upstream = Upstream(scheduler, scheduler.schedule)
    free_at_start = upstream.free_kv_blocks()
    assert not upstream.anything_waits()
    driver.add(make_request("u", prompt_len=40) for _ in range(3))
    assert upstream.anything_waits()
    assert upstream.waiting_count() == 3
    driver.run(1)
    assert upstream.held_slots() == 2  # the slots are full
    assert upstream.waiting_count() == 1
    assert upstream.free_kv_blocks() < free_at_start
    assert set(upstream.requests()) == {r.request_id for r in scheduler.running} | {
        r.request_id for r in scheduler.waiting
    }
    upstream.set_active_cap(1)
    assert scheduler.max_num_active_reqs == 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempting_frees_the_slot_and_the_kv_blocks(tiny_model_dir, async_scheduling):
    scheduler, driver = driven_scheduler(tiny_model_dir, async_scheduling)
    upstream = Upstream(scheduler, scheduler.schedule)
    victim, other = make_request("u", prompt_len=40), make_request("u")
    driver.add([victim, other])
    driver.run(2)
    free_before = upstream.free_kv_blocks()
    assert upstream.blocks_can_be_freed(victim)
    upstream.preempt(victim)
    assert victim not in scheduler.running
    assert victim.status == RequestStatus.PREEMPTED
    assert victim in scheduler.waiting
    assert upstream.free_kv_blocks() > free_before


def test_a_request_samples_next_from_its_last_prefill_position_on():
    request = make_request("u", prompt_len=8)
    request.num_computed_tokens = 6
    assert not next_step_samples(request)
    request.num_computed_tokens = 7
    assert next_step_samples(request)
