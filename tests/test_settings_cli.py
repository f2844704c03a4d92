"""The flags (``pacing.settings.cli``) of the limits, the mode, the identity
and the control plane, through vLLM's own serve parser and a plain argparse
parser: what they put into ``additional_config``, and bad values and
combinations refused naming the flag."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from engine_ext import hooks
from pacing.identity import HEADER, XARGS_SOURCE, UserSource
from pacing.modes import Mode
from pacing.settings import cli as settings_cli
from pacing.settings.checks import SettingsError
from pacing.settings.model import OutputRateSettings
from tests import serve_parser_harness

# The serve parser's fixtures (tests/serve_parser_harness.py), registered here.
serve_parser = serve_parser_harness.serve_parser
default_control_port_taken_or_not = (
    serve_parser_harness.default_control_port_taken_or_not
)


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
    assert getattr(args, hooks.GUARD_ARG)


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


def test_without_the_default_flag_nothing_changes(serve_parser):
    args = serve_parser.parse_args(["m"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert "output_rate" not in (engine_args.additional_config or {})
    assert not getattr(args, hooks.GUARD_ARG, False)


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
    settings_cli.add_cli_args(parser)
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
    settings_cli.add_cli_args(parser)
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(parser.parse_args(argv))
    assert str(error.value) == (
        f"{argv[0]} needs --default-user-output-tokens-per-second: the default "
        "limit is what turns per-user output pacing on"
    )


def test_enforce_without_the_default_flag_is_simply_pacing_off():
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    args = parser.parse_args(["--output-rate-mode", "enforce"])
    assert OutputRateSettings.from_cli_args(args) == OutputRateSettings()


def test_flags_round_trip_through_additional_config(tmp_path):
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
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
    settings_cli.add_cli_args(parser)
    args = parser.parse_args(["--output-rate-control-token-file", "/missing"])
    assert OutputRateSettings.from_cli_args(args) == OutputRateSettings()


def test_rate_flag_type_rejects_bool_like_values():
    with pytest.raises(argparse.ArgumentTypeError):
        settings_cli._rate_arg("true")


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
