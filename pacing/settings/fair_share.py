"""Fair share's pricing as the flag and ``additional_config`` give it
(``pacing.fair_share``); every failure is a ``SettingsError`` naming the flag or
the key. The switch and the weights are the policy's (``pacing.settings.policy``).

- ``--output-rate-fair-share-config '{"prompt_price": 1, "output_price": 2,
  "hysteresis": 1024, "min_run_tokens": 16}'`` (any subset).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from pacing.fair_share import FairShareSettings
from pacing.settings.checks import (
    SettingsError,
    check_entry_keys,
    field_names,
    parse_json,
)
from pacing.settings.flags import FAIR_SHARE_CONFIG_FLAG


def parse_fair_share_config(value: object, where: str) -> FairShareSettings:
    """The pricing and hysteresis object (absent keys: the defaults)."""
    if value is None:
        return FairShareSettings()
    check_entry_keys(value, where, field_names(FairShareSettings))
    assert isinstance(value, Mapping)  # check_entry_keys refuses anything else
    try:
        return FairShareSettings(**value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {exc}") from None


def config_from_flag(raw: str | None) -> FairShareSettings:
    return parse_fair_share_config(
        parse_json(raw, FAIR_SHARE_CONFIG_FLAG), FAIR_SHARE_CONFIG_FLAG
    )


def config_entry(config: FairShareSettings) -> dict[str, Any]:
    """``config`` as its ``additional_config`` object."""
    return asdict(config)
