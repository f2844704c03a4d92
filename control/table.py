"""The policy in force as the control plane reads it (``table_in_force``), the
policy document's text (``pacing.policy``: the one format and rules of the
config file and the CLI's import/export), and the control plane's checks of
single values: the pure rules' words, raised as ``InvalidArgument`` (a band
named by a holder against the policy's bands too).
"""

from __future__ import annotations

from collections.abc import Sequence

from control.errors import InvalidArgument
from pacing.fair_share import validate_weight
from pacing.identity import validate_user
from pacing.limiter import validate_rate
from pacing.policy import text
from pacing.policy.document import Document, known_band
from pacing.policy.errors import PolicyError
from pacing.policy.errors import shown as shown
from pacing.policy.model import Policy
from pacing.policy.text import Format as Format
from pacing.shared import SharedLimiter
from pacing.table_caps import MAX_EXPLICIT_LIMITS as MAX_EXPLICIT_LIMITS
from pacing.table_caps import MAX_TIERS as MAX_TIERS


def table_in_force(shared: SharedLimiter) -> Policy:
    """The policy ``shared`` holds, with its mode and fair-share switch (default
    None while pacing is off). Requires ``shared.lock``."""
    return shared.policy_in_force()


def check_user(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid user id, else raises InvalidArgument."""
    try:
        return validate_user(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_rate(value: object, *, field: str) -> int:
    """Returns ``value`` if it is a valid tokens/s limit (an integer in
    1..``MAX_RATE``), else raises InvalidArgument."""
    try:
        return validate_rate(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_tier(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid tier id (the user-id rule), else
    raises InvalidArgument."""
    return check_user(value, field=field)


def check_team(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid team id (the user-id rule), else
    raises InvalidArgument."""
    return check_user(value, field=field)


def check_band(band: str | None, bands: Sequence[str], *, field: str) -> None:
    """InvalidArgument naming ``field`` when ``band`` (``None``: none) is not
    one of ``bands``, in the limits file's words."""
    if band is not None:
        try:
            known_band(band, bands, field)
        except PolicyError as error:
            raise InvalidArgument(str(error)) from None


def check_default_band(band: str | None, bands: Sequence[str], *, field: str) -> None:
    """``check_band``, and InvalidArgument naming ``field`` when there are
    ``bands`` and the default has none (the band of users no holder puts in
    one)."""
    if band is None and bands:
        raise InvalidArgument(
            f"{field}: needs band (one of bands: the band of users no holder "
            "puts in one)"
        )
    check_band(band, bands, field=field)


def check_weight(value: object, *, field: str) -> float | None:
    """A fair-share weight as a request gives it: ``None`` for 0 (none), else
    a valid weight; InvalidArgument naming ``field``."""
    if value == 0 and not isinstance(value, bool):
        return None
    try:
        return validate_weight(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def loads(content: str, fmt: Format, *, source: str) -> Document:
    """Decodes and checks a document in ``fmt``."""
    try:
        return text.loads(content, fmt, source=source)
    except PolicyError as exc:
        raise InvalidArgument(str(exc)) from None


def dumps(document: Document, fmt: Format) -> str:
    """Encodes ``document`` in ``fmt`` (``pacing.policy.document.to_tree``)."""
    return text.dumps(document, fmt)


def format_of(path: str) -> Format:
    """The format a file name implies: ``.json`` is JSON, ``.yaml``/``.yml`` YAML."""
    try:
        return text.format_of(path)
    except PolicyError as exc:
        raise InvalidArgument(str(exc)) from None
