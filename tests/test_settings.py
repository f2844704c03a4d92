"""The one settings object (``pacing.settings``): flags, ``additional_config``,
and configurations refused at config time."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from engine_ext import hooks
from engine_ext.plugin import register
from engine_ext.scheduler import OutputRateAsyncScheduler, OutputRateScheduler
from engine_ext.supported import check_supported
from pacing import settings
from pacing.identity import HEADER, XARGS_SOURCE, UserSource
from pacing.limits import LimitSource
from pacing.modes import Mode
from pacing.settings import (
    DEFAULT_MAX_LABELLED_USERS,
    ControlSettings,
    MetricsSettings,
    OutputRateSettings,
    SettingsError,
)
from pacing.store_settings import (
    FAILURE_AFTER_FLAG,
    FAILURE_MODE_FLAG,
    PASSWORD_ENV,
    PASSWORD_FILE_FLAG,
    STORE_FLAG,
    TIMEOUT_FLAG,
    FailureMode,
    StoreSettings,
)
from tools.scheduler_harness import make_scheduler

register()


@pytest.fixture(scope="module")
def serve_parser() -> FlexibleArgumentParser:
    """vLLM's own serve parser, with our plugin's flags."""
    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(autouse=True)
def _default_control_port_taken_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing the flags runs the start-up checks, which bind the control
    plane's address: with the default one (127.0.0.1:50151) these tests failed
    whenever a server on the same machine held it. What they test is parsing;
    the port check has its own test (test_startup_checks)."""
    monkeypatch.setattr("control.preflight.check_port_free", lambda address: None)


def test_serve_parser_accepts_the_flags(serve_parser):
    args = serve_parser.parse_args(
        [
            "m",
            "--max-num-active-seqs",
            "4",
            "--default-user-output-tokens-per-second",
            "100",
            "--user-output-tokens-per-second",
            '{"user-a": 100, "user-b": 500}',
        ]
    )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.max_num_active_seqs == 4
    entry = engine_args.additional_config["output_rate"]
    assert entry["default_rate"] == 100
    assert entry["user_rates"] == {"user-a": 100, "user-b": 500}
    assert entry["control"]["address"] == "127.0.0.1:50151"  # the flags' default
    assert hooks.HTTP_GUARD in args.middleware


def test_the_flags_keep_the_metrics_given_in_additional_config(serve_parser):
    metrics = {"emit": False, "max_labelled_users": 7}
    args = serve_parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "100",
            "--output-rate-control-address",
            "off",
            "--additional-config",
            json.dumps({"output_rate": {"metrics": metrics}, "other": 1}),
        ]
    )
    additional = AsyncEngineArgs.from_cli_args(args).additional_config
    assert additional["output_rate"]["metrics"] == metrics
    assert additional["output_rate"]["control"]["address"] == "off"
    assert additional["other"] == 1  # another plugin's entry stays


def test_serve_parser_accepts_the_mode_tier_and_exemption_flags(serve_parser):
    args = serve_parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "100",
            "--output-rate-mode",
            "Shadow",
            "--output-rate-tiers",
            '{"free": 20, "pro": 200, "staff": 5}',
            "--output-rate-tier-members",
            '{"alice": "pro", "bob": "free", "carol": "staff"}',
            "--output-rate-exempt-users",
            '["ops"]',
            "--output-rate-exempt-tiers",
            '["staff"]',
        ]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert entry["mode"] == "shadow"
    assert entry["tier_rates"] == {"free": 20, "pro": 200, "staff": 5}
    assert entry["memberships"] == {"alice": "pro", "bob": "free", "carol": "staff"}
    assert (entry["exempt_users"], entry["exempt_tiers"]) == (["ops"], ["staff"])
    paced = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert paced.mode is Mode.SHADOW


