"""The gateway's objective puts a request in a band, on vLLM's real Scheduler,
sync and async: the guard writes the objective beside the user, attested with
it (``output_rate_objective``); the scheduler puts the request in the band the
policy in force maps it to (``Policy.objectives``), instead of its user's. An
objective the policy does not map leaves the request in its user's band, is
counted for the user and logged once per name."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from pacing.attestation import (
    ATTESTATION_FIELD,
    KEY_BYTES,
    KEY_ENV,
    REQUEST_FIELD,
    attest,
    new_binding,
)
from pacing.identity import ANONYMOUS_USER, OBJECTIVE_FIELD
from pacing.policy.model import Limits, User
from tools.scheduler_harness import SYNC_AND_ASYNC, driven_scheduler, make_request

KEY = bytes(range(KEY_BYTES))
BANDS = ("interactive", "standard", "batch")
OBJECTIVES = {"premium": "interactive", "bulk": "batch"}
#: Each user's own band; everyone else is in ``standard``.
USERS = {"i": "interactive", "b": "batch"}
LOGGER = "vllm.engine_ext.scheduler"


@pytest.fixture(autouse=True)
def attestation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key ``vllm serve`` hands the engine core in the attested mode."""
    monkeypatch.setenv(KEY_ENV, KEY.hex())


def objective_scheduler(model_dir, async_scheduling, *, gateway=True, **kwargs):
    """A scheduler behind a gateway (user header) whose policy has three bands,
    ``USERS`` in theirs, and ``OBJECTIVES``; one slot, caps far above what the
    engine does."""
    output_rate: dict[str, object] = {
        "policy": {"default": {"tokens_per_second": 100_000}}
    }
    if gateway:
        output_rate["user_source"] = "header:x-user-id"
    scheduler, driver = driven_scheduler(
        model_dir,
        async_scheduling,
        default_rate=None,
        output_rate=output_rate,
        max_num_seqs=1,
        **kwargs,
    )
    shared = scheduler.output_rate_shared
    policy = shared.policy
    shared.policy = dataclasses.replace(
        policy,
        bands=BANDS,
        objectives=OBJECTIVES,
        default=dataclasses.replace(policy.default, band="standard"),
        users={user: User(Limits(band=band)) for user, band in USERS.items()},
    )
    return scheduler, driver


def from_gateway(user: str, objective: str | None = None, **kwargs):
    """A request as the guard writes it: the user, the gateway's objective
    (if any), a binding and their attestation."""
    request = make_request(user, **kwargs)
    extra = request.sampling_params.extra_args
    if objective is not None:
        extra[OBJECTIVE_FIELD] = objective
    binding = extra[REQUEST_FIELD] = new_binding()
    extra[ATTESTATION_FIELD] = attest(
        KEY, user, int(time.time()), binding=binding, objective=objective
    )
    return request


def start_order(driver, requests, steps: int = 200) -> list[str]:
    """The request ids of ``requests`` (added), in the order their first
    step came; each has ended by the last step."""
    started: list[str] = []
    for _ in range(steps):
        output = driver.step()
        started += [
            rid for rid in output.num_scheduled_tokens if rid not in set(started)
        ]
    driver.settle()
    assert all(r.is_finished() for r in requests)
    return started


@SYNC_AND_ASYNC
def test_a_mapped_objective_orders_the_request_in_its_band(
    tiny_model_dir, async_scheduling
):
    """One slot: a standard user's ``premium`` request starts before everyone
    else's, an interactive user's ``bulk`` one after every standard one; the
    same users' requests without an objective stay in their own bands."""
    scheduler, driver = objective_scheduler(tiny_model_dir, async_scheduling)
    standard = [from_gateway("s", max_tokens=4) for _ in range(2)]
    bulk = from_gateway("i", "bulk", max_tokens=4)
    premium = from_gateway("s", "premium", max_tokens=4)
    interactive = from_gateway("i", max_tokens=4)
    requests = [*standard, bulk, premium, interactive]
    driver.add(requests)
    bands = scheduler._steps.bands
    assert [scheduler.user_of(r) for r in (bulk, premium)] == ["i", "s"]
    assert bands.request_band == {
        bulk.request_id: BANDS.index("batch"),
        premium.request_id: BANDS.index("interactive"),
    }
    order = start_order(driver, requests)
    assert order == [
        premium.request_id,  # interactive by its objective; arrived first
        interactive.request_id,
        *(r.request_id for r in standard),
        bulk.request_id,  # batch by its objective
    ]
    assert bands.request_band == {}  # forgotten as each ended
    assert scheduler.accounting.unknown_objectives_total == 0


