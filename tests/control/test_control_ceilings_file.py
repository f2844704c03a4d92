"""Ceilings and the limits file: a file (JSON or YAML) holding ceilings in the
object form loads at start, every ceiling a gRPC write sets is written back,
an operator's edit of one is applied to the ceilings' table at once, and a bad
one (out of range, or below its holder's rate) is refused at its path, the
last good table kept."""

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
from tests.control_harness import make_rig, serving, table

#: Ceilings on every holder that may set one, in the object form, beside a
#: user in the number form.
DOC = {
    "default_tokens_per_second": 10,
    "default": {"ceiling_tokens_per_second": 40},
    "tiers": {"free": {"tokens_per_second": 5, "ceiling_tokens_per_second": 25}},
    "users": {
        "p": {"tokens_per_second": 100, "ceiling_tokens_per_second": 150},
        "q": 1000,
        "m": {"tier": "free"},
    },
}
#: The ceilings the table holds for DOC: own, the tier's, the default's.
IN_DOC = {"nobody": 40, "p": 150, "q": 40, "m": 25}


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


def ceilings(shared) -> dict[str, int]:
    with shared.lock:
        return {user: shared.ceilings.table.rate_of(user) for user in IN_DOC}


def test_a_file_with_ceilings_in_the_object_form_loads_at_start(path):
    write(path, DOC)
    preflight.check_config_file(str(path), None)  # valid for the start-up check
    policy = load_at_start(ConfigFile(path), table(10)).policy
    assert policy.default == Limits(10, ceiling_tokens_per_second=40)
    assert policy.users["p"].limits == Limits(100, ceiling_tokens_per_second=150)
    assert policy.users["q"].limits == Limits(1000)  # the number form, as before
    assert policy.groups["tier"]["free"] == Limits(5, ceiling_tokens_per_second=25)
    rig = make_rig(10, {"alice": 5})
    started(path, rig)
    assert ceilings(rig.shared) == IN_DOC
    assert rig.limiter.rate_of("p") == 100  # the rates are their own


def test_every_ceiling_written_through_grpc_is_in_the_file(path):
    rig = make_rig(10, {"alice": 5})
    service, _ = started(path, rig)
    with serving(service) as served:
        stub = served.stub
        stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(ceiling_tokens_per_second=40)
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(
                    name="limits/p",
                    tokens_per_second=100,
                    ceiling_tokens_per_second=150,
                ),
                allow_missing=True,
            )
        )
        stub.CreateTier(
            pb.CreateTierRequest(
                tier_id="free",
                tier=pb.Tier(tokens_per_second=5, ceiling_tokens_per_second=25),
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", ceiling_tokens_per_second=7),
                update_mask=FieldMask(paths=["ceiling_tokens_per_second"]),
            )
        )
    saved = ConfigFile(path).load().policy
    assert saved.default == Limits(10, ceiling_tokens_per_second=40)
    assert saved.users["p"].limits == Limits(100, ceiling_tokens_per_second=150)
    assert saved.users["alice"].limits == Limits(5, ceiling_tokens_per_second=7)
    assert saved.groups["tier"]["free"] == Limits(5, ceiling_tokens_per_second=25)
    assert path.read_text().count("ceiling_tokens_per_second") == 4


def test_an_edit_of_a_ceiling_is_applied_to_the_ceilings_table(path):
    rig = make_rig(10, {"alice": 5})
    _, watcher = started(path, rig)
    assert ceilings(rig.shared)["p"] == 0
    write(path, DOC)
    assert watcher.poll() is True
    assert ceilings(rig.shared) == IN_DOC
    edited = {
        **DOC,
        "users": {**DOC["users"], "p": {"ceiling_tokens_per_second": 250}},
        "tiers": {"free": {"tokens_per_second": 5}},
    }
    write(path, edited)
    assert watcher.poll() is True
    got = ceilings(rig.shared)
    assert (got["p"], got["m"]) == (250, 40)  # m: the tier's gone, the default's
    assert rig.limiter.rate_of("p") == 10  # its own rate gone: the default


@pytest.mark.parametrize(
    ("where", "holder", "said"),
    [
        (
            "default",
            {"default": {"ceiling_tokens_per_second": 0}},
            f"{RULE} 0",
        ),
        (
            "users.p",
            {"users": {"p": {"tokens_per_second": 9, "ceiling_tokens_per_second": -1}}},
            f"{RULE} -1",
        ),
        (
            "default",
            {"default": {"ceiling_tokens_per_second": 5}},
            "must be at least tokens_per_second (10), got 5",
        ),
        (
            "users.p",
            {"users": {"p": {"tokens_per_second": 9, "ceiling_tokens_per_second": 8}}},
            "must be at least tokens_per_second (9), got 8",
        ),
        (
            "tiers.free",
            {
                "tiers": {
                    "free": {"tokens_per_second": 9, "ceiling_tokens_per_second": 3}
                }
            },
            "must be at least tokens_per_second (9), got 3",
        ),
    ],
    ids=["default-zero", "user-negative", "default-below", "user-below", "tier-below"],
)
def test_a_bad_ceiling_in_the_file_is_refused_at_its_path(path, where, holder, said):
    message = f"{where}.ceiling_tokens_per_second: {said}"
    bad = {"default_tokens_per_second": 10, **holder}
    write(path, bad)
    with pytest.raises(SettingsError) as start:
        preflight.check_config_file(str(path), None)
    assert str(start.value) == f"{CONFIG_FLAG}: {path}: {message}"
    # A reload keeps the last good table.
    write(path, DOC)
    rig = make_rig(10, {"alice": 5})
    _, watcher = started(path, rig)
    write(path, bad)
    assert watcher.poll() is False
    assert watcher.last_error == f"{path}: {message}"
    assert ceilings(rig.shared) == IN_DOC


def test_a_team_in_the_file_sets_a_ceiling_and_an_edit_applies_it(path):
    doc = {
        "default_tokens_per_second": 10,
        "teams": {"acme": {"tokens_per_second": 6, "ceiling_tokens_per_second": 9}},
    }
    write(path, doc)
    preflight.check_config_file(str(path), None)
    rig = make_rig(10, {"alice": 5})
    _, watcher = started(path, rig)
    assert rig.shared.ceilings.team_ceilings == {"acme": 9}
    doc["teams"]["acme"]["ceiling_tokens_per_second"] = 12
    write(path, doc)
    assert watcher.poll() is True
    assert rig.shared.ceilings.team_ceilings == {"acme": 12}
