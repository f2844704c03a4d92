"""Priority bands in the control plane: ``band`` is carried by every RPC that
writes or reads a holder (the default, user entries, tiers, teams, the whole
table), ``bands`` and ``objectives`` by the whole table, and each lands in the
band table at once (the policy in force is replaced, ``SharedLimiter.policy``,
which rebuilds ``SharedLimiter.bands``). A band that is not one of the table's
bands is INVALID_ARGUMENT naming the request's field, in the limits file's
words; a replaced table is checked by the document's rules; the user states
name the band that applies to each user."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask

from control.kinds import ALL, TEAMS, TIERS, USERS, Kind
from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

BANDS = ("interactive", "standard", "batch")
#: The words refusing a band that is not one of ``BANDS``.
UNKNOWN = "unknown band 'gold' (bands: interactive, standard, batch)"
#: The words refusing a default without a band while there are bands.
NEEDS_BAND = "needs band (one of bands: the band of users no holder puts in one)"
#: What each kind needs beside a band to exist.
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


def with_bands(served, *, objectives=None, default: str = "standard") -> object:
    """The table with alice's entry, ``BANDS`` and the default in
    ``default``."""
    return served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default=pb.DefaultLimit(tokens_per_second=10, band=default),
                limits=[pb.Limit(name="limits/alice", tokens_per_second=5)],
                bands=BANDS,
                objectives=objectives_of(objectives or {}),
            )
        )
    )


def objectives_of(objectives: dict[str, str]) -> list[pb.Objective]:
    return [pb.Objective(name=name, band=band) for name, band in objectives.items()]


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


def update_default(served, mask: list[str] | None = None, **values) -> object:
    return served.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(**values),
            update_mask=FieldMask(paths=mask or []),
        )
    )


def band_in_force(shared, user: str) -> str:
    """The band the band table puts ``user`` in ("": no bands)."""
    with shared.lock:
        bands = shared.bands
        tier, team = shared.limiter.tier_of(user), shared.teams.team_of(user)
        return bands.name_of(bands.index_of(user, tier, team))


def holder_band(shared, kind: Kind, holder_id: str) -> str | None:
    """The band the band table holds for a holder of ``kind`` (None: none)."""
    with shared.lock:
        bands = shared.bands
        held = {USERS: bands.users, TIERS: bands.tiers, TEAMS: bands.teams}[kind]
        index = held.get(holder_id)
        return None if index is None else bands.name_of(index)


def user_state(served, user: str) -> pb.UserState:
    return served.stub.GetUserState(pb.GetUserStateRequest(name=f"userStates/{user}"))


def refused(write) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        write()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return error.value


# -- every verb of every kind ---------------------------------------------------


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_every_kind_carries_its_band_through_create_get_list_and_update(served, kind):
    with_bands(served)
    created = create(served, kind, "h1", band="batch")
    assert created.band == "batch"
    got = call(served, "Get", kind, name=kind.name("h1"))
    assert got == created
    listed = getattr(call(served, "List", kind), kind.collection)
    assert [h.band for h in listed if h.name == got.name] == ["batch"]
    assert holder_band(served.rig.shared, kind, "h1") == "batch"
    # A mask naming the band changes it alone.
    updated = update(served, kind, "h1", ["band"], band="interactive")
    assert updated.band == "interactive"
    assert updated.tokens_per_second == created.tokens_per_second
    assert updated.etag != created.etag
    # A mask naming another field keeps it.
    kept = update(served, kind, "h1", ["tokens_per_second"], tokens_per_second=9)
    assert (kept.tokens_per_second, kept.band) == (9, "interactive")
    # An empty mask changes the fields set: the band alone here.
    again = update(served, kind, "h1", [], band="standard")
    assert (again.tokens_per_second, again.band) == (9, "standard")
    assert holder_band(served.rig.shared, kind, "h1") == "standard"


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_a_masked_empty_band_clears_it_and_keeps_the_holder(served, kind):
    with_bands(served)
    create(served, kind, "h1", tokens_per_second=7, band="batch")
    cleared = update(served, kind, "h1", ["band"])
    assert (cleared.tokens_per_second, cleared.band) == (7, "")
    assert call(served, "Get", kind, name=kind.name("h1")) == cleared
    assert holder_band(served.rig.shared, kind, "h1") is None


def test_a_band_alone_makes_a_user_entry_but_not_a_tier(served):
    with_bands(served)
    created = create(served, USERS, "p", band="batch")
    assert (created.tokens_per_second, created.band) == (0, "batch")
    assert served.rig.limiter.rate_of("p") == 10  # the default rate still applies
    assert band_in_force(served.rig.shared, "p") == "batch"
    update(served, USERS, "p", ["band"])  # clearing it leaves no entry
    with pytest.raises(grpc.RpcError) as gone:
        call(served, "Get", USERS, name="limits/p")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    error = refused(
        lambda: call(
            served, "Create", TIERS, tier_id="free", tier=pb.Tier(band="batch")
        )
    )
    assert error.details().startswith("tier.tokens_per_second: must be an integer")
    error = refused(
        lambda: call(
            served,
            "Update",
            TIERS,
            tier=pb.Tier(name="tiers/free", band="batch"),
            allow_missing=True,
        )
    )
    assert "a band alone does not make a tier" in error.details()
    assert served.rig.shared.policy.groups["tier"] == {}


# -- a band that is not one of the bands ------------------------------------------


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_a_band_not_in_the_bands_is_refused_naming_the_field(served, kind):
    with_bands(served)
    create(served, kind, "h1", band="batch")
    etag = call(served, "Get", kind, name=kind.name("h1")).etag
    for write in (
        lambda: update(served, kind, "h1", ["band"], band="gold"),
        lambda: update(served, kind, "h1", [], band="gold"),
        lambda: create(served, kind, "h2", band="gold"),
    ):
        assert refused(write).details() == f"{kind.resource}.band: {UNKNOWN}"
    assert call(served, "Get", kind, name=kind.name("h1")).etag == etag
    assert holder_band(served.rig.shared, kind, "h1") == "batch"
    assert holder_band(served.rig.shared, kind, "h2") is None


def test_without_bands_no_holder_may_name_one(served):
    for write, field in (
        (lambda: create(served, USERS, "p", band="batch"), "limit.band"),
        (lambda: create(served, TIERS, "free", band="batch"), "tier.band"),
        (lambda: create(served, TEAMS, "acme", band="batch"), "team.band"),
        (lambda: update_default(served, band="batch"), "default_limit.band"),
    ):
        assert refused(write).details() == (
            f"{field}: unknown band 'batch' (bands: none are set)"
        )
    policy = served.rig.shared.policy
    assert (policy.users.keys(), policy.default.band) == ({"alice"}, None)


@pytest.mark.parametrize(
    ("band", "said"),
    [
        ("a\x01", "band name must not contain control characters"),
        ("b" * 257, "band name must be at most 256 bytes in UTF-8"),
    ],
    ids=["control-character", "too-long"],
)
def test_a_bad_band_name_is_refused_with_the_rules_words(served, band, said):
    with_bands(served)
    for write, field in (
        (lambda: create(served, USERS, "p", band=band), "limit.band"),
        (lambda: update(served, TIERS, "free", ["band"], band=band), "tier.band"),
        (lambda: update_default(served, band=band), "default_limit.band"),
    ):
        assert refused(write).details() == f"{field}: {said}"


# -- the default ----------------------------------------------------------------


def test_the_default_limit_carries_its_band_through_get_and_update(served):
    with_bands(served)
    stub = served.stub
    shared = served.rig.shared
    assert stub.GetDefaultLimit(pb.GetDefaultLimitRequest()).band == "standard"
    set_ = update_default(served, band="batch")
    assert (set_.tokens_per_second, set_.band) == (10, "batch")
    assert stub.GetDefaultLimit(pb.GetDefaultLimitRequest()) == set_
    assert band_in_force(shared, "nobody") == "batch"
    rate = update_default(served, tokens_per_second=20)
    assert (rate.tokens_per_second, rate.band) == (20, "batch")
    assert stub.GetLimitsTable(pb.GetLimitsTableRequest()).default == rate
    # Unknown, or cleared while there are bands: refused, nothing changed.
    for values, said in (
        ({"band": "gold"}, UNKNOWN),
        ({}, NEEDS_BAND),
    ):
        error = refused(
            lambda values=values: update_default(served, ["band"], **values)
        )
        assert error.details() == f"default_limit.band: {said}"
    assert stub.GetDefaultLimit(pb.GetDefaultLimitRequest()) == rate
    assert band_in_force(shared, "nobody") == "batch"


def test_without_bands_the_default_has_no_band_and_a_masked_clear_is_fine(served):
    cleared = update_default(served, ["band"])
    assert (cleared.tokens_per_second, cleared.band) == (10, "")


# -- resolution and the band table ------------------------------------------------


def test_bands_resolve_own_then_tiers_then_teams_then_the_defaults(served):
    with_bands(served)
    create(served, TIERS, "free", band="batch")
    create(served, TIERS, "plain")
    create(served, TEAMS, "acme", band="interactive")
    create(served, USERS, "own", band="interactive", tier="tiers/free")
    create(served, USERS, "m", tier="tiers/free", team="teams/acme")
    create(served, USERS, "t", tier="tiers/plain", team="teams/acme")
    shared = served.rig.shared
    users = ("own", "m", "t", "alice", "nobody")
    assert [band_in_force(shared, u) for u in users] == [
        "interactive",  # its own, over its tier's
        "batch",  # its tier's, over its team's
        "interactive",  # its team's: its tier has none
        "standard",  # the default's
        "standard",
    ]
    update(served, TIERS, "free", ["band"])  # the tier's gone: m's team's
    assert band_in_force(shared, "m") == "interactive"
    update_default(served, band="batch")
    assert band_in_force(shared, "alice") == "batch"
    assert [user_state(served, u).band for u in users[:-1]] == [
        "interactive",
        "interactive",
        "interactive",
        "batch",
    ]


def test_every_band_written_lands_in_the_band_table_at_once(served):
    with_bands(served)
    shared = served.rig.shared
    wakes = len(served.rig.wakes)
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/p", band="batch"),
        allow_missing=True,
    )
    assert band_in_force(shared, "p") == "batch"
    call(served, "Delete", USERS, name="limits/p")
    assert band_in_force(shared, "p") == "standard"
    assert len(served.rig.wakes) > wakes  # each change wakes an idle engine


# -- the whole table ----------------------------------------------------------------


def test_replace_limits_table_carries_bands_and_objectives(served):
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default=pb.DefaultLimit(tokens_per_second=10, band="standard"),
                limits=[
                    pb.Limit(name="limits/p", tokens_per_second=100, band="batch"),
                    pb.Limit(name="limits/m", tier="tiers/free", team="teams/acme"),
                ],
                tiers=[pb.Tier(name="tiers/free", tokens_per_second=5)],
                teams=[
                    pb.Team(
                        name="teams/acme", tokens_per_second=600, band="interactive"
                    )
                ],
                bands=BANDS,
                objectives=objectives_of({"chat": "interactive", "bulk": "batch"}),
            )
        )
    )
    got = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    assert got == replaced
    assert list(got.bands) == list(BANDS)  # the order is the priority
    assert got.objectives == objectives_of({"bulk": "batch", "chat": "interactive"})
    assert got.default.band == "standard"
    assert {h.name: h.band for h in got.limits} == {"limits/m": "", "limits/p": "batch"}
    assert [t.band for t in got.teams] == ["interactive"]
    shared = served.rig.shared
    with shared.lock:
        table = shared.bands
        assert table.names == BANDS
        assert dict(table.objectives) == {"chat": 0, "bulk": 2}
        assert table.active
    assert [band_in_force(shared, u) for u in ("p", "m", "nobody")] == [
        "batch",
        "interactive",
        "standard",
    ]


def test_a_table_replaced_without_bands_has_none(served):
    with_bands(served, objectives={"chat": "interactive"})
    got = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(default_tokens_per_second=10)
        )
    )
    assert (list(got.bands), list(got.objectives), got.default.band) == ([], [], "")
    with served.rig.shared.lock:
        assert not served.rig.shared.bands.names
    assert band_in_force(served.rig.shared, "alice") == ""


@pytest.mark.parametrize(
    ("table", "said"),
    [
        (
            {"bands": ["a", "a"], "default": {"band": "a"}},
            "limits_table.bands[1]: 'a' appears more than once",
        ),
        (
            {"bands": ["a\x01"]},
            "limits_table.bands[0]: band name must not contain control characters",
        ),
        (
            {"bands": [f"b{i}" for i in range(9)], "default": {"band": "b0"}},
            "limits_table.bands: a policy holds at most 8 bands, got 9",
        ),
        ({"bands": list(BANDS)}, f"limits_table.default: {NEEDS_BAND}"),
        (
            {"bands": list(BANDS), "default": {"band": "gold"}},
            f"limits_table.default.band: {UNKNOWN}",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "limits": [{"name": "limits/p", "band": "gold"}],
            },
            f"limits_table.limits[0].band: {UNKNOWN}",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "tiers": [{"name": "tiers/free", "exempt": True, "band": "gold"}],
            },
            f"limits_table.tiers[0].band: {UNKNOWN}",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "teams": [
                    {"name": "teams/acme", "tokens_per_second": 6, "band": "gold"}
                ],
            },
            f"limits_table.teams[0].band: {UNKNOWN}",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "objectives": [("bulk", "batch"), ("chat", "gold")],
            },
            f"limits_table.objectives[1].band: {UNKNOWN}",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "objectives": [("chat", "")],
            },
            "limits_table.objectives[0].band: band name must not be empty",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "objectives": [("a\x01", "batch")],
            },
            "objective id in limits_table.objectives[0].name must not contain "
            "control characters",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "objectives": [("chat", "batch"), ("chat", "interactive")],
            },
            "limits_table.objectives[1].name: 'chat' appears more than once",
        ),
        (
            {
                "bands": list(BANDS),
                "default": {"band": "batch"},
                "objectives": [(f"o{i}", "batch") for i in range(101)],
            },
            "limits_table.objectives: a policy holds at most 100 objectives, got 101",
        ),
        (
            {"limits": [{"name": "limits/p", "band": "batch"}]},
            "limits_table.limits[0].band: unknown band 'batch' (bands: none are set)",
        ),
        (
            {"objectives": [("chat", "batch")]},
            "limits_table.objectives[0].band: unknown band 'batch' (bands: none are "
            "set)",
        ),
    ],
    ids=[
        "duplicate",
        "bad-name",
        "too-many",
        "default-without",
        "default-unknown",
        "user-unknown",
        "tier-unknown",
        "team-unknown",
        "objective-unknown",
        "objective-without-a-band",
        "objective-bad-name",
        "objective-twice",
        "too-many-objectives",
        "band-without-bands",
        "objective-without-bands",
    ],
)
def test_a_replaced_table_that_breaks_a_band_rule_is_refused_at_its_field(
    served, table, said
):
    with_bands(served)
    before = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    message = pb.LimitsTable(
        default=pb.DefaultLimit(tokens_per_second=10, **table.get("default", {})),
        bands=table.get("bands", []),
        objectives=[
            pb.Objective(name=name, band=band)
            for name, band in table.get("objectives", [])
        ],
        limits=[pb.Limit(**h) for h in table.get("limits", [])],
        tiers=[pb.Tier(**h) for h in table.get("tiers", [])],
        teams=[pb.Team(**h) for h in table.get("teams", [])],
    )
    error = refused(
        lambda: served.stub.ReplaceLimitsTable(
            pb.ReplaceLimitsTableRequest(limits_table=message)
        )
    )
    assert error.details() == said
    assert served.stub.GetLimitsTable(pb.GetLimitsTableRequest()) == before


# -- the states -----------------------------------------------------------------


def test_without_bands_a_user_state_names_no_band(served):
    assert user_state(served, "alice").band == ""


def test_a_user_known_only_by_its_band_has_a_state(served):
    with_bands(served)
    create(served, USERS, "p", band="batch")
    state = user_state(served, "p")
    assert (state.limit_tokens_per_second, state.band) == (10, "batch")
    listed = served.stub.ListUserStates(pb.ListUserStatesRequest()).user_states
    assert {s.user: s.band for s in listed} == {"alice": "standard", "p": "batch"}


def test_watched_states_carry_the_band(served):
    with_bands(served)
    create(served, USERS, "p", band="interactive")
    stream = served.stub.WatchUserStates(
        pb.WatchUserStatesRequest(
            names=["userStates/p"], interval=Duration(nanos=100_000_000)
        )
    )
    try:
        first = next(stream)
    finally:
        stream.cancel()
    ((state,),) = [first.user_states]
    assert (state.user, state.band) == ("p", "interactive")
