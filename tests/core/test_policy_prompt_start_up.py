"""Prompt budgets at start-up: ``prompt_tokens_per_second`` on every holder of
a start-up policy (``--output-rate-policy`` inline or as a JSON or YAML file,
``additional_config``'s ``policy``) is read in the object form beside the
number form, survives the trip through ``additional_config``, makes the prompt
tables the scheduler's shared limiter holds, and a bad one is refused with the
rate rule's words at its path, whichever way it came in."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from pacing.accounting import Accounting
from pacing.policy.document import parse
from pacing.policy.errors import PolicyError
from pacing.policy.model import Limits, Policy
from pacing.policy.text import dumps, loads
from pacing.settings import cli as settings_cli
from pacing.settings.checks import SettingsError
from pacing.settings.flags import POLICY_FLAG
from pacing.settings.model import ADDITIONAL_CONFIG_KEY, OutputRateSettings
from pacing.settings.policy import policy_of_flag
from pacing.shared import SharedLimiter
from tests.control_harness import PROMPT_RATE_RULE as RULE
from tests.control_harness import PROMPT_RATES_DOC as DOC
from tools.fake_clock import FakeClock


def check(policy: Policy) -> None:
    """``policy`` is DOC's."""
    assert policy.default == Limits(10, prompt_tokens_per_second=3000)
    assert policy.users["p"].limits == Limits(1000, prompt_tokens_per_second=1500)
    assert policy.users["q"].limits == Limits(1000)
    assert policy.groups["tier"]["free"] == Limits(5, prompt_tokens_per_second=200)
    assert policy.groups["team"]["acme"] == Limits(600, prompt_tokens_per_second=4000)


def shared_of(settings: OutputRateSettings) -> SharedLimiter:
    """The shared limiter the scheduler builds from ``settings``."""
    return SharedLimiter(
        settings.build_limiter(),
        Accounting(),
        FakeClock(),
        mode=settings.mode,
        fair_share=settings.build_fair_share(),
        teams=settings.build_teams(),
        policy=settings.policy,
    )


def flag_settings(value: str) -> OutputRateSettings:
    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    args = parser.parse_args(
        [POLICY_FLAG, value, "--output-rate-control-address", "off"]
    )
    return OutputRateSettings.from_cli_args(args)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_a_document_with_prompt_rates_reads_and_writes_back_the_same(fmt):
    text = json.dumps(DOC) if fmt == "json" else yaml.safe_dump(DOC)
    document = loads(text, fmt)
    check(document.policy)
    written = dumps(document, fmt)
    tree = json.loads(written) if fmt == "json" else yaml.safe_load(written)
    assert tree["users"]["q"] == 1000  # the number form stays the number form
    assert tree["users"]["p"] == DOC["users"]["p"]
    assert loads(written, fmt) == document


def test_the_number_form_alone_is_still_a_valid_user():
    policy = parse({"default_tokens_per_second": 10, "users": {"p": 1000}}).policy
    assert policy.users["p"].limits == Limits(1000)
    assert policy.limit_table("prompt_tokens_per_second").user_rates == {}


@pytest.mark.parametrize("given_as", ["inline", "json file", "yaml file"])
def test_the_policy_flag_carries_every_prompt_rate_to_the_scheduler(tmp_path, given_as):
    if given_as == "inline":
        value = json.dumps(DOC)
    elif given_as == "json file":
        (tmp_path / "policy.json").write_text(json.dumps(DOC))
        value = str(tmp_path / "policy.json")
    else:
        (tmp_path / "policy.yaml").write_text(yaml.safe_dump(DOC))
        value = str(tmp_path / "policy.yaml")
    check(policy_of_flag(value))
    settings = flag_settings(value)
    check(settings.policy)
    # Through additional_config, as the API process hands it to the engine.
    entry = {ADDITIONAL_CONFIG_KEY: settings.to_additional_config()}
    json.dumps(entry)  # survives vLLM's serialisation
    engine = OutputRateSettings.from_additional_config(entry)
    assert engine == settings
    shared = shared_of(engine)
    prompt = shared.prompt
    assert prompt.active
    assert [prompt.rate_of(u) for u in ("p", "q", "m", "nobody")] == [
        1500,
        3000,
        200,
        3000,
    ]
    assert prompt.teams.table.rate_of("acme") == 4000
    assert prompt.teams.team_of("m") == "acme"
    assert shared.limiter.rate_of("p") == 1000  # the output rates are their own
    assert shared.policy.users["p"].limits.prompt_tokens_per_second == 1500


def test_additional_config_carries_every_prompt_rate_to_the_scheduler():
    entry = {ADDITIONAL_CONFIG_KEY: {"policy": DOC}}
    settings = OutputRateSettings.from_additional_config(entry)
    check(settings.policy)
    prompt = shared_of(settings).prompt
    assert (prompt.rate_of("p"), prompt.teams.table.rate_of("acme")) == (1500, 4000)


def test_a_policy_without_prompt_rates_paces_no_prompt():
    settings = OutputRateSettings.from_additional_config(
        {ADDITIONAL_CONFIG_KEY: {"policy": {"default_tokens_per_second": 10}}}
    )
    prompt = shared_of(settings).prompt
    assert not prompt.active
    assert prompt.rate_of("anyone") == 0


BAD_PLACES = {
    "default": lambda v: {"default": {"prompt_tokens_per_second": v}},
    "users.p": lambda v: {
        "users": {"p": {"tokens_per_second": 9, "prompt_tokens_per_second": v}}
    },
    "tiers.free": lambda v: {
        "tiers": {"free": {"exempt": True, "prompt_tokens_per_second": v}}
    },
    "teams.acme": lambda v: {
        "teams": {"acme": {"tokens_per_second": 6, "prompt_tokens_per_second": v}}
    },
}


@pytest.mark.parametrize("value", [0, -1, 1_000_001, "fast", 1.5, True])
@pytest.mark.parametrize("where", BAD_PLACES)
def test_a_bad_prompt_rate_is_refused_at_its_path_whichever_way_it_comes_in(
    tmp_path, where, value
):
    said = f"{where}.prompt_tokens_per_second: {RULE} {value!r}"
    doc = {"default_tokens_per_second": 10, **BAD_PLACES[where](value)}
    with pytest.raises(PolicyError) as document:
        parse(doc)
    assert str(document.value) == said
    with pytest.raises(SettingsError) as inline:
        policy_of_flag(json.dumps(doc))
    assert str(inline.value) == f"{POLICY_FLAG}: {said}"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SettingsError) as file:
        policy_of_flag(str(path))
    assert str(file.value) == f"{POLICY_FLAG} {path}: {said}"
    with pytest.raises(SettingsError) as config:
        OutputRateSettings.from_additional_config(
            {ADDITIONAL_CONFIG_KEY: {"policy": doc}}
        )
    assert str(config.value) == (
        f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['policy']: {said}"
    )