def test_without_the_mode_flag_pacing_enforces(serve_parser):
    args = serve_parser.parse_args(
        ["m", "--default-user-output-tokens-per-second", "100"]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert entry["mode"] == "enforce"
    assert OutputRateSettings.from_additional_config({}).mode is Mode.ENFORCE


def test_the_limiter_gets_the_whole_limit_table():
    paced = OutputRateSettings(
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


def test_without_the_default_flag_nothing_changes(serve_parser):
    args = serve_parser.parse_args(["m"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert "output_rate" not in (engine_args.additional_config or {})
    assert hooks.HTTP_GUARD not in (args.middleware or [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--default-user-output-tokens-per-second", "0"], "between 1 and"),
        (["--default-user-output-tokens-per-second", "-5"], "between 1 and"),
        (["--default-user-output-tokens-per-second", "2.5"], "positive integer"),
        (["--default-user-output-tokens-per-second", "ten"], "positive integer"),
        (["--user-output-tokens-per-second", "{bad"], "not valid JSON"),
        (["--user-output-tokens-per-second", "[1, 2]"], "must be a JSON object"),
        (["--user-output-tokens-per-second", '{"a": 0}'], "between 1 and"),
        (["--user-output-tokens-per-second", '{"a": -1}'], "between 1 and"),
        (["--user-output-tokens-per-second", '{"a": 1.5}'], "positive integer"),
        (["--user-output-tokens-per-second", '{"a": true}'], "positive integer"),
        (["--user-output-tokens-per-second", '{"": 5}'], "must not be empty"),
        (["--user-output-tokens-per-second", '{"a": 10000000000}'], "between 1 and"),
        (["--output-rate-mode", "fast"], "must be one of enforce, shadow, off"),
        (["--output-rate-mode", ""], "must be one of enforce, shadow, off"),
        (["--output-rate-tiers", "{bad"], "not valid JSON"),
        (["--output-rate-tiers", '["free"]'], "must be a JSON object"),
        (["--output-rate-tiers", '{"free": 0}'], "between 1 and"),
        (["--output-rate-tiers", '{"free": "20"}'], "positive integer"),
        (["--output-rate-tiers", '{"": 20}'], "must not be empty"),
        (["--output-rate-tiers", '{"fr\\u200bee": 20}'], "must not contain"),
        (["--output-rate-tier-members", '["alice"]'], "must be a JSON object"),
        (["--output-rate-tier-members", '{"alice": 5}'], "must be a string"),
        (["--output-rate-tier-members", '{"alice": ""}'], "must not be empty"),
        (["--output-rate-exempt-users", '{"ops": true}'], "must be a JSON array"),
        (["--output-rate-exempt-users", '"ops"'], "must be a JSON array"),
        (["--output-rate-exempt-users", "[5]"], "must hold names"),
        (["--output-rate-exempt-users", '[""]'], "must not be empty"),
        (["--output-rate-exempt-tiers", "[[]]"], "must hold names"),
        (["--output-rate-exempt-tiers", '["st\\u0000aff"]'], "must not contain"),
        (["--output-rate-user-source", "body"], "must be xargs, header:NAME or"),
        (["--output-rate-user-source", ""], "must be xargs, header:NAME or"),
        (["--output-rate-user-source", "header:"], "names no valid HTTP header"),
        (["--output-rate-user-source", "header:X User"], "no valid HTTP header"),
        (["--output-rate-user-source", "header:Cookie"], "carries a credential"),
    ],
)
def test_bad_flag_values_are_rejected_naming_the_flag(
    serve_parser, capsys, argv, message
):
    with pytest.raises(SystemExit) as exit_info:
        serve_parser.parse_args(["m", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert argv[0] in error and message in error


def test_bad_flag_fails_start_up_with_one_line(tiny_model_dir):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine_ext.serve",
            tiny_model_dir,
            "--user-output-tokens-per-second",
            '{"a": 5}',
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 2  # like an argparse error
    # vLLM may log warnings first; the failure itself is the last line, alone.
    assert completed.stderr.splitlines()[-1] == (
        "error: --user-output-tokens-per-second needs "
        "--default-user-output-tokens-per-second: the default limit is what turns "
        "per-user output pacing on"
    )
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--output-rate-tier-members", '{"alice": "gold"}'],
            "--output-rate-tier-members puts 'alice' in tier 'gold', which neither "
            "--output-rate-tiers nor --output-rate-exempt-tiers defines",
        ),
        (
            [
                "--output-rate-tiers",
                '{"free": 20}',
                "--output-rate-tier-members",
                '{"alice": "pro"}',
            ],
            "--output-rate-tier-members puts 'alice' in tier 'pro'",
        ),
    ],
)
def test_a_member_of_an_undefined_tier_is_refused_naming_the_flags(argv, message):
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    args = parser.parse_args(["--default-user-output-tokens-per-second", "10", *argv])
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(args)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    "argv",
    [
        ["--output-rate-mode", "shadow"],
        ["--output-rate-mode", "off"],
        ["--output-rate-tiers", '{"free": 20}'],
        ["--output-rate-exempt-users", '["ops"]'],
        ["--output-rate-exempt-tiers", '["staff"]'],
        ["--output-rate-user-source", "header:X-User-Id"],
        ["--output-rate-user-source", "openai-user"],
        ["--output-rate-require-user"],
    ],
)
def test_limit_flags_without_the_default_flag_are_refused(argv):
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(parser.parse_args(argv))
    assert str(error.value) == (
        f"{argv[0]} needs --default-user-output-tokens-per-second: the default "
        "limit is what turns per-user output pacing on"
    )


def test_enforce_without_the_default_flag_is_simply_pacing_off():
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    args = parser.parse_args(["--output-rate-mode", "enforce"])
    assert OutputRateSettings.from_cli_args(args) == OutputRateSettings()


def test_tiers_and_the_mode_round_trip_through_additional_config():
    paced = OutputRateSettings(
        default_rate=50,
        user_rates={"dave": 7},
        mode=Mode.OFF,
        tier_rates={"free": 20},
        memberships={"alice": "free", "erin": "staff"},
        exempt_users=frozenset({"ops", "root"}),
        exempt_tiers=frozenset({"staff"}),
    )
    additional = {"output_rate": paced.to_additional_config()}
    assert json.loads(json.dumps(additional))["output_rate"]["exempt_users"] == [
        "ops",
        "root",
    ]
    assert OutputRateSettings.from_additional_config(additional) == paced
    # Older entries, without the new keys, read as enforce with no tiers.
    old = OutputRateSettings.from_additional_config(
        {"output_rate": {"default_rate": 50, "mode": None}}
    )
    assert (old.mode, old.tier_rates, old.exempt_users) == (Mode.ENFORCE, {}, set())


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"mode": "fast"},
            "additional_config['output_rate']['mode'] must be one of enforce, "
            "shadow, off, got 'fast'",
        ),
        ({"mode": 1}, "must be one of enforce, shadow, off"),
        ({"tier_rates": ["free"]}, "['tier_rates'] must be an object"),
        ({"tier_rates": {"free": 0}}, "--output-rate-tiers rate of 'free'"),
        ({"memberships": {"a": "gold"}}, "puts 'a' in tier 'gold'"),
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
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_additional_config(
            {"output_rate": {"default_rate": 10, **entry}}
        )
    assert message in str(error.value)


