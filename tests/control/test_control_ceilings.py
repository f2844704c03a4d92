"""Ceilings in the control plane: ``ceiling_tokens_per_second`` is carried by
every RPC that writes or reads a holder (the default, user entries, tiers,
teams, the whole table), lands in the ceilings' table at
once (the policy in force is replaced, ``SharedLimiter.policy``), is refused
with the rate rule's words at the request's field, and below the holder's own
rate with INVALID_ARGUMENT naming the ceiling; the user states show the
ceiling that applies, the tokens borrowed and whether the user may borrow."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask

from control.kinds import TEAMS, TIERS, USERS, Kind
from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

CEILING = "ceiling_tokens_per_second"
#: The rate rule's words for a bad value (``pacing.limits.validate_rate``).
RULE = "must be an integer in 1..1000000 (tokens per second), got"
#: The kinds whose holders may set a ceiling (``ATTRIBUTES``).
WITH_CEILINGS = (USERS, TIERS, TEAMS)
#: What each kind needs beside a ceiling to exist.
EXISTS = {
    "user": {},
    "tier": {"tokens_per_second": 5},
    "team": {"tokens_per_second": 5},
}


def below(rate: int, ceiling: int) -> str:
    """The words refusing a ceiling below its holder's rate."""
    return f"must be at least tokens_per_second ({rate}), got {ceiling}"


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


def ceiling_in_force(shared, kind: Kind, holder_id: str) -> int | None:
    """What the ceilings' tables hold: the ceiling that applies to a user
    (None: none), a tier's, a team's."""
    with shared.lock:
        table = shared.ceilings.table
        if kind is TIERS:
            return table.tier_rates.get(holder_id)
        if kind is TEAMS:
            return shared.ceilings.team_ceilings.get(holder_id)
        return table.rate_of(holder_id) or None


def user_state(served, user: str) -> pb.UserState:
    return served.stub.GetUserState(pb.GetUserStateRequest(name=f"userStates/{user}"))


def refused(write) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        write()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return error.value


# -- every verb of every kind that may set one ------------------------------------


@pytest.mark.parametrize("kind", WITH_CEILINGS, ids=lambda kind: kind.collection)
def test_every_kind_carries_its_ceiling_through_create_get_list_and_update(
    served, kind
):
    created = create(served, kind, "h1", ceiling_tokens_per_second=50)
    assert created.ceiling_tokens_per_second == 50
    got = call(served, "Get", kind, name=kind.name("h1"))
    assert got == created
    listed = getattr(call(served, "List", kind), kind.collection)
    assert [h.ceiling_tokens_per_second for h in listed if h.name == got.name] == [50]
    # A mask naming the ceiling changes it alone.
    updated = update(served, kind, "h1", [CEILING], ceiling_tokens_per_second=80)
    assert updated.ceiling_tokens_per_second == 80
    assert updated.tokens_per_second == created.tokens_per_second
    assert updated.etag != created.etag
    # A mask naming another field keeps it.
    kept = update(served, kind, "h1", ["tokens_per_second"], tokens_per_second=9)
    assert (kept.tokens_per_second, kept.ceiling_tokens_per_second) == (9, 80)
    # An empty mask changes the fields set: the ceiling alone here.
    again = update(served, kind, "h1", [], ceiling_tokens_per_second=90)
    assert (again.tokens_per_second, again.ceiling_tokens_per_second) == (9, 90)
    assert ceiling_in_force(served.rig.shared, kind, "h1") == 90


@pytest.mark.parametrize("kind", WITH_CEILINGS, ids=lambda kind: kind.collection)
def test_a_masked_zero_clears_the_ceiling_and_keeps_the_holder(served, kind):
    create(served, kind, "h1", tokens_per_second=7, ceiling_tokens_per_second=50)
    assert ceiling_in_force(served.rig.shared, kind, "h1") == 50
    cleared = update(served, kind, "h1", [CEILING])
    assert (cleared.tokens_per_second, cleared.ceiling_tokens_per_second) == (7, 0)
    assert call(served, "Get", kind, name=kind.name("h1")) == cleared
    assert ceiling_in_force(served.rig.shared, kind, "h1") is None
    with served.rig.shared.lock:
        assert not served.rig.shared.ceilings.active


