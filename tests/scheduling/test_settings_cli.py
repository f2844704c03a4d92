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

# The serve parser's autouse fixture (tests/serve_parser_harness.py), registered
# here; ``serve_parser`` itself is registered in conftest.py.
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
    assert entry["policy"]["default_tokens_per_second"] == 100
    assert entry["policy"]["users"] == {"user-a": 100, "user-b": 500}
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
    policy = entry["policy"]
    assert policy["mode"] == "shadow"
    assert policy["tiers"] == {
        "free": {"tokens_per_second": 20},
        "pro": {"tokens_per_second": 200},
        "staff": {"tokens_per_second": 5, "exempt": True},
    }
    assert policy["memberships"] == {"alice": "pro", "bob": "free", "carol": "staff"}
    assert policy["exempt_users"] == ["ops"]
    paced = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert paced.mode is Mode.SHADOW
    table = paced.policy.limit_table()
    assert table.tier_rates == {"free": 20, "pro": 200, "staff": 5}
    assert (table.exempt_users, table.exempt_tiers) == ({"ops"}, {"staff"})


def test_without_the_mode_flag_pacing_enforces(serve_parser):
    args = serve_parser.parse_args(
        ["m", "--default-user-output-tokens-per-second", "100"]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert "mode" not in entry["policy"]  # the policy does not say
    paced = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert paced.mode is Mode.ENFORCE
    assert OutputRateSettings.from_additional_config({}).mode is Mode.ENFORCE


def test_without_the_default_flag_nothing_changes(serve_parser):
    args = serve_parser.parse_args(["m"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert "output_rate" not in (engine_args.additional_config or {})
    assert not getattr(args, hooks.GUARD_ARG, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--default-user-output-tokens-per-second", "0"], "must be an integer in 1.."),
        (["--default-user-output-tokens-per-second", "-5"], "must be an integer in 1"),
        (["--default-user-output-tokens-per-second", "2.5"], "positive integer"),
        (["--default-user-output-tokens-per-second", "ten"], "positive integer"),
        (["--user-output-tokens-per-second", "{bad"], "not valid JSON"),
        (["--user-output-tokens-per-second", "[1, 2]"], "must be a JSON object"),
        (["--output-rate-mode", "fast"], "must be one of enforce, shadow, off"),
        (["--output-rate-mode", ""], "must be one of enforce, shadow, off"),
        (["--output-rate-tiers", "{bad"], "not valid JSON"),
        (["--output-rate-tiers", '["free"]'], "must be a JSON object"),
        (["--output-rate-tier-members", '["alice"]'], "must be a JSON object"),
        (["--output-rate-exempt-users", '{"ops": true}'], "must be a JSON array"),
        (["--output-rate-exempt-users", '"ops"'], "must be a JSON array"),
        (["--output-rate-exempt-users", "[5]"], "must hold names"),
        (["--output-rate-exempt-tiers", "[[]]"], "must hold names"),
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


#: The end of the refusal of a rate that breaks the policy's rule.
RATE_RULE = "must be an integer in 1..1000000 (tokens per second), got"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--user-output-tokens-per-second", '{"a": 0}'],
            f"--user-output-tokens-per-second: users.a: {RATE_RULE} 0",
        ),
        (
            ["--user-output-tokens-per-second", '{"a": -1}'],
            f"--user-output-tokens-per-second: users.a: {RATE_RULE} -1",
        ),
        (
            ["--user-output-tokens-per-second", '{"a": 1.5}'],
            f"--user-output-tokens-per-second: users.a: {RATE_RULE} 1.5",
        ),
        (
            ["--user-output-tokens-per-second", '{"a": true}'],
            f"--user-output-tokens-per-second: users.a: {RATE_RULE} True",
        ),
        (
            ["--user-output-tokens-per-second", '{"": 5}'],
            "--user-output-tokens-per-second: users['']: user id must not be empty",
        ),
        (
            ["--user-output-tokens-per-second", '{"a": 10000000000}'],
            f"--user-output-tokens-per-second: users.a: {RATE_RULE} 10000000000",
        ),
        (
            ["--output-rate-tiers", '{"free": 0}'],
            f"--output-rate-tiers: tiers.free.tokens_per_second: {RATE_RULE} 0",
        ),
        (
            ["--output-rate-tiers", '{"free": "20"}'],
            f"--output-rate-tiers: tiers.free.tokens_per_second: {RATE_RULE} '20'",
        ),
        (
            ["--output-rate-tiers", '{"": 20}'],
            "--output-rate-tiers: tiers['']: tier id must not be empty",
        ),
        (
            ["--output-rate-tiers", '{"fr\\u200bee": 20}'],
            "--output-rate-tiers: tiers['fr\\u200bee']: tier id must not contain "
            "invisible format characters",
        ),
        (
            ["--output-rate-tier-members", '{"alice": 5}'],
            "--output-rate-tier-members: memberships.alice: tier id must be a "
            "string, got int",
        ),
        (
            ["--output-rate-tier-members", '{"alice": ""}'],
            "--output-rate-tier-members: memberships.alice: tier id must not be empty",
        ),
        (
            ["--output-rate-exempt-users", '[""]'],
            "--output-rate-exempt-users: exempt_users[0]: user id must not be empty",
        ),
        (
            ["--output-rate-exempt-tiers", '["st\\u0000aff"]'],
            "--output-rate-exempt-tiers: exempt_tiers[0]: tier id must not contain "
            "control characters",
        ),
    ],
)
def test_flag_values_breaking_a_policy_rule_are_refused_naming_the_flag(argv, message):
    # JSON of the flag's type passes the parser; the policy's rules are checked
    # on the document the flags build (vLLM's hook turns the error into
    # "error: ..." and exit 2, as argparse does).
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    args = parser.parse_args(["--default-user-output-tokens-per-second", "10", *argv])
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(args)
    assert str(error.value) == message


def test_a_flag_value_breaking_a_policy_rule_ends_the_hook_with_code_2(
    serve_parser, capsys
):
    args = serve_parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "10",
            "--output-rate-tiers",
            '{"free": 0}',
        ]
    )
    with pytest.raises(SystemExit) as exit_info:
        AsyncEngineArgs.from_cli_args(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --output-rate-tiers: tiers.free.tokens_per_second: {RATE_RULE} 0\n"
    )


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
        "error: --user-output-tokens-per-second needs a default limit "
        "(--default-user-output-tokens-per-second, default_tokens_per_second in "
        "--output-rate-policy) or a limits file (--user-output-rate-config): they "
        "turn per-user output pacing on"
    )
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--output-rate-tier-members", '{"alice": "gold"}'],
            "--output-rate-tier-members: memberships.alice: unknown tier 'gold'",
        ),
        (
            [
                "--output-rate-tiers",
                '{"free": 20}',
                "--output-rate-tier-members",
                '{"alice": "pro"}',
            ],
            "--output-rate-tier-members: memberships.alice: unknown tier 'pro'",
        ),
    ],
)
def test_a_member_of_an_undefined_tier_is_refused_naming_the_flags(argv, message):
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    args = parser.parse_args(["--default-user-output-tokens-per-second", "10", *argv])
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(args)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "argv",
    [
        ["--output-rate-mode", "shadow"],
        ["--output-rate-mode", "off"],
        # Given, not defaulted (the flag has no default): refused like the others.
        ["--output-rate-mode", "enforce"],
        ["--output-rate-tiers", '{"free": 20}'],
        ["--output-rate-exempt-users", '["ops"]'],
        ["--output-rate-exempt-tiers", '["staff"]'],
        ["--output-rate-user-source", "header:X-User-Id"],
        ["--output-rate-user-source", "openai-user"],
        ["--output-rate-require-user"],
        ["--output-rate-control-token-file", "/missing"],
        ["--output-rate-control-address", "off"],
    ],
)
def test_limit_flags_without_the_default_flag_are_refused(argv):
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(parser.parse_args(argv))
    assert str(error.value) == (
        f"{argv[0]} needs a default limit "
        "(--default-user-output-tokens-per-second, default_tokens_per_second in "
        "--output-rate-policy) or a limits file (--user-output-rate-config): they "
        "turn per-user output pacing on"
    )


def test_a_limits_file_alone_turns_pacing_on(tmp_path):
    # The file gives the default; the flags' pieces need no default of their own.
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    path = str(tmp_path / "limits.json")
    args = parser.parse_args(
        [
            "--user-output-rate-config",
            path,
            "--output-rate-tiers",
            '{"free": 20}',
            "--output-rate-control-address",
            "off",
        ]
    )
    paced = OutputRateSettings.from_cli_args(args)
    assert paced.enabled
    assert paced.config_path == path
    assert paced.policy.default_rate is None
    assert paced.policy.limit_table().tier_rates == {"free": 20}


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
    # A control-plane flag given without pacing is refused (above).
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    paced = OutputRateSettings.from_cli_args(parser.parse_args([]))
    assert paced == OutputRateSettings()
    assert paced.control is None


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
