"""The generic control plane: every kind of rate holder (``control.kinds``) is
served by the same five verbs over a real in-process gRPC server, its messages
carry every attribute the policy lets it set, a change of one holder visits
only the users it can move, and the policy in force stays what the runtime
tables hold."""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest

from control.errors import ControlError
from control.kinds import ALL, TEAMS, TIERS, USERS, Kind
from control.service.operations import LimitsService
from pacing.fair_share_policy import policy_of as share_policy_of
from pacing.policy.model import ATTRIBUTES, RULES, Limits, policy_of
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

#: One valid value of each attribute, for every kind that may set it.
VALUES = {
    "tokens_per_second": 7,
    "exempt": True,
    "weight": 2.5,
    "prompt_tokens_per_second": 1500,
    "ceiling_tokens_per_second": 70,
    "band": "batch",
}
#: The bands of the table while ``VALUES`` are set (``band``: one of them).
BANDS = ("interactive", "batch")


@pytest.fixture
def served():
    rig = make_rig(10, {"alice": 5})
    with serving(LimitsService(rig.shared)) as served:
        served.rig = rig
        yield served


def call(served, verb: str, kind: Kind, request: object) -> object:
    plural = "s" if verb == "List" else ""
    return getattr(served.stub, f"{verb}{kind.title}{plural}")(request)