def test_a_user_entry_may_hold_a_ceiling_alone(served):
    created = create(served, USERS, "p", ceiling_tokens_per_second=50)
    assert (created.tokens_per_second, created.ceiling_tokens_per_second) == (0, 50)
    shared = served.rig.shared
    assert ceiling_in_force(shared, USERS, "p") == 50
    assert shared.limiter.rate_of("p") == 10  # the default rate still applies
    update(served, USERS, "p", [CEILING])  # clearing it leaves no entry
    with pytest.raises(grpc.RpcError) as gone:
        call(served, "Get", USERS, name="limits/p")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_ceiling_alone_does_not_make_a_tier(served):
    error = refused(
        lambda: call(
            served,
            "Create",
            TIERS,
            tier_id="free",
            tier=pb.Tier(ceiling_tokens_per_second=50),
        )
    )
    assert error.details() == f"tier.tokens_per_second: {RULE} 0"
    assert served.rig.shared.policy.groups["tier"] == {}


# -- the default ----------------------------------------------------------------


def test_the_default_limit_carries_its_ceiling_through_get_and_update(served):
    stub = served.stub
    set_ = stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(ceiling_tokens_per_second=40)
        )
    )
    assert (set_.tokens_per_second, set_.ceiling_tokens_per_second) == (10, 40)
    assert stub.GetDefaultLimit(pb.GetDefaultLimitRequest()) == set_
    rate = stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=20)
        )
    )
    assert (rate.tokens_per_second, rate.ceiling_tokens_per_second) == (20, 40)
    with served.rig.shared.lock:
        assert served.rig.shared.ceilings.table.rate_of("nobody") == 40
    masked = stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=99),
            update_mask=FieldMask(paths=[CEILING]),
        )
    )
    assert (masked.tokens_per_second, masked.ceiling_tokens_per_second) == (20, 0)
    assert stub.GetLimitsTable(pb.GetLimitsTableRequest()).default == masked
    with served.rig.shared.lock:
        assert served.rig.shared.ceilings.table.rate_of("nobody") == 0


def test_ceilings_resolve_as_rates_do_own_then_tiers_then_the_defaults(served):
    served.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(ceiling_tokens_per_second=40)
        )
    )
    create(served, TIERS, "free", ceiling_tokens_per_second=30)
    create(served, USERS, "own", ceiling_tokens_per_second=70)
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/m", tier="tiers/free"),
        allow_missing=True,
    )
    shared = served.rig.shared
    with shared.lock:
        table = shared.ceilings.table
        assert [table.rate_of(u) for u in ("own", "m", "alice", "nobody")] == [
            70,
            30,
            40,
            40,
        ]


# -- a ceiling below the rate ---------------------------------------------------


@pytest.mark.parametrize("kind", WITH_CEILINGS, ids=lambda kind: kind.collection)
def test_a_ceiling_below_the_holders_rate_is_refused_naming_it(served, kind):
    create(served, kind, "h1", tokens_per_second=20, ceiling_tokens_per_second=50)
    etag = call(served, "Get", kind, name=kind.name("h1")).etag
    where = f"{kind.resource}.{CEILING}"
    for write, message in (
        (
            lambda: update(served, kind, "h1", [CEILING], ceiling_tokens_per_second=9),
            below(20, 9),
        ),
        (  # raising the rate above the ceiling names the ceiling too
            lambda: update(served, kind, "h1", [], tokens_per_second=60),
            below(60, 50),
        ),
        (
            lambda: create(
                served, kind, "h2", tokens_per_second=20, ceiling_tokens_per_second=19
            ),
            below(20, 19),
        ),
    ):
        assert refused(write).details() == f"{where}: {message}"
    got = call(served, "Get", kind, name=kind.name("h1"))
    assert (got.etag, got.ceiling_tokens_per_second) == (etag, 50)
    assert ceiling_in_force(served.rig.shared, kind, "h1") == 50
    # Equal to the rate is a ceiling that lends nothing, and allowed.
    same = update(served, kind, "h1", [CEILING], ceiling_tokens_per_second=20)
    assert same.ceiling_tokens_per_second == 20


