"""Priority bands and the limits file: a file (JSON or YAML) holding bands,
objectives and holders' bands loads at start, every band a gRPC write sets
(the table's bands and objectives included) is written back, an operator's
edit is applied to the band table at once, and a bad one (an unknown band, a
default without one) is refused at its path, the last good table kept."""

from __future__ import annotations

import json

import pytest
import yaml
from google.protobuf.field_mask_pb2 import FieldMask

from control import preflight
from control.persistence import ConfigFile, ConfigWatcher, load_at_start
from control.service.operations import LimitsService
from pacing.policy.document import parse
from pacing.policy.model import Limits
from pacing.settings.checks import SettingsError
from pacing.settings.flags import CONFIG_FLAG
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving, table

#: Bands on every kind of holder, the default's and an objective.
DOC = {
    "default_tokens_per_second": 10,
    "default": {"band": "standard"},
    "bands": ["interactive", "standard", "batch"],
    "objectives": {"chat": "interactive"},
    "tiers": {"free": {"tokens_per_second": 5, "band": "batch"}},
    "teams": {"acme": {"tokens_per_second": 60, "band": "interactive"}},
    "users": {
        "p": {"tokens_per_second": 100, "band": "interactive"},
        "q": 1000,
        "m": {"tier": "free"},
        "t": {"team": "acme"},
    },
}
#: The band each user is in for DOC: own, the tier's, the team's, the default's.
IN_DOC = {
    "nobody": "standard",
    "p": "interactive",
    "q": "standard",
    "m": "batch",
    "t": "interactive",
}


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


def bands(shared) -> dict[str, str]:
    """The band each user of ``IN_DOC`` is in ("": no bands)."""
    with shared.lock:
        table = shared.bands
        return {
            user: table.name_of(
                table.index_of(
                    user, shared.limiter.tier_of(user), shared.teams.team_of(user)
                )
            )
            for user in IN_DOC
        }


def test_a_file_with_bands_loads_at_start(path):
    write(path, DOC)
    preflight.check_config_file(str(path), None)  # valid for the start-up check
    policy = load_at_start(ConfigFile(path), table(10)).policy
    assert policy.bands == ("interactive", "standard", "batch")
    assert policy.objectives == {"chat": "interactive"}
    assert policy.default == Limits(10, band="standard")
    assert policy.users["p"].limits == Limits(100, band="interactive")
    assert policy.groups["tier"]["free"] == Limits(5, band="batch")
    assert policy.groups["team"]["acme"] == Limits(60, band="interactive")
    rig = make_rig(10, {"alice": 5})
    started(path, rig)
    assert bands(rig.shared) == IN_DOC
    with rig.shared.lock:
        assert dict(rig.shared.bands.objectives) == {"chat": 0}


def test_every_band_written_through_grpc_is_in_the_file(path):
    rig = make_rig(10, {"alice": 5})
    service, _ = started(path, rig)
    with serving(service) as served:
        stub = served.stub
        stub.ReplaceLimitsTable(
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(
                    default=pb.DefaultLimit(tokens_per_second=10, band="standard"),
                    limits=[pb.Limit(name="limits/alice", tokens_per_second=5)],
                    bands=["interactive", "standard", "batch"],
                    objectives=[pb.Objective(name="bulk", band="batch")],
                )
            )
        )
        stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(default_limit=pb.DefaultLimit(band="batch"))
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", band="interactive"),
                update_mask=FieldMask(paths=["band"]),
            )
        )
        stub.CreateTier(
            pb.CreateTierRequest(
                tier_id="free", tier=pb.Tier(tokens_per_second=5, band="standard")
            )
        )
        stub.CreateTeam(
            pb.CreateTeamRequest(
                team_id="acme", team=pb.Team(tokens_per_second=60, band="batch")
            )
        )
    saved = ConfigFile(path).load().policy
    assert saved.bands == ("interactive", "standard", "batch")
    assert saved.objectives == {"bulk": "batch"}
    assert saved.default == Limits(10, band="batch")
    assert saved.users["alice"].limits == Limits(5, band="interactive")
    assert saved.groups["tier"]["free"] == Limits(5, band="standard")
    assert saved.groups["team"]["acme"] == Limits(60, band="batch")


def test_an_edit_of_the_bands_is_applied_to_the_band_table(path):
    rig = make_rig(10, {"alice": 5})
    _, watcher = started(path, rig)
    assert set(bands(rig.shared).values()) == {""}
    write(path, DOC)
    assert watcher.poll() is True
    assert bands(rig.shared) == IN_DOC
    edited = {
        **DOC,
        "bands": ["standard", "batch"],
        "objectives": {},
        "users": {**DOC["users"], "p": {"tokens_per_second": 100}},
        "teams": {"acme": {"tokens_per_second": 60}},
    }
    write(path, edited)
    assert watcher.poll() is True
    assert bands(rig.shared) == {**IN_DOC, "p": "standard", "t": "standard"}
    with rig.shared.lock:
        assert rig.shared.bands.names == ("standard", "batch")
        assert not rig.shared.bands.objectives


@pytest.mark.parametrize(
    ("where", "change", "said"),
    [
        (
            "users.p.band",
            {"users": {"p": {"band": "gold"}}},
            "unknown band 'gold' (bands: interactive, standard, batch)",
        ),
        (
            "objectives.chat",
            {"objectives": {"chat": "gold"}},
            "unknown band 'gold' (bands: interactive, standard, batch)",
        ),
        (
            "default",
            {"default": {}},
            "needs band (one of bands: the band of users no holder puts in one)",
        ),
        ("bands[1]", {"bands": ["a", "a"]}, "'a' appears more than once"),
    ],
    ids=["user-unknown", "objective-unknown", "default-without", "duplicate"],
)
def test_a_bad_band_in_the_file_is_refused_at_its_path(path, where, change, said):
    message = f"{where}: {said}"
    bad = {**DOC, **change}
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
    assert bands(rig.shared) == IN_DOC


def test_a_reload_without_a_default_rate_keeps_the_rate_and_takes_the_band():
    """A document without a default rate (an edit removed it, the flags give
    none) keeps the engine's rate, never its band: once there are bands the
    document's default names one, which must be the one in force."""
    rig = make_rig(10, {"alice": 5})
    service = LimitsService(rig.shared)
    policy = parse({"bands": ["interactive", "batch"], "default": {"band": "batch"}})
    assert service.reload(lambda: policy.policy) is True
    assert rig.shared.policy.default == Limits(10, band="batch")
    assert bands(rig.shared)["nobody"] == "batch"
