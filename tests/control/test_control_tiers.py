"""Tiers, memberships and exemptions through a real in-process gRPC server:
CRUD, etags, where a user's limit comes from, and every bad input with its
status code and message."""

from __future__ import annotations

import grpc
import pytest

from control.kinds import TIERS, USERS
from control.service.operations import LimitsService
from control.table import MAX_TIERS
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

CONTROL = "/outputrate.v1.OutputRateControl/"
Invalid = grpc.StatusCode.INVALID_ARGUMENT
NotFound = grpc.StatusCode.NOT_FOUND
Precondition = grpc.StatusCode.FAILED_PRECONDITION
Aborted = grpc.StatusCode.ABORTED


@pytest.fixture
def rig():
    """alice 5/s of her own; tier free at 2/s with carol; tier staff exempt."""
    rig = make_rig(10, {"alice": 5, "bob": 20})
    service = LimitsService(rig.shared)
    service.create(TIERS, "free", {"tokens_per_second": 2})
    service.create(TIERS, "staff", {"exempt": True})
    service.create(USERS, "carol", {"tier": "tiers/free"})
    rig.wakes.clear()
    return rig


@pytest.fixture
def service(rig):
    return LimitsService(rig.shared)


@pytest.fixture
def served(service):
    with serving(service) as served:
        yield served


def table(served) -> pb.LimitsTable:
    return served.stub.GetLimitsTable(pb.GetLimitsTableRequest())