def request_of(verb: str, kind: Kind, **fields: object) -> object:
    plural = "s" if verb == "List" else ""
    return getattr(pb, f"{verb}{kind.title}{plural}Request")(**fields)


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_every_kind_message_carries_every_attribute_the_policy_lets_it_set(kind):
    message_fields = set(getattr(pb, kind.title).DESCRIPTOR.fields_by_name)
    assert set(kind.fields) <= message_fields
    assert set(kind.attributes) == set(ATTRIBUTES[kind.holder])
    assert set(kind.attributes) <= set(RULES)


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_every_kind_is_created_read_listed_updated_and_deleted_by_the_same_verbs(
    served, kind
):
    name = kind.name("h1")
    values = {a: VALUES[a] for a in kind.attributes}
    shared = served.rig.shared
    with shared.lock:  # bands, for the band to name one
        shared.policy = dataclasses.replace(
            shared.policy, default=Limits(10, band=BANDS[0]), bands=BANDS
        )
    created = call(
        served,
        "Create",
        kind,
        request_of(
            "Create",
            kind,
            **{f"{kind.resource}_id": "h1"},
            **{kind.resource: getattr(pb, kind.title)(**values)},
        ),
    )
    assert created.name == name
    assert {a: getattr(created, a) for a in values} == values
    got = call(served, "Get", kind, request_of("Get", kind, name=name))
    assert got == created
    listed = call(served, "List", kind, request_of("List", kind))
    assert name in [holder.name for holder in getattr(listed, kind.collection)]
    update = request_of(
        "Update",
        kind,
        **{kind.resource: getattr(pb, kind.title)(name=name, tokens_per_second=9)},
    )
    updated = call(served, "Update", kind, update)
    assert updated.tokens_per_second == 9
    assert updated.etag != created.etag
    call(served, "Delete", kind, request_of("Delete", kind, name=name))
    with pytest.raises(grpc.RpcError) as missing:
        call(served, "Get", kind, request_of("Get", kind, name=name))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert missing.value.details().startswith(f"'{name}' does not exist")


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_every_kind_names_its_field_in_a_bad_rate_with_the_rules_words(served, kind):
    request = request_of(
        "Create",
        kind,
        **{f"{kind.resource}_id": "h2"},
        **{kind.resource: getattr(pb, kind.title)(tokens_per_second=2_000_000)},
    )
    with pytest.raises(grpc.RpcError) as error:
        call(served, "Create", kind, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == (
        f"{kind.resource}.tokens_per_second: must be an integer in 1..1000000 "
        "(tokens per second), got 2000000"
    )


def test_a_change_of_one_user_visits_only_that_user_under_the_lock():
    rig = make_rig(10, {f"u{i}": 5 for i in range(50)})
    service = LimitsService(rig.shared)
    visited: list[list[str]] = []
    limiter = rig.shared.limiter
    replace = limiter.replace_limits

    def spy(table, now_ns, users=None):
        visited.append(list(users) if users is not None else ["<all>"])
        replace(table, now_ns, users)

    limiter.replace_limits = spy
    service.update(USERS, "limits/u3", {"tokens_per_second": 9})
    service.create(TIERS, "gold", {"tokens_per_second": 4})
    service.update(USERS, "limits/v1", {"tier": "tiers/gold"}, allow_missing=True)
    service.update(TIERS, "tiers/gold", {"tokens_per_second": 6})
    service.create(TEAMS, "acme", {"tokens_per_second": 40})
    assert visited == [["u3"], [], ["v1"], ["v1"], []]
    assert limiter.rate_of("u3") == 9
    assert limiter.rate_of("v1") == 6
    assert limiter.rate_of("u5") == 5


def runtime_policy(shared):
    """The policy the runtime tables hold, read back from them."""
    with shared.lock:
        return policy_of(
            default_rate=shared.limiter.default_rate,
            table=shared.limiter.limits(),
            teams=shared.teams.table.copy(),
            share=share_policy_of(shared.fair_share),
        )


def test_the_policy_in_force_is_what_the_runtime_holds_after_every_change():
    rig = make_rig(10, {"alice": 5})
    service = LimitsService(rig.shared)
    rng = random.Random(40)
    users, tiers, teams = ["u0", "u1", "u2", "alice"], ["t0", "t1"], ["g0", "g1"]
    changes = 0
    for _ in range(300):
        choice = rng.randrange(7)
        try:
            if choice == 0:
                service.create(TIERS, rng.choice(tiers), {"tokens_per_second": 3})
            elif choice == 1:
                service.create(TEAMS, rng.choice(teams), {"tokens_per_second": 30})
            elif choice == 2:
                values = {
                    "tokens_per_second": rng.choice([0, 4, 8]),
                    "exempt": rng.random() < 0.2,
                    "weight": rng.choice([0, 1.5]),
                    "tier": rng.choice(["", *(f"tiers/{t}" for t in tiers)]),
                    "team": rng.choice(["", *(f"teams/{t}" for t in teams)]),
                }
                service.update(
                    USERS,
                    f"limits/{rng.choice(users)}",
                    values,
                    ["*"],
                    allow_missing=True,
                )
            elif choice == 3:
                kind = rng.choice([TIERS, TEAMS])
                group = rng.choice(tiers if kind is TIERS else teams)
                service.delete(kind, kind.name(group), allow_missing=True)
            elif choice == 4:
                service.update_default("", {"tokens_per_second": rng.choice([10, 20])})
            elif choice == 5:
                service.delete(USERS, f"limits/{rng.choice(users)}", allow_missing=True)
            else:
                service.update(TIERS, f"tiers/{rng.choice(tiers)}", {"weight": 2.0})
            changes += 1
        except ControlError:
            pass  # refused: nothing changed, which the check below also covers
        assert rig.shared.policy.same_table(runtime_policy(rig.shared))
    assert changes > 100


def test_the_table_carries_the_default_with_every_attribute_it_holds(served):
    table = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    assert table.default == pb.DefaultLimit(
        name="defaultLimit", tokens_per_second=table.default_tokens_per_second
    )
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(default=pb.DefaultLimit(tokens_per_second=30))
        )
    )
    assert (replaced.default_tokens_per_second, replaced.default.tokens_per_second) == (
        30,
        30,
    )
    assert served.rig.shared.limiter.default_rate == 30
    with pytest.raises(grpc.RpcError) as error:
        served.stub.ReplaceLimitsTable(
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(
                    default_tokens_per_second=40,
                    default=pb.DefaultLimit(tokens_per_second=50),
                )
            )
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == (
        "limits_table.default.tokens_per_second: 50 differs from "
        "limits_table.default_tokens_per_second (40)"
    )
    assert served.rig.shared.limiter.default_rate == 30