def test_additional_config_round_trip_and_validation():
    config = OutputRateSettings(default_rate=5, user_rates={"x": 7})
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
    with pytest.raises(SettingsError, match="between 1 and"):
        OutputRateSettings.from_additional_config({"output_rate": {"default_rate": 0}})


def test_flags_round_trip_through_additional_config(tmp_path):
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--default-user-output-tokens-per-second",
            "10",
            "--output-rate-control-address",
            "127.0.0.1:0",
            "--user-output-rate-config",
            str(tmp_path / "limits.yaml"),
            "--output-rate-control-token-file",
            "/run/secrets/token",
        ]
    )
    paced = OutputRateSettings.from_cli_args(args)
    additional = {"output_rate": paced.to_additional_config()}
    json.dumps(additional)  # must survive vLLM's serialisation
    assert OutputRateSettings.from_additional_config(additional) == paced
    assert paced.control is not None
    assert paced.control.token_file == "/run/secrets/token"


def test_without_the_default_flag_the_flags_ask_for_no_control_plane():
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    args = parser.parse_args(["--output-rate-control-token-file", "/missing"])
    assert OutputRateSettings.from_cli_args(args) == OutputRateSettings()


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
    paced = OutputRateSettings(
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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_config_selects_the_matching_scheduler(tiny_model_dir, async_scheduling):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        additional_config={"output_rate": {"default_rate": 10, "user_rates": {}}},
        async_scheduling=async_scheduling,
    )
    vllm_config = engine_args.create_engine_config()
    chosen = vllm_config.scheduler_config.scheduler_cls
    # The CPU platform forces synchronous scheduling; the choice follows vLLM's
    # resolved setting, not the flag.
    resolved = vllm_config.scheduler_config.async_scheduling
    assert chosen is (OutputRateAsyncScheduler if resolved else OutputRateScheduler)


