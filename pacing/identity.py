"""Who a request belongs to: ``vllm_xargs.output_rate_user`` (which vLLM hands the
engine as ``SamplingParams.extra_args``), where the HTTP guard takes it from
(``UserSource``), and the one rule for a valid user id.

With the default source the client writes the field itself, unauthenticated. With
a header or the OpenAI ``user`` field as the source, the guard refuses a
client-sent field and writes the id it read there instead, so the engine side
never changes: it reads the field.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

#: Key in ``vllm_xargs`` / ``SamplingParams.extra_args``.
USER_FIELD = "output_rate_user"
#: Key beside ``USER_FIELD`` for the team a gateway named (``TeamSource``);
#: only the guard writes it, and only with a team header source.
TEAM_FIELD = "output_rate_team"
#: Key beside ``USER_FIELD`` for the objective a gateway named (``OBJECTIVE_HEADERS``);
#: only the guard writes it, and only with a gateway user source. The engine
#: maps it to a priority band through the policy's ``objectives``.
OBJECTIVE_FIELD = "output_rate_objective"
#: The request headers of the Gateway API Inference Extension / llm-d that name
#: a request's objective (an ``InferenceObjective``): the current name first,
#: then its deprecated one. Sent both, they must agree.
OBJECTIVE_HEADERS: Final = (
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
)
#: The shared budget of requests that name no user.
ANONYMOUS_USER = "__anonymous__"
#: Longest accepted user id, in UTF-8 bytes (bounds memory per tracked user).
MAX_USER_BYTES = 256
#: Unicode general categories a user id must not contain, with the words error
#: messages use for them. Cs (surrogates) is caught earlier, by the strict UTF-8
#: encoding, and listed for completeness.
FORBIDDEN_CATEGORIES: Mapping[str, str] = {
    "Cc": "control characters",
    "Cf": "invisible format characters",
    "Zl": "line separators",
    "Zp": "paragraph separators",
    "Cs": "surrogates",
}


def validate_user(value: object, *, field: str = f"vllm_xargs.{USER_FIELD}") -> str:
    """Returns ``value`` unchanged if it is a valid user id, else raises ValueError
    naming ``field``.

    A valid user id is a ``str`` that

    1. is well-formed Unicode: it encodes as strict UTF-8, so it holds no lone
       surrogate (U+D800..U+DFFF, which JSON's ``\\ud800`` escapes can produce);
    2. is 1 to ``MAX_USER_BYTES`` (256) bytes long in UTF-8;
    3. holds no character whose Unicode general category
       (``unicodedata.category``) is Cc (controls: U+0000..U+001F, U+007F..U+009F,
       so C0, DEL and C1 including U+0085), Cf (invisible format characters such
       as U+200B, U+200D, U+202E, U+FEFF, U+00AD; so emoji joined by U+200D are
       refused), Zl (U+2028) or Zp (U+2029).

    Everything else is accepted and kept verbatim (no normalisation, case
    folding or trimming): spaces, ``/``, any script, emoji. This is the one
    definition; every entry point uses it: the HTTP guard, the gRPC control
    plane, the limits file, the ``--user-output-tokens-per-second`` flag and
    offline requests (``user_from_extra_args``). Error messages never echo
    ``value``.
    """
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {type(value).__name__}")
    if value == "":
        raise ValueError(f"{field} must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            f"{field} must be well-formed Unicode: it contains a lone surrogate "
            "(U+D800..U+DFFF)"
        ) from None
    if size > MAX_USER_BYTES:
        raise ValueError(f"{field} must be at most {MAX_USER_BYTES} bytes in UTF-8")
    # Fast path: str.isprintable() is false for every C* and Z* character except
    # the ASCII space, so a printable id holds no forbidden category.
    if not value.isprintable():
        for ch in value:
            kind = FORBIDDEN_CATEGORIES.get(unicodedata.category(ch))
            if kind is not None:
                raise ValueError(f"{field} must not contain {kind}")
    return value


def user_from_extra_args(extra_args: Mapping[str, Any] | None) -> str:
    """The user a request is charged to; ``ANONYMOUS_USER`` when it names none.

    Raises ValueError for a present but invalid value (see ``validate_user``).
    """
    if not extra_args or USER_FIELD not in extra_args:
        return ANONYMOUS_USER
    return validate_user(extra_args[USER_FIELD])


#: The kinds of ``UserSource``, as ``--output-rate-user-source`` spells them
#: (a header's is ``header:NAME``).
XARGS: Final = "xargs"
HEADER: Final = "header"
OPENAI_USER: Final = "openai-user"
_HEADER_PREFIX = f"{HEADER}:"
#: An RFC 9110 header name (a ``token``).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Headers that carry credentials: an id read from one would put the secret in
#: metrics labels, logs and the control plane.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


@dataclass(frozen=True)
class UserSource:
    """Where the HTTP guard reads a request's user id: the body's
    ``vllm_xargs.output_rate_user`` (``xargs``), request header ``header``
    (``header``; lower case, as ASGI servers hand header names over), or the
    body's OpenAI ``user`` field (``openai-user``)."""

    kind: Literal["xargs", "header", "openai-user"] = XARGS
    header: str | None = None

    @property
    def spec(self) -> str:
        """The ``--output-rate-user-source`` value that selects this source."""
        return f"{_HEADER_PREFIX}{self.header}" if self.kind == HEADER else self.kind

    @property
    def where(self) -> str:
        """Where the id comes from, in words for error messages."""
        if self.kind == HEADER:
            return f"request header {self.header}"
        if self.kind == OPENAI_USER:
            return "the OpenAI `user` field"
        return f"vllm_xargs.{USER_FIELD}"


#: The default: the client's own ``vllm_xargs.output_rate_user``.
XARGS_SOURCE = UserSource()


def parse_user_source(raw: object, *, field: str = "user source") -> UserSource:
    """``raw`` (``xargs``, ``header:NAME`` or ``openai-user``; kinds and header
    names are case-insensitive) as a ``UserSource``; ValueError naming
    ``field`` otherwise. NAME must be an HTTP header name other than one that
    carries credentials (``CREDENTIAL_HEADERS``)."""
    if isinstance(raw, UserSource):
        return raw
    if not isinstance(raw, str):
        raise ValueError(
            f"{field} must be a string (xargs, header:NAME or openai-user), "
            f"got {type(raw).__name__}"
        )
    text = raw.strip()
    if text.lower() == XARGS:
        return XARGS_SOURCE
    if text.lower() == OPENAI_USER:
        return UserSource(OPENAI_USER)
    if text[: len(_HEADER_PREFIX)].lower() != _HEADER_PREFIX:
        raise ValueError(
            f"{field} must be xargs, header:NAME or openai-user, got {raw!r}"
        )
    return UserSource(HEADER, _header_name(text[len(_HEADER_PREFIX) :], field))


def _header_name(raw: str, field: str) -> str:
    """``raw`` as a lower-case HTTP header name that carries no credential;
    ValueError naming ``field`` otherwise."""
    name = raw.strip()
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(
            f"{field} names no valid HTTP header ({name!r}): NAME must be one "
            "token of letters, digits and !#$%&'*+-.^_`|~, e.g. header:X-User-Id"
        )
    if name.lower() in CREDENTIAL_HEADERS:
        raise ValueError(
            f"{field} must not be {name}: it carries a credential, which would "
            "end up in metrics labels and logs; let the gateway map it to a user "
            "id in a header of its own"
        )
    return name.lower()


#: ``--output-rate-team-source`` value for the membership table.
TABLE: Final = "table"


@dataclass(frozen=True)
class TeamSource:
    """Where a request's team comes from: the membership table (``header``
    None), or request header ``header`` (lower case) set by the trusted
    gateway, which then decides the team of the request's user."""

    header: str | None = None

    @property
    def spec(self) -> str:
        """The ``--output-rate-team-source`` value that selects this source."""
        return TABLE if self.header is None else f"{_HEADER_PREFIX}{self.header}"

    @property
    def where(self) -> str:
        return (
            "the membership table"
            if self.header is None
            else (f"request header {self.header}")
        )


#: The default: the membership table.
TABLE_TEAM_SOURCE = TeamSource()


def parse_team_source(raw: object, *, field: str = "team source") -> TeamSource:
    """``raw`` (``table`` or ``header:NAME``, case-insensitive) as a
    ``TeamSource``; ValueError naming ``field`` otherwise (NAME follows the
    user source's header rules)."""
    if isinstance(raw, TeamSource):
        return raw
    if not isinstance(raw, str):
        raise ValueError(
            f"{field} must be a string (table or header:NAME), got {type(raw).__name__}"
        )
    text = raw.strip()
    if text.lower() == TABLE:
        return TABLE_TEAM_SOURCE
    if text[: len(_HEADER_PREFIX)].lower() != _HEADER_PREFIX:
        raise ValueError(f"{field} must be table or header:NAME, got {raw!r}")
    return TeamSource(_header_name(text[len(_HEADER_PREFIX) :], field))
