"""Start-up checks in the API-server process (``control.preflight``): every
control-plane mistake ends the start before the model loads, with one line that
names the flag, and exit code 2; the engine-core process still refuses the same
settings (the second line)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from control import preflight
from control.errors import InvalidArgument
from control.plugin import register as register_control_plane
from control.runner import serve
from control.server import BindRefused
from engine_ext.plugin import register
from pacing.settings.checks import SettingsError
from pacing.settings.flags import (
    ADDRESS_FLAG,
    CONFIG_FLAG,
    TLS_CERT_FLAG,
    TOKEN_ENV,
    TOKEN_FILE_FLAG,
)
from pacing.settings.model import ControlSettings
from pacing.settings.store import PASSWORD_ENV, PASSWORD_FILE_FLAG, STORE_FLAG
from tests.control_harness import make_rig

register()
register_control_plane()  # its entry point, should vLLM not have loaded it yet

#: vLLM logs these once the engine core starts and once the model starts loading.
MODEL_START_LINES = ("Initializing a V1 LLM engine", "Starting to load model")


@pytest.fixture(autouse=True)
def _no_token_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture
def taken_address() -> Iterator[str]:
    """A loopback address another socket is listening on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield f"127.0.0.1:{other.getsockname()[1]}"


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


#: The flags' default limit the checks are given (pacing on by the flags).
FLAGS_DEFAULT = 10


def _refusal(
    settings: ControlSettings, default_rate: int | None = FLAGS_DEFAULT
) -> str:
    with pytest.raises(SettingsError) as error:
        preflight.check(settings, default_rate)
    return str(error.value)


# -- each case, through the preflight ------------------------------------------


def test_a_taken_port_is_refused_naming_the_address_flag(taken_address):
    message = _refusal(ControlSettings(address=taken_address))
    assert message == f"{ADDRESS_FLAG} {taken_address}: cannot listen: " + (
        "Address already in use"
    )


def test_a_free_port_passes_and_is_released():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    preflight.check(ControlSettings(address=address), FLAGS_DEFAULT)
    host, _, port = address.rpartition(":")
    with socket.socket() as again:  # no SO_REUSEADDR: fails if still held
        again.bind((host, int(port)))


def test_a_port_that_is_no_number_is_refused():
    message = _refusal(ControlSettings(address="127.0.0.1:http"))
    assert message.startswith(f"{ADDRESS_FLAG} 127.0.0.1:http: expected HOST:PORT")


def test_a_limits_path_that_is_a_directory_is_refused(tmp_path):
    directory = tmp_path / "limits.json"
    directory.mkdir()
    message = _refusal(
        ControlSettings(address="127.0.0.1:0", config_path=str(directory))
    )
    assert message == f"{CONFIG_FLAG} {directory}: Is a directory"


def test_a_limits_file_that_is_not_json_is_refused(tmp_path):
    path = _write(tmp_path / "limits.json", '{"users": {"a": 5}')
    message = _refusal(ControlSettings(address="127.0.0.1:0", config_path=path))
    assert message.startswith(f"{CONFIG_FLAG}: {path}: not valid JSON")


def test_a_limits_file_with_an_invalid_user_id_is_refused(tmp_path):
    path = _write(tmp_path / "limits.json", '{"users": {"bad\\u0001id": 5}}')
    message = _refusal(ControlSettings(address="127.0.0.1:0", config_path=path))
    assert message.startswith(f"{CONFIG_FLAG}: {path}: users['bad\\x01id']: user id")
    assert "control characters" in message


def test_a_limits_file_of_unknown_format_is_refused(tmp_path):
    path = _write(tmp_path / "limits.txt", "{}")
    message = _refusal(ControlSettings(address="127.0.0.1:0", config_path=path))
    assert message.startswith(f"{CONFIG_FLAG}: {path}: cannot tell the format")


def test_a_missing_limits_file_passes_without_being_created(tmp_path):
    path = tmp_path / "limits.yaml"
    preflight.check(
        ControlSettings(address="127.0.0.1:0", config_path=str(path)), FLAGS_DEFAULT
    )
    assert not path.exists()  # the engine core creates it from the flags


#: The refusal of a start-up table without a default limit, after the path.
NO_DEFAULT = (
    "default_tokens_per_second: required (the limit of every user the policy "
    "does not name), unless --default-user-output-tokens-per-second or "
    "--output-rate-policy gives one"
)