def error_of(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value


def state(served, user: str) -> pb.UserState:
    return served.stub.GetUserState(pb.GetUserStateRequest(name=f"userStates/{user}"))


def update_limit(served, user: str, *paths: str, **fields) -> pb.Limit:
    request = pb.UpdateLimitRequest(
        limit=pb.Limit(name=f"limits/{user}", **fields), allow_missing=True
    )
    request.update_mask.paths.extend(paths)
    return served.stub.UpdateLimit(request)


def update_tier(served, tier: str, *paths: str, **fields) -> pb.Tier:
    request = pb.UpdateTierRequest(tier=pb.Tier(name=f"tiers/{tier}", **fields))
    request.update_mask.paths.extend(paths)
    return served.stub.UpdateTier(request)


# -- tiers -------------------------------------------------------------------


def test_create_get_and_list_tiers_with_member_counts(served):
    created = served.stub.CreateTier(
        pb.CreateTierRequest(tier_id="pro", tier=pb.Tier(tokens_per_second=200))
    )
    assert (created.name, created.tokens_per_second, created.exempt) == (
        "tiers/pro",
        200,
        False,
    )
    assert created.etag
    got = served.stub.GetTier(pb.GetTierRequest(name="tiers/free"))
    assert (got.tokens_per_second, got.member_count) == (2, 1)
    listed = served.stub.ListTiers(pb.ListTiersRequest(page_size=2))
    assert [(t.name, t.member_count) for t in listed.tiers] == [
        ("tiers/free", 1),
        ("tiers/pro", 0),
    ]
    rest = served.stub.ListTiers(
        pb.ListTiersRequest(page_size=2, page_token=listed.next_page_token)
    )
    assert [(t.name, t.exempt, t.tokens_per_second) for t in rest.tiers] == [
        ("tiers/staff", True, 0)
    ]
    assert rest.next_page_token == ""


def test_a_member_gets_its_tiers_rate_and_a_rate_change_keeps_its_debt(served, rig):
    rig.step("carol", 2)  # free at 2/s: one token granted, TAT 500 ms ahead
    assert rig.limiter.rate_of("carol") == 2
    assert state(served, "carol").tat_lead.ToNanoseconds() == 500_000_000
    update_tier(served, "free", tokens_per_second=10)
    # One token owed at 10/s: 100 ms ahead, within the burst; at the next step.
    after = state(served, "carol")
    assert after.limit_tokens_per_second == 10
    assert after.tat_lead.ToNanoseconds() == 100_000_000
    assert after.next_token_in.ToNanoseconds() == 0
    assert len(rig.wakes) == 1


def test_a_users_own_limit_wins_over_its_tier(served, rig):
    update_limit(served, "alice", tier="tiers/free")
    got = served.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
    assert (got.tokens_per_second, got.tier) == (5, "tiers/free")
    assert rig.limiter.rate_of("alice") == 5
    alice = state(served, "alice")
    assert (alice.limit_source, alice.tier) == (pb.UserState.USER, "tiers/free")


def test_deleting_a_tier_with_members_fails_and_changes_nothing(served, rig):
    before = table(served)
    error = error_of(served.stub.DeleteTier, pb.DeleteTierRequest(name="tiers/free"))
    assert error.code() == Precondition
    assert "'tiers/free' has 1 member(s)" in error.details()
    assert table(served) == before
    update_limit(served, "carol", "tier")  # carol leaves: her entry is now empty
    served.stub.DeleteTier(pb.DeleteTierRequest(name="tiers/free"))
    assert [t.name for t in table(served).tiers] == ["tiers/staff"]
    assert rig.limiter.rate_of("carol") == 10


def test_removing_a_tiers_last_rule_is_refused_while_it_has_members(served, rig):
    error = error_of(
        served.stub.UpdateTier,
        pb.UpdateTierRequest(
            tier=pb.Tier(name="tiers/free"), update_mask={"paths": ["*"]}
        ),
    )
    assert error.code() == Precondition
    assert rig.limiter.tier_rates == {"free": 2}


def test_an_update_leaving_a_tier_neither_rate_nor_exemption_removes_it(served, rig):
    update_tier(served, "staff", "exempt", exempt=False)
    assert "staff" not in rig.limiter.exempt_tiers
    assert [t.name for t in table(served).tiers] == ["tiers/free"]


def test_update_tier_creates_only_with_allow_missing(served, rig):
    request = pb.UpdateTierRequest(tier=pb.Tier(name="tiers/pro", tokens_per_second=9))
    assert error_of(served.stub.UpdateTier, request).code() == NotFound
    request.allow_missing = True
    assert served.stub.UpdateTier(request).tokens_per_second == 9
    assert rig.limiter.tier_rates == {"free": 2, "pro": 9}


def test_a_tier_switched_from_rate_to_exemption_keeps_its_members(served, rig):
    update_tier(served, "free", "*", exempt=True)
    got = served.stub.GetTier(pb.GetTierRequest(name="tiers/free"))
    assert (got.tokens_per_second, got.exempt, got.member_count) == (0, True, 1)
    assert rig.limiter.rate_of("carol") == 0
    assert state(served, "carol").limit_source == pb.UserState.EXEMPT


def test_the_number_of_tiers_is_bounded(served):
    for i in range(MAX_TIERS - 2):
        served.stub.CreateTier(
            pb.CreateTierRequest(tier_id=f"t{i}", tier=pb.Tier(tokens_per_second=1))
        )
    error = error_of(
        served.stub.CreateTier,
        pb.CreateTierRequest(tier_id="one-more", tier=pb.Tier(tokens_per_second=1)),
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"at most {MAX_TIERS} tiers" in error.details()


# -- membership and exemptions ------------------------------------------------


def test_an_empty_mask_changes_only_the_fields_set(served, rig):
    got = update_limit(served, "alice", tier="tiers/free")
    assert (got.tokens_per_second, got.tier, got.exempt) == (5, "tiers/free", False)
    got = update_limit(served, "alice", tokens_per_second=7)
    assert (got.tokens_per_second, got.tier) == (7, "tiers/free")
    assert rig.limiter.memberships == {"alice": "free", "carol": "free"}


def test_a_field_named_in_the_mask_is_cleared(served, rig):
    update_limit(served, "alice", tier="tiers/free")
    got = update_limit(served, "alice", "tokens_per_second")
    assert (got.tokens_per_second, got.tier) == (0, "tiers/free")
    assert rig.limiter.rate_of("alice") == 2  # the tier's rate now


def test_an_update_that_leaves_nothing_removes_the_entry(served, rig):
    update_limit(served, "bob", "*")
    error = error_of(served.stub.GetLimit, pb.GetLimitRequest(name="limits/bob"))
    assert error.code() == NotFound
    assert "bob" not in rig.limiter.user_rates


def test_an_exempt_user_is_never_throttled_and_gets_its_limit_back(served, rig):
    got = update_limit(served, "alice", exempt=True)
    assert (got.tokens_per_second, got.exempt) == (5, True)
    assert rig.step("alice", 100) == 100  # 5/s would grant one
    alice = state(served, "alice")
    assert (alice.limit_tokens_per_second, alice.throttled_skips) == (0, 0)
    assert alice.limit_source == pb.UserState.EXEMPT
    update_limit(served, "alice", "exempt")
    assert rig.limiter.rate_of("alice") == 5
    assert rig.step("alice", 3) == 1


def test_an_exemption_is_distinct_from_no_entry(served, rig):
    update_limit(served, "dan", exempt=True)
    got = served.stub.GetLimit(pb.GetLimitRequest(name="limits/dan"))
    assert (got.tokens_per_second, got.tier, got.exempt) == (0, "", True)
    assert rig.limiter.rate_of("dan") == 0
    served.stub.DeleteLimit(pb.DeleteLimitRequest(name="limits/dan"))
    assert rig.limiter.rate_of("dan") == 10  # no entry: the default


def test_an_exempt_tier_frees_members_without_a_limit_of_their_own(served, rig):
    update_limit(served, "alice", tier="tiers/staff")
    update_limit(served, "dan", tier="tiers/staff")
    assert rig.limiter.rate_of("dan") == 0
    assert rig.limiter.rate_of("alice") == 5  # her pinned limit stays
    dan = state(served, "dan")
    assert (dan.limit_source, dan.tier) == (pb.UserState.EXEMPT, "tiers/staff")


def test_create_limit_with_only_a_tier(served, rig):
    got = served.stub.CreateLimit(
        pb.CreateLimitRequest(limit_id="erin", limit=pb.Limit(tier="tiers/free"))
    )
    assert (got.name, got.tokens_per_second, got.tier) == (
        "limits/erin",
        0,
        "tiers/free",
    )
    assert rig.limiter.rate_of("erin") == 2


def test_list_limits_includes_members_and_exempt_users(served):
    update_limit(served, "dan", exempt=True)
    page = served.stub.ListLimits(pb.ListLimitsRequest())
    assert [(x.name, x.tokens_per_second, x.tier, x.exempt) for x in page.limits] == [
        ("limits/alice", 5, "", False),
        ("limits/bob", 20, "", False),
        ("limits/carol", 0, "tiers/free", False),
        ("limits/dan", 0, "", True),
    ]


# -- etags -------------------------------------------------------------------


def test_a_limits_etag_guards_its_update_and_delete(served, rig):
    read = served.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
    update_limit(served, "alice", tokens_per_second=6)  # someone else
    stale = pb.UpdateLimitRequest(
        limit=pb.Limit(name="limits/alice", tokens_per_second=9, etag=read.etag)
    )
    error = error_of(served.stub.UpdateLimit, stale)
    assert error.code() == Aborted
    assert "'limits/alice' changed since it was read" in error.details()
    assert rig.limiter.rate_of("alice") == 6
    fresh = served.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
    stale.limit.etag = fresh.etag
    updated = served.stub.UpdateLimit(stale)
    assert updated.etag not in ("", fresh.etag)
    error = error_of(
        served.stub.DeleteLimit,
        pb.DeleteLimitRequest(name="limits/alice", etag=fresh.etag),
    )
    assert error.code() == Aborted
    served.stub.DeleteLimit(
        pb.DeleteLimitRequest(name="limits/alice", etag=updated.etag)
    )
    assert "alice" not in rig.limiter.user_rates


def test_a_tiers_etag_guards_its_update_and_delete(served, rig):
    read = served.stub.GetTier(pb.GetTierRequest(name="tiers/staff"))
    update_tier(served, "staff", tokens_per_second=50)
    request = pb.UpdateTierRequest(
        tier=pb.Tier(name="tiers/staff", tokens_per_second=60, etag=read.etag)
    )
    assert error_of(served.stub.UpdateTier, request).code() == Aborted
    assert rig.limiter.tier_rates["staff"] == 50
    error = error_of(
        served.stub.DeleteTier, pb.DeleteTierRequest(name="tiers/staff", etag=read.etag)
    )
    assert error.code() == Aborted
    current = served.stub.GetTier(pb.GetTierRequest(name="tiers/staff")).etag
    served.stub.DeleteTier(pb.DeleteTierRequest(name="tiers/staff", etag=current))
    assert "staff" not in rig.limiter.tier_rates


def test_every_tier_or_membership_change_moves_the_tables_etag(served, rig):
    etags = {table(served).etag}
    update_tier(served, "free", tokens_per_second=3)
    etags.add(table(served).etag)
    update_limit(served, "bob", tier="tiers/free")
    etags.add(table(served).etag)
    update_limit(served, "bob", exempt=True)
    etags.add(table(served).etag)
    assert len(etags) == 4
    assert len(rig.wakes) == 3


# -- the whole table -----------------------------------------------------------


def test_the_table_holds_tiers_memberships_and_exemptions(served):
    update_limit(served, "dan", exempt=True)
    got = table(served)
    assert [
        (t.name, t.tokens_per_second, t.exempt, t.member_count) for t in got.tiers
    ] == [
        ("tiers/free", 2, False, 1),
        ("tiers/staff", 0, True, 0),
    ]
    assert [(x.name, x.tokens_per_second, x.tier, x.exempt) for x in got.limits] == [
        ("limits/alice", 5, "", False),
        ("limits/bob", 20, "", False),
        ("limits/carol", 0, "tiers/free", False),
        ("limits/dan", 0, "", True),
    ]


def test_replacing_the_table_with_what_was_read_keeps_everything(served, rig):
    before = table(served)
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(limits_table=before)
    )
    assert replaced.etag != before.etag
    before.etag = replaced.etag
    assert replaced == before


def test_replace_swaps_tiers_and_moves_members_at_once(served, rig):
    rig.step("carol", 1)  # free at 2/s: 500 ms ahead
    served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=10,
                tiers=[pb.Tier(name="tiers/pro", tokens_per_second=20)],
                limits=[pb.Limit(name="limits/carol", tier="tiers/pro")],
            )
        )
    )
    assert rig.limiter.tier_rates == {"pro": 20}
    assert rig.limiter.memberships == {"carol": "pro"}
    assert rig.limiter.user_rates == {}
    # Her one owed token is kept at the new pace: 50 ms ahead.
    assert state(served, "carol").tat_lead.ToNanoseconds() == 50_000_000


