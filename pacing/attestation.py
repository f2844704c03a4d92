"""Proof that the HTTP guard checked a request's user id.

With a gateway source (``--output-rate-user-source header:…`` or
``openai-user``) or a required user (``--output-rate-require-user``), the guard
writes beside ``output_rate_user`` an attestation: an HMAC-SHA256 of the id
under a key that exists only in the server's own processes. The scheduler
charges a request to its named user only if the attestation matches; a request
that reached the engine any other way (a route, front end or vLLM version the
guard does not cover) is charged to ``__anonymous__``, or refused when a user is
required. So identity fails closed by construction, not by a list of paths.

The key is generated at start-up in the process the operator started and
handed to the processes vLLM spawns (API servers, engine cores) through the
environment (``KEY_ENV``); engines started apart (``--headless``) need the
operator to set the same key there. It never appears in a request, a response,
a log line, vLLM's config or a metric.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Final, NamedTuple

from pacing.identity import (
    ANONYMOUS_USER,
    TEAM_FIELD,
    USER_FIELD,
    XARGS_SOURCE,
    UserSource,
    user_from_extra_args,
)

# Under vLLM's logger so that its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Key in ``vllm_xargs`` / ``SamplingParams.extra_args`` beside ``USER_FIELD``.
ATTESTATION_FIELD: Final = "output_rate_attestation"
#: Environment variable holding the key, hex-encoded.
KEY_ENV: Final = "OUTPUT_RATE_ATTESTATION_KEY"
#: Key size in bytes (HMAC-SHA256's block-size-independent strength).
KEY_BYTES: Final = 32
#: How long an attestation is accepted after the guard issued it (seconds): the
#: engine reads it when the request arrives, normally milliseconds later; the
#: API server's preprocessing (media fetched from URLs, tokenizing) takes longer.
LIFETIME_S: Final = 300
#: How far in the future an issue time may be (seconds): engines started apart
#: (``--headless``) read another host's clock.
CLOCK_SKEW_S: Final = 30


class AttestationKeyError(ValueError):
    """The key in the environment is missing or malformed."""


def attested_mode(source: UserSource, require_user: bool) -> bool:
    """Whether the engine trusts only attested user ids: with a gateway source
    (the client must not name its user) or a required user (a request that
    bypassed the guard must not pass as named)."""
    return source != XARGS_SOURCE or require_user


def ensure_key(environ: MutableMapping[str, str]) -> None:
    """Puts a fresh random key into ``environ`` unless one is there already
    (an operator's, for engines started apart, or the parent process's)."""
    if not environ.get(KEY_ENV):
        environ[KEY_ENV] = secrets.token_hex(KEY_BYTES)


def key_from(environ: Mapping[str, str]) -> bytes:
    """The key in ``environ``; AttestationKeyError if absent or not at least
    ``KEY_BYTES`` bytes of hex. The message never echoes the value."""
    raw = environ.get(KEY_ENV)
    if not raw:
        raise AttestationKeyError(
            f"{KEY_ENV} is not set: user ids can only be attested by the API "
            "server's guard (vllm serve); for engines started apart, set the same "
            "key in every process"
        )
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise AttestationKeyError(f"{KEY_ENV} must be hex") from None
    if len(key) < KEY_BYTES:
        raise AttestationKeyError(f"{KEY_ENV} must hold at least {KEY_BYTES} bytes")
    return key


def attest(key: bytes, user: str, issued_at: int, team: str | None = None) -> str:
    """The attestation of ``user`` (already a valid id), and of ``team`` when
    the gateway named one, under ``key``, issued at ``issued_at`` (Unix
    seconds): ``"<issued_at>.<hex HMAC>"``. The time makes it expire: vLLM's
    request log (``--enable-log-requests``) prints extra args, so an
    attestation read there is worth ``LIFETIME_S`` at most. Ids hold no NUL
    (``validate_user``), so the fields cannot run into each other."""
    message = f"{issued_at}\x00{user}"
    if team is not None:
        message += f"\x00{team}"
    mac = hmac.new(key, message.encode(), hashlib.sha256)
    return f"{issued_at}.{mac.hexdigest()}"


class Identity(NamedTuple):
    """Who a request is charged to, and the team its gateway named (None:
    the membership table decides)."""

    user: str
    team: str | None = None


def attested_identity(
    key: bytes, extra_args: Mapping[str, Any] | None, now: float
) -> Identity | None:
    """The id (and team) ``extra_args`` names if its attestation matches and
    was issued within ``LIFETIME_S`` before ``now`` (Unix seconds; up to
    ``CLOCK_SKEW_S`` after it), else None (no id, no attestation, a forged,
    expired or malformed one, or values of the wrong type)."""
    if not extra_args:
        return None
    user = extra_args.get(USER_FIELD)
    tag = extra_args.get(ATTESTATION_FIELD)
    team = extra_args.get(TEAM_FIELD)
    if not isinstance(user, str) or not isinstance(tag, str):
        return None
    if team is not None and not isinstance(team, str):
        return None
    issued_text, _, _ = tag.partition(".")
    if not issued_text.isascii() or not issued_text.isdigit() or len(issued_text) > 12:
        return None
    issued_at = int(issued_text)
    if not now - LIFETIME_S <= issued_at <= now + CLOCK_SKEW_S:
        return None
    try:
        expected = attest(key, user, issued_at, team).encode()
    except UnicodeEncodeError:  # a lone surrogate
        return None
    sent = tag.encode("utf-8", "replace")
    return Identity(user, team) if hmac.compare_digest(expected, sent) else None


#: Unattested or refused requests are logged at most this often (ns): a client
#: that found a way around the guard must not flood the log.
_LOG_INTERVAL_NS: Final = 10_000_000_000


class RequestIdentity:
    """Who a request that reached the engine is charged to.

    Without the attested mode (the default source, no user required), the
    id in its extra args, as the client wrote it. In the attested mode, that id
    only if the guard attested it; otherwise ``ANONYMOUS_USER``, or None (the
    request is refused) when a user is required.
    """

    def __init__(
        self,
        key: bytes | None,
        *,
        require_user: bool,
        clock: Callable[[], int],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = key
        self._require_user = require_user
        #: Rate-limits the log lines (ns).
        self._clock = clock
        #: Unix time, to check an attestation's age across processes and hosts.
        self._wall_clock = wall_clock
        self._logged_at_ns: int | None = None
        self._unlogged = 0

    @classmethod
    def for_settings(
        cls,
        source: UserSource,
        require_user: bool,
        environ: Mapping[str, str],
        clock: Callable[[], int],
    ) -> RequestIdentity:
        """The identity rule of a server with these settings; raises
        AttestationKeyError when the attested mode has no key to check with."""
        key = key_from(environ) if attested_mode(source, require_user) else None
        return cls(key, require_user=require_user, clock=clock)

    def identify(
        self, request_id: str, extra_args: Mapping[str, Any] | None
    ) -> Identity | None:
        """The user ``request_id`` is charged to, and the team its gateway
        named (attested with the user; never in the unattested mode); None
        when the request is refused."""
        if self._key is None:
            try:
                return Identity(user_from_extra_args(extra_args))
            except ValueError as exc:
                # The HTTP guard rejects these with 400; only offline callers
                # get here.
                self._log(
                    "request %s: %s; charging it as %s", request_id, exc, ANONYMOUS_USER
                )
                return Identity(ANONYMOUS_USER)
        identity = attested_identity(self._key, extra_args, self._wall_clock())
        if identity is not None:
            return identity
        if self._require_user:
            self._log(
                "request %s refused: its user id was not checked by the HTTP "
                "guard (a route or front end the guard does not cover) and a user "
                "is required",
                request_id,
            )
            return None
        if extra_args and USER_FIELD in extra_args:
            self._log(
                "request %s: its user id was not checked by the HTTP guard (a route "
                "or front end the guard does not cover); charging it as %s",
                request_id,
                ANONYMOUS_USER,
            )
        return Identity(ANONYMOUS_USER)

    def _log(self, message: str, *args: object) -> None:
        now_ns = self._clock()
        logged_at = self._logged_at_ns
        if logged_at is not None and now_ns - logged_at < _LOG_INTERVAL_NS:
            self._unlogged += 1
            return
        if self._unlogged:
            message += f" ({self._unlogged} more since the last such line)"
        self._logged_at_ns, self._unlogged = now_ns, 0
        logger.warning(message, *args)