@pytest.mark.parametrize("address", ["127.0.0.1:0", "off"])
def test_a_start_up_table_without_a_default_limit_is_refused(tmp_path, address):
    # Neither the file nor the flags give one: the file, missing or without
    # one, is refused, with the control plane on or off.
    missing = str(tmp_path / "missing.json")
    settings = ControlSettings(address=address, config_path=missing)
    assert _refusal(settings, None) == f"{CONFIG_FLAG}: {missing}: {NO_DEFAULT}"
    path = _write(tmp_path / "limits.json", '{"users": {"a": 5}}')
    settings = ControlSettings(address=address, config_path=path)
    assert _refusal(settings, None) == f"{CONFIG_FLAG}: {path}: {NO_DEFAULT}"
    preflight.check(settings, FLAGS_DEFAULT)  # the flags give one
    own = _write(tmp_path / "own.json", '{"default_tokens_per_second": 7}')
    preflight.check(ControlSettings(address=address, config_path=own), None)


def test_a_missing_limits_file_in_a_missing_directory_is_refused(tmp_path):
    path = tmp_path / "nowhere" / "limits.json"
    message = _refusal(ControlSettings(address="127.0.0.1:0", config_path=str(path)))
    assert message.startswith(f"{CONFIG_FLAG} {path}: the file is missing")
    assert f"{tmp_path / 'nowhere'} does not exist" in message


def test_a_public_address_without_auth_is_refused():
    message = _refusal(ControlSettings(address="0.0.0.0:0"))
    assert message.startswith(f"{ADDRESS_FLAG}: refusing to listen on 0.0.0.0:0")
    assert "no authentication is configured" in message
    assert TOKEN_FILE_FLAG in message


def test_a_public_address_with_a_token_and_no_tls_is_refused(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "secret")
    message = _refusal(ControlSettings(address="0.0.0.0:0"))
    assert message.startswith(f"{ADDRESS_FLAG}: refusing to listen on 0.0.0.0:0")
    assert "bearer tokens would cross the network in clear text" in message
    assert TLS_CERT_FLAG in message


def test_a_public_address_with_a_token_over_tls_passes(monkeypatch, tmp_path):
    monkeypatch.setenv(TOKEN_ENV, "secret")
    settings = ControlSettings(  # the preflight reads the files, gRPC parses them
        address="0.0.0.0:0",
        tls_cert=_write(tmp_path / "cert.pem", "cert"),
        tls_key=_write(tmp_path / "key.pem", "key"),
    )
    preflight.check(settings, FLAGS_DEFAULT)


def test_an_empty_token_file_is_refused(tmp_path):
    path = _write(tmp_path / "token", " \n")
    message = _refusal(ControlSettings(address="127.0.0.1:0", token_file=path))
    assert message == f"{TOKEN_FILE_FLAG} {path} is empty"


def test_a_missing_token_file_is_refused(tmp_path):
    path = str(tmp_path / "token")
    message = _refusal(ControlSettings(address="127.0.0.1:0", token_file=path))
    assert message == f"{TOKEN_FILE_FLAG} {path}: No such file or directory"


def test_a_missing_tls_file_is_refused(tmp_path):
    key = _write(tmp_path / "key.pem", "key")
    cert = str(tmp_path / "cert.pem")
    settings = ControlSettings(address="127.0.0.1:0", tls_cert=cert, tls_key=key)
    assert _refusal(settings) == f"{TLS_CERT_FLAG} {cert}: No such file or directory"


def test_only_the_limits_file_is_checked_when_the_control_plane_is_off(tmp_path):
    # No port is bound and no auth is asked for; the limits file is loaded and
    # watched all the same, so it is checked.
    preflight.check(ControlSettings(address="off"), FLAGS_DEFAULT)
    directory = tmp_path / "limits.json"
    directory.mkdir()
    message = _refusal(ControlSettings(address="off", config_path=str(directory)))
    assert message == f"{CONFIG_FLAG} {directory}: Is a directory"


def test_token_and_tls_flags_are_refused_with_the_control_plane_off(tmp_path):
    for flag, given in (
        (TOKEN_FILE_FLAG, {"token_file": str(tmp_path / "missing")}),
        (TLS_CERT_FLAG, {"tls_cert": "c.pem", "tls_key": "k.pem"}),
    ):
        with pytest.raises(SettingsError) as error:
            ControlSettings(address="off", **given)
        assert str(error.value) == (
            f"{flag} cannot take effect with {ADDRESS_FLAG} off: no control "
            "plane listens"
        )


