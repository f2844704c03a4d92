"""The global store's flags (``pacing.settings.cli``), through vLLM's own serve
parser and a plain argparse parser: what they put into ``additional_config``,
bad values and combinations refused naming the flag and never showing a
password, and the password file read in the API process."""

from __future__ import annotations

import argparse
import json

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from pacing.settings import cli as settings_cli
from pacing.settings.checks import SettingsError
from pacing.settings.model import (
    DEFAULT_MAX_LABELLED_USERS,
    ControlSettings,
    MetricsSettings,
    OutputRateSettings,
)
from pacing.settings.store import (
    FAILURE_AFTER_FLAG,
    FAILURE_MODE_FLAG,
    PASSWORD_ENV,
    PASSWORD_FILE_FLAG,
    STORE_FLAG,
    TIMEOUT_FLAG,
    FailureMode,
    StoreSettings,
)
from tests import serve_parser_harness
from tests.settings_harness import settings_of

# The serve parser's autouse fixture (tests/serve_parser_harness.py), registered
# here; ``serve_parser`` itself is registered in conftest.py.
default_control_port_taken_or_not = (
    serve_parser_harness.default_control_port_taken_or_not
)


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
            "--output-rate-store-fleet",
            "blue-1",
            "--output-rate-store-expected-engines",
            "4",
        ]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    assert entry["store"] == {
        "url": "rediss://redis.internal:6380/2",
        "password_file": str(password),
        "failure_mode": "fail-closed",
        "failure_after_s": 2.5,
        "timeout_ms": 20,
        "fleet": "blue-1",
        "expected_engines": 4,
    }
    assert SECRET not in json.dumps(entry)  # the path travels, not the password
    paced = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert paced.store == StoreSettings(
        "rediss://redis.internal:6380/2",
        password_file=str(password),
        failure_mode=FailureMode.FAIL_CLOSED,
        failure_after_s=2.5,
        timeout_ms=20,
        fleet="blue-1",
        expected_engines=4,
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
        "fleet": None,
        "expected_engines": None,
    }


def test_without_the_store_flag_settings_and_additional_config_are_as_before(
    serve_parser,
):
    args = serve_parser.parse_args(
        ["m", "--default-user-output-tokens-per-second", "100"]
    )
    entry = AsyncEngineArgs.from_cli_args(args).additional_config["output_rate"]
    # The entry without a store, key for key: no store key appears.
    assert entry == {
        "policy": {
            "default_tokens_per_second": 100,
            "tiers": {},
            "users": {},
            "memberships": {},
            "exempt_users": [],
            "weights": {"users": {}, "tiers": {}},
        },
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
    assert paced == settings_of(
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
    settings_cli.add_cli_args(parser)
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(parser.parse_args([STORE_FLAG, STORE_URL]))
    assert str(error.value) == (
        f"{STORE_FLAG} needs a default limit (--default-user-output-tokens-per-second, "
        "default_tokens_per_second in --output-rate-policy) or a limits file "
        "(--user-output-rate-config): they turn per-user output pacing on"
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
    settings_cli.add_cli_args(parser)
    args = parser.parse_args(["--default-user-output-tokens-per-second", "10", *argv])
    with pytest.raises(SettingsError) as error:
        OutputRateSettings.from_cli_args(args)
    assert str(error.value) == f"{argv[0]} needs {STORE_FLAG}"


def test_an_unreadable_password_file_ends_the_parse_in_the_api_process(tmp_path):
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
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
