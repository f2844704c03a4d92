"""One rule, one error, wherever the mistake comes in: the same document gives
the same text and path at start-up (the limits file, ``--output-rate-policy``,
``additional_config``), at a reload of the file and at ``import``; the same
mistake in one gRPC write or one CLI command gives the same words at the
request's field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from control import preflight
from control.persistence import ConfigFile, ConfigWatcher
from control.service.operations import LimitsService
from pacing.settings.checks import SettingsError
from pacing.settings.flags import CONFIG_FLAG, POLICY_FLAG
from pacing.settings.model import ADDITIONAL_CONFIG_KEY, OutputRateSettings
from pacing.settings.policy import policy_of_flag
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests import cli_harness
from tests.control_harness import table

RATE = "must be an integer in 1..1000000 (tokens per second), got -5"
WEIGHT = "must be a number in (0, 1e+06], got -1.5"


@dataclass(frozen=True)
class Rule:
    document: dict[str, Any]
    path: str  # in the document
    message: str
    limit: pb.Limit  # the same mistake in one write of user u7's entry
    mask: str
    field: str  # ... at that request's field
    command: list[str]  # ... and in one CLI command
    status: str  # the CLI's words for the gRPC status (or argparse's usage error)


RULES = {
    "unknown team": Rule(
        {"team_members": {"u7": "ghostteam"}},
        "team_members.u7",
        "unknown team 'ghostteam'",
        pb.Limit(name="limits/u7", team="teams/ghostteam"),
        "team",
        "limit.team",
        ["join", "u7", "ghostteam"],
        "error: FAILED_PRECONDITION",
    ),
    "unknown tier": Rule(
        {"memberships": {"u7": "gold"}},
        "memberships.u7",
        "unknown tier 'gold'",
        pb.Limit(name="limits/u7", tier="tiers/gold"),
        "tier",
        "limit.tier",
        ["assign", "u7", "gold"],
        "error: FAILED_PRECONDITION",
    ),
    "bad rate": Rule(
        {"users": {"u7": -5}},
        "users.u7",
        RATE,
        pb.Limit(name="limits/u7", tokens_per_second=-5),
        "tokens_per_second",
        "limit.tokens_per_second",
        ["set", "u7", "-5"],
        "output-rate-ctl set: error: argument rate",
    ),
    "bad weight": Rule(
        {"weights": {"users": {"u7": -1.5}}},
        "weights.users.u7",
        WEIGHT,
        pb.Limit(name="limits/u7", weight=-1.5),
        "weight",
        "limit.weight",
        ["set-weight", "u7", "-1.5"],
        "output-rate-ctl set-weight: error: argument weight",
    ),
    "unknown band": Rule(
        {"users": {"u7": {"band": "gold"}}},
        "users.u7.band",
        "unknown band 'gold' (bands: none are set)",
        pb.Limit(name="limits/u7", band="gold"),
        "band",
        "limit.band",
        ["update", "u7", "--band", "gold", "--allow-missing"],
        "error: INVALID_ARGUMENT",
    ),
}


def document_of(rule: Rule) -> dict[str, Any]:
    return {"default_tokens_per_second": 10, **rule.document}


def write(path: Path, tree: dict[str, Any]) -> str:
    path.write_text(json.dumps(tree))
    return str(path)


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES)
def test_a_document_gives_the_same_error_at_every_way_in(rule, tmp_path, ctl):
    said = f"{rule.path}: {rule.message}"
    path = write(tmp_path / "limits.json", document_of(rule))
    # Start-up: the limits file, --output-rate-policy, additional_config.
    with pytest.raises(SettingsError) as start:
        preflight.check_config_file(path, None)
    assert str(start.value) == f"{CONFIG_FLAG}: {path}: {said}"
    with pytest.raises(SettingsError) as flag:
        policy_of_flag(json.dumps(document_of(rule)))
    assert str(flag.value) == f"{POLICY_FLAG}: {said}"
    entry = {ADDITIONAL_CONFIG_KEY: {"policy": document_of(rule)}}
    with pytest.raises(SettingsError) as config:
        OutputRateSettings.from_additional_config(entry)
    assert str(config.value) == f"additional_config['output_rate']['policy']: {said}"
    # A reload of the file.
    good = tmp_path / "good.json"
    write(good, {"default_tokens_per_second": 10})
    file = ConfigFile(good)
    file.load()
    watcher = ConfigWatcher(
        file, LimitsService(cli_harness.make_rig(10).shared), table()
    )
    write(good, document_of(rule))
    assert watcher.poll() is False
    assert watcher.last_error == f"{good}: {said}"
    # import.
    status, _, err = ctl("import", path)
    assert (status, err) == (1, f"error: INVALID_ARGUMENT: {path}: {said}\n")


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES)
def test_one_write_gives_the_same_words_at_the_requests_field(rule, served, ctl):
    with pytest.raises(grpc.RpcError) as write_error:
        served.stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=rule.limit,
                update_mask=FieldMask(paths=[rule.mask]),
                allow_missing=True,
            ),
            metadata=(("authorization", f"Bearer {cli_harness.TOKEN}"),),
        )
    assert write_error.value.details() == f"{rule.field}: {rule.message}"
    status, _, err = ctl(*rule.command)
    if rule.status.startswith("error: "):  # sent, refused by the server
        assert (status, err) == (1, f"{rule.status}: {rule.field}: {rule.message}\n")
    else:  # refused by the CLI's argument type, before anything is sent
        help_hint = f" (see output-rate-ctl {rule.command[0]} --help)\n"
        assert (status, err) == (2, f"{rule.status}: {rule.message}{help_hint}")