@SYNC_AND_ASYNC
def test_an_unknown_objective_stays_in_its_users_band_counted_and_logged_once(
    tiny_model_dir, async_scheduling, caplog
):
    """``gold`` and ``silver`` are no objective of the policy: each request
    naming one is ordered by its user's band, never raised or lowered, and
    counted for its user; each name is logged once."""
    scheduler, driver = objective_scheduler(tiny_model_dir, async_scheduling)
    batch = [from_gateway("b", "gold", max_tokens=4) for _ in range(2)]
    batch.append(from_gateway("b", "silver", max_tokens=4))
    standard = from_gateway("s", "gold", max_tokens=4)
    interactive = from_gateway("i", "silver", max_tokens=4)
    requests = [*batch, standard, interactive]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        driver.add(requests)
    accounting = scheduler.accounting
    assert accounting.unknown_objectives == {"b": 3, "s": 1, "i": 1}
    assert accounting.unknown_objectives_total == 5
    assert scheduler._steps.bands.request_band == {}
    logged = [r.getMessage() for r in caplog.records if "maps to no band" in r.message]
    assert len(logged) == 2
    assert "'gold'" in logged[0]
    assert "'silver'" in logged[1]
    order = start_order(driver, requests)
    assert order == [
        interactive.request_id,
        standard.request_id,
        *(r.request_id for r in batch),
    ]
    # Idle users are forgotten with their counters; the total stays.
    assert accounting.unknown_objectives == {}
    assert accounting.unknown_objectives_total == 5


@SYNC_AND_ASYNC
def test_objectives_follow_the_policy_in_force(tiny_model_dir, async_scheduling):
    """The policy is hot-reloaded at the engine, which the guard does not see:
    an objective mapped after start places the requests that arrive after it,
    and one the policy stops mapping is unknown again (the user's band)."""
    scheduler, driver = objective_scheduler(tiny_model_dir, async_scheduling)
    shared = scheduler.output_rate_shared
    bands = scheduler._steps.bands
    early = from_gateway("s", "gold")
    driver.add([early])
    assert bands.band_of(early) == BANDS.index("standard")
    shared.policy = dataclasses.replace(
        shared.policy, objectives={**OBJECTIVES, "gold": "interactive"}
    )
    later = from_gateway("s", "gold")
    driver.add([later])
    assert bands.band_of(later) == BANDS.index("interactive")
    assert bands.band_of(early) == BANDS.index("standard")  # placed on arrival
    shared.policy = dataclasses.replace(shared.policy, objectives={})
    last = from_gateway("b", "premium")
    driver.add([last])
    assert bands.band_of(last) == BANDS.index("batch")
    assert scheduler.accounting.unknown_objectives == {"s": 1, "b": 1}


@SYNC_AND_ASYNC
def test_an_objective_not_attested_with_its_user_places_nothing(
    tiny_model_dir, async_scheduling
):
    """A client that adds an objective to a guard-written request (past the
    guard) breaks its attestation: the request is anonymous, in the default
    band. Without a gateway source, a client-sent objective is not read."""
    scheduler, driver = objective_scheduler(tiny_model_dir, async_scheduling)
    forged = from_gateway("s")
    forged.sampling_params.extra_args[OBJECTIVE_FIELD] = "premium"
    driver.add([forged])
    assert scheduler.user_of(forged) == ANONYMOUS_USER
    assert scheduler._steps.bands.band_of(forged) == BANDS.index("standard")
    plain, plain_driver = objective_scheduler(
        tiny_model_dir, async_scheduling, gateway=False
    )
    sent = make_request("b")
    sent.sampling_params.extra_args[OBJECTIVE_FIELD] = "premium"
    plain_driver.add([sent])
    assert plain.user_of(sent) == "b"
    assert plain._steps.bands.band_of(sent) == BANDS.index("batch")
    assert plain.accounting.unknown_objectives_total == 0
