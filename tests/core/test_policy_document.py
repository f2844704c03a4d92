"""The policy document (``pacing.policy.document``): document -> ``Policy`` ->
document is the identity for random valid policies, every earlier-format
document gives the same policy as its rewrite in the object form, and each
rule fails once, at the path of the mistake."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacing.modes import Mode
from pacing.policy.document import Document, parse, to_tree
from pacing.policy.errors import PolicyError, render_path
from pacing.policy.model import KINDS, Limits, Policy, User
from pacing.policy.text import dumps, loads

IDS = st.sampled_from(["a", "b", "user-c", "d.e", "ü", "f g", "x/y"])
RATES = st.integers(1, 1_000_000)
WEIGHTS = st.sampled_from([0.5, 1.0, 2.0, 3.25, 1_000_000.0])


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    tiers = draw(
        st.dictionaries(
            IDS,
            st.builds(
                Limits, st.none() | RATES, st.booleans(), st.none() | WEIGHTS
            ).filter(lambda limits: limits.tokens_per_second or limits.exempt),
            max_size=3,
        )
    )
    teams = draw(
        st.dictionaries(
            IDS,
            st.builds(Limits, RATES, st.just(False), st.none() | WEIGHTS),
            max_size=3,
        )
    )
    users: dict[str, User] = {}
    for user in draw(st.lists(IDS, unique=True, max_size=5)):
        groups: dict[Any, str] = {}
        for kind, names in (("tier", tiers), ("team", teams)):
            if names and draw(st.booleans()):
                groups[kind] = draw(st.sampled_from(sorted(names)))
        limits = draw(
            st.builds(Limits, st.none() | RATES, st.booleans(), st.none() | WEIGHTS)
        )
        if limits or groups:
            users[user] = User(limits, groups)
    return Policy(
        mode=draw(st.none() | st.sampled_from(list(Mode))),
        fair_share=draw(st.none() | st.booleans()),
        default=Limits(draw(st.none() | RATES)),
        groups={"tier": tiers, "team": teams},
        users=users,
    )


def object_form(policy: Policy) -> dict[str, Any]:
    """``policy`` written without any alias key: each holder's limits and a
    user's groups in its own object."""
    tree: dict[str, Any] = {}
    if policy.mode is not None:
        tree["mode"] = policy.mode.value
    if policy.fair_share is not None:
        tree["fair_share"] = policy.fair_share
    if policy.default_rate is not None:
        tree["default"] = {"tokens_per_second": policy.default_rate}
    for kind, key in (("tier", "tiers"), ("team", "teams")):
        tree[key] = {
            name: {
                attribute: getattr(limits, attribute)
                for attribute in limits.set_attributes()
            }
            for name, limits in policy.groups[kind].items()
        }
    tree["users"] = {
        user: {
            **{a: getattr(entry.limits, a) for a in entry.limits.set_attributes()},
            **entry.groups,
        }
        for user, entry in policy.users.items()
    }
    return tree


@settings(max_examples=300, deadline=None)
@given(policies())
def test_document_to_policy_to_document_is_the_identity(policy):
    tree = to_tree(Document(policy))
    assert parse(tree).policy == policy
    assert to_tree(parse(tree)) == tree
    for fmt in ("json", "yaml"):
        assert loads(dumps(Document(policy), fmt), fmt).policy == policy


@settings(max_examples=300, deadline=None)
@given(policies())
def test_an_earlier_format_document_gives_the_policy_of_its_object_form(policy):
    earlier = to_tree(Document(policy))  # the alias keys of earlier files
    assert parse(object_form(policy)).policy == parse(earlier).policy == policy


def test_a_rate_may_be_a_number_or_an_object():
    assert (
        parse({"users": {"a": 5}}).policy
        == parse({"users": {"a": {"tokens_per_second": 5}}}).policy
    )


def test_every_kind_of_group_is_one_type_with_the_same_limits():
    policy = parse(
        {
            "tiers": {"free": {"tokens_per_second": 20, "weight": 2}},
            "teams": {"acme": {"tokens_per_second": 600, "weight": 3}},
        }
    ).policy
    assert policy.groups == {
        "tier": {"free": Limits(20, weight=2.0)},
        "team": {"acme": Limits(600, weight=3.0)},
    }
    assert set(KINDS) == set(policy.groups)


ERRORS = [
    # (document, path, message): each rule fails at the path of the mistake.
    (
        {"team_members": {"u7": "ghostteam"}},
        "team_members.u7",
        "unknown team 'ghostteam'",
    ),
    (
        {"users": {"u7": {"team": "ghostteam"}}},
        "users.u7.team",
        "unknown team 'ghostteam'",
    ),
    ({"memberships": {"u7": "gold"}}, "memberships.u7", "unknown tier 'gold'"),
    ({"users": {"u7": {"tier": "gold"}}}, "users.u7.tier", "unknown tier 'gold'"),
    ({"weights": {"tiers": {"gold": 2}}}, "weights.tiers.gold", "unknown tier 'gold'"),
    ({"weights": {"teams": {"x": 2}}}, "weights.teams.x", "unknown team 'x'"),
    (
        {"users": {"a": {"weight": 2}}, "weights": {"users": {"a": 3}}},
        "weights.users.a",
        "also given at users.a.weight",
    ),
    (
        {"default": {"tokens_per_second": 5}, "default_tokens_per_second": 5},
        "default_tokens_per_second",
        "also given at default.tokens_per_second",
    ),
    (
        {"users": {"a": {"exempt": True}}, "exempt_users": ["a"]},
        "exempt_users[0]",
        "also given at users.a.exempt",
    ),
    ({"users": {"a": {}}}, "users.a", "an entry must set at least one of"),
    ({"users": {"a": {"rate": 1}}}, "users.a", "unknown field(s) 'rate'"),
    ({"teams": {"t": {"exempt": True}}}, "teams.t", "unknown field(s) 'exempt'"),
    ({"default": {"weight": 2}}, "default", "unknown field(s) 'weight'"),
    ({"teams": {"t": {"weight": 2}}}, "teams.t", "needs tokens_per_second"),
    (
        {"users": {"a": 0}},
        "users.a",
        "must be an integer in 1..1000000 (tokens per second), got 0",
    ),
    (
        {"users": {"a": {"weight": -1}}},
        "users.a.weight",
        "must be a number in (0, 1e+06], got -1",
    ),
]


@pytest.mark.parametrize(("tree", "path", "message"), ERRORS)
def test_each_rule_fails_once_at_the_path_of_the_mistake(tree, path, message):
    with pytest.raises(PolicyError) as info:
        parse(tree, source="f")
    assert info.value.path == path
    assert info.value.message.startswith(message)
    assert str(info.value).startswith(f"f: {path}: {message}")


def test_paths_quote_keys_that_are_not_plain():
    assert render_path(["users", "a.b", "weight"]) == "users['a.b'].weight"
    assert render_path(["exempt_users", 3]) == "exempt_users[3]"
    assert render_path("--flag") == "--flag"