# -- where a user's limit comes from ---------------------------------------------


@pytest.mark.parametrize(
    ("user", "change", "source", "tier", "limit"),
    [
        ("alice", {}, pb.UserState.USER, "", 5),
        ("carol", {}, pb.UserState.TIER, "tiers/free", 2),
        ("zed", {}, pb.UserState.DEFAULT, "", 10),
        ("zed", {"exempt": True}, pb.UserState.EXEMPT, "", 0),
        ("zed", {"tier": "tiers/staff"}, pb.UserState.EXEMPT, "tiers/staff", 0),
        ("alice", {"tier": "tiers/staff"}, pb.UserState.USER, "tiers/staff", 5),
    ],
    ids=["own", "tier", "default", "exempt", "exempt-tier", "own-over-exempt-tier"],
)
def test_user_state_shows_where_the_limit_comes_from(
    served, rig, user, change, source, tier, limit
):
    if change:
        update_limit(served, user, **change)
    rig.step(user)
    got = state(served, user)
    assert (got.limit_source, got.tier, got.limit_tokens_per_second) == (
        source,
        tier,
        limit,
    )


def test_user_state_while_pacing_is_off_says_off():
    rig = make_rig(None)
    with serving(LimitsService(rig.shared)) as served:
        rig.step("u")
        assert state(served, "u").limit_source == pb.UserState.OFF


