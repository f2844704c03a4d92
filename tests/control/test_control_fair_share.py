"""Fair share through the control plane, over a real in-process gRPC server:
the switch on ``pacingMode`` (live, etag-guarded, refused where the engine
cannot run it), weights per user (an entry may hold only a weight) and per
tier, in the limits table, and each user's standing in its state."""

from __future__ import annotations

import math

import grpc
import pytest

from control.kinds import TIERS, USERS
from control.service.operations import LimitsService
from pacing.modes import Mode
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

Invalid = grpc.StatusCode.INVALID_ARGUMENT
REFUSAL = "fair share orders admission by weighted service; not under priority"


@pytest.fixture
def rig():
    """alice 5/s of her own; tier free at 2/s with carol."""
    rig = make_rig(10, {"alice": 5})
    service = LimitsService(rig.shared)
    service.create(TIERS, "free", {"tokens_per_second": 2})
    service.create(USERS, "carol", {"tier": "tiers/free"})
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


def switch(served, on: bool, etag: str = "") -> pb.PacingMode:
    request = pb.UpdatePacingModeRequest(
        pacing_mode=pb.PacingMode(fair_share=on, etag=etag)
    )
    request.update_mask.paths.append("fair_share")
    return served.stub.UpdatePacingMode(request)


def update_limit(served, user: str, *paths: str, **fields) -> pb.Limit:
    request = pb.UpdateLimitRequest(
        limit=pb.Limit(name=f"limits/{user}", **fields), allow_missing=True
    )
    request.update_mask.paths.extend(paths)
    return served.stub.UpdateLimit(request)


def update_tier(served, tier: str, *paths: str, **fields) -> pb.Tier:
    request = pb.UpdateTierRequest(
        tier=pb.Tier(name=f"tiers/{tier}", **fields), allow_missing=True
    )
    request.update_mask.paths.extend(paths)
    return served.stub.UpdateTier(request)


def state(served, user: str) -> pb.UserState:
    return served.stub.GetUserState(pb.GetUserStateRequest(name=f"userStates/{user}"))


def table(served) -> pb.LimitsTable:
    return served.stub.GetLimitsTable(pb.GetLimitsTableRequest())


# -- the switch ------------------------------------------------------------------


def test_fair_share_is_switched_live_and_wakes_the_engine(served, rig):
    before = served.stub.GetPacingMode(pb.GetPacingModeRequest())
    table_etag = table(served).etag
    got = switch(served, True)
    assert (got.fair_share, got.mode) == (True, pb.PacingMode.ENFORCE)
    assert rig.shared.fair_share.enabled is True
    assert got.etag != before.etag
    assert served.stub.GetPacingMode(pb.GetPacingModeRequest()) == got
    assert len(rig.wakes) == 1
    assert table(served).etag == table_etag  # the switch is not part of the table
    assert switch(served, False).fair_share is False
    assert rig.shared.fair_share.enabled is False


def test_a_mode_change_without_a_mask_leaves_fair_share_on(served, rig):
    switch(served, True)
    got = served.stub.UpdatePacingMode(
        pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(mode="SHADOW"))
    )
    assert (got.mode, got.fair_share) == (pb.PacingMode.SHADOW, True)
    assert (rig.shared.mode, rig.shared.fair_share.enabled) == (Mode.SHADOW, True)


def test_without_a_mask_fair_share_true_switches_it_on_and_keeps_the_mode(served, rig):
    got = served.stub.UpdatePacingMode(
        pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(fair_share=True))
    )
    assert (got.mode, got.fair_share) == (pb.PacingMode.ENFORCE, True)
    assert rig.shared.fair_share.enabled is True


def test_the_star_mask_sets_mode_and_switch_together(served, rig):
    request = pb.UpdatePacingModeRequest(
        pacing_mode=pb.PacingMode(mode="OFF", fair_share=True)
    )
    request.update_mask.paths.append("*")
    served.stub.UpdatePacingMode(request)
    assert (rig.shared.mode, rig.shared.fair_share.enabled) == (Mode.OFF, True)


def test_the_etag_guards_the_switch(served, rig):
    read = served.stub.GetPacingMode(pb.GetPacingModeRequest())
    switch(served, True)  # by someone else
    error = error_of(
        served.stub.UpdatePacingMode,
        pb.UpdatePacingModeRequest(
            pacing_mode=pb.PacingMode(mode="SHADOW", etag=read.etag)
        ),
    )
    assert error.code() == grpc.StatusCode.ABORTED
    assert rig.shared.mode is Mode.ENFORCE


def test_switching_on_where_the_engine_refuses_is_failed_precondition(rig):
    rig.shared.fair_share.refusal = REFUSAL
    written = []
    service = LimitsService(rig.shared, persist=written.append)
    with serving(service) as served:
        error = error_of(
            served.stub.UpdatePacingMode,
            pb.UpdatePacingModeRequest(
                pacing_mode=pb.PacingMode(fair_share=True),
                update_mask={"paths": ["fair_share"]},
            ),
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == (
            f"pacing_mode.fair_share: fair share cannot run here: {REFUSAL}"
        )
        assert rig.shared.fair_share.enabled is False
        assert written == []  # nothing persisted
        assert rig.wakes == []
        # The mode still switches on such an engine.
        served.stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(mode="SHADOW"))
        )
    assert rig.shared.mode is Mode.SHADOW


