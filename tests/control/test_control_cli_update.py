"""``output-rate-ctl update``: a user entry's fields changed in one call, its
options derived from ``USERS.fields`` as a group kind's update's are."""

from __future__ import annotations

import argparse
import json

from control.cli import spelling
from control.cli.args import build_parser
from control.cli.client import Client
from control.kinds import USERS
from tests.cli_harness import entry


def _update_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    (choices,) = (
        action.choices
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    sub: argparse.ArgumentParser = choices["update"]
    return sub


def test_the_options_of_update_are_those_of_each_field_of_a_user_entry():
    sub = _update_parser()
    options = [
        option
        for action in sub._actions
        for option in action.option_strings
        if action.dest in USERS.fields
    ]
    expected = [
        option
        for field in USERS.fields
        for option in (spelling.option(field), spelling.clear_option(field))
    ]
    assert options == expected == spelling.update_options(USERS)
    assert {action.dest for action in sub._actions} == {
        "help",
        "user",
        "allow_missing",
        *USERS.fields,
    }
    # The same words as the group kinds' updates for the same attribute.
    assert expected[:6] == [
        "--rate",
        "--no-rate",
        "--exempt",
        "--no-exempt",
        "--weight",
        "--no-weight",
    ]
    assert expected[-4:] == ["--tier", "--no-tier", "--team", "--no-team"]


def test_update_sets_several_fields_in_one_call_and_clears_one(ctl, rig):
    ctl("create-tier", "free", "2")
    ctl("teams", "create", "acme", "60")
    status, out, _ = ctl(
        "--json", "update", "alice", "--rate", "7", "--tier", "free", "--weight", "3"
    )
    assert (status, json.loads(out)) == (0, entry("alice", 7, "free", weight=3.0))
    assert rig.limiter.rate_of("alice") == 7
    assert rig.limiter.memberships == {"alice": "free"}
    status, out, _ = ctl("update", "alice", "--no-rate", "--team", "acme")
    assert (status, out.splitlines()) == (
        0,
        [
            "USER   TOKENS/S  TIER  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  TEAM",
            "alice         -  free      no     3.0         -       -     -  acme",
        ],
    )
    assert rig.limiter.rate_of("alice") == 2  # now the tier's
    assert rig.shared.teams.table.team_of("alice") == "acme"
    status, out, _ = ctl("--json", "get", "alice")
    assert json.loads(out) == entry("alice", None, "free", weight=3.0, team="acme")


def test_update_sends_one_update_masking_exactly_the_fields_given(
    ctl, rig, monkeypatch
):
    ctl("teams", "create", "acme", "60")
    ctl("set-weight", "bob", "2")
    calls: list[tuple[str, object]] = []
    call = Client.call

    def recording(self: Client, method: str, request: object) -> object:
        calls.append((method, request))
        return call(self, method, request)

    monkeypatch.setattr(Client, "call", recording)
    assert ctl("update", "bob", "--exempt", "--team", "acme")[0] == 0
    ((method, request),) = calls
    assert method == "UpdateLimit"
    assert list(request.update_mask.paths) == ["exempt", "team"]
    assert (request.limit.name, request.limit.team) == ("limits/bob", "teams/acme")
    assert not request.allow_missing
    status, out, _ = ctl("--json", "get", "bob")
    # The rate and the weight were not in the mask: they stay.
    assert status == 0
    assert json.loads(out) == entry("bob", 20, exempt=True, weight=2.0, team="acme")


def test_update_of_a_user_without_an_entry_needs_allow_missing(ctl, rig):
    status, out, err = ctl("update", "carol", "--rate", "7")
    assert (status, out) == (1, "")
    assert err.startswith("error: NOT_FOUND:")
    status, out, _ = ctl("--json", "update", "carol", "--rate", "7", "--allow-missing")
    assert (status, json.loads(out)) == (0, entry("carol", 7))
    assert rig.limiter.rate_of("carol") == 7


def test_update_that_leaves_nothing_reports_that_the_default_applies(ctl, rig):
    assert ctl("update", "alice", "--no-rate")[:2] == (
        0,
        "alice has no entry left (the default applies)\n",
    )
    assert rig.limiter.rate_of("alice") == 10
    status, out, _ = ctl("--json", "update", "bob", "--no-rate", "--no-weight")
    assert (status, json.loads(out)) == (0, {"deleted": "bob"})


def test_update_without_an_option_is_a_usage_error_and_sends_nothing(ctl, rig):
    status, out, err = ctl("update", "alice")
    assert (status, out) == (2, "")
    assert err == (
        "output-rate-ctl: error: update needs --rate, --no-rate, --exempt, "
        "--no-exempt, --weight, --no-weight, --prompt-rate, --no-prompt-rate, "
        "--ceiling, --no-ceiling, --band, --no-band, --tier, --no-tier, --team or "
        "--no-team\n"
    )
    assert rig.limiter.rate_of("alice") == 5


def test_update_refuses_an_option_and_its_clear_together(ctl, rig):
    status, out, err = ctl("update", "alice", "--rate", "7", "--no-rate")
    assert (status, out) == (2, "")
    assert "not allowed with argument" in err
    assert rig.limiter.rate_of("alice") == 5
