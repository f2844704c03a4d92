"""Ceilings with a global store: the store's flat form carries no piece for
``ceiling_tokens_per_second``, so the limits document holds the ceilings under
``attributes`` in the policy document's object form (``pacing.policy.flat``),
a policy with ceilings comes back from ``decode`` as it was encoded, a stored
ceiling below its holder's rate is refused, never applied, and ceilings set
through one engine's control plane become every engine's ceilings' table
(``store.limits_sync`` through ``SharedLimiter.policy``)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from google.protobuf.field_mask_pb2 import FieldMask

from control.service.operations import LimitsService
from pacing.modes import Mode
from pacing.policy.model import Limits, Policy, User
from pacing.settings.store import StoreSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from store.clients import connect
from store.limits_table import decode, encode
from store.redis_store import KeySpace
from store.runtime import RunningStore, attach
from tests.control_harness import Rig, Served, make_rig, serving

#: How long a change may take to reach an engine on this shared machine.
EVENTUALLY_S = 20.0


def with_ceilings() -> Policy:
    """Ceilings on every holder that may set one, beside the pieces' own
    attributes (a rate, an exemption, a weight) and a prompt rate."""
    return Policy(
        mode=Mode.ENFORCE,
        fair_share=False,
        default=Limits(30, ceiling_tokens_per_second=60),
        groups={
            "tier": {
                "pro": Limits(200, weight=4.0, ceiling_tokens_per_second=400),
                "free": Limits(5),
                "vip": Limits(exempt=True, ceiling_tokens_per_second=9),
            },
            "team": {"acme": Limits(60, ceiling_tokens_per_second=150)},
        },
        users={
            "alice": User(
                Limits(10, ceiling_tokens_per_second=25),
                {"tier": "free", "team": "acme"},
            ),
            "bob": User(Limits(ceiling_tokens_per_second=90), {"tier": "pro"}),
            "carol": User(Limits(7, prompt_tokens_per_second=70)),
        },
    )


def test_a_policy_with_ceilings_round_trips_through_the_document():
    policy = with_ceilings()
    document = encode(policy)
    assert decode(document) == policy
    assert decode(document.encode()) == policy  # as Redis answers: bytes
    assert encode(decode(document)) == document


def test_ceilings_travel_under_attributes_beside_the_pieces():
    raw = json.loads(encode(with_ceilings()))
    assert raw["default_rate"] == 30
    assert raw["user_rates"] == {"alice": 10, "carol": 7}
    assert raw["tier_rates"] == {"free": 5, "pro": 200}
    assert raw["attributes"] == {
        "default": {"ceiling_tokens_per_second": 60},
        "users": {
            "alice": {"ceiling_tokens_per_second": 25},
            "bob": {"ceiling_tokens_per_second": 90},
            "carol": {"prompt_tokens_per_second": 70},
        },
        "tiers": {
            "pro": {"ceiling_tokens_per_second": 400},
            "vip": {"ceiling_tokens_per_second": 9},
        },
        "teams": {"acme": {"ceiling_tokens_per_second": 150}},
    }


def test_a_policy_without_ceilings_is_stored_as_before():
    policy = Policy(mode=Mode.ENFORCE, fair_share=False, default=Limits(30))
    assert "attributes" not in json.loads(encode(policy))


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        (
            {"users": {"alice": {"ceiling_tokens_per_second": 5}}},
            "limits document: users.alice.ceiling_tokens_per_second: must be at "
            "least tokens_per_second (10), got 5",
        ),
        (
            {"tiers": {"pro": {"ceiling_tokens_per_second": 100}}},
            "limits document: tiers.pro.ceiling_tokens_per_second: must be at "
            "least tokens_per_second (200), got 100",
        ),
        (
            {"default": {"ceiling_tokens_per_second": 20}},
            "limits document: default.ceiling_tokens_per_second: must be at "
            "least tokens_per_second (30), got 20",
        ),
        (
            {"users": {"alice": {"ceiling_tokens_per_second": 0}}},
            "limits document: users.alice.ceiling_tokens_per_second: must be an "
            "integer in 1..1000000",
        ),
        (
            {"teams": {"acme": {"ceiling_tokens_per_second": 50}}},
            "limits document: teams.acme.ceiling_tokens_per_second: must be at "
            "least tokens_per_second (60), got 50",
        ),
    ],
    ids=["user-below", "tier-below", "default-below", "user-zero", "team-below"],
)
def test_a_stored_ceiling_that_breaks_the_rules_is_refused(attributes, message):
    document = json.loads(
        encode(
            Policy(
                mode=Mode.ENFORCE,
                fair_share=False,
                default=Limits(30),
                groups={"tier": {"pro": Limits(200)}, "team": {"acme": Limits(60)}},
                users={"alice": User(Limits(10))},
            )
        )
    )
    document["attributes"] = attributes
    with pytest.raises(ValueError) as error:
        decode(json.dumps(document))
    assert str(error.value).startswith(message)


# -- two engines on the session's real redis-server ------------------------------


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """The test's own connection to an empty database."""
    real = connect(redis_url, timeout_s=5.0)
    assert isinstance(real, redis.Redis)
    real.flushdb()
    yield real
    real.close()


@contextlib.contextmanager
def served_engine(url: str) -> Iterator[tuple[Rig, RunningStore, Served]]:
    """One engine's store runtime with its control plane on real gRPC."""
    rig = make_rig(default_rate=10)
    running = attach(rig.shared, StoreSettings(url))
    try:
        with serving(LimitsService(rig.shared, global_store=True)) as served:
            yield rig, running, served
    finally:
        running.stop()


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + EVENTUALLY_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {EVENTUALLY_S} s"
        time.sleep(0.01)


def test_ceilings_set_through_one_engine_reach_the_others_ceilings(
    redis_url: str, client: redis.Redis
) -> None:
    with contextlib.ExitStack() as stack:
        first, second = (
            stack.enter_context(served_engine(redis_url)) for _ in range(2)
        )
        stub = first[2].stub
        stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(ceiling_tokens_per_second=40),
                update_mask=FieldMask(paths=["ceiling_tokens_per_second"]),
            )
        )
        stub.CreateTier(
            pb.CreateTierRequest(
                tier_id="pro",
                tier=pb.Tier(tokens_per_second=50, ceiling_tokens_per_second=80),
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(
                    name="limits/alice",
                    tokens_per_second=20,
                    ceiling_tokens_per_second=30,
                ),
                allow_missing=True,
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/bob", tier="tiers/pro"),
                update_mask=FieldMask(paths=["tier"]),
                allow_missing=True,
            )
        )
        shared = second[0].shared

        def table() -> dict[str, int]:
            with shared.lock:
                ceilings = shared.ceilings.table
                return {u: ceilings.rate_of(u) for u in ("alice", "bob", "nobody")}

        wait_for(lambda: table() == {"alice": 30, "bob": 80, "nobody": 40})
        with shared.lock:
            assert shared.ceilings.active
        document = json.loads(client.hget(KeySpace().limits, "document"))
        assert document["attributes"] == {
            "default": {"ceiling_tokens_per_second": 40},
            "users": {"alice": {"ceiling_tokens_per_second": 30}},
            "tiers": {"pro": {"ceiling_tokens_per_second": 80}},
        }
        # Cleared through the second engine, gone from the first.
        second[2].stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(),
                update_mask=FieldMask(paths=["ceiling_tokens_per_second"]),
            )
        )
        other = first[0].shared

        def default_ceiling() -> int:
            with other.lock:
                return other.ceilings.table.rate_of("nobody")

        wait_for(lambda: default_ceiling() == 0)
