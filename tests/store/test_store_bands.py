"""Priority bands with a global store: the limits document holds the bands and
the objectives under top-level keys of their own (``bands``, ``objectives``:
the policy document's), written only when there are some, so a table without
bands is stored byte for byte as before, and each holder's ``band`` under
``attributes`` (``pacing.policy.flat``); a policy with bands comes back from
``decode`` as it was encoded, a stored band that breaks the rules is refused,
never applied, and bands set through one engine's control plane become every
engine's band table (``store.limits_sync`` through ``SharedLimiter.policy``)."""

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
BANDS = ("interactive", "standard", "batch")


def with_bands() -> Policy:
    """Bands on every kind of holder and the default, objectives, beside the
    pieces' own attributes and a ceiling."""
    return Policy(
        mode=Mode.ENFORCE,
        fair_share=False,
        default=Limits(30, band="standard"),
        groups={
            "tier": {
                "pro": Limits(200, weight=4.0, band="interactive"),
                "free": Limits(5),
                "bulk": Limits(exempt=True, band="batch"),
            },
            "team": {"acme": Limits(60, band="interactive")},
        },
        users={
            "alice": User(Limits(10, band="batch"), {"tier": "free", "team": "acme"}),
            "bob": User(Limits(band="interactive"), {"tier": "pro"}),
            "carol": User(Limits(7, ceiling_tokens_per_second=70)),
        },
        bands=BANDS,
        objectives={"chat": "interactive", "bulk": "batch"},
    )


def test_a_policy_with_bands_round_trips_through_the_document():
    policy = with_bands()
    document = encode(policy)
    assert decode(document) == policy
    assert decode(document.encode()) == policy  # as Redis answers: bytes
    assert encode(decode(document)) == document


def test_bands_and_objectives_are_top_level_and_holders_bands_attributes():
    raw = json.loads(encode(with_bands()))
    assert raw["bands"] == list(BANDS)  # in their order: the priority
    assert raw["objectives"] == {"bulk": "batch", "chat": "interactive"}
    assert raw["default_rate"] == 30
    assert raw["tier_rates"] == {"free": 5, "pro": 200}
    assert raw["attributes"] == {
        "default": {"band": "standard"},
        "users": {
            "alice": {"band": "batch"},
            "bob": {"band": "interactive"},
            "carol": {"ceiling_tokens_per_second": 70},
        },
        "tiers": {"pro": {"band": "interactive"}, "bulk": {"band": "batch"}},
        "teams": {"acme": {"band": "interactive"}},
    }


def test_a_policy_without_bands_is_stored_byte_for_byte_as_before():
    """The document the previous version wrote for this table (computed with
    it, pasted here): no ``bands``, no ``objectives``, no ``attributes``."""
    policy = Policy(
        mode=Mode.ENFORCE,
        fair_share=False,
        default=Limits(30),
        groups={"tier": {"free": Limits(5)}},
        users={"alice": User(Limits(10), {"tier": "free"})},
    )
    document = (
        '{"default_rate": 30, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {"alice": "free"}, "mode": "enforce", "tier_rates": '
        '{"free": 5}, "user_rates": {"alice": 10}}'
    )
    assert encode(policy) == document
    assert decode(document) == policy


def test_bands_alone_without_holders_bands_are_stored_with_the_defaults_band():
    policy = Policy(
        mode=Mode.ENFORCE,
        fair_share=False,
        default=Limits(30, band="batch"),
        bands=("batch",),
    )
    raw = json.loads(encode(policy))
    assert (raw["bands"], raw["attributes"]) == (
        ["batch"],
        {"default": {"band": "batch"}},
    )
    assert "objectives" not in raw
    assert decode(encode(policy)) == policy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"attributes": {"users": {"alice": {"band": "gold"}}}},
            "limits document: users.alice.band: unknown band 'gold' (bands: "
            "interactive, standard, batch)",
        ),
        (
            {"objectives": {"chat": "gold"}},
            "limits document: objectives.chat: unknown band 'gold'",
        ),
        (
            {"attributes": {}},
            "limits document: default: needs band",
        ),
        (
            {"bands": ["a", "a"]},
            "limits document: bands[1]: 'a' appears more than once",
        ),
        ({"bands": "batch"}, "limits document: bands: must be a list of band names"),
        (
            {"objectives": ["chat"]},
            "limits document: objectives: must be an object mapping objective names",
        ),
    ],
    ids=[
        "user-unknown",
        "objective-unknown",
        "default-without",
        "duplicate",
        "bands-not-a-list",
        "objectives-not-an-object",
    ],
)
def test_a_stored_band_that_breaks_the_rules_is_refused(change, message):
    document = json.loads(
        encode(
            Policy(
                mode=Mode.ENFORCE,
                fair_share=False,
                default=Limits(30, band="standard"),
                users={"alice": User(Limits(10))},
                bands=BANDS,
            )
        )
    )
    document.update(change)
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


def test_bands_set_through_one_engine_reach_the_others_band_table(
    redis_url: str, client: redis.Redis
) -> None:
    with contextlib.ExitStack() as stack:
        first, second = (
            stack.enter_context(served_engine(redis_url)) for _ in range(2)
        )
        stub = first[2].stub
        stub.ReplaceLimitsTable(
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(
                    default=pb.DefaultLimit(tokens_per_second=10, band="standard"),
                    limits=[
                        pb.Limit(name="limits/alice", tokens_per_second=20),
                        pb.Limit(name="limits/bob", tier="tiers/pro"),
                    ],
                    tiers=[
                        pb.Tier(name="tiers/pro", tokens_per_second=50, band="batch")
                    ],
                    bands=BANDS,
                    objectives=[pb.Objective(name="chat", band="interactive")],
                )
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", band="interactive"),
                update_mask=FieldMask(paths=["band"]),
            )
        )
        shared = second[0].shared

        def bands() -> tuple[tuple[str, ...], dict[str, str]]:
            with shared.lock:
                table = shared.bands
                users = {
                    u: table.name_of(table.index_of(u, shared.limiter.tier_of(u), None))
                    for u in ("alice", "bob", "nobody")
                }
                return table.names, users

        wait_for(
            lambda: (
                bands()
                == (
                    BANDS,
                    {"alice": "interactive", "bob": "batch", "nobody": "standard"},
                )
            )
        )
        with shared.lock:
            assert dict(shared.bands.objectives) == {"chat": 0}
        state = second[2].stub.GetUserState(
            pb.GetUserStateRequest(name="userStates/bob")
        )
        assert state.band == "batch"
        document = json.loads(client.hget(KeySpace().limits, "document"))
        assert (document["bands"], document["objectives"]) == (
            list(BANDS),
            {"chat": "interactive"},
        )
        assert document["attributes"] == {
            "default": {"band": "standard"},
            "users": {"alice": {"band": "interactive"}},
            "tiers": {"pro": {"band": "batch"}},
        }
        # The default's band changed through the second engine, in the first.
        second[2].stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(band="batch"),
                update_mask=FieldMask(paths=["band"]),
            )
        )
        other = first[0].shared

        def default_band() -> str:
            with other.lock:
                table = other.bands
                return table.name_of(table.default)

        wait_for(lambda: default_band() == "batch")
        # Bands dropped through the first: gone from the second, and the
        # stored document is as it was before bands.
        first[2].stub.ReplaceLimitsTable(
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(default_tokens_per_second=10)
            )
        )
        wait_for(lambda: bands()[0] == ())
        document = json.loads(client.hget(KeySpace().limits, "document"))
        assert not {"bands", "objectives", "attributes"} & set(document)
