"""Who a request belongs to: ``vllm_xargs.output_rate_user`` (which vLLM hands the
engine as ``SamplingParams.extra_args``).

The field is not authenticated: a trusted gateway must overwrite it. The OpenAI
``user`` field plays no part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Key in ``vllm_xargs`` / ``SamplingParams.extra_args``.
USER_FIELD = "output_rate_user"
#: The shared budget of requests that name no user.
ANONYMOUS_USER = "__anonymous__"
#: Longest accepted user id, in UTF-8 bytes (bounds memory per tracked user).
MAX_USER_BYTES = 256


def validate_user(value: object, *, field: str = f"vllm_xargs.{USER_FIELD}") -> str:
    """Returns ``value`` if it is a valid user id, else raises ValueError naming
    ``field``: a non-empty string of at most ``MAX_USER_BYTES`` UTF-8 bytes without
    control characters."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {type(value).__name__}")
    if value == "":
        raise ValueError(f"{field} must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_USER_BYTES:
        raise ValueError(f"{field} must be at most {MAX_USER_BYTES} bytes in UTF-8")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(f"{field} must not contain control characters")
    return value


def user_from_extra_args(extra_args: Mapping[str, Any] | None) -> str:
    """The user a request is charged to; ``ANONYMOUS_USER`` when it names none.

    Raises ValueError for a present but invalid value.
    """
    if not extra_args or USER_FIELD not in extra_args:
        return ANONYMOUS_USER
    return validate_user(extra_args[USER_FIELD])