def test_engine_config_without_pacing_keeps_upstream_scheduler(tiny_model_dir):
    vllm_config = EngineArgs(
        model=tiny_model_dir, max_model_len=512
    ).create_engine_config()
    assert vllm_config.scheduler_config.scheduler_cls is None


class _HashableConfig:
    """What vLLM also takes as ``additional_config``: an object with a hash."""

    def compute_hash(self) -> str:
        return "another-plugin"


def test_a_hashable_additional_config_object_leaves_pacing_off(tiny_model_dir):
    vllm_config = EngineArgs(
        model=tiny_model_dir, max_model_len=512, additional_config=_HashableConfig()
    ).create_engine_config()
    assert vllm_config.scheduler_config.scheduler_cls is None
    assert not OutputRateSettings.from_additional_config(_HashableConfig()).enabled


def test_another_custom_scheduler_is_refused(tiny_model_dir):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
        additional_config={"output_rate": {"default_rate": 10}},
    )
    with pytest.raises(SettingsError, match="--scheduler-cls"):
        engine_args.create_engine_config()


def _vllm_config(tiny_model_dir):
    return make_scheduler(tiny_model_dir, default_rate=10).vllm_config


@pytest.mark.parametrize(
    ("mutate", "option"),
    [
        (lambda c: setattr(c, "speculative_config", object()), "--speculative-config"),
        (
            lambda c: setattr(c.parallel_config, "data_parallel_size", 2),
            "--data-parallel-size",
        ),
        (
            lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2),
            "--pipeline-parallel-size",
        ),
        (lambda c: setattr(c, "kv_transfer_config", object()), "--kv-transfer-config"),
        (lambda c: setattr(c, "ec_transfer_config", object()), "--ec-transfer-config"),
        (
            lambda c: setattr(c.cache_config, "kv_offloading_size", 1.0),
            "--kv-offloading-size",
        ),
        (
            lambda c: setattr(
                c.aux_output_config, "enable_return_routed_experts", True
            ),
            "aux output",
        ),
        (lambda c: setattr(c, "diffusion_config", object()), "diffusion"),
    ],
)
def test_unsupported_configurations_are_refused_naming_the_option(
    tiny_model_dir, mutate, option
):
    vllm_config = _vllm_config(tiny_model_dir)
    check_supported(vllm_config)  # the plain tiny model is fine
    mutate(vllm_config)
    with pytest.raises(SettingsError, match=option):
        check_supported(vllm_config)


def test_hooks_fail_loudly_when_vllm_internals_moved():
    class Moved:
        pass

    with pytest.raises(RuntimeError, match="vLLM internals moved"):
        hooks._wrap(Moved, "_process_engine_step", lambda original, self: None)


def test_hooks_install_once():
    register()
    register()
    wrapped = EngineArgs.__dict__["create_engine_config"]
    assert getattr(wrapped, "__output_rate_hook__", False)
    assert not getattr(wrapped.__wrapped__, "__output_rate_hook__", False)


def test_rate_flag_type_rejects_bool_like_values():
    with pytest.raises(argparse.ArgumentTypeError):
        settings._rate_arg("true")


def test_serve_parser_accepts_the_identity_flags(serve_parser):
    args = serve_parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "100",
            "--output-rate-user-source",
            "Header:X-User-Id",
            "--output-rate-require-user",
        ]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert (entry["user_source"], entry["require_user"]) == ("header:x-user-id", True)
    paced = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert paced.user_source == UserSource(HEADER, "x-user-id")
    assert paced.require_user is True


