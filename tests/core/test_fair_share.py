"""The pure fair-share ledger (``pacing.fair_share``) and its settings: prices,
weights, the lift, rebasing, clean-up, and every bad value refused naming its
flag or key."""

from __future__ import annotations

import argparse

import pytest

from pacing.fair_share import (
    DEFAULT_WEIGHT,
    REBASE_AT,
    FairShare,
    FairShareSettings,
    Weights,
    validate_weight,
)
from pacing.settings.checks import SettingsError
from pacing.settings.cli import add_cli_args
from pacing.settings.model import OutputRateSettings
from tests.settings_harness import settings_of


@pytest.mark.parametrize(
    ("prompt", "output", "weight", "units"),
    [(0, 1, 1.0, 2.0), (10, 0, 1.0, 10.0), (10, 5, 1.0, 20.0), (10, 5, 4.0, 5.0)],
)
def test_service_is_priced_tokens_over_the_weight(prompt, output, weight, units):
    assert FairShare().cost(prompt, output, weight) == units


def test_prices_are_configurable():
    ledger = FairShare(FairShareSettings(prompt_price=0.5, output_price=3))
    assert ledger.cost(4, 2, 2.0) == (0.5 * 4 + 3 * 2) / 2


def test_a_users_own_weight_wins_over_its_tiers_then_the_default():
    weights = Weights({"alice": 3}, {"pro": 4})
    assert weights.of("alice", "pro") == 3
    assert weights.of("bob", "pro") == 4
    assert weights.of("bob", "free") == DEFAULT_WEIGHT
    assert weights.of("bob", None) == DEFAULT_WEIGHT
    weights.set_user("alice", None)
    weights.set_tier("pro", 0.5)
    assert weights.of("alice", "pro") == 0.5


@pytest.mark.parametrize("bad", [0, -1, 1e7, float("nan"), True, "2", None])
def test_a_bad_weight_is_refused(bad):
    with pytest.raises(ValueError, match="weight"):
        validate_weight(bad)


def test_the_lift_raises_newcomers_to_the_smallest_other_counter():
    ledger = FairShare()
    ledger.charge("a", 100)
    ledger.charge("b", 60)
    ledger.charge("c", 500)  # ahead already: keeps its own
    ledger.lift({"new", "c"}, {"a", "b", "new", "c"})
    assert ledger.of("new") == 60
    assert ledger.of("c") == 500


def test_the_lift_with_nobody_else_backlogged_changes_nothing():
    ledger = FairShare()
    ledger.lift({"new"}, {"new"})
    assert ledger.of("new") == 0 and "new" not in ledger.counter


def test_counters_are_rebased_past_the_threshold():
    ledger = FairShare()
    ledger.charge("a", REBASE_AT + 10)
    ledger.charge("b", REBASE_AT + 30)
    ledger.lift({"c"}, {"a", "b", "c"})
    assert (ledger.of("a"), ledger.of("b"), ledger.of("c")) == (0, 20, 0)
    assert ledger.gap({"a", "b"}) == 20


def test_the_gap_is_taken_among_the_backlogged_of_the_last_step():
    ledger = FairShare()
    ledger.charge("a", 10)
    ledger.charge("b", 50)
    ledger.charge("idle", 999)
    ledger.backlogged = frozenset({"a", "b"})
    assert ledger.gap() == 40
    assert ledger.gap({"a"}) == 0


def test_cleanup_drops_only_counters_the_lift_would_replace():
    ledger = FairShare()
    for user, units in {"a": 100, "b": 200, "behind": 50, "ahead": 300}.items():
        ledger.charge(user, units)
    ledger.cleanup({"a", "b"})
    assert set(ledger.counter) == {"a", "b", "ahead"}
    ledger.cleanup(set())  # nobody backlogged: everyone starts equal
    assert ledger.counter == {}