# -- the engine side refuses the same settings ----------------------------------


@pytest.mark.parametrize(
    ("case", "engine_error"),
    [
        ("port taken", OSError),
        ("directory", IsADirectoryError),
        ("bad json", InvalidArgument),
        ("public", BindRefused),
        ("token in clear text", BindRefused),
        ("empty token", SettingsError),
    ],
)
def test_the_engine_side_refuses_what_the_preflight_refuses(
    tmp_path, taken_address, case, engine_error
):
    directory = tmp_path / "limits.json"
    directory.mkdir()
    settings = {
        "port taken": ControlSettings(address=taken_address),
        "directory": ControlSettings(address="127.0.0.1:0", config_path=str(directory)),
        "bad json": ControlSettings(
            address="127.0.0.1:0", config_path=_write(tmp_path / "l.json", "{")
        ),
        "public": ControlSettings(address="0.0.0.0:0"),
        "token in clear text": ControlSettings(
            address="0.0.0.0:0", token_file=_write(tmp_path / "secret", "s3cret")
        ),
        "empty token": ControlSettings(
            address="127.0.0.1:0", token_file=_write(tmp_path / "token", "")
        ),
    }[case]
    with pytest.raises(SettingsError):
        preflight.check(settings, FLAGS_DEFAULT)
    with pytest.raises(engine_error):
        serve(make_rig(10).shared, settings).stop(0)


# -- the hook in the API process -------------------------------------------------


def test_the_hook_exits_with_code_2_and_one_line(tmp_path, capsys):
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "10",
            "--output-rate-control-token-file",
            str(tmp_path / "token"),
        ]
    )
    with pytest.raises(SystemExit) as exit_info:
        AsyncEngineArgs.from_cli_args(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error == (
        f"error: {TOKEN_FILE_FLAG} {tmp_path / 'token'}: No such file or directory\n"
    )


def test_the_hook_checks_nothing_without_pacing(tmp_path):
    parser = make_arg_parser(FlexibleArgumentParser())
    engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(["m"]))
    assert "output_rate" not in (engine_args.additional_config or {})


def test_the_hook_refuses_a_control_flag_without_pacing(tmp_path, capsys):
    # Refused as needing pacing, before its file is looked at.
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        ["m", "--output-rate-control-token-file", str(tmp_path / "token")]
    )
    with pytest.raises(SystemExit) as exit_info:
        AsyncEngineArgs.from_cli_args(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {TOKEN_FILE_FLAG} needs a default limit "
        "(--default-user-output-tokens-per-second, default_tokens_per_second in "
        "--output-rate-policy) or a limits file (--user-output-rate-config): they "
        "turn per-user output pacing on\n"
    )


# -- real starts ------------------------------------------------------------------

#: A real start per family of bad setting: (flag, value, what the line says).
#: ``{dir}`` is a directory, ``{missing}`` a path that does not exist, ``{taken}``
#: an address another socket listens on.
BAD_SETTINGS = {
    "limits file": (CONFIG_FLAG, "{dir}", "Is a directory"),
    "address": (ADDRESS_FLAG, "0.0.0.0:50151", "no authentication"),
    "port": (ADDRESS_FLAG, "{taken}", "Address already in use"),
    "token file": (TOKEN_FILE_FLAG, "{missing}", "No such file"),
    "token in clear text": (ADDRESS_FLAG, "0.0.0.0:50151", "in clear text"),
}
STORE_URL = "redis://127.0.0.1:6379/0"
SECRET = "s3cret-Pa55"
#: The store's, refused by the parser or the start-up hook: (arguments, line).
BAD_STORE_SETTINGS = {
    "password in the URL": (
        [STORE_FLAG, f"redis://:{SECRET}@127.0.0.1:6379/0"],
        f"argument {STORE_FLAG}: {STORE_FLAG} must not hold a password",
    ),
    "missing password file": (
        [STORE_FLAG, STORE_URL, PASSWORD_FILE_FLAG, "{missing}"],
        f"error: {PASSWORD_FILE_FLAG} {{missing}}: No such file",
    ),
}