def test_without_the_identity_flags_the_client_names_its_user(serve_parser):
    args = serve_parser.parse_args(
        ["m", "--default-user-output-tokens-per-second", "100"]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert (entry["user_source"], entry["require_user"]) == ("xargs", False)
    # Entries of earlier versions, without the keys, read the same.
    old = OutputRateSettings.from_additional_config(
        {"output_rate": {"default_rate": 5}}
    )
    assert (old.user_source, old.require_user) == (XARGS_SOURCE, False)


@pytest.mark.parametrize("source", ["openai-user", "header:x-user-id", "xargs"])
def test_the_identity_settings_round_trip_through_additional_config(source):
    paced = OutputRateSettings(default_rate=5, user_source=source, require_user=True)
    additional = json.loads(json.dumps({"output_rate": paced.to_additional_config()}))
    assert additional["output_rate"]["user_source"] == source
    assert OutputRateSettings.from_additional_config(additional) == paced


def test_require_user_must_be_a_boolean():
    with pytest.raises(SettingsError, match="--output-rate-require-user must be a"):
        OutputRateSettings(default_rate=5, require_user=1)  # type: ignore[arg-type]


# -- the global store (issue 11) ------------------------------------------------

STORE_URL = "redis://127.0.0.1:6379/0"
SECRET = "s3cret-Pa55"


def test_serve_parser_accepts_the_store_flags(serve_parser, tmp_path):
    password = tmp_path / "password"
    password.write_text(SECRET)
    args = serve_parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "100",
            "--output-rate-store",
            "rediss://redis.internal:6380/2",
            "--output-rate-store-password-file",
            str(password),
            "--output-rate-store-failure-mode",
            "Fail-Closed",
            "--output-rate-store-failure-after",
            "2.5",
            "--output-rate-store-timeout-ms",
            "20",
        ]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert entry["store"] == {
        "url": "rediss://redis.internal:6380/2",
        "password_file": str(password),
        "failure_mode": "fail-closed",
        "failure_after_s": 2.5,
        "timeout_ms": 20,
    }
    assert SECRET not in json.dumps(entry)  # the path travels, not the password
    paced = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert paced.store == StoreSettings(
        "rediss://redis.internal:6380/2",
        password_file=str(password),
        failure_mode=FailureMode.FAIL_CLOSED,
        failure_after_s=2.5,
        timeout_ms=20,
    )
    assert paced == OutputRateSettings.from_cli_args(args)


