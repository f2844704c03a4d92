"""The attested mode on vLLM's real Scheduler / AsyncScheduler: a request that
reached the engine without the HTTP guard's attestation (a route, front end or
vLLM version the guard does not cover) is charged to ``__anonymous__``, or, with
a user required, finished with an error before any step and its client told."""

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
    attest,
)
from pacing.identity import ANONYMOUS_USER
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


def request_as(user: str, attestation: str | None):
    request = make_request(user)
    if attestation is not None:
        request.sampling_params.extra_args[ATTESTATION_FIELD] = attestation
    return request


@MODES
def test_an_unattested_request_is_charged_to_the_anonymous_budget(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=100_000, output_rate=GATEWAY
    )
    driver.add(
        [
            request_as("vip", attest(KEY, "vip", now())),
            request_as("victim", None),  # bypassed the guard
            request_as("victim", "0" * 64),  # forged
            request_as("victim", attest(KEY, "vip", now())),  # another user's
            # An old one, as vLLM's request log may show it.
            request_as("victim", attest(KEY, "victim", now() - LIFETIME_S - 5)),
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
    attested = request_as("vip", attest(KEY, "vip", now()))
    bypassed = request_as("victim", None)
    driver.add([attested, bypassed])
    assert bypassed.status == RequestStatus.FINISHED_ERROR
    first = scheduler.schedule()
    assert bypassed.request_id not in first.num_scheduled_tokens
    assert attested.request_id in first.num_scheduled_tokens
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