def test_a_default_ceiling_below_the_default_rate_is_refused_naming_it(served):
    stub = served.stub
    error = refused(
        lambda: stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(ceiling_tokens_per_second=5)
            )
        )
    )
    assert error.details() == f"default_limit.{CEILING}: {below(10, 5)}"
    stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(ceiling_tokens_per_second=40)
        )
    )
    error = refused(
        lambda: stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(tokens_per_second=50)
            )
        )
    )
    assert error.details() == f"default_limit.{CEILING}: {below(50, 40)}"
    default = stub.GetDefaultLimit(pb.GetDefaultLimitRequest())
    assert (default.tokens_per_second, default.ceiling_tokens_per_second) == (10, 40)
    assert served.rig.limiter.default_rate == 10


def test_a_ceiling_below_the_rate_in_a_replaced_table_is_refused_at_its_field(
    served,
):
    before = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    for table, field, message in (
        (
            pb.LimitsTable(
                default_tokens_per_second=10,
                limits=[
                    pb.Limit(
                        name="limits/p",
                        tokens_per_second=30,
                        ceiling_tokens_per_second=20,
                    )
                ],
            ),
            "limits_table.limits[0]",
            below(30, 20),
        ),
        (
            pb.LimitsTable(
                default_tokens_per_second=10,
                tiers=[
                    pb.Tier(
                        name="tiers/free",
                        tokens_per_second=30,
                        ceiling_tokens_per_second=20,
                    )
                ],
            ),
            "limits_table.tiers[0]",
            below(30, 20),
        ),
        (
            pb.LimitsTable(
                default_tokens_per_second=10,
                default=pb.DefaultLimit(ceiling_tokens_per_second=5),
            ),
            "limits_table.default",
            below(10, 5),
        ),
    ):
        error = refused(
            lambda table=table: served.stub.ReplaceLimitsTable(
                pb.ReplaceLimitsTableRequest(limits_table=table)
            )
        )
        assert error.details() == f"{field}.{CEILING}: {message}"
    assert served.stub.GetLimitsTable(pb.GetLimitsTableRequest()) == before


# -- bad values -------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 1_000_001])
@pytest.mark.parametrize("kind", WITH_CEILINGS, ids=lambda kind: kind.collection)
def test_a_bad_ceiling_is_refused_at_the_field_and_changes_nothing(served, kind, value):
    create(served, kind, "h1", ceiling_tokens_per_second=50)
    etag = call(served, "Get", kind, name=kind.name("h1")).etag
    for write in (
        lambda: update(served, kind, "h1", [CEILING], ceiling_tokens_per_second=value),
        lambda: update(served, kind, "h1", [], ceiling_tokens_per_second=value),
        lambda: create(served, kind, "h2", ceiling_tokens_per_second=value),
    ):
        error = refused(write)
        assert error.details() == f"{kind.resource}.{CEILING}: {RULE} {value}"
    assert call(served, "Get", kind, name=kind.name("h1")).etag == etag
    assert ceiling_in_force(served.rig.shared, kind, "h1") == 50


@pytest.mark.parametrize("value", [-1, 1_000_001])
def test_a_bad_default_ceiling_is_refused_at_the_field(served, value):
    error = refused(
        lambda: served.stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(ceiling_tokens_per_second=value)
            )
        )
    )
    assert error.details() == f"default_limit.{CEILING}: {RULE} {value}"
    assert served.rig.shared.policy.default.ceiling_tokens_per_second is None


# -- hot reload and the whole table ---------------------------------------------


def test_every_ceiling_written_lands_in_the_ceilings_table_at_once(served):
    shared = served.rig.shared
    wakes = len(served.rig.wakes)
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/p", ceiling_tokens_per_second=50),
        allow_missing=True,
    )
    assert ceiling_in_force(shared, USERS, "p") == 50
    with shared.lock:
        assert shared.ceilings.active
    create(served, TIERS, "free", ceiling_tokens_per_second=20)
    call(
        served,
        "Update",
        USERS,
        limit=pb.Limit(name="limits/m", tier="tiers/free"),
        allow_missing=True,
    )
    assert ceiling_in_force(shared, USERS, "m") == 20  # the tier's
    update(served, TIERS, "free", [CEILING], ceiling_tokens_per_second=30)
    assert ceiling_in_force(shared, USERS, "m") == 30
    call(served, "Delete", USERS, name="limits/p")
    assert ceiling_in_force(shared, USERS, "p") is None
    call(served, "Delete", USERS, name="limits/m")
    call(served, "Delete", TIERS, name="tiers/free")
    with shared.lock:
        assert not shared.ceilings.active
    assert len(served.rig.wakes) > wakes  # each change wakes an idle engine