def test_fair_share_settings_flags_reach_additional_config_and_back():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--default-user-output-tokens-per-second",
            "100",
            "--output-rate-tiers",
            '{"pro": 200}',
            "--output-rate-fair-share",
            "--output-rate-weights",
            '{"users": {"alice": 2}, "tiers": {"pro": 4}}',
            "--output-rate-fair-share-config",
            '{"hysteresis": 64, "min_run_tokens": 4}',
            "--output-rate-control-address",
            "off",
        ]
    )
    settings = OutputRateSettings.from_cli_args(args)
    entry = settings.to_additional_config()
    assert entry["policy"]["fair_share"] is True
    assert entry["policy"]["weights"]["users"] == {"alice": 2.0}
    assert entry["policy"]["weights"]["tiers"] == {"pro": 4.0}
    assert entry["fair_share_config"]["hysteresis"] == 64
    again = OutputRateSettings.from_additional_config({"output_rate": entry})
    ledger = again.build_fair_share()
    assert ledger.enabled and ledger.settings.min_run_tokens == 4
    assert ledger.weights.of("bob", "pro") == 4


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--output-rate-weights", "[1]", "must be a JSON object"),
        ("--output-rate-weights", "{", "is not valid JSON"),
        ("--output-rate-fair-share-config", '{"hysteresis": -1}', "hysteresis"),
        ("--output-rate-fair-share-config", '{"min_run_tokens": 0}', "min_run_tokens"),
        ("--output-rate-fair-share-config", '{"speed": 1}', "unknown keys"),
    ],
)
def test_a_bad_fair_share_flag_is_an_argparse_error_naming_it(
    flag, value, message, capsys
):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--default-user-output-tokens-per-second", "1", flag, value])
    err = capsys.readouterr().err
    assert flag in err and message in err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            '{"users": {"a": 0}}',
            "--output-rate-weights: weights.users.a: must be a number in "
            "(0, 1e+06], got 0",
        ),
        (
            '{"people": {}}',
            "--output-rate-weights: weights: unknown field(s) 'people'; "
            "expected 'users', 'tiers', 'teams'",
        ),
    ],
)
def test_a_weight_breaking_a_policy_rule_is_a_settings_error_naming_the_flag(
    value, message
):
    # JSON of the right type passes argparse; the policy's rules are checked
    # once every flag is parsed.
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--default-user-output-tokens-per-second", "1", "--output-rate-weights", value]
    )
    with pytest.raises(SettingsError) as caught:
        OutputRateSettings.from_cli_args(args)
    assert str(caught.value) == message


def test_fair_share_needs_pacing_on_and_tier_weights_a_tier():
    needs = (
        "needs a default limit (--default-user-output-tokens-per-second, "
        "default_tokens_per_second in --output-rate-policy) or a limits file "
        "(--user-output-rate-config): they turn per-user output pacing on"
    )
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(SettingsError) as caught:
        OutputRateSettings.from_cli_args(
            parser.parse_args(["--output-rate-fair-share"])
        )
    assert str(caught.value) == f"--output-rate-fair-share {needs}"
    with pytest.raises(SettingsError) as caught:
        settings_of(fair_share=True)
    assert str(caught.value) == f"the policy {needs}"
    args = parser.parse_args(
        [
            "--default-user-output-tokens-per-second",
            "10",
            "--output-rate-weights",
            '{"tiers": {"gold": 2}}',
        ]
    )
    with pytest.raises(SettingsError) as caught:
        OutputRateSettings.from_cli_args(args)
    assert str(caught.value) == (
        "--output-rate-weights: weights.tiers.gold: unknown tier 'gold'"
    )
    with pytest.raises(SettingsError) as caught:
        settings_of(default_rate=10, tier_weights={"gold": 2})
    assert str(caught.value).endswith(": weights.tiers.gold: unknown tier 'gold'")


def test_settings_without_fair_share_keep_the_old_additional_config_keys():
    entry = settings_of(default_rate=10).to_additional_config()
    assert "fair_share_config" not in entry
    assert "fair_share" not in entry["policy"]
    assert not any(entry["policy"]["weights"].values())
