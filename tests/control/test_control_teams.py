"""Teams through a real in-process gRPC server: CRUD, memberships through the
users' entries, etags, the whole table, team states, and bad input with its
status code and message."""

from __future__ import annotations

import grpc
import pytest

from control.kinds import TEAMS, USERS
from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

Invalid = grpc.StatusCode.INVALID_ARGUMENT
NotFound = grpc.StatusCode.NOT_FOUND
Precondition = grpc.StatusCode.FAILED_PRECONDITION
Aborted = grpc.StatusCode.ABORTED
Exists = grpc.StatusCode.ALREADY_EXISTS


@pytest.fixture
def rig():
    """Default 1000/s (users never bind before their team); team acme at
    100/s with user-a; team beta at 50/s without members."""
    rig = make_rig(1000)
    service = LimitsService(rig.shared)
    service.create(TEAMS, "acme", {"tokens_per_second": 100})
    service.create(TEAMS, "beta", {"tokens_per_second": 50})
    service.create(USERS, "user-a", {"team": "teams/acme"})
    rig.wakes.clear()
    return rig


@pytest.fixture
def served(rig):
    with serving(LimitsService(rig.shared)) as served:
        yield served


def error_of(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value


def join(served, user: str, team: str) -> pb.Limit:
    request = pb.UpdateLimitRequest(
        limit=pb.Limit(name=f"limits/{user}", team=team), allow_missing=True
    )
    request.update_mask.paths.append("team")
    return served.stub.UpdateLimit(request)


def update_team(served, team: str, *paths: str, **fields) -> pb.Team:
    request = pb.UpdateTeamRequest(team=pb.Team(name=f"teams/{team}", **fields))
    request.update_mask.paths.extend(paths)
    return served.stub.UpdateTeam(request)


def test_a_team_is_created_read_listed_updated_and_deleted(served, rig):
    created = served.stub.CreateTeam(
        pb.CreateTeamRequest(
            team_id="gamma", team=pb.Team(tokens_per_second=30, weight=2)
        )
    )
    assert (created.name, created.tokens_per_second, created.weight) == (
        "teams/gamma",
        30,
        2.0,
    )
    assert rig.shared.teams.table.rate_of("gamma") == 30
    assert rig.shared.fair_share.weights.team("gamma") == 2.0
    assert rig.wakes  # a change wakes an idle engine
    got = served.stub.GetTeam(pb.GetTeamRequest(name="teams/acme"))
    assert (got.tokens_per_second, got.member_count, got.weight) == (100, 1, 0.0)
    first = served.stub.ListTeams(pb.ListTeamsRequest(page_size=2))
    rest = served.stub.ListTeams(
        pb.ListTeamsRequest(page_size=2, page_token=first.next_page_token)
    )
    assert [t.name for t in (*first.teams, *rest.teams)] == [
        "teams/acme",
        "teams/beta",
        "teams/gamma",
    ]
    assert rest.next_page_token == ""
    updated = update_team(served, "gamma", tokens_per_second=60)  # the weight stays
    assert (updated.tokens_per_second, updated.weight) == (60, 2.0)
    assert rig.shared.teams.table.rate_of("gamma") == 60
    cleared = update_team(served, "gamma", "weight")
    assert cleared.weight == 0.0
    assert "gamma" not in rig.shared.fair_share.weights.teams
    served.stub.DeleteTeam(pb.DeleteTeamRequest(name="teams/gamma"))
    assert rig.shared.teams.table.rate_of("gamma") is None
    assert error_of(
        served.stub.GetTeam, pb.GetTeamRequest(name="teams/gamma")
    ).code() == (NotFound)


def test_creating_an_existing_team_is_already_exists(served):
    error = error_of(
        served.stub.CreateTeam,
        pb.CreateTeamRequest(team_id="acme", team=pb.Team(tokens_per_second=5)),
    )
    assert error.code() == Exists
    assert "'teams/acme' exists; use UpdateTeam" in error.details()


def test_a_team_with_members_cannot_be_deleted(served, rig):
    error = error_of(served.stub.DeleteTeam, pb.DeleteTeamRequest(name="teams/acme"))
    assert error.code() == Precondition
    assert "'teams/acme' has 1 member(s)" in error.details()
    assert rig.shared.teams.table.rate_of("acme") == 100
    assert rig.shared.teams.table.team_of("user-a") == "acme"
    join(served, "user-a", "")  # out of the team: now it can go
    served.stub.DeleteTeam(pb.DeleteTeamRequest(name="teams/acme"))
    assert rig.shared.teams.table.rate_of("acme") is None


def test_a_users_team_is_part_of_its_entry_and_moves_with_it(served, rig):
    moved = join(served, "user-a", "teams/beta")
    assert (moved.name, moved.team) == ("limits/user-a", "teams/beta")
    assert rig.shared.teams.table.team_of("user-a") == "beta"
    got = served.stub.GetLimit(pb.GetLimitRequest(name="limits/user-a"))
    assert got.team == "teams/beta"
    members = {
        t.name: t.member_count
        for t in served.stub.ListTeams(pb.ListTeamsRequest()).teams
    }
    assert members == {"teams/acme": 0, "teams/beta": 1}
    # A team alone makes an entry; leaving it removes the entry.
    request = pb.UpdateLimitRequest(limit=pb.Limit(name="limits/user-a"))
    request.update_mask.paths.append("team")
    served.stub.UpdateLimit(request)
    assert rig.shared.teams.table.team_of("user-a") is None
    assert (
        error_of(served.stub.GetLimit, pb.GetLimitRequest(name="limits/user-a")).code()
        == NotFound
    )


def test_joining_a_team_that_does_not_exist_is_failed_precondition(served, rig):
    error = error_of(
        served.stub.CreateLimit,
        pb.CreateLimitRequest(limit_id="user-z", limit=pb.Limit(team="teams/nope")),
    )
    assert error.code() == Precondition
    assert error.details() == "limit.team: unknown team 'nope'"
    assert rig.shared.teams.table.team_of("user-z") is None


def test_an_update_or_delete_with_a_stale_etag_is_aborted(served, rig):
    etag = served.stub.GetTeam(pb.GetTeamRequest(name="teams/beta")).etag
    update_team(served, "beta", tokens_per_second=70)
    error = error_of(
        served.stub.UpdateTeam,
        pb.UpdateTeamRequest(
            team=pb.Team(name="teams/beta", tokens_per_second=80, etag=etag)
        ),
    )
    assert error.code() == Aborted
    error = error_of(
        served.stub.DeleteTeam, pb.DeleteTeamRequest(name="teams/beta", etag=etag)
    )
    assert error.code() == Aborted
    assert rig.shared.teams.table.rate_of("beta") == 70
    current = served.stub.GetTeam(pb.GetTeamRequest(name="teams/beta")).etag
    served.stub.DeleteTeam(pb.DeleteTeamRequest(name="teams/beta", etag=current))
    assert rig.shared.teams.table.rate_of("beta") is None


@pytest.mark.parametrize(
    ("call", "request_", "code", "message"),
    [
        (
            "CreateTeam",
            pb.CreateTeamRequest(team_id="x", team=pb.Team(tokens_per_second=0)),
            Invalid,
            "team.tokens_per_second",
        ),
        (
            "CreateTeam",
            pb.CreateTeamRequest(team_id="", team=pb.Team(tokens_per_second=5)),
            Invalid,
            "team_id",
        ),
        ("GetTeam", pb.GetTeamRequest(name="tiers/acme"), Invalid, "teams/{team}"),
        (
            "UpdateTeam",
            pb.UpdateTeamRequest(
                team=pb.Team(name="teams/acme"),
                update_mask={"paths": ["tokens_per_second"]},
            ),
            Invalid,
            "team.tokens_per_second",
        ),
        (
            "UpdateTeam",
            pb.UpdateTeamRequest(team=pb.Team(name="teams/zeta", weight=2)),
            NotFound,
            "'teams/zeta' does not exist",
        ),
        (
            "UpdateTeam",
            pb.UpdateTeamRequest(
                team=pb.Team(name="teams/acme", tokens_per_second=5),
                update_mask={"paths": ["exempt"]},
            ),
            Invalid,
            "update_mask: cannot update 'exempt'",
        ),
        (
            "GetTeamState",
            pb.GetTeamStateRequest(name="teamStates/zeta"),
            NotFound,
            "'teamStates/zeta': no such team",
        ),
    ],
    ids=[
        "zero-rate",
        "empty-id",
        "wrong-collection",
        "rate-cleared",
        "update-missing",
        "unknown-mask-field",
        "state-of-missing-team",
    ],
)
def test_bad_team_requests_get_their_status_and_change_nothing(
    served, rig, call, request_, code, message
):
    before = (rig.shared.teams.table.rates, rig.shared.teams.table.memberships)
    error = error_of(getattr(served.stub, call), request_)
    assert error.code() == code
    assert message in error.details()
    assert (rig.shared.teams.table.rates, rig.shared.teams.table.memberships) == before


def test_update_team_creates_only_with_allow_missing(served, rig):
    created = served.stub.UpdateTeam(
        pb.UpdateTeamRequest(
            team=pb.Team(name="teams/zeta", tokens_per_second=9), allow_missing=True
        )
    )
    assert created.tokens_per_second == 9
    assert rig.shared.teams.table.rate_of("zeta") == 9


def test_replace_limits_table_carries_teams_weights_and_memberships(served, rig):
    etag = served.stub.GetLimitsTable(pb.GetLimitsTableRequest()).etag
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=500,
                limits=[
                    pb.Limit(name="limits/user-b", team="teams/new"),
                    pb.Limit(name="limits/user-c", tokens_per_second=7),
                ],
                teams=[pb.Team(name="teams/new", tokens_per_second=40, weight=3)],
                etag=etag,
            )
        )
    )
    assert [
        (t.name, t.tokens_per_second, t.weight, t.member_count) for t in replaced.teams
    ] == [("teams/new", 40, 3.0, 1)]
    table = rig.shared.teams.table
    assert (table.rates, table.memberships) == ({"new": 40}, {"user-b": "new"})
    assert rig.shared.fair_share.weights.teams == {"new": 3.0}
    assert rig.shared.teams.cells.rate_of("new") == 40


