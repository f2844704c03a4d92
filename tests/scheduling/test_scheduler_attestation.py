"""The attested mode on vLLM's real Scheduler / AsyncScheduler: a request that
reached the engine without the HTTP guard's attestation (a route, front end or
vLLM version the guard does not cover) is charged to ``__anonymous__``, or, with
a user required, finished with an error before any step and its client told;
an attestation holds for the chain of engine requests it was issued for."""

from __future__ import annotations

import time

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from pacing.attestation import (
    ATTESTATION_FIELD,
    KEY_BYTES,
    KEY_ENV,
    LIFETIME_S,
    REQUEST_FIELD,
    attest,
    new_binding,
)
from pacing.identity import ANONYMOUS_USER, USER_FIELD
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler, make_request, model_output_for

KEY = bytes(range(KEY_BYTES))
GATEWAY = {"user_source": "header:x-user-id"}


@pytest.fixture(autouse=True)
def attestation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key ``vllm serve`` hands the engine core in the attested mode."""
    monkeypatch.setenv(KEY_ENV, KEY.hex())


def now() -> int:
    """The guard's clock: Unix seconds."""
    return int(time.time())


def tag(user: str, issued_at: int, binding: str) -> str:
    return attest(KEY, user, issued_at, binding=binding)


def request_as(user: str, attestation: str | None, binding: str = ""):
    request = make_request(user)
    if attestation is not None:
        extra_args = request.sampling_params.extra_args
        extra_args[REQUEST_FIELD] = binding
        extra_args[ATTESTATION_FIELD] = attestation
    return request


def attested(user: str, issued_at: int | None = None):
    """A request as the guard writes it, in an HTTP request of its own."""
    binding = new_binding()
    return request_as(user, tag(user, issued_at or now(), binding), binding)


@MODES
def test_an_unattested_request_is_charged_to_the_anonymous_budget(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=100_000, output_rate=GATEWAY
    )
    vips = new_binding()
    driver.add(
        [
            request_as("vip", tag("vip", now(), vips), vips),
            request_as("victim", None),  # bypassed the guard
            request_as("victim", "0" * 64, vips),  # forged
            request_as("victim", tag("vip", now(), vips), vips),  # another user's
            # An old one, as vLLM's request log may show it.
            attested("victim", now() - LIFETIME_S - 5),
        ]
    )
    driver.run(10)
    driver.settle()
    assert scheduler.accounting.of("vip").charged > 0
    assert scheduler.accounting.of("victim").charged == 0
    # Four requests' worth: every step charged each of them once.
    anonymous = scheduler.accounting.of(ANONYMOUS_USER).charged
    assert anonymous == 4 * scheduler.accounting.of("vip").charged


@MODES
def test_with_a_user_required_an_unattested_request_ends_in_an_error_unscheduled(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        output_rate={**GATEWAY, "require_user": True},
    )
    checked = attested("vip")
    bypassed = request_as("victim", None)
    driver.add([checked, bypassed])
    assert bypassed.status == RequestStatus.FINISHED_ERROR
    first = scheduler.schedule()
    assert bypassed.request_id not in first.num_scheduled_tokens
    assert checked.request_id in first.num_scheduled_tokens
    outputs = scheduler.update_from_output(first, model_output_for(scheduler, first))
    told = [
        output
        for engine_outputs in outputs.values()
        for output in engine_outputs.outputs
        if output.request_id == bypassed.request_id
    ]
    assert [output.finish_reason for output in told] == [FinishReason.ERROR]
    assert scheduler.accounting.of("victim").charged == 0
    assert scheduler.accounting.of(ANONYMOUS_USER).charged == 0


@MODES
@pytest.mark.parametrize("require_user", [False, True], ids=["optional", "required"])
def test_a_responses_tool_loop_keeps_its_user_while_its_chain_lives(
    tiny_model_dir, async_scheduling, require_user
):
    """vLLM's Responses tool loop submits every turn with the first turn's
    sampling params: turn 2 arrives 400 s after the guard's attestation and is
    charged to the user; the same extra args replayed a lifetime after the
    chain's last request ended are not."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        output_rate={**GATEWAY, "require_user": require_user},
    )
    issued_at, start_ns = now(), driver.clock()
    scheduler.wall_clock = lambda: issued_at + (driver.clock() - start_ns) / 1e9
    binding = new_binding()
    xargs = {
        USER_FIELD: "vip",
        REQUEST_FIELD: binding,
        ATTESTATION_FIELD: tag("vip", issued_at, binding),
    }

    def turn():
        request = make_request("vip", max_tokens=20)
        request.sampling_params.extra_args.update(xargs)
        driver.add([request])
        return request

    first = turn()
    driver.run(25, step_ms=10_000)  # 20 tokens, one per 10 s step
    driver.settle()
    assert first.is_finished()
    turn_charge = scheduler.accounting.of("vip").charged
    driver.clock.advance_ms(400_000 - (driver.clock() - start_ns) / 1e6)
    second = turn()
    assert scheduler.user_of(second) == "vip"
    driver.run(25, step_ms=10_000)
    driver.settle()
    assert second.is_finished()
    assert scheduler.accounting.of("vip").charged == 2 * turn_charge
    driver.clock.advance_ms((LIFETIME_S + 1) * 1_000)
    replay = turn()
    if require_user:
        assert replay.status == RequestStatus.FINISHED_ERROR
    else:
        assert scheduler.user_of(replay) == ANONYMOUS_USER
    driver.run(5)
    driver.settle()
    anonymous = scheduler.accounting.of(ANONYMOUS_USER).charged
    assert anonymous == (0 if require_user else 5)
