"""The policy, given in any form, turns pacing on, and a flag that cannot take
effect ends the start: through vLLM's own serve parser and our hook
(``EngineArgs.from_cli_args``), then the engine side (``control.runner.attach``)
with the limits file alone, loaded and watched without a control plane."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from control.runner import attach
from pacing.fair_share_policy import policy_of as share_policy_of
from pacing.policy.document import parse
from pacing.policy.model import Limits, Policy, policy_of
from pacing.settings.flags import (
    ADDRESS_FLAG,
    CONFIG_FLAG,
    DEFAULT_RATE_FLAG,
    POLICY_FLAG,
    TIERS_FLAG,
    TLS_CERT_FLAG,
    TOKEN_FILE_FLAG,
)
from pacing.settings.model import ADDITIONAL_CONFIG_KEY, OutputRateSettings
from tests import serve_parser_harness
from tests.control_harness import make_rig
from tools.scheduler_harness import make_scheduler

default_control_port_taken_or_not = (
    serve_parser_harness.default_control_port_taken_or_not
)

POLICY = {"default_tokens_per_second": 1000, "users": {"slow": 20}}


def started(serve_parser, argv: list[str]) -> OutputRateSettings:
    """The settings the engine reads after vLLM's parser and our hook."""
    args = serve_parser.parse_args(["model", *argv])
    config = AsyncEngineArgs.from_cli_args(args).additional_config
    return OutputRateSettings.from_additional_config(config)