def test_replace_limits_table_refuses_a_membership_of_a_team_it_lacks(served, rig):
    error = error_of(
        served.stub.ReplaceLimitsTable,
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=10,
                limits=[pb.Limit(name="limits/user-b", team="teams/acme")],
            )
        ),
    )
    assert error.code() == Invalid
    assert error.details() == ("limits_table.limits[0].team: unknown team 'acme'")
    assert rig.shared.teams.table.rate_of("acme") == 100


def test_get_team_state_reports_budget_and_throttled_members(served, rig):
    join(served, "user-b", "teams/acme")
    state = served.stub.GetTeamState(pb.GetTeamStateRequest(name="teamStates/acme"))
    # A full bucket: 100 ms of 100/s, plus one token.
    assert (state.name, state.budget_tokens, state.member_count) == (
        "teamStates/acme",
        11,
        2,
    )
    assert state.tat_lead.ToNanoseconds() == 0
    # The scheduler asks for more than the team has: the team binds.
    with rig.shared.lock:
        granted = rig.shared.budget.take_team(
            "acme", {"user-a": 20, "user-b": 20}, rig.clock()
        )
    assert sum(taken for taken, _ in granted.values()) == 11
    rig.counts.value = {"user-a": (2, 1), "user-b": (1, 0), "user-x": (5, 5)}
    state = served.stub.GetTeamState(pb.GetTeamStateRequest(name="teamStates/acme"))
    assert state.budget_tokens == 0
    assert state.tokens_charged == 11
    assert state.throttled_steps == 1
    assert (state.running_members, state.throttled_members) == (2, 1)
    assert state.tat_lead.ToNanoseconds() == pytest.approx(110_000_000, abs=1)
    assert state.next_token_in.ToNanoseconds() == pytest.approx(10_000_000, abs=1)
    assert (state.tokens_per_second, state.weight) == (100, 1.0)


def test_list_team_states_pages_in_team_order(served):
    first = served.stub.ListTeamStates(pb.ListTeamStatesRequest(page_size=1))
    rest = served.stub.ListTeamStates(
        pb.ListTeamStatesRequest(page_size=1, page_token=first.next_page_token)
    )
    assert [s.team for s in (*first.team_states, *rest.team_states)] == [
        "acme",
        "beta",
    ]
    assert rest.next_page_token == ""
    assert [s.budget_tokens for s in (*first.team_states, *rest.team_states)] == [
        11,
        6,
    ]
