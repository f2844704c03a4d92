"""Identity that fails closed by construction (``pacing.attestation``): in the
attested mode the engine charges a named user only if the HTTP guard attested
the id; a request that reached the engine any other way is anonymous, or
refused when a user is required."""

from __future__ import annotations

import argparse

import pytest

from engine_ext.hooks import _refuse_unguarded_front_ends
from pacing.attestation import (
    ATTESTATION_FIELD,
    BINDING_BYTES,
    CLOCK_SKEW_S,
    KEY_BYTES,
    KEY_ENV,
    LIFETIME_S,
    REQUEST_FIELD,
    AttestationKeyError,
    RequestIdentity,
    attest,
    attested_mode,
    ensure_key,
    key_from,
    new_binding,
    verify,
)
from pacing.identity import (
    ANONYMOUS_USER,
    TEAM_FIELD,
    USER_FIELD,
    XARGS_SOURCE,
    parse_user_source,
)
from pacing.settings.checks import SettingsError

KEY = bytes(range(KEY_BYTES))
HEADER = parse_user_source("header:x-user-id")


#: Unix seconds on the identity's wall clock in these tests.
NOW = 1_800_000_000
#: The request binding the guard drew for the HTTP request of these tests.
BINDING = "ab" * BINDING_BYTES
OTHER_BINDING = "cd" * BINDING_BYTES


def identity(*, require_user: bool = False) -> RequestIdentity:
    return RequestIdentity(
        KEY, require_user=require_user, clock=lambda: 0, wall_clock=lambda: NOW
    )


def tag(
    user: str = "vip",
    issued_at: int = NOW,
    *,
    binding: str = BINDING,
    team: str | None = None,
    key: bytes = KEY,
) -> str:
    return attest(key, user, issued_at, binding=binding, team=team)


def sent(user: object, attestation: str, binding: str = BINDING) -> dict[str, object]:
    """Extra args as the guard writes them: the id, the binding, the tag."""
    return {USER_FIELD: user, REQUEST_FIELD: binding, ATTESTATION_FIELD: attestation}


def test_only_a_gateway_source_or_a_required_user_is_attested():
    assert not attested_mode(XARGS_SOURCE, False)
    assert attested_mode(XARGS_SOURCE, True)
    assert attested_mode(HEADER, False)


@pytest.mark.parametrize("issued_at", [NOW, NOW - LIFETIME_S, NOW + CLOCK_SKEW_S])
def test_an_attested_id_is_charged_to_its_user(issued_at):
    xargs = sent("vip", tag(issued_at=issued_at))
    assert identity().identify("r", xargs) == ("vip", None, None)


@pytest.mark.parametrize(
    "xargs",
    [
        {USER_FIELD: "vip"},  # a route or front end that bypassed the guard
        sent("vip", "0" * 64),  # forged
        sent("vip", tag("other")),  # another user's
        sent("vip", tag(key=b"k" * KEY_BYTES)),
        # Expired (as vLLM's request log may show it), or from the future.
        sent("vip", tag(issued_at=NOW - LIFETIME_S - 1)),
        sent("vip", tag(issued_at=NOW + CLOCK_SKEW_S + 1)),
        # Another issue time under the same MAC, and a malformed time.
        sent("vip", f"{NOW - 1}." + tag().split(".")[1]),
        sent("vip", "-1." + "0" * 64),
        sent("vip", "١٢." + "0" * 64),
        sent("vip", "é"),
        sent(5, tag("5")),
        None,
    ],
)
def test_an_unattested_request_is_anonymous_or_refused_when_a_user_is_required(
    xargs,
):
    assert identity().identify("r", xargs) == (ANONYMOUS_USER, None, None)
    assert identity(require_user=True).identify("r", xargs) is None


def test_a_users_tag_never_verifies_for_another_split_of_its_fields():
    """A tag for (alice, teamB) once verified as user ``alice\\0teamB`` with
    no team: the MAC covered the fields joined by NULs."""
    relabelled = sent("alice\x00teamB", tag("alice", team="teamB"))
    assert verify(KEY, relabelled) is None
    assert identity().identify("r", relabelled) == (ANONYMOUS_USER, None, None)
    # Re-validation aside, no other split of the same characters into binding,
    # user and team (or none) shares a tag, NULs between them or not.
    for text in (f"{BINDING}alice\x00teamB", f"{BINDING}\x00alice\x00teamB"):
        splits = [
            (text[:i], text[i:j], text[j:] if team else None)
            for i in range(len(text) + 1)
            for j in range(i, len(text) + 1)
            for team in (True, False)
            if team or j == len(text)
        ]
        tags = {tag(user, binding=binding, team=team) for binding, user, team in splits}
        assert len(tags) == len(splits)


@pytest.mark.parametrize(
    ("user", "team"),
    [
        ("a\x01b", None),
        ("", None),
        ("a" * 257, None),
        ("a\u202eb", None),
        ("alice", "a\x00b"),
        ("alice", ""),
    ],
)
def test_an_id_the_guard_would_refuse_never_passes_however_well_attested(user, team):
    xargs = {**sent(user, tag(user, team=team)), TEAM_FIELD: team}
    assert verify(KEY, xargs) is None
    assert identity().identify("r", xargs) == (ANONYMOUS_USER, None, None)
    assert identity(require_user=True).identify("r", xargs) is None


