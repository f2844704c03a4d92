"""The settings objects (``pacing.settings.model``): what they accept, what they
refuse naming the key, and their round trip through ``additional_config``."""

from __future__ import annotations

import json

import pytest

from pacing.limits import LimitSource
from pacing.modes import Mode
from pacing.settings.checks import SettingsError
from pacing.settings.model import (
    DEFAULT_MAX_LABELLED_USERS,
    ControlSettings,
    MetricsSettings,
    OutputRateSettings,
)
from pacing.settings.store import STORE_FLAG, StoreSettings
from tests.settings_harness import settings_of

STORE_URL = "redis://127.0.0.1:6379/0"
SECRET = "s3cret-Pa55"


def test_the_limiter_gets_the_whole_limit_table():
    paced = settings_of(
        default_rate=100,
        user_rates={"dave": 7, "ops": 3},
        tier_rates={"free": 20, "pro": 200},
        memberships={"alice": "pro", "dave": "free", "erin": "staff"},
        exempt_users=["ops"],
        exempt_tiers=["staff"],
    )
    limiter = paced.build_limiter()
    assert limiter.default_rate == 100
    # user -> (tokens/s, where that comes from); 0 is unlimited.
    expected = {
        "alice": (200, LimitSource("tier", "pro")),
        "dave": (7, LimitSource("user")),  # its own limit wins over its tier
        "erin": (0, LimitSource("exempt", "staff")),
        "ops": (0, LimitSource("exempt")),  # the exemption wins over its limit
        "zed": (100, LimitSource("default")),
    }
    assert {
        user: (limiter.rate_of(user), limiter.limit_source(user)) for user in expected
    } == expected


def test_without_pacing_the_limiter_limits_nobody():
    limiter = OutputRateSettings().build_limiter()
    assert not limiter.enabled
    assert limiter.rate_of("anyone") == 0


def test_tiers_and_the_mode_round_trip_through_additional_config():
    paced = settings_of(
        default_rate=50,
        user_rates={"dave": 7},
        mode=Mode.OFF,
        tier_rates={"free": 20},
        memberships={"alice": "free", "erin": "staff"},
        exempt_users=frozenset({"ops", "root"}),
        exempt_tiers=frozenset({"staff"}),
    )
    additional = {"output_rate": paced.to_additional_config()}
    written = json.loads(json.dumps(additional))["output_rate"]["policy"]
    assert written["exempt_users"] == ["ops", "root"]
    assert OutputRateSettings.from_additional_config(additional) == paced
    # Older entries, without the new keys, read as enforce with no tiers.
    old = OutputRateSettings.from_additional_config(
        {"output_rate": {"default_rate": 50, "mode": None}}
    )
    table = old.policy.limit_table()
    assert (old.mode, table.tier_rates, table.exempt_users) == (Mode.ENFORCE, {}, set())


def test_the_flat_keys_of_earlier_versions_are_read_as_the_policy():
    paced = settings_of(
        default_rate=50,
        user_rates={"dave": 7},
        mode=Mode.SHADOW,
        tier_rates={"free": 20},
        memberships={"alice": "free"},
        exempt_users=["ops"],
    )
    flat = {
        "default_rate": 50,
        "user_rates": {"dave": 7},
        "mode": "shadow",
        "tier_rates": {"free": 20},
        "memberships": {"alice": "free"},
        "exempt_users": ["ops"],
        "exempt_tiers": [],
    }
    read = OutputRateSettings.from_additional_config({"output_rate": flat})
    assert read == paced
    assert read.to_additional_config() == paced.to_additional_config()


def test_the_policy_key_and_the_flat_keys_cannot_be_mixed():
    entry = {"policy": {"default_tokens_per_second": 10}, "user_rates": {"a": 5}}
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_additional_config({"output_rate": entry})
    assert str(error.value) == (
        "additional_config['output_rate']['policy'] holds the whole policy: "
        "additional_config['output_rate']['user_rates'] cannot be given with it"
    )


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"mode": "fast"},
            "additional_config['output_rate']: mode: must be one of enforce, "
            "shadow, off, got 'fast'",
        ),
        ({"mode": 1}, "must be one of enforce, shadow, off"),
        (
            {"tier_rates": ["free"]},
            "additional_config['output_rate']: tier_rates: must be an object",
        ),
        (
            {"tier_rates": {"free": 0}},
            "additional_config['output_rate']: tiers.free.tokens_per_second: must "
            "be an integer in 1..1000000 (tokens per second), got 0",
        ),
        (
            {"memberships": {"a": "gold"}},
            "additional_config['output_rate']: memberships.a: unknown tier 'gold'",
        ),
        (
            {
                "policy": {
                    "default_tokens_per_second": 10,
                    "tiers": {"free": {"tokens_per_second": 0}},
                }
            },
            "additional_config['output_rate']['policy']: tiers.free.tokens_per_second: "
            "must be an integer in 1..1000000 (tokens per second), got 0",
        ),
        ({"exempt_users": "ops"}, "['exempt_users'] must be an array of names"),
        ({"exempt_tiers": [{"a": 1}]}, "must hold names"),
        ({"exempt_users": ["\ud800"]}, "lone surrogate"),
        (
            {"user_source": "header:a b"},
            "additional_config['output_rate']['user_source'] names no valid HTTP "
            "header ('a b')",
        ),
        ({"user_source": 5}, "['user_source'] must be a string"),
        ({"require_user": "yes"}, "['require_user'] must be a boolean"),
    ],
)
def test_invalid_tables_and_modes_in_additional_config_are_refused(entry, message):
    base = {} if "policy" in entry else {"default_rate": 10}
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_additional_config({"output_rate": {**base, **entry}})
    assert message in str(error.value)


