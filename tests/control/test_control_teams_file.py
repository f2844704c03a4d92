"""Teams in the limits file: validation, write-back, restarts, live edits and
the merge with the flags' teams at start-up."""

from __future__ import annotations

import json

import grpc
import pytest

from control.errors import InvalidArgument
from control.persistence import ConfigFile, ConfigWatcher, load_at_start
from control.runner import serve
from control.service.operations import LimitsService
from control.table import dumps, loads
from pacing.settings.model import ControlSettings
from pacing.teams import TeamTable
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc
from tests.control_harness import make_rig, pieces, table

TEAMS_DOC = {
    "default_tokens_per_second": 100,
    "teams": {"acme": {"tokens_per_second": 600}, "beta": {"tokens_per_second": 200}},
    "team_members": {"user-a": "acme", "user-b": "beta"},
    "weights": {"teams": {"acme": 2}},
}


@pytest.fixture(params=["json", "yaml"])
def path(request, tmp_path):
    return tmp_path / f"limits.{request.param}"


def settings_for(path) -> ControlSettings:
    return ControlSettings(address="127.0.0.1:0", config_path=str(path))


def with_flag_teams(rates: dict[str, int], members: dict[str, str]):
    """A rig whose teams came from --output-rate-teams and
    --output-rate-team-members."""
    return make_rig(10, teams=TeamTable(rates, members))


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_teams_round_trip_through_the_document_format(fmt):
    doc = loads(json.dumps(TEAMS_DOC), "json", source="f")
    assert pieces(doc).team_rates == {"acme": 600, "beta": 200}
    assert pieces(doc).team_members == {"user-a": "acme", "user-b": "beta"}
    assert pieces(doc).team_weights == {"acme": 2.0}
    assert pieces(doc).users == {"user-a", "user-b"}
    again = loads(dumps(doc, fmt), fmt, source="f")
    assert again.policy.same_table(doc.policy)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"teams": {"acme": {"tokens_per_second": 5}}, "team_members": {"u": "x"}},
            "f: team_members.u: unknown team 'x'",
        ),
        (
            {"teams": {"acme": {}}},
            "f: teams.acme: needs tokens_per_second",
        ),
        (
            {"teams": {"acme": {"tokens_per_second": 0}}},
            "f: teams.acme.tokens_per_second: must be an integer in 1..1000000",
        ),
        (
            {"teams": {"acme": {"tokens_per_second": 5, "exempt": True}}},
            "f: teams.acme: unknown field(s) 'exempt'",
        ),
        (
            {
                "teams": {"acme": {"tokens_per_second": 5}},
                "weights": {"teams": {"b": 2}},
            },
            "f: weights.teams.b: unknown team 'b'",
        ),
        (
            {"teams": {"": {"tokens_per_second": 5}}},
            "f: teams['']: team id must not be empty",
        ),
    ],
    ids=[
        "unknown-team",
        "no-rate",
        "zero-rate",
        "exempt-team",
        "weight-of-unknown-team",
        "empty-id",
    ],
)
def test_a_bad_team_in_the_document_is_an_error_naming_the_field(tree, message):
    with pytest.raises(InvalidArgument) as info:
        loads(json.dumps(tree), "json", source="f")
    assert str(info.value).startswith(message)


def test_team_changes_survive_a_restart_through_the_limits_file(path):
    first = make_rig(10)
    plane = serve(first.shared, settings_for(path))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            stub = output_rate_pb2_grpc.OutputRateControlStub(channel)
            stub.CreateTeam(
                pb.CreateTeamRequest(
                    team_id="acme", team=pb.Team(tokens_per_second=60, weight=3)
                )
            )
            stub.CreateLimit(
                pb.CreateLimitRequest(
                    limit_id="user-a", limit=pb.Limit(team="teams/acme")
                )
            )
    finally:
        plane.stop(0)
    saved = ConfigFile(path).load()
    assert saved is not None
    assert (
        pieces(saved).team_rates,
        pieces(saved).team_members,
        pieces(saved).team_weights,
    ) == (
        {"acme": 60},
        {"user-a": "acme"},
        {"acme": 3.0},
    )
    # A new engine process from the same flags (no teams): the file's teams.
    second = make_rig(10)
    plane = serve(second.shared, settings_for(path))
    try:
        table = second.shared.teams.table
        assert (table.rates, table.memberships) == ({"acme": 60}, {"user-a": "acme"})
        assert second.shared.teams.cells.rate_of("acme") == 60
        assert second.shared.fair_share.weights.teams == {"acme": 3.0}
    finally:
        plane.stop(0)


def test_the_start_merges_the_flags_teams_with_the_files(path):
    path.write_text(
        json.dumps(
            {
                "teams": {"beta": {"tokens_per_second": 20}},
                "team_members": {"user-a": "beta", "user-b": "beta"},
            }
        )
    )
    rig = with_flag_teams({"acme": 60}, {"user-a": "acme", "user-c": "acme"})
    plane = serve(rig.shared, settings_for(path))
    try:
        table = rig.shared.teams.table
        assert table.rates == {"acme": 60, "beta": 20}
        # The file's membership wins for a user both place.
        assert table.memberships == {
            "user-a": "beta",
            "user-b": "beta",
            "user-c": "acme",
        }
    finally:
        plane.stop(0)


def test_a_missing_file_is_created_with_the_flags_teams(path):
    rig = with_flag_teams({"acme": 60}, {"user-a": "acme"})
    plane = serve(rig.shared, settings_for(path))
    plane.stop(0)
    saved = ConfigFile(path).load()
    assert saved is not None
    teams = saved.policy.team_table()
    assert (teams.rates, teams.memberships) == ({"acme": 60}, {"user-a": "acme"})


def test_an_edit_of_the_teams_applies_live(path):
    rig = make_rig(10)
    file = ConfigFile(path)
    service = LimitsService(rig.shared, persist=file.write)
    flags = table(default_rate=10)
    doc = load_at_start(file, flags)
    service.reload(lambda: doc.policy)
    watcher = ConfigWatcher(file, service, flags)
    path.write_text(json.dumps(TEAMS_DOC))
    assert watcher.poll() is True
    held = rig.shared.teams.table
    assert (held.rates, held.memberships) == (
        {"acme": 600, "beta": 200},
        {"user-a": "acme", "user-b": "beta"},
    )
    assert rig.shared.fair_share.weights.teams == {"acme": 2.0}
    path.write_text(json.dumps({"default_tokens_per_second": 100}))
    assert watcher.poll() is True
    assert not rig.shared.teams.table  # the edit removed them all