# -- weights -------------------------------------------------------------------


def test_a_weight_alone_gives_a_user_an_entry_without_a_limit(served, rig):
    got = update_limit(served, "dave", "weight", weight=2.5)
    assert (got.name, got.tokens_per_second, got.tier, got.weight) == (
        "limits/dave",
        0,
        "",
        2.5,
    )
    assert rig.shared.fair_share.weights.users == {"dave": 2.5}
    assert "dave" not in rig.limiter.user_rates
    assert rig.limiter.rate_of("dave") == 10  # the default still limits him
    assert served.stub.GetLimit(pb.GetLimitRequest(name="limits/dave")) == got
    listed = served.stub.ListLimits(pb.ListLimitsRequest()).limits
    assert [limit.name for limit in listed] == [
        "limits/alice",
        "limits/carol",
        "limits/dave",
    ]
    assert state(served, "dave").weight == 2.5
    assert len(rig.wakes) == 1


def test_clearing_the_only_weight_removes_the_entry(served, rig):
    update_limit(served, "dave", "weight", weight=2.0)
    assert update_limit(served, "dave", "weight") == pb.Limit(name="limits/dave")
    assert rig.shared.fair_share.weights.users == {}
    error = error_of(served.stub.GetLimit, pb.GetLimitRequest(name="limits/dave"))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_a_weight_beside_a_limit_keeps_the_limit_and_moves_the_etag(served, rig):
    before = served.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
    got = update_limit(served, "alice", weight=3.0)  # empty mask: the fields set
    assert (got.tokens_per_second, got.weight) == (5, 3.0)
    assert got.etag != before.etag
    assert rig.limiter.rate_of("alice") == 5
    error = error_of(
        served.stub.UpdateLimit,
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", weight=4.0, etag=before.etag)
        ),
    )
    assert error.code() == grpc.StatusCode.ABORTED
    assert rig.shared.fair_share.weights.users == {"alice": 3.0}
    # Deleting the entry deletes the weight with it.
    served.stub.DeleteLimit(pb.DeleteLimitRequest(name="limits/alice"))
    assert rig.shared.fair_share.weights.users == {}


def test_a_tiers_weight_applies_to_members_without_their_own(served, rig):
    got = update_tier(served, "free", "weight", weight=4.0)
    assert (got.tokens_per_second, got.weight, got.member_count) == (2, 4.0, 1)
    update_limit(served, "erin", "tier", "weight", tier="tiers/free", weight=0.5)
    assert state(served, "carol").weight == 4.0
    assert state(served, "erin").weight == 0.5  # her own wins
    assert state(served, "alice").weight == 1.0  # in no tier
    assert rig.shared.fair_share.weights.tiers == {"free": 4.0}
    assert served.stub.GetTier(pb.GetTierRequest(name="tiers/free")).weight == 4.0


def test_a_new_tier_takes_its_weight(served, rig):
    created = served.stub.CreateTier(
        pb.CreateTierRequest(
            tier_id="pro", tier=pb.Tier(tokens_per_second=200, weight=8.0)
        )
    )
    assert created.weight == 8.0
    assert rig.shared.fair_share.weights.tiers == {"pro": 8.0}


def test_a_weight_alone_does_not_make_a_tier(served, rig):
    error = error_of(
        served.stub.UpdateTier,
        pb.UpdateTierRequest(
            tier=pb.Tier(name="tiers/gold", weight=4.0), allow_missing=True
        ),
    )
    assert error.code() == Invalid
    assert error.details() == (
        "tier.weight: a weight alone does not make a tier: give 'tiers/gold' "
        "tokens_per_second or exempt"
    )
    error = error_of(
        served.stub.CreateTier,
        pb.CreateTierRequest(tier_id="gold", tier=pb.Tier(weight=4.0)),
    )
    assert error.code() == Invalid
    assert "tokens_per_second" in error.details()
    assert rig.shared.fair_share.weights.tiers == {}


def test_a_tier_that_loses_its_rate_and_exemption_loses_its_weight(served, rig):
    served.stub.CreateTier(
        pb.CreateTierRequest(tier_id="pro", tier=pb.Tier(tokens_per_second=9))
    )
    update_tier(served, "pro", "weight", weight=3.0)
    assert update_tier(served, "pro", "tokens_per_second") == pb.Tier(name="tiers/pro")
    assert rig.shared.fair_share.weights.tiers == {}
    served.stub.CreateTier(
        pb.CreateTierRequest(tier_id="pro", tier=pb.Tier(tokens_per_second=9))
    )
    assert served.stub.GetTier(pb.GetTierRequest(name="tiers/pro")).weight == 0


BAD_WEIGHTS = [-1.0, math.nan, math.inf, 1e7]