def test_the_store_flag_alone_takes_the_defaults(serve_parser):
    args = serve_parser.parse_args(
        ["m", "--default-user-output-tokens-per-second", "100", STORE_FLAG, STORE_URL]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert entry["store"] == {
        "url": STORE_URL,
        "password_file": None,
        "failure_mode": "keep-local-share",
        "failure_after_s": 5.0,
        "timeout_ms": 50,
    }


def test_without_the_store_flag_settings_and_additional_config_are_as_before(
    serve_parser,
):
    args = serve_parser.parse_args(
        ["m", "--default-user-output-tokens-per-second", "100"]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    # The entry of the version before the store, key for key.
    assert entry == {
        "default_rate": 100,
        "user_rates": {},
        "mode": "enforce",
        "tier_rates": {},
        "memberships": {},
        "exempt_users": [],
        "exempt_tiers": [],
        "user_source": "xargs",
        "require_user": False,
        "metrics": {"emit": False, "max_labelled_users": DEFAULT_MAX_LABELLED_USERS},
        "control": {
            "address": "127.0.0.1:50151",
            "config_path": None,
            "token_file": None,
            "tls_cert": None,
            "tls_key": None,
            "tls_client_ca": None,
        },
    }
    paced = OutputRateSettings.from_cli_args(args)
    assert paced.store is None
    assert paced == OutputRateSettings(
        default_rate=100, control=ControlSettings(), metrics=MetricsSettings()
    )
    assert OutputRateSettings.from_additional_config({"output_rate": entry}) == paced


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([STORE_FLAG, "http://127.0.0.1:6379/0"], "must be a URL starting redis://"),
        ([STORE_FLAG, "redis://127.0.0.1:6379/db"], "must be a database number"),
        ([STORE_FLAG, "redis://h/0?socket_timeout=1"], "is not taken"),
        ([FAILURE_MODE_FLAG, "fail-slow"], "must be one of keep-local-share"),
        ([FAILURE_AFTER_FLAG, "-1"], "non-negative number of seconds"),
        ([FAILURE_AFTER_FLAG, "nan"], "non-negative number of seconds"),
        ([FAILURE_AFTER_FLAG, "soon"], "non-negative number of seconds"),
        ([TIMEOUT_FLAG, "0"], "milliseconds in 1..60000"),
        ([TIMEOUT_FLAG, "2.5"], "milliseconds in 1..60000"),
    ],
)
def test_bad_store_flag_values_are_rejected_naming_the_flag(
    serve_parser, capsys, argv, message
):
    with pytest.raises(SystemExit) as exit_info:
        serve_parser.parse_args(["m", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert argv[0] in error and message in error


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@127.0.0.1:6379/0",
        f"rediss://engine:{SECRET}@redis.internal:6380/0",
        f"redis://127.0.0.1:6379/0?password={SECRET}",
    ],
)
def test_a_password_in_the_store_url_is_refused_without_being_shown(
    serve_parser, capsys, url
):
    with pytest.raises(SystemExit) as exit_info:
        serve_parser.parse_args(
            ["m", "--default-user-output-tokens-per-second", "100", STORE_FLAG, url]
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{STORE_FLAG} must not hold a password" in error
    assert PASSWORD_FILE_FLAG in error and PASSWORD_ENV in error
    assert SECRET not in error


def test_the_store_flag_needs_the_default_flag():
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(parser.parse_args([STORE_FLAG, STORE_URL]))
    assert str(error.value) == (
        f"{STORE_FLAG} needs --default-user-output-tokens-per-second: the default "
        "limit is what turns per-user output pacing on"
    )


@pytest.mark.parametrize(
    "argv",
    [
        [PASSWORD_FILE_FLAG, "/run/secrets/redis"],
        [FAILURE_MODE_FLAG, "fail-open"],
        [FAILURE_AFTER_FLAG, "1"],
        [TIMEOUT_FLAG, "20"],
    ],
)
def test_the_other_store_flags_need_the_store_flag(argv):
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    args = parser.parse_args(["--default-user-output-tokens-per-second", "10", *argv])
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(args)
    assert str(error.value) == f"{argv[0]} needs {STORE_FLAG}"


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
    paced = OutputRateSettings(
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


def test_an_unreadable_password_file_ends_the_parse_in_the_api_process(tmp_path):
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    missing = tmp_path / "password"
    args = parser.parse_args(
        [
            "--default-user-output-tokens-per-second",
            "10",
            STORE_FLAG,
            STORE_URL,
            PASSWORD_FILE_FLAG,
            str(missing),
        ]
    )
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(args)
    assert str(error.value) == (
        f"{PASSWORD_FILE_FLAG} {missing}: No such file or directory"
    )
    missing.write_text(SECRET)
    assert OutputRateSettings.from_cli_args(args).store is not None


# -- data parallel needs the store ------------------------------------------------


def test_data_parallel_without_a_store_is_refused_naming_the_store_flag(
    tiny_model_dir,
):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        data_parallel_size=2,
        additional_config={"output_rate": {"default_rate": 10}},
    )
    with pytest.raises(SettingsError) as error:
        engine_args.create_engine_config()
    message = str(error.value)
    assert "--data-parallel-size > 1 without a store" in message
    assert f"with {STORE_FLAG} redis://HOST:PORT/DB the ranks share" in message


def test_data_parallel_with_a_store_gets_our_scheduler(tiny_model_dir):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        data_parallel_size=2,
        additional_config={
            "output_rate": {"default_rate": 10, "store": {"url": STORE_URL}}
        },
    )
    vllm_config = engine_args.create_engine_config()
    assert vllm_config.parallel_config.data_parallel_size == 2
    assert vllm_config.scheduler_config.scheduler_cls is OutputRateScheduler
    # Each rank reads the same store settings from the config it is handed.
    paced = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    assert paced.store == StoreSettings(STORE_URL)


def test_a_store_lifts_only_the_data_parallel_refusal(tiny_model_dir):
    vllm_config = _vllm_config(tiny_model_dir)
    vllm_config.additional_config["output_rate"]["store"] = {"url": STORE_URL}
    vllm_config.parallel_config.data_parallel_size = 2
    check_supported(vllm_config)
    vllm_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(SettingsError, match="--pipeline-parallel-size"):
        check_supported(vllm_config)
