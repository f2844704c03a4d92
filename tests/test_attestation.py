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
    CLOCK_SKEW_S,
    KEY_BYTES,
    KEY_ENV,
    LIFETIME_S,
    AttestationKeyError,
    RequestIdentity,
    attest,
    attested_mode,
    ensure_key,
    key_from,
)
from pacing.identity import ANONYMOUS_USER, USER_FIELD, XARGS_SOURCE, parse_user_source
from pacing.settings.checks import SettingsError

KEY = bytes(range(KEY_BYTES))
HEADER = parse_user_source("header:x-user-id")


#: Unix seconds on the identity's wall clock in these tests.
NOW = 1_800_000_000


def identity(*, require_user: bool = False) -> RequestIdentity:
    return RequestIdentity(
        KEY, require_user=require_user, clock=lambda: 0, wall_clock=lambda: NOW
    )


def test_only_a_gateway_source_or_a_required_user_is_attested():
    assert not attested_mode(XARGS_SOURCE, False)
    assert attested_mode(XARGS_SOURCE, True)
    assert attested_mode(HEADER, False)


@pytest.mark.parametrize("issued_at", [NOW, NOW - LIFETIME_S, NOW + CLOCK_SKEW_S])
def test_an_attested_id_is_charged_to_its_user(issued_at):
    xargs = {USER_FIELD: "vip", ATTESTATION_FIELD: attest(KEY, "vip", issued_at)}
    assert identity().identify("r", xargs) == ("vip", None)


@pytest.mark.parametrize(
    "xargs",
    [
        {USER_FIELD: "vip"},  # a route or front end that bypassed the guard
        {USER_FIELD: "vip", ATTESTATION_FIELD: "0" * 64},  # forged
        {USER_FIELD: "vip", ATTESTATION_FIELD: attest(KEY, "other", NOW)},  # other's
        {USER_FIELD: "vip", ATTESTATION_FIELD: attest(b"k" * KEY_BYTES, "vip", NOW)},
        # Expired (as vLLM's request log may show it), or from the future.
        {
            USER_FIELD: "vip",
            ATTESTATION_FIELD: attest(KEY, "vip", NOW - LIFETIME_S - 1),
        },
        {
            USER_FIELD: "vip",
            ATTESTATION_FIELD: attest(KEY, "vip", NOW + CLOCK_SKEW_S + 1),
        },
        # Another issue time under the same MAC, and a malformed time.
        {
            USER_FIELD: "vip",
            ATTESTATION_FIELD: f"{NOW - 1}." + attest(KEY, "vip", NOW).split(".")[1],
        },
        {USER_FIELD: "vip", ATTESTATION_FIELD: "-1." + "0" * 64},
        {USER_FIELD: "vip", ATTESTATION_FIELD: "١٢." + "0" * 64},
        {USER_FIELD: "vip", ATTESTATION_FIELD: "é"},
        {USER_FIELD: 5, ATTESTATION_FIELD: attest(KEY, "5", NOW)},
        None,
    ],
)
def test_an_unattested_request_is_anonymous_or_refused_when_a_user_is_required(
    xargs,
):
    assert identity().identify("r", xargs) == (ANONYMOUS_USER, None)
    assert identity(require_user=True).identify("r", xargs) is None


def test_without_the_attested_mode_the_client_names_its_user():
    plain = RequestIdentity(None, require_user=False, clock=lambda: 0)
    assert plain.identify("r", {USER_FIELD: "vip"}) == ("vip", None)
    assert plain.identify("r", {USER_FIELD: ""}) == (ANONYMOUS_USER, None)


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