def test_replace_limits_table_carries_every_ceiling(served):
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=10,
                default=pb.DefaultLimit(
                    tokens_per_second=10, ceiling_tokens_per_second=40
                ),
                limits=[
                    pb.Limit(
                        name="limits/p",
                        tokens_per_second=100,
                        ceiling_tokens_per_second=150,
                    ),
                    pb.Limit(name="limits/m", tier="tiers/free", team="teams/acme"),
                ],
                tiers=[
                    pb.Tier(
                        name="tiers/free",
                        tokens_per_second=5,
                        ceiling_tokens_per_second=25,
                    )
                ],
                teams=[pb.Team(name="teams/acme", tokens_per_second=600)],
            )
        )
    )
    got = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
    assert got == replaced
    assert got.default.ceiling_tokens_per_second == 40
    assert {h.name: h.ceiling_tokens_per_second for h in got.limits} == {
        "limits/m": 0,
        "limits/p": 150,
    }
    assert [t.ceiling_tokens_per_second for t in got.tiers] == [25]
    shared = served.rig.shared
    with shared.lock:
        table = shared.ceilings.table
        assert [table.rate_of(u) for u in ("p", "m", "alice")] == [150, 25, 40]


# -- the states -----------------------------------------------------------------


def test_a_user_without_a_ceiling_shows_none_and_may_not_borrow(served):
    state = user_state(served, "alice")
    assert (state.ceiling_tokens_per_second, state.borrowed_tokens) == (0, 0)
    assert not state.may_borrow


def test_user_state_shows_the_ceiling_the_tokens_borrowed_and_the_spare(served):
    rig = served.rig
    shared = rig.shared
    create(served, USERS, "p", tokens_per_second=10, ceiling_tokens_per_second=30)
    with shared.lock:
        now = rig.clock()
        shared.limiter.take_up_to("p", 100, now)  # its own budget spent
        borrowing = shared.budget
        assert borrowing is shared.ceilings.borrowing
        borrowed, _ = borrowing.take_up_to("p", 100, now)
    assert borrowed > 0
    state = user_state(served, "p")
    assert (state.limit_tokens_per_second, state.ceiling_tokens_per_second) == (10, 30)
    assert state.borrowed_tokens == borrowed
    assert state.may_borrow  # nobody waits
    with shared.lock:
        borrowing.lend_to({"alice", "bob"})  # others within their rate wait
    assert not user_state(served, "p").may_borrow
    with shared.lock:
        borrowing.lend_to({"p"})  # p alone waits: spare for p, not for alice
    assert user_state(served, "p").may_borrow
    assert not user_state(served, "alice").may_borrow
    # A refund goes back to the borrow cell first.
    with shared.lock:
        borrowing.refund("p", rig.clock(), 1)
    assert user_state(served, "p").borrowed_tokens == borrowed - 1


def test_a_user_known_only_by_its_ceiling_has_a_state(served):
    create(served, USERS, "p", ceiling_tokens_per_second=30)
    state = user_state(served, "p")
    assert (state.limit_tokens_per_second, state.ceiling_tokens_per_second) == (10, 30)
    listed = served.stub.ListUserStates(pb.ListUserStatesRequest()).user_states
    assert {s.user: s.ceiling_tokens_per_second for s in listed} == {
        "alice": 0,
        "p": 30,
    }


def test_watched_states_carry_the_ceiling(served):
    create(served, USERS, "p", ceiling_tokens_per_second=30)
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
    assert (state.user, state.ceiling_tokens_per_second, state.may_borrow) == (
        "p",
        30,
        True,
    )