@pytest.mark.parametrize(
    "xargs",
    [
        sent("vip", tag(), OTHER_BINDING),  # moved to another HTTP request
        sent("vip", tag(binding=OTHER_BINDING)),  # another request's tag
        {USER_FIELD: "vip", ATTESTATION_FIELD: tag()},  # the binding dropped
        # Correctly attested, but no binding the guard draws.
        sent("vip", tag(binding=BINDING.upper()), BINDING.upper()),
        sent("vip", tag(binding="ab"), "ab"),
        sent("vip", tag(binding=""), ""),
        {**sent("vip", tag()), REQUEST_FIELD: 5},
    ],
)
def test_a_tag_holds_only_for_the_binding_it_was_issued_for(xargs):
    assert verify(KEY, xargs) is None
    assert identity(require_user=True).identify("r", xargs) is None


def test_every_binding_is_fresh_and_attestable():
    bindings = {new_binding() for _ in range(100)}
    assert len(bindings) == 100
    for binding in bindings:
        assert len(binding) == 2 * BINDING_BYTES
        xargs = sent("vip", tag(binding=binding), binding)
        assert identity().identify("r", xargs) == ("vip", None, None)


class Clocks:
    """The identity's monotonic (ns) and wall (Unix s) clocks, moved together."""

    def __init__(self) -> None:
        self.ns = 10**12
        self.wall = NOW

    def advance(self, seconds: int) -> None:
        self.ns += seconds * 10**9
        self.wall += seconds

    def identity(self, *, require_user: bool = False) -> RequestIdentity:
        return RequestIdentity(
            KEY,
            require_user=require_user,
            clock=lambda: self.ns,
            wall_clock=lambda: self.wall,
        )


def test_a_tag_holds_past_its_lifetime_while_its_chain_lives():
    """A Responses tool loop reuses its first turn's extra args for every turn
    (and parallel sampling runs siblings): the id holds while a request of the
    binding is live, and for ``LIFETIME_S`` after the last one ended."""
    clocks = Clocks()
    rule = clocks.identity(require_user=True)
    xargs = sent("vip", tag())
    assert rule.identify("turn-1", xargs) == ("vip", None, None)
    assert rule.identify("sibling", xargs) == ("vip", None, None)
    clocks.advance(LIFETIME_S + 100)
    rule.request_ended("turn-1")
    assert rule.identify("turn-2", xargs) == ("vip", None, None)  # the sibling is live
    rule.request_ended("sibling")
    rule.request_ended("turn-2")
    clocks.advance(LIFETIME_S)  # the longest gap between turns
    assert rule.identify("turn-3", xargs) == ("vip", None, None)
    rule.request_ended("turn-3")
    clocks.advance(LIFETIME_S + 1)
    assert rule.identify("replay", xargs) is None


def test_a_live_chain_revives_no_other_bindings_stale_tag():
    clocks = Clocks()
    rule = clocks.identity()
    assert rule.identify("live", sent("vip", tag())) == ("vip", None, None)
    clocks.advance(LIFETIME_S + 1)
    stale = sent("vip", tag(binding=OTHER_BINDING), OTHER_BINDING)
    assert rule.identify("other", stale) == (ANONYMOUS_USER, None, None)


def test_chains_are_forgotten_a_lifetime_after_their_last_request_ended():
    clocks = Clocks()
    rule = clocks.identity()
    bindings = [new_binding() for _ in range(1_000)]
    for n, binding in enumerate(bindings):
        rule.identify(f"r{n}", sent("vip", tag(binding=binding), binding))
        rule.request_ended(f"r{n}")
    # Refused and anonymous requests are never remembered.
    rule.identify("anonymous", {USER_FIELD: "vip"})
    rule.request_ended("anonymous")
    clocks.advance(LIFETIME_S)
    rule.identify("next", sent("vip", tag(binding=BINDING, issued_at=clocks.wall)))
    assert (len(rule._live), len(rule._ended)) == (1, 1_000)
    clocks.advance(1)
    rule.identify("last", sent("vip", tag(binding=BINDING, issued_at=clocks.wall)))
    assert (rule._binding_of, rule._live, rule._ended) == (
        {"next": BINDING, "last": BINDING},
        {BINDING: 2},
        {},
    )


def test_without_the_attested_mode_the_client_names_its_user():
    plain = RequestIdentity(None, require_user=False, clock=lambda: 0)
    assert plain.identify("r", {USER_FIELD: "vip"}) == ("vip", None, None)
    assert plain.identify("r", {USER_FIELD: ""}) == (ANONYMOUS_USER, None, None)


def test_the_attested_mode_refuses_to_start_without_a_key():
    with pytest.raises(AttestationKeyError, match=KEY_ENV):
        RequestIdentity.for_settings(HEADER, False, {}, lambda: 0)
    with pytest.raises(AttestationKeyError, match="hex"):
        key_from({KEY_ENV: "not hex"})
    with pytest.raises(AttestationKeyError, match="at least"):
        key_from({KEY_ENV: "00"})


def test_a_key_is_generated_once_and_kept():
    environ: dict[str, str] = {}
    ensure_key(environ)
    first = environ[KEY_ENV]
    ensure_key(environ)
    assert environ[KEY_ENV] == first
    assert len(key_from(environ)) == KEY_BYTES


@pytest.mark.parametrize(
    ("grpc", "rust", "refused"),
    [(True, "0", "--grpc"), (False, "1", "VLLM_USE_RUST_FRONTEND")],
)
def test_front_ends_without_the_guard_are_refused_in_the_attested_mode(
    monkeypatch, grpc, rust, refused
):
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", rust)
    with pytest.raises(SettingsError, match=refused):
        _refuse_unguarded_front_ends(argparse.Namespace(grpc=grpc))
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "0")
    _refuse_unguarded_front_ends(argparse.Namespace(grpc=False))