def test_additional_config_round_trip_and_validation():
    config = settings_of(default_rate=5, user_rates={"x": 7})
    assert (
        OutputRateSettings.from_additional_config(
            {"output_rate": config.to_additional_config()}
        )
        == config
    )
    assert not OutputRateSettings.from_additional_config({}).enabled
    with pytest.raises(SettingsError, match="unknown keys"):
        OutputRateSettings.from_additional_config({"output_rate": {"rate": 5}})
    with pytest.raises(SettingsError, match="must be an object"):
        OutputRateSettings.from_additional_config({"output_rate": 5})
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_additional_config({"output_rate": {"default_rate": 0}})
    assert str(error.value) == (
        "additional_config['output_rate']: default_tokens_per_second: must be an "
        "integer in 1..1000000 (tokens per second), got 0"
    )


def test_control_defaults_listen_on_loopback():
    paced = OutputRateSettings.from_additional_config(
        {"output_rate": {"default_rate": 10, "control": {}}}
    )
    assert paced.control == ControlSettings()
    assert paced.control.address == "127.0.0.1:50151"
    assert paced.control.enabled


def test_unknown_control_settings_are_refused():
    with pytest.raises(SettingsError, match="unknown keys"):
        OutputRateSettings.from_additional_config(
            {"output_rate": {"default_rate": 10, "control": {"adress": "x"}}}
        )


def test_metrics_default_to_not_emitting_with_the_default_cap():
    assert OutputRateSettings.from_additional_config(None).metrics == MetricsSettings(
        emit=False, max_labelled_users=DEFAULT_MAX_LABELLED_USERS
    )
    paced = settings_of(
        default_rate=5, metrics=MetricsSettings(emit=True, max_labelled_users=7)
    )
    assert (
        OutputRateSettings.from_additional_config(
            {"output_rate": paced.to_additional_config()}
        )
        == paced
    )


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ([], "must be an object"),
        ({"cap": 3}, "unknown keys"),
        ({"max_labelled_users": -1}, "max_labelled_users"),
        ({"max_labelled_users": "100"}, "max_labelled_users"),
        ({"emit": "yes"}, "emit"),
    ],
)
def test_invalid_metrics_settings_are_refused_naming_the_field(entry, message):
    with pytest.raises(SettingsError, match=message):
        OutputRateSettings.from_additional_config({"output_rate": {"metrics": entry}})


@pytest.mark.parametrize(
    ("old", "new"),
    [("output_rate_control", "control"), ("output_rate_metrics", "metrics")],
)
def test_the_keys_of_earlier_versions_are_refused_naming_their_new_place(old, new):
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_additional_config(
            {"output_rate": {"default_rate": 10}, old: {}}
        )
    assert str(error.value) == (
        f"additional_config[{old!r}] is no longer read: use "
        f"additional_config['output_rate'][{new!r}]"
    )


@pytest.mark.parametrize("source", ["openai-user", "header:x-user-id", "xargs"])
def test_the_identity_settings_round_trip_through_additional_config(source):
    paced = settings_of(default_rate=5, user_source=source, require_user=True)
    additional = json.loads(json.dumps({"output_rate": paced.to_additional_config()}))
    assert additional["output_rate"]["user_source"] == source
    assert OutputRateSettings.from_additional_config(additional) == paced


def test_require_user_must_be_a_boolean():
    with pytest.raises(SettingsError, match="--output-rate-require-user must be a"):
        settings_of(default_rate=5, require_user=1)


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ({"url": STORE_URL, "passwd": "x"}, "['store'] has unknown keys ['passwd']"),
        ({}, "['store'] needs a 'url'"),
        ("redis://h/0", "['store'] must be an object"),
        ({"url": f"redis://:{SECRET}@h/0"}, f"{STORE_FLAG} must not hold a password"),
        ({"url": STORE_URL, "failure_mode": "open"}, "must be one of keep-local"),
        ({"url": STORE_URL, "failure_after_s": -1}, "non-negative number"),
        ({"url": STORE_URL, "timeout_ms": 0}, "whole number of milliseconds"),
    ],
)
def test_invalid_store_entries_in_additional_config_are_refused(store, message):
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_additional_config(
            {"output_rate": {"default_rate": 10, "store": store}}
        )
    assert message in str(error.value)
    assert SECRET not in str(error.value)


def test_the_store_round_trips_through_additional_config_offline():
    paced = settings_of(
        default_rate=10,
        store=StoreSettings("unix:///run/redis.sock?db=1", failure_mode="fail-open"),
    )
    additional = json.loads(json.dumps({"output_rate": paced.to_additional_config()}))
    assert additional["output_rate"]["store"]["failure_mode"] == "fail-open"
    assert OutputRateSettings.from_additional_config(additional) == paced
    # An entry without the key (or null) has no store.
    for entry in ({"default_rate": 10}, {"default_rate": 10, "store": None}):
        assert (
            OutputRateSettings.from_additional_config({"output_rate": entry}).store
            is None
        )
