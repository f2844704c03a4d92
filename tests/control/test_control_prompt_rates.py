"""Prompt budgets in the control plane: ``prompt_tokens_per_second`` is carried
by every RPC that writes or reads a rate holder (the default, user entries,
tiers, teams, the whole table), lands in the prompt tables at once (the
policy in force is replaced with the runtime tables, ``SharedLimiter.policy``),
is refused with the rate rule's words at the request's field, and the user and
team states show the prompt budget beside the output budget."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from control.kinds import ALL, TEAMS, TIERS, USERS, Kind
from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

PROMPT = "prompt_tokens_per_second"
#: The rate rule's words for a bad value (``pacing.limits.validate_rate``).
RULE = "must be an integer in 1..1000000 (tokens per second), got"
#: What each kind needs beside a prompt rate to exist.
EXISTS = {
    "user": {},
    "tier": {"tokens_per_second": 5},
    "team": {"tokens_per_second": 60},
}


@pytest.fixture
def served():
    rig = make_rig(10, {"alice": 5})
    with serving(LimitsService(rig.shared)) as served:
        served.rig = rig
        yield served


def call(served, verb: str, kind: Kind, **fields: object) -> object:
    plural = "s" if verb == "List" else ""
    request = getattr(pb, f"{verb}{kind.title}{plural}Request")(**fields)
    return getattr(served.stub, f"{verb}{kind.title}{plural}")(request)


def create(served, kind: Kind, holder_id: str, **values: object) -> object:
    message = getattr(pb, kind.title)(**{**EXISTS[kind.holder], **values})
    return call(
        served,
        "Create",
        kind,
        **{f"{kind.resource}_id": holder_id, kind.resource: message},
    )


def update(served, kind: Kind, holder_id: str, mask: list[str], **values) -> object:
    message = getattr(pb, kind.title)(name=kind.name(holder_id), **values)
    return call(
        served,
        "Update",
        kind,
        **{kind.resource: message},
        update_mask=FieldMask(paths=mask),
    )


def prompt_rate_in_force(shared, kind: Kind, holder_id: str) -> int | None:
    """What the prompt tables hold for the holder: the prompt rate that
    applies to a user, a tier's, a team's (shared by its members)."""
    with shared.lock:
        if kind is TEAMS:
            return shared.prompt.teams.table.rate_of(holder_id)
        if kind is TIERS:
            return shared.prompt.limiter.tier_rates.get(holder_id)
        return shared.prompt.limiter.rate_of(holder_id) or None


# -- every verb of every kind ---------------------------------------------------


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_every_kind_carries_its_prompt_rate_through_create_get_list_and_update(
    served, kind
):
    created = create(served, kind, "h1", prompt_tokens_per_second=1500)
    assert created.prompt_tokens_per_second == 1500
    got = call(served, "Get", kind, name=kind.name("h1"))
    assert got == created
    listed = getattr(call(served, "List", kind), kind.collection)
    assert [h.prompt_tokens_per_second for h in listed if h.name == got.name] == [1500]
    # A mask naming the prompt rate changes it alone.
    updated = update(served, kind, "h1", [PROMPT], prompt_tokens_per_second=2500)
    assert updated.prompt_tokens_per_second == 2500
    assert updated.tokens_per_second == created.tokens_per_second
    assert updated.etag != created.etag
    # A mask naming another field keeps it.
    kept = update(served, kind, "h1", ["tokens_per_second"], tokens_per_second=9)
    assert (kept.tokens_per_second, kept.prompt_tokens_per_second) == (9, 2500)
    # An empty mask changes the fields set: the prompt rate alone here.
    again = update(served, kind, "h1", [], prompt_tokens_per_second=3500)
    assert (again.tokens_per_second, again.prompt_tokens_per_second) == (9, 3500)


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_a_masked_zero_clears_the_prompt_rate_and_keeps_the_holder(served, kind):
    create(served, kind, "h1", tokens_per_second=7, prompt_tokens_per_second=1500)
    cleared = update(served, kind, "h1", [PROMPT])
    assert (cleared.tokens_per_second, cleared.prompt_tokens_per_second) == (7, 0)
    assert call(served, "Get", kind, name=kind.name("h1")) == cleared
    assert prompt_rate_in_force(served.rig.shared, kind, "h1") is None


def test_a_user_entry_may_hold_a_prompt_rate_alone(served):
    created = create(served, USERS, "p", prompt_tokens_per_second=1500)
    assert (created.tokens_per_second, created.prompt_tokens_per_second) == (0, 1500)
    shared = served.rig.shared
    assert prompt_rate_in_force(shared, USERS, "p") == 1500
    assert shared.limiter.rate_of("p") == 10  # the output default still applies
    # Clearing the prompt rate leaves no entry.
    update(served, USERS, "p", [PROMPT])
    with pytest.raises(grpc.RpcError) as gone:
        call(served, "Get", USERS, name="limits/p")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_prompt_rate_alone_does_not_make_a_tier(served):
    with pytest.raises(grpc.RpcError) as error:
        call(
            served,
            "Create",
            TIERS,
            tier_id="free",
            tier=pb.Tier(prompt_tokens_per_second=200),
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == f"tier.tokens_per_second: {RULE} 0"
    assert served.rig.shared.policy.groups["tier"] == {}


# -- the default ----------------------------------------------------------------


def test_the_default_limit_carries_its_prompt_rate_through_get_and_update(served):
    stub = served.stub
    assert stub.GetDefaultLimit(pb.GetDefaultLimitRequest()) == pb.DefaultLimit(
        name="defaultLimit", tokens_per_second=10
    )
    set_ = stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(prompt_tokens_per_second=3000)
        )
    )
    assert (set_.tokens_per_second, set_.prompt_tokens_per_second) == (10, 3000)
    assert stub.GetDefaultLimit(pb.GetDefaultLimitRequest()) == set_
    rate = stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=20)
        )
    )
    assert (rate.tokens_per_second, rate.prompt_tokens_per_second) == (20, 3000)
    masked = stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=99),
            update_mask=FieldMask(paths=[PROMPT]),
        )
    )
    assert (masked.tokens_per_second, masked.prompt_tokens_per_second) == (20, 0)
    table = stub.GetLimitsTable(pb.GetLimitsTableRequest())
    assert table.default == masked


def test_a_default_prompt_rate_applies_to_users_without_one_at_once(served):
    shared = served.rig.shared
    served.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(prompt_tokens_per_second=3000)
        )
    )
    create(served, USERS, "own", prompt_tokens_per_second=50)
    with shared.lock:
        assert shared.prompt.active
        assert shared.prompt.limiter.rate_of("nobody") == 3000
        assert shared.prompt.limiter.rate_of("alice") == 3000
        assert shared.prompt.limiter.rate_of("own") == 50
        assert shared.limiter.rate_of("nobody") == 10  # output untouched
    served.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(), update_mask=FieldMask(paths=[PROMPT])
        )
    )
    with shared.lock:
        assert shared.prompt.limiter.rate_of("nobody") == 0
        assert shared.prompt.limiter.rate_of("own") == 50


# -- hot reload of the prompt tables --------------------------------------------


def test_every_prompt_rate_written_lands_in_the_prompt_tables_at_once(served):
    shared = served.rig.shared
    wakes = len(served.rig.wakes)
    with pytest.raises(grpc.RpcError) as missing:  # no entry: allow_missing
        update(served, USERS, "p", [PROMPT], prompt_tokens_per_second=1500)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/p", prompt_tokens_per_second=1500),
        allow_missing=True,
    )
    assert prompt_rate_in_force(shared, USERS, "p") == 1500
    create(served, TIERS, "free", prompt_tokens_per_second=200)
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/m", tier="tiers/free"),
        allow_missing=True,
    )
    assert prompt_rate_in_force(shared, USERS, "m") == 200  # the tier's
    update(served, TIERS, "free", [PROMPT], prompt_tokens_per_second=300)
    assert prompt_rate_in_force(shared, USERS, "m") == 300
    create(served, TEAMS, "acme", prompt_tokens_per_second=4000)
    assert prompt_rate_in_force(shared, TEAMS, "acme") == 4000
    update(served, TEAMS, "acme", [PROMPT], prompt_tokens_per_second=5000)
    assert prompt_rate_in_force(shared, TEAMS, "acme") == 5000
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/m", tier="tiers/free", team="teams/acme"),
    )
    with shared.lock:
        assert shared.prompt.teams.team_of("m") == "acme"
        assert shared.prompt.limits("m")
    update(served, TEAMS, "acme", [PROMPT])
    assert prompt_rate_in_force(shared, TEAMS, "acme") is None
    with shared.lock:
        assert shared.prompt.teams.team_of("m") is None
        assert shared.teams.table.team_of("m") == "acme"  # the output team stays
    assert len(served.rig.wakes) > wakes  # each change wakes an idle engine


def test_deleting_a_holder_takes_its_prompt_rate_out_of_the_tables(served):
    shared = served.rig.shared
    create(served, USERS, "p", prompt_tokens_per_second=1500)
    create(served, TEAMS, "acme", prompt_tokens_per_second=4000)
    call(served, "Delete", USERS, name="limits/p")
    call(served, "Delete", TEAMS, name="teams/acme")
    assert prompt_rate_in_force(shared, USERS, "p") is None
    assert prompt_rate_in_force(shared, TEAMS, "acme") is None
    with shared.lock:
        assert not shared.prompt.active


# -- bad values -------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 1_000_001])
@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_a_bad_prompt_rate_is_refused_at_the_field_and_changes_nothing(
    served, kind, value
):
    create(served, kind, "h1", prompt_tokens_per_second=1500)
    etag = call(served, "Get", kind, name=kind.name("h1")).etag
    for write in (
        lambda: update(served, kind, "h1", [PROMPT], prompt_tokens_per_second=value),
        lambda: update(served, kind, "h1", [], prompt_tokens_per_second=value),
        lambda: create(served, kind, "h2", prompt_tokens_per_second=value),
    ):
        with pytest.raises(grpc.RpcError) as error:
            write()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == f"{kind.resource}.{PROMPT}: {RULE} {value}"
    assert call(served, "Get", kind, name=kind.name("h1")).etag == etag
    assert prompt_rate_in_force(served.rig.shared, kind, "h1") == 1500


@pytest.mark.parametrize("value", [-1, 1_000_001])
def test_a_bad_default_prompt_rate_is_refused_at_the_field(served, value):
    with pytest.raises(grpc.RpcError) as error:
        served.stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(prompt_tokens_per_second=value)
            )
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == f"default_limit.{PROMPT}: {RULE} {value}"
    assert served.rig.shared.policy.default.prompt_tokens_per_second is None


@pytest.mark.parametrize("value", [-1, 1_000_001])
def test_a_bad_prompt_rate_in_a_replaced_table_is_refused_at_its_field(served, value):
    before = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    for table, field in (
        (
            pb.LimitsTable(
                default_tokens_per_second=10,
                limits=[pb.Limit(name="limits/p", prompt_tokens_per_second=value)],
            ),
            "limits_table.limits[0]",
        ),
        (
            pb.LimitsTable(
                default_tokens_per_second=10,
                teams=[
                    pb.Team(
                        name="teams/acme",
                        tokens_per_second=60,
                        prompt_tokens_per_second=value,
                    )
                ],
            ),
            "limits_table.teams[0]",
        ),
        (
            pb.LimitsTable(
                default_tokens_per_second=10,
                default=pb.DefaultLimit(prompt_tokens_per_second=value),
            ),
            "limits_table.default",
        ),
    ):
        with pytest.raises(grpc.RpcError) as error:
            served.stub.ReplaceLimitsTable(
                pb.ReplaceLimitsTableRequest(limits_table=table)
            )
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == f"{field}.{PROMPT}: {RULE} {value}"
    assert served.stub.GetLimitsTable(pb.GetLimitsTableRequest()) == before


# -- the whole table ------------------------------------------------------------


def test_replace_limits_table_carries_every_prompt_rate(served):
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=10,
                default=pb.DefaultLimit(
                    tokens_per_second=10, prompt_tokens_per_second=3000
                ),
                limits=[
                    pb.Limit(
                        name="limits/p",
                        tokens_per_second=1000,
                        prompt_tokens_per_second=1500,
                    ),
                    pb.Limit(name="limits/m", tier="tiers/free", team="teams/acme"),
                ],
                tiers=[
                    pb.Tier(
                        name="tiers/free",
                        tokens_per_second=5,
                        prompt_tokens_per_second=200,
                    )
                ],
                teams=[
                    pb.Team(
                        name="teams/acme",
                        tokens_per_second=600,
                        prompt_tokens_per_second=4000,
                    )
                ],
            )
        )
    )
    got = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    assert got == replaced
    assert got.default.prompt_tokens_per_second == 3000
    assert {h.name: h.prompt_tokens_per_second for h in got.limits} == {
        "limits/m": 0,
        "limits/p": 1500,
    }
    assert [t.prompt_tokens_per_second for t in got.tiers] == [200]
    assert [t.prompt_tokens_per_second for t in got.teams] == [4000]
    shared = served.rig.shared
    with shared.lock:
        prompt = shared.prompt
        assert prompt.limiter.rate_of("p") == 1500
        assert prompt.limiter.rate_of("m") == 200
        assert prompt.limiter.rate_of("alice") == 3000  # alice is gone: the default
        assert prompt.teams.table.rate_of("acme") == 4000
        assert prompt.teams.team_of("m") == "acme"


# -- the states -----------------------------------------------------------------


def test_user_state_shows_the_prompt_budget_beside_the_output_budget(served):
    rig = served.rig
    create(served, USERS, "p", tokens_per_second=1000, prompt_tokens_per_second=100)
    shared = rig.shared
    with shared.lock:
        now = rig.clock()
        # 1 s of burst: 101 prompt tokens at once, the TAT 1.01 s ahead.
        assert shared.prompt.limiter.take_up_to("p", 150, now) == (101, 0)
        for counter, count in (
            ("prompt_tokens_charged", 101),
            ("prompt_held_skips", 3),
            ("prompt_shadow_holds", 2),
            ("prompt_wait_ns", 250_000_000),
        ):
            rig.accounting.record("p", counter, count)
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/p"))
    assert state.prompt_limit_tokens_per_second == 100
    assert state.prompt_tat_lead.ToNanoseconds() == 1_010_000_000
    assert state.prompt_next_token_in.ToNanoseconds() == 10_000_000
    assert (
        state.prompt_tokens_charged,
        state.prompt_held_skips,
        state.prompt_shadow_holds,
    ) == (101, 3, 2)
    assert state.prompt_wait.ToNanoseconds() == 250_000_000
    # The output budget is its own.
    assert state.limit_tokens_per_second == 1000
    assert state.tat_lead.ToNanoseconds() == 0
    assert state.tokens_charged == 0
    rig.clock.advance_ms(500)
    later = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/p"))
    assert later.prompt_tat_lead.ToNanoseconds() == 510_000_000
    assert later.prompt_next_token_in.ToNanoseconds() == 0


def test_a_user_without_a_prompt_rate_shows_a_prompt_budget_of_zero(served):
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/alice"))
    assert state.prompt_limit_tokens_per_second == 0
    assert state.prompt_tat_lead.ToNanoseconds() == 0
    assert state.prompt_next_token_in.ToNanoseconds() == 0
    assert state.prompt_wait.ToNanoseconds() == 0


def test_a_user_known_only_by_its_prompt_rate_has_a_state(served):
    create(served, USERS, "p", prompt_tokens_per_second=100)
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/p"))
    assert (state.limit_tokens_per_second, state.prompt_limit_tokens_per_second) == (
        10,
        100,
    )
    listed = served.stub.ListUserStates(pb.ListUserStatesRequest())
    assert "p" in [s.user for s in listed.user_states]


def test_team_state_shows_the_teams_prompt_rate(served):
    create(served, TEAMS, "acme", prompt_tokens_per_second=4000)
    create(served, TEAMS, "beta")
    states = served.stub.ListTeamStates(pb.ListTeamStatesRequest()).team_states
    assert [
        (s.team, s.tokens_per_second, s.prompt_tokens_per_second) for s in states
    ] == [
        ("acme", 60, 4000),
        ("beta", 60, 0),
    ]
    one = served.stub.GetTeamState(pb.GetTeamStateRequest(name="teamStates/acme"))
    assert one.prompt_tokens_per_second == 4000
