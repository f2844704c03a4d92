"""How big one limits table may be, wherever it comes from (the control
plane, the limits file, the store): one rule, checked at every entry point."""

from __future__ import annotations

from typing import Final

#: Most users one table may name (with a limit, a tier, an exemption or a
#: weight): bounds memory, the size of one ``GetLimitsTable`` reply (about
#: 27 MB at 256-byte ids) and of the config file.
MAX_EXPLICIT_LIMITS: Final = 100_000
#: Most tiers: the metrics label series by tier, so the label set stays small.
MAX_TIERS: Final = 100


def validate_user_count(count: int) -> None:
    """ValueError when a table would name more than ``MAX_EXPLICIT_LIMITS``
    users."""
    if count > MAX_EXPLICIT_LIMITS:
        raise ValueError(
            f"a table holds at most {MAX_EXPLICIT_LIMITS} users with a limit, "
            f"tier or exemption, got {count}"
        )


def validate_tier_count(count: int) -> None:
    """ValueError when a table would hold more than ``MAX_TIERS`` tiers."""
    if count > MAX_TIERS:
        raise ValueError(f"a table holds at most {MAX_TIERS} tiers, got {count}")
