"""Output-rate settings: parsing and validating flags, and their home in vLLM's
``additional_config`` (the field vLLM carries to the engine-core process for
plugins)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pacing.identity import validate_user
from pacing.limiter import validate_rate

#: Key of our settings inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "output_rate"

DEFAULT_RATE_FLAG = "--default-user-output-tokens-per-second"
USER_RATES_FLAG = "--user-output-tokens-per-second"


def flag_dest(flag: str) -> str:
    """The attribute argparse stores ``flag``'s value under (its ``dest``)."""
    return flag.lstrip("-").replace("-", "_")


class OutputRateConfigError(ValueError):
    """A setting of the output-rate limiter is invalid; the message names it."""


@dataclass(frozen=True)
class OutputRateConfig:
    """What the operator asked for: a default limit (``None`` = feature off) and
    per-user overrides, in output tokens per second."""

    default_rate: int | None = None
    user_rates: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            if self.default_rate is not None:
                validate_rate(self.default_rate, field=DEFAULT_RATE_FLAG)
            for user, rate in self.user_rates.items():
                validate_user(user, field=f"user name in {USER_RATES_FLAG}")
                validate_rate(rate, field=f"{USER_RATES_FLAG} rate of {user!r}")
        except ValueError as exc:
            raise OutputRateConfigError(str(exc)) from None
        if self.user_rates and self.default_rate is None:
            raise OutputRateConfigError(
                f"{USER_RATES_FLAG} needs {DEFAULT_RATE_FLAG}: the default limit "
                "is what turns per-user output pacing on"
            )

    @property
    def enabled(self) -> bool:
        return self.default_rate is not None

    @classmethod
    def from_flags(
        cls, default_rate: int | None, user_rates_json: str | None
    ) -> OutputRateConfig:
        """Builds the config from the two command-line flags' raw values."""
        return cls(
            default_rate=default_rate, user_rates=parse_user_rates(user_rates_json)
        )

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None
    ) -> OutputRateConfig:
        """Reads our entry of ``additional_config`` (absent means feature off)."""
        entry = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if entry is None:
            return cls()
        if not isinstance(entry, Mapping):
            raise OutputRateConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be an object"
            )
        unknown = set(entry) - {"default_rate", "user_rates"}
        if unknown:
            raise OutputRateConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] has unknown keys "
                f"{sorted(unknown)}; expected default_rate, user_rates"
            )
        user_rates = entry.get("user_rates") or {}
        if not isinstance(user_rates, Mapping):
            raise OutputRateConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['user_rates'] must be "
                "an object mapping user names to tokens per second"
            )
        return cls(default_rate=entry.get("default_rate"), user_rates=dict(user_rates))

    def to_additional_config(self) -> dict[str, Any]:
        """Our entry for ``additional_config`` (JSON-serialisable)."""
        return {"default_rate": self.default_rate, "user_rates": dict(self.user_rates)}


def parse_user_rates(raw: str | None) -> dict[str, int]:
    """Parses ``--user-output-tokens-per-second`` JSON: ``{"user": rate, ...}``."""
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise OutputRateConfigError(
            f"{USER_RATES_FLAG} is not valid JSON ({exc.msg} at position {exc.pos}); "
            'expected an object like {"user-a": 100}'
        ) from None
    if not isinstance(value, dict):
        raise OutputRateConfigError(
            f"{USER_RATES_FLAG} must be a JSON object mapping user names to tokens "
            f"per second, got {type(value).__name__}"
        )
    return value