@pytest.fixture(scope="module")
def refused_starts(
    tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, subprocess.CompletedProcess[str]], dict[str, str]]]:
    """Every real start of this file, run side by side (each is mostly vLLM's
    import, about 15 s here), with the paths and address they were given."""
    workdir = tmp_path_factory.mktemp("refused-starts")
    (workdir / "limits.json").mkdir()
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        places = {
            "dir": str(workdir / "limits.json"),
            "missing": str(workdir / "missing"),
            "taken": f"127.0.0.1:{other.getsockname()[1]}",
        }
        environment = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        starts: dict[str, tuple[list[str], dict[str, str]]] = {
            family: ([flag, value.format(**places)], environment)
            for family, (flag, value, _) in BAD_SETTINGS.items()
        }
        starts["token in clear text"] = (
            starts["token in clear text"][0],
            {**environment, TOKEN_ENV: "s3cret"},
        )
        for case, (arguments, _) in BAD_STORE_SETTINGS.items():
            starts[case] = ([a.format(**places) for a in arguments], environment)

        def start(case: str) -> subprocess.CompletedProcess[str]:
            arguments, env = starts[case]
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "engine_ext.serve",
                    tiny_model_dir,
                    "--default-user-output-tokens-per-second",
                    "100",
                    *arguments,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )

        with ThreadPoolExecutor(len(starts)) as pool:
            yield dict(zip(starts, pool.map(start, starts), strict=True)), places


@pytest.mark.parametrize("family", list(BAD_SETTINGS))
def test_a_bad_setting_ends_the_start_before_the_model_loads(refused_starts, family):
    flag, _, cause = BAD_SETTINGS[family]
    completed = refused_starts[0][family]
    assert completed.returncode == 2
    lines = completed.stderr.splitlines()
    # vLLM's import-time warnings may come first; ours is the last line and the
    # only one that starts with "error:".
    assert lines[-1].startswith(f"error: {flag}")
    assert cause in lines[-1]
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    output = completed.stdout + completed.stderr
    assert "Traceback" not in output
    assert not [line for line in MODEL_START_LINES if line in output]


# -- the store's settings ------------------------------------------------------


def test_the_hook_refuses_an_unreadable_store_password_file(tmp_path, capsys):
    parser = make_arg_parser(FlexibleArgumentParser())
    missing = tmp_path / "password"
    args = parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "10",
            STORE_FLAG,
            STORE_URL,
            PASSWORD_FILE_FLAG,
            str(missing),
        ]
    )
    with pytest.raises(SystemExit) as exit_info:
        AsyncEngineArgs.from_cli_args(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {PASSWORD_FILE_FLAG} {missing}: No such file or directory\n"
    )


def test_the_hook_refuses_a_store_without_pacing(capsys):
    # A store asked for and silently not used would let each engine grant the
    # whole limit.
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["m", STORE_FLAG, STORE_URL])
    with pytest.raises(SystemExit) as exit_info:
        AsyncEngineArgs.from_cli_args(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"error: {STORE_FLAG} needs a default limit "
        "(--default-user-output-tokens-per-second"
    )


def test_the_store_password_is_read_where_it_connects_not_in_the_api_process(
    tmp_path, monkeypatch
):
    # A readable file passes; the settings carry its path, and the variable's
    # value is not looked at (the engine-core process reads it).
    password = tmp_path / "password"
    password.write_text(SECRET)
    monkeypatch.setenv(PASSWORD_ENV, "other-" + SECRET)
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "10",
            STORE_FLAG,
            STORE_URL,
            PASSWORD_FILE_FLAG,
            str(password),
            # The default address may be taken on a shared machine.
            "--output-rate-control-address",
            "off",
        ]
    )
    additional = AsyncEngineArgs.from_cli_args(args).additional_config
    assert additional["output_rate"]["store"]["password_file"] == str(password)
    assert SECRET not in repr(additional)


@pytest.mark.parametrize("case", list(BAD_STORE_SETTINGS))
def test_a_bad_store_setting_ends_the_start_before_the_model_loads(
    refused_starts, case
):
    starts, places = refused_starts
    completed = starts[case]
    assert completed.returncode == 2
    lines = completed.stderr.splitlines()
    assert BAD_STORE_SETTINGS[case][1].format(**places) in lines[-1]
    output = completed.stdout + completed.stderr
    assert SECRET not in output  # not in an error, nor in vLLM's logged args
    assert "Traceback" not in output
    assert not [line for line in MODEL_START_LINES if line in output]
