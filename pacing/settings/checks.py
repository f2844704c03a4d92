"""Parsing of the settings' values, shared by the flags and
``additional_config``: ``SettingsError``, the JSON flags' values, arrays of
names and unknown keys. The policy's rules are the policy's
(``pacing.policy.document``).

Every failure raises a ``SettingsError`` whose message names the flag or the
key; nothing here reads argparse or builds a settings object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pacing.settings.flags import (
    EXEMPT_TIERS_FLAG,
    EXEMPT_USERS_FLAG,
    FAIR_SHARE_CONFIG_FLAG,
    TEAM_MEMBERS_FLAG,
    TEAMS_FLAG,
    TIER_MEMBERS_FLAG,
    TIERS_FLAG,
    USER_RATES_FLAG,
    WEIGHTS_FLAG,
)


class SettingsError(ValueError):
    """A setting is invalid; the message names the flag or the key."""


#: JSON flag -> (the JSON type of its value, what it is, an example).
_JSON_FLAGS: dict[str, tuple[type, str, str]] = {
    USER_RATES_FLAG: (
        dict,
        "object mapping user names to tokens per second",
        '{"user-a": 100}',
    ),
    TIERS_FLAG: (
        dict,
        "object mapping tier names to tokens per second",
        '{"free": 20}',
    ),
    TIER_MEMBERS_FLAG: (
        dict,
        "object mapping user names to tier names",
        '{"user-b": "pro"}',
    ),
    TEAMS_FLAG: (
        dict,
        "object mapping team names to tokens per second",
        '{"acme": 600}',
    ),
    TEAM_MEMBERS_FLAG: (
        dict,
        "object mapping user names to team names",
        '{"user-a": "acme"}',
    ),
    EXEMPT_USERS_FLAG: (list, "array of user names", '["ops"]'),
    EXEMPT_TIERS_FLAG: (list, "array of tier names", '["staff"]'),
    WEIGHTS_FLAG: (
        dict,
        "object of user, tier and team weights",
        '{"users": {"alice": 2}, "tiers": {"pro": 4}}',
    ),
    FAIR_SHARE_CONFIG_FLAG: (
        dict,
        "object of fair-share prices and hysteresis",
        '{"prompt_price": 1, "output_price": 2, "hysteresis": 1024}',
    ),
}


def parse_json(raw: str | None, flag: str) -> Any:
    """``flag``'s JSON value, checked to be of the flag's JSON type; empty when
    the flag is absent or blank."""
    kind, what, example = _JSON_FLAGS[flag]
    if raw is None or raw.strip() == "":
        return kind()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(
            f"{flag} is not valid JSON ({exc.msg} at position {exc.pos}); "
            f"expected a JSON {what} like {example}"
        ) from None
    if not isinstance(value, kind):
        raise SettingsError(f"{flag} must be a JSON {what}, got {type(value).__name__}")
    return value


def name_set(value: object, where: str) -> frozenset[str]:
    """``value`` (an array of names) as a set; each name is validated later."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(
        value, list | tuple | set | frozenset
    ):
        raise SettingsError(
            f"{where} must be an array of names, got {type(value).__name__}"
        )
    for name in value:
        if not isinstance(name, str):
            raise SettingsError(
                f"{where} must hold names (strings), got {name!r} of type "
                f"{type(name).__name__}"
            )
    return frozenset(value)


def names_entry(entry: Mapping[str, Any], key: str, where: str) -> frozenset[str]:
    """``entry[key]`` as a set of names (absent or null: empty)."""
    value = entry.get(key)
    return frozenset() if value is None else name_set(value, f"{where}[{key!r}]")


def field_names(cls: type) -> set[str]:
    """The field names of dataclass ``cls``: the keys its entry may hold."""
    return {f.name for f in fields(cls)}


def check_entry_keys(entry: object, where: str, known: set[str]) -> None:
    """Refuses ``entry`` unless it is an object whose keys all are in ``known``."""
    if not isinstance(entry, Mapping):
        raise SettingsError(f"{where} must be an object")
    unknown = set(entry) - known
    if unknown:
        raise SettingsError(
            f"{where} has unknown keys {sorted(unknown)}; expected "
            f"{', '.join(sorted(known))}"
        )