@pytest.mark.parametrize("weight", BAD_WEIGHTS, ids=["negative", "nan", "inf", "1e7"])
def test_a_bad_weight_is_invalid_argument_naming_the_field(served, rig, weight):
    calls = [
        (
            served.stub.UpdateLimit,
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/dave", weight=weight), allow_missing=True
            ),
            "limit.weight: must be a number in (0, 1e+06], got",
        ),
        (
            served.stub.CreateLimit,
            pb.CreateLimitRequest(limit_id="dave", limit=pb.Limit(weight=weight)),
            "limit.weight: must be a number in (0, 1e+06], got",
        ),
        (
            served.stub.UpdateTier,
            pb.UpdateTierRequest(tier=pb.Tier(name="tiers/free", weight=weight)),
            "tier.weight: must be a number in (0, 1e+06], got",
        ),
        (
            served.stub.CreateTier,
            pb.CreateTierRequest(
                tier_id="pro", tier=pb.Tier(tokens_per_second=5, weight=weight)
            ),
            "tier.weight: must be a number in (0, 1e+06], got",
        ),
        (
            served.stub.ReplaceLimitsTable,
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(
                    default_tokens_per_second=10,
                    limits=[pb.Limit(name="limits/dave", weight=weight)],
                )
            ),
            "limits_table.limits[0].weight: must be a number in (0, 1e+06], got",
        ),
        (
            served.stub.ReplaceLimitsTable,
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(
                    default_tokens_per_second=10,
                    tiers=[pb.Tier(name="tiers/x", exempt=True, weight=weight)],
                )
            ),
            "limits_table.tiers[0].weight: must be a number in (0, 1e+06], got",
        ),
    ]
    etag = table(served).etag
    for call, request, message in calls:
        error = error_of(call, request)
        assert error.code() == Invalid, message
        assert error.details().startswith(message), error.details()
    assert table(served).etag == etag
    assert rig.shared.fair_share.weights.users == {}
    assert rig.shared.fair_share.weights.tiers == {}


def test_the_limits_table_carries_weights_and_replace_sets_them(served, rig):
    switch(served, True)
    update_limit(served, "alice", "weight", weight=2.0)
    update_tier(served, "free", "weight", weight=4.0)
    got = table(served)
    assert [(x.name, x.weight) for x in got.limits] == [
        ("limits/alice", 2.0),
        ("limits/carol", 0.0),
    ]
    assert [(x.name, x.weight) for x in got.tiers] == [("tiers/free", 4.0)]
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=10,
                limits=[
                    pb.Limit(name="limits/bob", weight=3.0),  # a weight alone
                    pb.Limit(name="limits/carol", tier="tiers/pro"),
                ],
                tiers=[pb.Tier(name="tiers/pro", tokens_per_second=50, weight=6.0)],
                etag=got.etag,
            )
        )
    )
    assert replaced.etag != got.etag
    assert [(x.name, x.weight) for x in replaced.limits] == [
        ("limits/bob", 3.0),
        ("limits/carol", 0.0),
    ]
    weights = rig.shared.fair_share.weights
    assert (weights.users, weights.tiers) == ({"bob": 3.0}, {"pro": 6.0})
    assert rig.shared.fair_share.enabled is True  # not part of the table


# -- user state ----------------------------------------------------------------


def test_user_state_shows_weight_service_preemptions_and_lead(served, rig):
    switch(served, True)
    update_tier(served, "free", "weight", weight=2.0)
    ledger = rig.shared.fair_share
    ledger.counter.update({"alice": 100.0, "carol": 612.5, "dave": 40.0})
    ledger.backlogged = frozenset({"alice", "carol"})
    rig.accounting.record("carol", "fair_share_service", 612.5)
    rig.accounting.record("carol", "fair_share_preemptions", 2)
    rig.accounting.record("dave", "fair_share_service", 40.0)
    carol = state(served, "carol")
    assert (carol.fair_share, carol.weight) == (True, 2.0)
    assert (carol.fair_share_service, carol.fair_share_preemptions) == (612.5, 2)
    assert (carol.fair_share_backlogged, carol.fair_share_lead) == (True, 512.5)
    alice = state(served, "alice")
    assert (alice.fair_share_backlogged, alice.fair_share_lead) == (True, 0.0)
    dave = state(served, "dave")  # idle: not one of the gap's users
    assert (dave.fair_share_backlogged, dave.fair_share_lead) == (False, 0.0)
    listed = served.stub.ListUserStates(
        pb.ListUserStatesRequest(order_by="fair_share_service desc")
    ).user_states
    assert [s.user for s in listed] == ["carol", "dave", "alice"]
    watched = next(
        served.stub.WatchUserStates(
            pb.WatchUserStatesRequest(names=["userStates/carol"])
        )
    )
    assert watched.user_states[0].fair_share_lead == 512.5
    # Off, the last step's backlogged set is stale: nobody is in the gap.
    switch(served, False)
    carol = state(served, "carol")
    assert (carol.fair_share, carol.fair_share_backlogged) == (False, False)
    assert carol.fair_share_service == 612.5  # the counters stay
