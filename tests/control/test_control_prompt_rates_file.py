"""Prompt budgets and the limits file: a file (JSON or YAML) holding prompt
rates in the object form loads at start beside the number form, every prompt
rate a gRPC write sets is written back, an operator's edit of one is applied
to the prompt tables at once, and a bad one is refused with the rate rule's
words at its path, the last good table kept."""

from __future__ import annotations

import json

import pytest
import yaml
from google.protobuf.field_mask_pb2 import FieldMask

from control import preflight
from control.persistence import ConfigFile, ConfigWatcher, load_at_start
from control.service.operations import LimitsService
from pacing.policy.model import Limits
from pacing.settings.checks import SettingsError
from pacing.settings.flags import CONFIG_FLAG
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import PROMPT_RATE_RULE as RULE
from tests.control_harness import PROMPT_RATES_DOC as DOC
from tests.control_harness import make_rig, serving, table


@pytest.fixture(params=["json", "yaml"])
def path(request, tmp_path):
    return tmp_path / f"limits.{request.param}"


def write(path, doc: dict) -> None:
    """An operator's edit, in the file's own format."""
    if path.suffix == ".json":
        path.write_text(json.dumps(doc))
    else:
        path.write_text(yaml.safe_dump(doc))


def started(path, rig) -> tuple[LimitsService, ConfigWatcher]:
    file = ConfigFile(path)
    service = LimitsService(rig.shared, persist=file.write)
    flags = table(10, {"alice": 5})
    doc = load_at_start(file, flags)
    service.reload(lambda: doc.policy)
    return service, ConfigWatcher(file, service, flags)


def prompt_rates(shared) -> dict[str, object]:
    with shared.lock:
        limiter = shared.prompt.limiter
        return {
            "nobody": limiter.rate_of("nobody"),
            "p": limiter.rate_of("p"),
            "q": limiter.rate_of("q"),
            "m": limiter.rate_of("m"),
            "acme": shared.prompt.teams.table.rate_of("acme"),
            "m's team": shared.prompt.teams.team_of("m"),
        }


IN_DOC = {
    "nobody": 3000,
    "p": 1500,
    "q": 3000,
    "m": 200,
    "acme": 4000,
    "m's team": "acme",
}


def test_a_file_with_prompt_rates_in_the_object_form_loads_at_start(path):
    write(path, DOC)
    preflight.check_config_file(str(path), None)  # valid for the start-up check
    policy = load_at_start(ConfigFile(path), table(10)).policy
    assert policy.default == Limits(10, prompt_tokens_per_second=3000)
    assert policy.users["p"].limits == Limits(1000, prompt_tokens_per_second=1500)
    assert policy.users["q"].limits == Limits(1000)  # the number form, as before
    assert policy.groups["tier"]["free"].prompt_tokens_per_second == 200
    assert policy.groups["team"]["acme"].prompt_tokens_per_second == 4000
    rig = make_rig(10, {"alice": 5})
    started(path, rig)
    assert prompt_rates(rig.shared) == IN_DOC
    assert rig.limiter.rate_of("p") == 1000  # the output rates are their own
    assert rig.limiter.rate_of("q") == 1000


def test_every_prompt_rate_written_through_grpc_is_in_the_file(path):
    rig = make_rig(10, {"alice": 5})
    service, _ = started(path, rig)
    with serving(service) as served:
        stub = served.stub
        stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(prompt_tokens_per_second=3000)
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(
                    name="limits/p",
                    tokens_per_second=1000,
                    prompt_tokens_per_second=1500,
                ),
                allow_missing=True,
            )
        )
        stub.CreateTier(
            pb.CreateTierRequest(
                tier_id="free",
                tier=pb.Tier(tokens_per_second=5, prompt_tokens_per_second=200),
            )
        )
        stub.CreateTeam(
            pb.CreateTeamRequest(
                team_id="acme",
                team=pb.Team(tokens_per_second=600, prompt_tokens_per_second=4000),
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", prompt_tokens_per_second=7),
                update_mask=FieldMask(paths=["prompt_tokens_per_second"]),
            )
        )
    saved = ConfigFile(path).load().policy
    assert saved.default == Limits(10, prompt_tokens_per_second=3000)
    assert saved.users["p"].limits == Limits(1000, prompt_tokens_per_second=1500)
    assert saved.users["alice"].limits == Limits(5, prompt_tokens_per_second=7)
    assert saved.groups["tier"]["free"] == Limits(5, prompt_tokens_per_second=200)
    assert saved.groups["team"]["acme"] == Limits(600, prompt_tokens_per_second=4000)
    text = path.read_text()
    assert text.count("prompt_tokens_per_second") == 5


def test_an_edit_of_a_prompt_rate_is_applied_to_the_prompt_tables(path):
    rig = make_rig(10, {"alice": 5})
    _, watcher = started(path, rig)
    assert prompt_rates(rig.shared)["p"] == 0
    write(path, DOC)
    assert watcher.poll() is True
    assert prompt_rates(rig.shared) == IN_DOC
    edited = {
        **DOC,
        "users": {**DOC["users"], "p": {"prompt_tokens_per_second": 2500}},
        "teams": {"acme": {"tokens_per_second": 600}},
    }
    write(path, edited)
    assert watcher.poll() is True
    rates = prompt_rates(rig.shared)
    assert (rates["p"], rates["acme"], rates["m's team"]) == (2500, None, None)
    assert rig.limiter.rate_of("p") == 10  # its output rate gone: the default
    assert rig.shared.teams.table.team_of("m") == "acme"  # the output team stays


@pytest.mark.parametrize("value", [0, -1, 1_000_001, "fast"])
@pytest.mark.parametrize(
    ("where", "holder"),
    [
        ("default", lambda v: {"default": {"prompt_tokens_per_second": v}}),
        (
            "users.p",
            lambda v: {
                "users": {"p": {"tokens_per_second": 9, "prompt_tokens_per_second": v}}
            },
        ),
        (
            "tiers.free",
            lambda v: {
                "tiers": {"free": {"exempt": True, "prompt_tokens_per_second": v}}
            },
        ),
        (
            "teams.acme",
            lambda v: {
                "teams": {
                    "acme": {"tokens_per_second": 6, "prompt_tokens_per_second": v}
                }
            },
        ),
    ],
    ids=["default", "user", "tier", "team"],
)
def test_a_bad_prompt_rate_in_the_file_is_refused_at_its_path(
    path, where, holder, value
):
    said = f"{where}.prompt_tokens_per_second: {RULE} {value!r}"
    bad = {"default_tokens_per_second": 10, **holder(value)}
    write(path, bad)
    with pytest.raises(SettingsError) as start:
        preflight.check_config_file(str(path), None)
    assert str(start.value) == f"{CONFIG_FLAG}: {path}: {said}"
    # A reload keeps the last good table.
    write(path, DOC)
    rig = make_rig(10, {"alice": 5})
    _, watcher = started(path, rig)
    write(path, bad)
    assert watcher.poll() is False
    assert watcher.last_error == f"{path}: {said}"
    assert prompt_rates(rig.shared) == IN_DOC
