"""The fair-share settings' flags and their values (``pacing.fair_share``):
the switch, the weights and the pricing, as the flags and ``additional_config``
give them. Every failure is a ``SettingsError`` naming the flag or the key.

- ``--output-rate-fair-share``: on at start (live-switchable later).
- ``--output-rate-weights '{"users": {"alice": 2}, "tiers": {"pro": 4},
  "teams": {"acme": 2}}'``: a user's weight inside its team and, for a user
  without a team, at the top level; a team's weight at the top level.
- ``--output-rate-fair-share-config '{"prompt_price": 1, "output_price": 2,
  "hysteresis": 1024, "min_run_tokens": 16}'`` (any subset).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from pacing.fair_share import FairShareSettings, validate_weight
from pacing.settings.checks import SettingsError, check_keys, field_names, parse_json
from pacing.settings.flags import FAIR_SHARE_CONFIG_FLAG, WEIGHTS_FLAG

#: Keys of the weights object.
WEIGHT_KEYS = ("users", "tiers", "teams")
#: Weights by key of the weights object: user, tier and team weights.
WeightParts = tuple[dict[str, float], dict[str, float], dict[str, float]]


def parse_weights(value: object, where: str) -> WeightParts:
    """``{"users": {...}, "tiers": {...}, "teams": {...}}`` (any may be
    absent) as (user, tier, team weights), each weight checked."""
    if value is None:
        return {}, {}, {}
    if not isinstance(value, Mapping):
        raise SettingsError(
            f'{where} must be an object like {{"users": {{"alice": 2}}, '
            f'"tiers": {{"pro": 4}}}}, got {value!r}'
        )
    check_keys(value, where, set(WEIGHT_KEYS))
    parts: list[dict[str, float]] = []
    for key in WEIGHT_KEYS:
        part = value.get(key) or {}
        if not isinstance(part, Mapping):
            raise SettingsError(f"{where}[{key!r}] must be an object of name: weight")
        checked: dict[str, float] = {}
        for name, weight in part.items():
            try:
                checked[str(name)] = validate_weight(
                    weight, field=f"{where}[{key!r}][{name!r}]"
                )
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        parts.append(checked)
    return parts[0], parts[1], parts[2]


def parse_fair_share_config(value: object, where: str) -> FairShareSettings:
    """The pricing and hysteresis object (absent keys: the defaults)."""
    if value is None:
        return FairShareSettings()
    check_keys(value, where, field_names(FairShareSettings))
    assert isinstance(value, Mapping)  # check_keys refuses anything else
    try:
        return FairShareSettings(**value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {exc}") from None


def weights_from_flag(raw: str | None) -> WeightParts:
    return parse_weights(parse_json(raw, WEIGHTS_FLAG), WEIGHTS_FLAG)


def config_from_flag(raw: str | None) -> FairShareSettings:
    return parse_fair_share_config(
        parse_json(raw, FAIR_SHARE_CONFIG_FLAG), FAIR_SHARE_CONFIG_FLAG
    )


def config_entry(config: FairShareSettings) -> dict[str, Any]:
    """``config`` as its ``additional_config`` object."""
    return asdict(config)