def test_a_user_known_only_by_its_entry_has_a_state(served):
    update_limit(served, "dan", exempt=True)
    assert state(served, "dan").user == "dan"
    assert state(served, "carol").tier == "tiers/free"
    users = served.stub.ListUserStates(pb.ListUserStatesRequest()).user_states
    assert [s.user for s in users] == ["alice", "bob", "carol", "dan"]


# -- bad input ---------------------------------------------------------------

BAD_INPUT = [
    # (id, method, request, code, message part)
    (
        "get tier bad name",
        "GetTier",
        pb.GetTierRequest(name="free"),
        Invalid,
        "name must look like tiers/{tier}",
    ),
    (
        "get tier empty id",
        "GetTier",
        pb.GetTierRequest(name="tiers/"),
        Invalid,
        "tier id in name must not be empty",
    ),
    (
        "get unknown tier",
        "GetTier",
        pb.GetTierRequest(name="tiers/gold"),
        NotFound,
        "'tiers/gold' does not exist",
    ),
    (
        "create tier without rate or exemption",
        "CreateTier",
        pb.CreateTierRequest(tier_id="gold"),
        Invalid,
        "tier.tokens_per_second: must be an integer in 1..1000000 "
        "(tokens per second), got 0",
    ),
    (
        "create tier huge rate",
        "CreateTier",
        pb.CreateTierRequest(
            tier_id="gold", tier=pb.Tier(tokens_per_second=10**7, exempt=True)
        ),
        Invalid,
        "got 10000000",
    ),
    (
        "create tier control char",
        "CreateTier",
        pb.CreateTierRequest(tier_id="g\nold", tier=pb.Tier(tokens_per_second=1)),
        Invalid,
        "tier_id must not contain control characters",
    ),
    (
        "create existing tier",
        "CreateTier",
        pb.CreateTierRequest(tier_id="free", tier=pb.Tier(tokens_per_second=1)),
        grpc.StatusCode.ALREADY_EXISTS,
        "'tiers/free' exists",
    ),
    (
        "update tier bad mask",
        "UpdateTier",
        pb.UpdateTierRequest(
            tier=pb.Tier(name="tiers/free", tokens_per_second=1),
            update_mask={"paths": ["member_count"]},
        ),
        Invalid,
        "update_mask: cannot update 'member_count'",
    ),
    (
        "update tier negative rate",
        "UpdateTier",
        pb.UpdateTierRequest(tier=pb.Tier(name="tiers/free", tokens_per_second=-1)),
        Invalid,
        "got -1",
    ),
    (
        "update tier zero rate without mask",
        "UpdateTier",
        pb.UpdateTierRequest(tier=pb.Tier(name="tiers/free")),
        Invalid,
        "tier.tokens_per_second: must be an integer in 1..1000000 "
        "(tokens per second), got 0",
    ),
    (
        "update unknown tier",
        "UpdateTier",
        pb.UpdateTierRequest(tier=pb.Tier(name="tiers/gold", tokens_per_second=1)),
        NotFound,
        "'tiers/gold' does not exist",
    ),
    (
        "delete tier with members",
        "DeleteTier",
        pb.DeleteTierRequest(name="tiers/free"),
        Precondition,
        "'tiers/free' has 1 member(s)",
    ),
    (
        "delete unknown tier",
        "DeleteTier",
        pb.DeleteTierRequest(name="tiers/gold"),
        NotFound,
        "does not exist",
    ),
    (
        "delete tier stale etag",
        "DeleteTier",
        pb.DeleteTierRequest(name="tiers/staff", etag="0-0"),
        Aborted,
        "etag '0-0' is not current: 'tiers/staff' changed",
    ),
    (
        "list tiers negative page size",
        "ListTiers",
        pb.ListTiersRequest(page_size=-1),
        Invalid,
        "page_size must not be negative",
    ),
    (
        "list tiers garbage token",
        "ListTiers",
        pb.ListTiersRequest(page_token="garbage"),
        Invalid,
        "page_token is not valid",
    ),
    (
        "membership bad tier name",
        "UpdateLimit",
        pb.UpdateLimitRequest(limit=pb.Limit(name="limits/alice", tier="free")),
        Invalid,
        "limit.tier must look like tiers/{tier}",
    ),
    (
        "membership of unknown tier",
        "UpdateLimit",
        pb.UpdateLimitRequest(limit=pb.Limit(name="limits/alice", tier="tiers/gold")),
        Precondition,
        "limit.tier: unknown tier 'gold'",
    ),
    (
        "create entry in unknown tier",
        "CreateLimit",
        pb.CreateLimitRequest(limit_id="new", limit=pb.Limit(tier="tiers/gold")),
        Precondition,
        "limit.tier: unknown tier 'gold'",
    ),
    (
        "update entry bad mask",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", exempt=True),
            update_mask={"paths": ["etag"]},
        ),
        Invalid,
        "update_mask: cannot update 'etag'; mutable: "
        "tokens_per_second, exempt, weight, prompt_tokens_per_second, "
        "ceiling_tokens_per_second, band, tier, team",
    ),
    (
        "update entry stale etag",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", tokens_per_second=1, etag="0-0")
        ),
        Aborted,
        "'limits/alice' changed since it was read",
    ),
    (
        "replace membership outside the table",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1,
                limits=[pb.Limit(name="limits/a", tier="tiers/free")],
            )
        ),
        Invalid,
        "limits_table.limits[0].tier: unknown tier 'free'",
    ),
    (
        "replace duplicate tier",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1,
                tiers=[
                    pb.Tier(name="tiers/a", tokens_per_second=1),
                    pb.Tier(name="tiers/a", exempt=True),
                ],
            )
        ),
        Invalid,
        "limits_table.tiers[1].name: 'tiers/a' appears more than once",
    ),
    (
        "replace tier without rule",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1, tiers=[pb.Tier(name="tiers/a")]
            )
        ),
        Invalid,
        "limits_table.tiers[0].tokens_per_second: must be an integer in 1..1000000",
    ),
    (
        "replace empty entry",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1, limits=[pb.Limit(name="limits/a")]
            )
        ),
        Invalid,
        "limits_table.limits[0].tokens_per_second: must be an integer in 1..1000000",
    ),
    (
        "replace too many tiers",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1,
                tiers=[
                    pb.Tier(name=f"tiers/t{i}", exempt=True)
                    for i in range(MAX_TIERS + 1)
                ],
            )
        ),
        Invalid,
        f"limits_table.tiers: a policy holds at most {MAX_TIERS} tiers, "
        f"got {MAX_TIERS + 1}",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "code", "message"),
    [row[1:] for row in BAD_INPUT],
    ids=[row[0] for row in BAD_INPUT],
)
def test_bad_input_gets_its_status_and_changes_nothing(
    served, rig, method, request_, code, message
):
    before = table(served)
    error = error_of(getattr(served.stub, method), request_)
    assert error.code() == code
    assert message in error.details()
    assert table(served) == before
    assert rig.wakes == []
    assert served.server.rpc_counts.snapshot()[(CONTROL + method, code.name)] == 1
