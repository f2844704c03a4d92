"""The gateway's objective in the attestation (``pacing.attestation``): covered
by the MAC beside the user and the team, never interchangeable with the team,
re-validated by the id rule; attestations without an objective are the ones
issued before objectives were attested. And the count of objectives the
policy maps to no band (``pacing.accounting``)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from pacing.accounting import MAX_UNKNOWN_OBJECTIVE_NAMES, Accounting
from pacing.attestation import (
    ATTESTATION_FIELD,
    BINDING_BYTES,
    KEY_BYTES,
    REQUEST_FIELD,
    RequestIdentity,
    attest,
    verify,
)
from pacing.identity import OBJECTIVE_FIELD, TEAM_FIELD, USER_FIELD

KEY = bytes(range(KEY_BYTES))
NOW = 1_800_000_000
BINDING = "ab" * BINDING_BYTES


def sent(
    user: str, attestation: str, *, team: str | None = None, objective: object = None
) -> dict[str, object]:
    """Extra args as the guard writes them."""
    xargs: dict[str, object] = {
        USER_FIELD: user,
        REQUEST_FIELD: BINDING,
        ATTESTATION_FIELD: attestation,
    }
    if team is not None:
        xargs[TEAM_FIELD] = team
    if objective is not None:
        xargs[OBJECTIVE_FIELD] = objective
    return xargs


def tag(user: str = "vip", **fields: str | None) -> str:
    return attest(KEY, user, NOW, binding=BINDING, **fields)


def before_objectives(user: str, team: str | None) -> str:
    """An attestation as issued before objectives were attested."""
    fields = [b"output-rate-attestation/2", str(NOW).encode(), BINDING.encode()]
    fields += [user.encode()] + ([] if team is None else [team.encode()])
    message = b"".join(b"%d:%b" % (len(f), f) for f in fields)
    return f"{NOW}.{hmac.new(KEY, message, hashlib.sha256).hexdigest()}"


@pytest.mark.parametrize("team", [None, "acme"])
def test_an_attestation_without_an_objective_is_what_it_was(team):
    assert tag(team=team) == before_objectives("vip", team)
    assert verify(KEY, sent("vip", before_objectives("vip", team), team=team))


def test_the_attestation_covers_the_objective():
    good = sent("vip", tag(objective="premium"), objective="premium")
    attestation = verify(KEY, good)
    assert attestation is not None
    assert attestation.identity == ("vip", None, "premium")
    for forged in (
        sent("vip", tag(objective="premium"), objective="bulk"),  # relabelled
        sent("vip", tag(objective="premium")),  # dropped on the way
        sent("vip", tag(), objective="premium"),  # added past the guard
        sent("vip", tag(team="acme", objective="p"), team="acme"),
    ):
        assert verify(KEY, forged) is None


def test_a_team_never_passes_for_an_objective_or_back():
    as_team = tag(team="premium")
    as_objective = tag(objective="premium")
    assert as_team != as_objective
    assert verify(KEY, sent("vip", as_team, objective="premium")) is None
    assert verify(KEY, sent("vip", as_objective, team="premium")) is None
    both = tag(team="acme", objective="premium")
    assert verify(KEY, sent("vip", both, team="acme", objective="premium"))
    assert verify(KEY, sent("vip", both, team="premium", objective="acme")) is None


@pytest.mark.parametrize("objective", ["", "a\x00b", 5, "x" * 257])
def test_an_objective_that_breaks_the_id_rule_never_verifies(objective):
    text = objective if isinstance(objective, str) else str(objective)
    xargs = sent("vip", tag(objective=text), objective=objective)
    assert verify(KEY, xargs) is None


def test_the_engine_reads_the_objective_only_from_an_attestation():
    attested = RequestIdentity(
        KEY, require_user=False, clock=lambda: 0, wall_clock=lambda: NOW
    )
    xargs = sent("vip", tag(objective="premium"), objective="premium")
    assert attested.identify("r", xargs) == ("vip", None, "premium")
    forged = sent("vip", tag(), objective="premium")
    assert attested.identify("f", forged) == ("__anonymous__", None, None)
    plain = RequestIdentity(None, require_user=False, clock=lambda: 0)
    client = {USER_FIELD: "vip", OBJECTIVE_FIELD: "premium"}
    assert plain.identify("p", client) == ("vip", None, None)


def test_unknown_objectives_are_counted_per_user_and_each_name_is_new_once():
    accounting = Accounting()
    assert accounting.record_unknown_objective("a", "gold")
    assert not accounting.record_unknown_objective("b", "gold")
    assert accounting.record_unknown_objective("a", "silver")
    assert accounting.unknown_objectives == {"a": 2, "b": 1}
    assert accounting.unknown_objectives_total == 3
    accounting.forget({"b"})
    assert accounting.unknown_objectives == {"b": 1}
    assert accounting.unknown_objectives_total == 3
    assert not accounting.record_unknown_objective("a", "gold")  # still known


def test_the_names_remembered_are_bounded():
    accounting = Accounting()
    for n in range(MAX_UNKNOWN_OBJECTIVE_NAMES):
        assert accounting.record_unknown_objective("a", f"o{n}")
    assert not accounting.record_unknown_objective("a", "one-more")
    assert accounting.unknown_objectives == {"a": MAX_UNKNOWN_OBJECTIVE_NAMES + 1}
