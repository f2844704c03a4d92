"""Who a request belongs to: ``vllm_xargs.output_rate_user`` (which vLLM hands the
engine as ``SamplingParams.extra_args``), and the one rule for a valid user id.

The field is not authenticated: a trusted gateway must overwrite it. The OpenAI
``user`` field plays no part.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

#: Key in ``vllm_xargs`` / ``SamplingParams.extra_args``.
USER_FIELD = "output_rate_user"
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