def refused(serve_parser, argv: list[str], capsys) -> str:
    """The one line a start refused by our hook prints (exit code 2)."""
    args = serve_parser.parse_args(["model", *argv])
    with pytest.raises(SystemExit) as info:
        AsyncEngineArgs.from_cli_args(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err[len("error: ") : -1]


def write(path: Path, tree: object) -> str:
    path.write_text(json.dumps(tree) if not isinstance(tree, str) else tree)
    return str(path)


def test_the_limits_file_alone_turns_pacing_on(serve_parser, tmp_path):
    path = write(tmp_path / "limits.json", POLICY)
    settings = started(serve_parser, [CONFIG_FLAG, path])
    assert settings.enabled
    assert settings.config_path == path


def test_the_limits_file_alone_is_checked_at_start(serve_parser, tmp_path, capsys):
    bad = write(tmp_path / "limits.json", {**POLICY, "colour": "red"})
    assert refused(serve_parser, [CONFIG_FLAG, bad], capsys).startswith(
        f"{CONFIG_FLAG}: {bad}: unknown field(s) 'colour'"
    )
    broken = write(tmp_path / "broken.json", "{")
    assert refused(serve_parser, [CONFIG_FLAG, broken], capsys).startswith(
        f"{CONFIG_FLAG}: {broken}: not valid JSON"
    )


@pytest.mark.parametrize("address", ["off", "127.0.0.1:0"])
def test_a_start_up_table_without_a_default_is_refused(
    serve_parser, tmp_path, capsys, address
):
    no_default = write(tmp_path / "limits.json", {"users": {"slow": 20}})
    missing = str(tmp_path / "missing.json")
    for path in (no_default, missing):
        message = refused(
            serve_parser, [CONFIG_FLAG, path, ADDRESS_FLAG, address], capsys
        )
        assert message.startswith(
            f"{CONFIG_FLAG}: {path}: default_tokens_per_second: required"
        )


def test_the_file_is_checked_with_the_control_plane_off(serve_parser, tmp_path, capsys):
    bad = write(tmp_path / "limits.json", {**POLICY, "users": {"slow": 0}})
    message = refused(
        serve_parser,
        [DEFAULT_RATE_FLAG, "1000", ADDRESS_FLAG, "off", CONFIG_FLAG, bad],
        capsys,
    )
    assert message.startswith(f"{CONFIG_FLAG}: {bad}: users.slow: must be an integer")


@pytest.mark.parametrize("flag", [TOKEN_FILE_FLAG, TLS_CERT_FLAG])
def test_a_control_flag_with_the_control_plane_off_is_refused(
    serve_parser, tmp_path, capsys, flag
):
    argv = [DEFAULT_RATE_FLAG, "10", ADDRESS_FLAG, "off", flag, str(tmp_path / "x")]
    assert refused(serve_parser, argv, capsys) == (
        f"{flag} cannot take effect with {ADDRESS_FLAG} off: no control plane listens"
    )


def test_the_policy_flag_takes_the_document_inline_or_from_a_file(
    serve_parser, tmp_path
):
    inline = started(serve_parser, [POLICY_FLAG, json.dumps(POLICY)])
    path = tmp_path / "policy.yaml"
    path.write_text("default_tokens_per_second: 1000\nusers:\n  slow: 20\n")
    from_file = started(serve_parser, [POLICY_FLAG, str(path)])
    assert inline.policy == from_file.policy
    assert inline.policy.users["slow"].limits == Limits(20)
    assert inline.enabled


def test_the_alias_flags_build_the_same_policy(serve_parser):
    aliases = started(
        serve_parser,
        [DEFAULT_RATE_FLAG, "1000", "--user-output-tokens-per-second", '{"slow": 20}'],
    )
    assert (
        aliases.policy
        == started(serve_parser, [POLICY_FLAG, json.dumps(POLICY)]).policy
    )


def test_an_alias_with_the_policy_flag_is_refused(serve_parser, capsys):
    argv = [POLICY_FLAG, json.dumps(POLICY), TIERS_FLAG, '{"free": 20}']
    assert refused(serve_parser, argv, capsys).startswith(
        f"{TIERS_FLAG} is an alias of a piece of {POLICY_FLAG}"
    )


def test_a_policy_without_a_default_needs_a_file(serve_parser, capsys, tmp_path):
    argv = [POLICY_FLAG, '{"users": {"slow": 20}}']
    assert refused(serve_parser, argv, capsys).startswith(
        f"{POLICY_FLAG}: default_tokens_per_second: required"
    )
    path = write(tmp_path / "limits.json", {"default_tokens_per_second": 7})
    settings = started(serve_parser, [*argv, CONFIG_FLAG, path])
    assert settings.enabled and settings.policy.default_rate is None


def test_a_policy_error_names_the_alias_and_the_path(serve_parser, capsys):
    argv = [
        DEFAULT_RATE_FLAG,
        "10",
        "--output-rate-team-members",
        '{"u7": "ghostteam"}',
    ]
    assert refused(serve_parser, argv, capsys) == (
        "--output-rate-team-members: team_members.u7: unknown team 'ghostteam'"
    )


def test_the_entry_carries_the_policy_as_one_document(serve_parser):
    args = serve_parser.parse_args(["model", POLICY_FLAG, json.dumps(POLICY)])
    entry = AsyncEngineArgs.from_cli_args(args).additional_config[ADDITIONAL_CONFIG_KEY]
    assert entry["policy"]["users"] == {"slow": 20}
    assert entry["policy"]["default_tokens_per_second"] == 1000


def test_with_the_control_plane_off_the_file_is_loaded_and_watched(tmp_path):
    """Engine side: no server, the file's limits in force, an edit applied."""
    path = tmp_path / "limits.json"
    write(path, POLICY)
    rig = make_rig(None)
    settings = OutputRateSettings.from_additional_config(
        {
            ADDITIONAL_CONFIG_KEY: {
                "policy": {},
                "control": {"address": "off", "config_path": str(path)},
            }
        }
    )
    assert settings.enabled and settings.policy == Policy()
    plane = attach(rig.shared, settings)
    assert plane is not None
    try:
        assert plane.server is None
        assert rig.limiter.default_rate == 1000
        assert rig.limiter.user_rates == {"slow": 20}
        write(path, {**POLICY, "users": {"slow": 10}})
        # The watcher counts an edit once it is applied: wait for the count.
        deadline = time.monotonic() + 30
        while plane.snapshot().config_reloads["success"] == 0:
            assert time.monotonic() < deadline, "the edit was not applied"
            time.sleep(0.05)
        assert rig.limiter.user_rates == {"slow": 10}
        assert plane.snapshot().config_reloads == {"success": 1, "failure": 0}
    finally:
        plane.stop()


def test_the_schedulers_policy_in_force_is_the_start_up_policy(tiny_model_dir):
    policy = {
        "default": {"tokens_per_second": 100},
        "tiers": {"pro": {"tokens_per_second": 50, "weight": 2}},
        "teams": {"acme": {"tokens_per_second": 80}},
        "users": {"a": {"tokens_per_second": 7, "tier": "pro", "team": "acme"}},
    }
    scheduler = make_scheduler(
        tiny_model_dir, default_rate=None, output_rate={"policy": policy}
    )
    shared = scheduler.output_rate_shared
    with shared.lock:
        in_force = shared.policy_in_force()
        read_back = policy_of(
            default_rate=shared.limiter.default_rate,
            table=shared.limiter.limits(),
            teams=shared.teams.table.copy(),
            share=share_policy_of(shared.fair_share),
        )
    assert in_force.same_table(parse(policy).policy)
    assert in_force.same_table(read_back)
