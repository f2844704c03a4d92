"""Proof that the HTTP guard checked a request's user id.

With a gateway source (``--output-rate-user-source header:…`` or
``openai-user``) or a required user (``--output-rate-require-user``), the guard
writes beside ``output_rate_user`` a fresh random request binding and an
attestation: an HMAC-SHA256 of the id, the team, the objective, the binding and
the issue time under a key that exists only in the server's own processes. The
scheduler charges a request to its named user only if the attestation matches
and is fresh, or belongs to a chain of engine requests still alive
(``RequestIdentity``: the turns of one Responses tool loop share one request's
extra args); a request that reached the engine any other way (a route, front
end or vLLM version the guard does not cover) is charged to ``__anonymous__``,
or refused when a user is required. So identity fails closed by construction,
not by a list of paths.

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
import re
import secrets
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Final, NamedTuple

from pacing.identity import (
    ANONYMOUS_USER,
    OBJECTIVE_FIELD,
    TEAM_FIELD,
    USER_FIELD,
    XARGS_SOURCE,
    UserSource,
    user_from_extra_args,
    validate_user,
)

# Under vLLM's logger so that its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Key in ``vllm_xargs`` / ``SamplingParams.extra_args`` beside ``USER_FIELD``.
ATTESTATION_FIELD: Final = "output_rate_attestation"
#: Environment variable holding the key, hex-encoded.
KEY_ENV: Final = "OUTPUT_RATE_ATTESTATION_KEY"
#: Key size in bytes (HMAC-SHA256's block-size-independent strength).
KEY_BYTES: Final = 32
#: Key beside ``USER_FIELD`` for the request binding: random, drawn by the guard
#: per HTTP request and covered by the attestation. Not vLLM's engine request
#: id: vLLM derives those per route (a Responses tool turn is
#: ``<id>_<n>-<random>``, a parallel-sampling child and each prompt of a
#: multi-prompt completion get their own), so the guard cannot know them.
REQUEST_FIELD: Final = "output_rate_request"
#: Random bytes in a binding (hex in ``REQUEST_FIELD``).
BINDING_BYTES: Final = 16
#: What ``new_binding`` writes; anything else is refused.
_BINDING = re.compile(f"[0-9a-f]{{{2 * BINDING_BYTES}}}")
#: The MAC's first field: names this message format, so that no tag of another
#: format or purpose verifies as one of these.
_DOMAIN: Final = b"output-rate-attestation/2"
#: How long after the guard issued it an attestation is accepted for a binding
#: the engine has not seen alive (seconds), and how long a binding's chain lives
#: after its last request ended: the engine reads it when the request arrives,
#: normally milliseconds later; the API server's preprocessing (media fetched
#: from URLs, tokenizing) and a tool call between two turns take longer. vLLM's
#: request log (``--enable-log-requests``) prints extra args: a tag read there is
#: worth this long, or as long as its chain lives, for its user only.
LIFETIME_S: Final = 300
_LIFETIME_NS: Final = LIFETIME_S * 1_000_000_000
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


def new_binding() -> str:
    """A fresh request binding, for one HTTP request."""
    return secrets.token_hex(BINDING_BYTES)


def attest(
    key: bytes,
    user: str,
    issued_at: int,
    *,
    binding: str,
    team: str | None = None,
    objective: str | None = None,
) -> str:
    """The attestation under ``key`` that the guard checked ``user`` (and
    ``team`` and ``objective``, when the gateway named them) for the HTTP
    request ``binding`` names, issued at ``issued_at`` (Unix seconds):
    ``"<issued_at>.<hex HMAC>"``.

    The MAC covers a list of fields, each written as its UTF-8 length in
    bytes, ``:`` and its bytes, so that no two lists share a message: no field
    can run into the next. After the user come the team, then the objective,
    each only while it or a later one is named; a team left out before an
    objective is an empty field, which no valid id is. So no team is one field
    fewer (or an empty one), never a string, and an attestation without an
    objective is the one it was before objectives were attested.
    """
    fields = [_DOMAIN, str(issued_at).encode(), binding.encode(), user.encode()]
    if team is not None or objective is not None:
        fields.append(b"" if team is None else team.encode())
    if objective is not None:
        fields.append(objective.encode())
    message = b"".join(b"%d:%b" % (len(field), field) for field in fields)
    return f"{issued_at}.{hmac.new(key, message, hashlib.sha256).hexdigest()}"


class Identity(NamedTuple):
    """Who a request is charged to, the team its gateway named (None: the
    membership table decides) and the objective it named (None: the request
    is in its user's band)."""

    user: str
    team: str | None = None
    objective: str | None = None


class Attestation(NamedTuple):
    """What a matching attestation vouches for: who, for which HTTP request
    (its binding), since when (Unix seconds)."""

    identity: Identity
    binding: str
    issued_at: int


def verify(key: bytes, extra_args: Mapping[str, Any] | None) -> Attestation | None:
    """What the attestation in ``extra_args`` vouches for if it matches their
    user, team, objective and binding under ``key`` and those are what the
    guard writes (ids that pass ``validate_user``, a binding of
    ``new_binding``'s form); else None. Its age is the caller's to judge."""
    if not extra_args:
        return None
    tag = extra_args.get(ATTESTATION_FIELD)
    binding = extra_args.get(REQUEST_FIELD)
    if not isinstance(tag, str) or not isinstance(binding, str):
        return None
    if not _BINDING.fullmatch(binding):
        return None
    team = extra_args.get(TEAM_FIELD)
    objective = extra_args.get(OBJECTIVE_FIELD)
    try:
        user = validate_user(extra_args.get(USER_FIELD))
        if team is not None:
            team = validate_user(team)
        if objective is not None:
            objective = validate_user(objective)
    except ValueError:
        return None
    issued_text, _, _ = tag.partition(".")
    if not issued_text.isascii() or not issued_text.isdigit() or len(issued_text) > 12:
        return None
    issued_at = int(issued_text)
    expected = attest(
        key, user, issued_at, binding=binding, team=team, objective=objective
    ).encode()
    if not hmac.compare_digest(expected, tag.encode("utf-8", "replace")):
        return None
    return Attestation(Identity(user, team, objective), binding, issued_at)


#: Unattested or refused requests are logged at most this often (ns): a client
#: that found a way around the guard must not flood the log.
_LOG_INTERVAL_NS: Final = 10_000_000_000


class RequestIdentity:
    """Who a request that reached the engine is charged to.

    Without the attested mode (the default source, no user required), the
    id in its extra args, as the client wrote it. In the attested mode, that id
    only if the guard attested it, at most ``LIFETIME_S`` ago or for a binding
    whose chain is alive: a request with that binding is live here, or the last
    one ended at most ``LIFETIME_S`` ago (the gap between two tool turns);
    otherwise ``ANONYMOUS_USER``, or None (the request is refused) when a user
    is required. The scheduler reports each request's end (``request_ended``).
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
        #: Rate-limits the log lines and times chains (monotonic ns).
        self._clock = clock
        #: Unix time, to check an attestation's age across processes and hosts.
        self._wall_clock = wall_clock
        self._logged_at_ns: int | None = None
        self._unlogged = 0
        #: Per live request admitted on an attestation: its binding.
        self._binding_of: dict[str, str] = {}
        #: Per binding with live requests: how many.
        self._live: dict[str, int] = {}
        #: Per binding whose requests all ended: when the last did (ns), oldest
        #: first; forgotten ``LIFETIME_S`` later.
        self._ended: dict[str, int] = {}

    @classmethod
    def for_settings(
        cls,
        source: UserSource,
        require_user: bool,
        environ: Mapping[str, str],
        clock: Callable[[], int],
        wall_clock: Callable[[], float] = time.time,
    ) -> RequestIdentity:
        """The identity rule of a server with these settings; raises
        AttestationKeyError when the attested mode has no key to check with."""
        key = key_from(environ) if attested_mode(source, require_user) else None
        return cls(key, require_user=require_user, clock=clock, wall_clock=wall_clock)

    def identify(
        self, request_id: str, extra_args: Mapping[str, Any] | None
    ) -> Identity | None:
        """The user ``request_id`` is charged to, and the team and objective
        its gateway named (attested with the user; never in the unattested
        mode); None when the request is refused."""
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
        attestation = verify(self._key, extra_args)
        if attestation is not None and self._admits(request_id, attestation):
            return attestation.identity
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

    def request_ended(self, request_id: str) -> None:
        """Notes that ``request_id`` left the engine (finished or refused)."""
        binding = self._binding_of.pop(request_id, None)
        if binding is None:
            return
        left = self._live[binding] - 1
        if left:
            self._live[binding] = left
        else:
            del self._live[binding]
            self._ended[binding] = self._clock()

    def _admits(self, request_id: str, attestation: Attestation) -> bool:
        """Whether ``attestation`` is fresh or its chain alive; if so, counts
        ``request_id`` in its chain."""
        now_ns = self._clock()
        ended = self._ended
        # Forgets the chains whose last request ended over LIFETIME_S ago.
        while ended:
            oldest, ended_at = next(iter(ended.items()))
            if now_ns - ended_at <= _LIFETIME_NS:
                break
            del ended[oldest]
        now = self._wall_clock()
        issued_at, binding = attestation.issued_at, attestation.binding
        if issued_at > now + CLOCK_SKEW_S:
            return False
        alive = binding in self._live or binding in ended
        if issued_at < now - LIFETIME_S and not alive:
            return False
        self._binding_of[request_id] = binding
        self._live[binding] = self._live.get(binding, 0) + 1
        ended.pop(binding, None)
        return True

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
