"""Settings for tests, written as the policy's pieces (``POLICY_ALIASES``'
names: ``default_rate``, ``user_rates``, ``tier_rates``, ...) next to the other
settings, as the flags give them."""

from __future__ import annotations

from typing import Any

from pacing.settings.flags import POLICY_ALIASES
from pacing.settings.model import OutputRateSettings
from pacing.settings.policy import policy_of_pieces


def settings_of(**given: Any) -> OutputRateSettings:
    """``OutputRateSettings`` whose policy the pieces among ``given`` build
    (``SettingsError`` for a piece that breaks a rule), the rest as given."""
    pieces = {name: given.pop(name) for name in list(given) if name in POLICY_ALIASES}
    return OutputRateSettings(
        policy=policy_of_pieces(pieces, source="settings"), **given
    )
