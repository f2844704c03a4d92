"""Tests for ``pacing.modes``."""

from __future__ import annotations

import pytest

from pacing.modes import Mode, parse_mode


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("enforce", Mode.ENFORCE), ("shadow", Mode.SHADOW), (" OFF ", Mode.OFF)],
)
def test_a_mode_is_parsed_from_its_name(raw: str, mode: Mode) -> None:
    assert parse_mode(raw) is mode
    assert str(mode) == mode.value


@pytest.mark.parametrize("raw", ["", "dry-run", None, 1, ["enforce"]])
def test_an_unknown_mode_is_refused_naming_the_field_and_the_choices(
    raw: object,
) -> None:
    with pytest.raises(
        ValueError, match="--output-rate-mode must be one of enforce, shadow, off"
    ):
        parse_mode(raw, field="--output-rate-mode")
