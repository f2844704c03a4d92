"""The reference pages under docs/reference/ are what ``tools.reference_docs``
generates from the code now, and the generator reads the code: every flag,
metric, RPC, CLI command and refusal the code defines is on its page, and a
change in the code changes the page."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import tempfile
from types import SimpleNamespace

import pytest

from tools import reference_docs as ref

REGENERATE = f"run `{ref.COMMAND}` and commit the result"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return ref.generate()


def _committed(name: str) -> str:
    path = ref.ROOT / ref.REFERENCE_DIR / name
    if not path.is_file():
        pytest.fail(f"{ref.REFERENCE_DIR / name} is missing: {REGENERATE}")
    return path.read_text(encoding="utf-8")


# -- the committed pages -----------------------------------------------------------


@pytest.mark.parametrize("name", list(ref.PAGES))
def test_the_committed_page_is_what_the_code_generates(pages, name):
    committed = _committed(name)
    if committed != pages[name]:
        diff = difflib.unified_diff(
            committed.splitlines(),
            pages[name].splitlines(),
            f"committed {name}",
            f"generated {name}",
            lineterm="",
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(
            f"{ref.REFERENCE_DIR / name} differs from the code: {REGENERATE}\n{shown}"
        )


def test_check_names_the_pages_that_differ(tmp_path):
    assert ref.differing(tmp_path) == [str(ref.REFERENCE_DIR / n) for n in ref.PAGES]
    assert ref.write(tmp_path) == [str(ref.REFERENCE_DIR / n) for n in ref.PAGES]
    assert ref.differing(tmp_path) == []
    assert ref.write(tmp_path) == []
    page = tmp_path / ref.REFERENCE_DIR / "metrics.md"
    page.write_text(page.read_text() + "a hand edit\n")
    assert ref.differing(tmp_path) == [str(ref.REFERENCE_DIR / "metrics.md")]


@pytest.mark.parametrize("name", list(ref.PAGES))
def test_each_page_says_it_is_generated_and_holds_nothing_of_this_machine(pages, name):
    text = pages[name]
    assert text.split("\n", 1)[0] == ref.NOTICE
    assert ref.COMMAND in ref.NOTICE and "do not edit by hand" in ref.NOTICE
    for path in (str(ref.ROOT), tempfile.gettempdir()):
        assert path not in text
    headings = [line for line in text.split("\n") if line.startswith("#")]
    assert len(headings) == len(set(headings))


# -- flags.md -----------------------------------------------------------------------


def _our_flags() -> list[str]:
    """The flags ``pacing.settings.cli`` adds, on a parser of its own."""
    from pacing.settings import cli as settings_cli

    parser = argparse.ArgumentParser()
    settings_cli.add_cli_args(parser)
    return [a.option_strings[0] for a in parser._actions if a.dest != "help"]


def test_every_flag_vllm_serve_gets_from_us_is_on_the_flags_page(pages):
    from pacing.settings.model import ADDITIONAL_CONFIG_KEY, FLAG_KEYS

    group = ref.serve_flag_group()
    in_vllm = [action.option_strings[0] for action in group._group_actions]
    assert in_vllm == _our_flags()
    # A flag whose metavar holds a "|" is in <code> (a table cell cannot hold
    # one in backticks).
    rows = {
        found[1]: line
        for line in pages["flags.md"].split("\n")
        if (found := re.match(r"\| (?:`|<code>)(--[\w-]+)", line))
    }
    assert list(rows) == [f for f in in_vllm if f in rows]  # the parser's order
    assert sorted(rows) == sorted(in_vllm)
    for flag in in_vllm:
        for key in FLAG_KEYS[flag]:
            assert f"`{ADDITIONAL_CONFIG_KEY}.{key}`" in rows[flag]


def test_every_additional_config_key_names_a_settings_field():
    from pacing.settings.flags import POLICY_ALIASES, SETTING_FLAGS
    from pacing.settings.model import FLAG_KEYS, OutputRateSettings

    assert sorted(FLAG_KEYS) == sorted(_our_flags())
    classes = ref._settings_classes()
    for keys in FLAG_KEYS.values():
        for key in keys:
            area, _, name = key.rpartition(".")
            assert name in {f.name for f in dataclasses.fields(classes[area])}, key
    # A new setting of the entry itself needs a flag (or is one of its objects).
    objects = {"control", "metrics", "store"}
    fields = {f.name for f in dataclasses.fields(OutputRateSettings)} - objects
    assert fields == set(SETTING_FLAGS)
    assert objects <= set(classes)
    # Every alias flag builds the policy, and shows its one key.
    for flag in POLICY_ALIASES.values():
        assert FLAG_KEYS[flag] == ("policy",), flag


def test_the_flags_page_follows_the_code(monkeypatch):
    """A default the help text names, changed in the code, changes the page."""
    import pacing.settings.cli

    monkeypatch.setattr(pacing.settings.cli, "DEFAULT_TIMEOUT_MS", 77)
    assert "(default 77)" in ref.flags_page()


def test_a_flag_without_an_additional_config_key_is_refused(monkeypatch):
    import pacing.settings.cli

    original = pacing.settings.cli.add_cli_args

    def with_one_more(group):
        original(group)
        group.add_argument("--output-rate-made-up", help="not in FLAG_KEYS")

    monkeypatch.setattr(pacing.settings.cli, "add_cli_args", with_one_more)
    with pytest.raises(LookupError, match="--output-rate-made-up"):
        ref.flags_page()


# -- metrics.md ---------------------------------------------------------------------


def test_every_metric_is_on_the_metrics_page_with_its_type_and_labels(pages):
    from engine_ext import metrics

    definitions = ref.metric_definitions()
    names = {ref.exposed_name(metric) for metric in definitions}
    # Every exported name the module defines is one of the definitions.
    constants = {
        value
        for value in vars(metrics).values()
        if isinstance(value, str) and value.startswith("vllm:output_rate_")
    }
    assert constants == names
    table, buckets = pages["metrics.md"].split("\n## Histogram buckets\n")
    rows = {
        line.split("`")[1]: line
        for line in table.split("\n")
        if line.startswith("| `vllm:")
    }
    assert len(rows) == len(definitions)
    assert f"| `{metrics.STORE_ROUND_TRIP_SECONDS}` | 0.0001, " in buckets
    charged = rows[metrics.TOKENS_CHARGED]
    assert "| counter |" in charged and "`model_name`, `user`" in charged
    for metric in definitions:
        family = metric.describe()[0]
        row = rows[ref.exposed_name(metric)]
        assert f"| {family.type} |" in row
        assert ", ".join(f"`{label}`" for label in metric._labelnames) in row
        assert ref.inline(family.documentation) in row


# -- grpc-api.md --------------------------------------------------------------------


def test_every_rpc_message_field_and_enum_value_is_on_the_grpc_page(pages):
    from protos.outputrate.v1 import output_rate_pb2

    text = pages["grpc-api.md"]
    descriptor = output_rate_pb2.DESCRIPTOR
    for service in descriptor.services_by_name.values():
        assert f"### Service `{service.full_name}`" in text
        for method in service.methods:
            assert f"| `{method.name}` | " in text
            for type_ in (method.input_type, method.output_type):
                package = descriptor.package + "."
                assert f"`{type_.full_name.removeprefix(package)}`" in text
    assert "| stream `WatchUserStatesResponse` |" in text

    def walk(message, prefix=""):
        name = prefix + message.name
        section = text.split(f"### Message `{name}`\n", 1)[1].split("\n### ", 1)[0]
        for field in message.fields:
            assert f"| `{field.name}` | {field.number} | " in section
        for enum_type in message.enum_types:
            assert f"#### Enum `{name}.{enum_type.name}`" in section
            for value in enum_type.values:
                assert f"| `{value.name}` | {value.number} | " in section
        for nested in message.nested_types:
            walk(nested, name + ".")

    for message in descriptor.message_types_by_name.values():
        walk(message)


def test_the_grpc_page_carries_the_proto_comments(pages):
    from protos.generate import PROTOS

    proto = (PROTOS / "outputrate/v1/output_rate.proto").read_text()
    comment = "Sends the state of selected users now and then once every"
    assert comment in proto
    assert comment in pages["grpc-api.md"]


# -- cli.md -------------------------------------------------------------------------


def test_every_cli_command_and_option_is_on_the_cli_page(pages):
    text = pages["cli.md"]
    parser = ref.cli_parser()
    commands = ref.subcommands(parser)
    assert {"set", "create-tier", "watch", "import"} <= set(commands)
    for name, sub in commands.items():
        assert f"| `{name}` | " in text
        section = text.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        assert f"{parser.prog} [global options] {name}" in section
        for action in ref._visible_actions(sub):
            for option in action.option_strings or [action.metavar or action.dest]:
                assert option in section, (name, option)
    for action in ref._visible_actions(parser):
        assert f"| `{action.option_strings[0]}" in text


# -- refused-configurations.md ------------------------------------------------------


def test_every_refusal_is_on_its_page_in_order(pages):
    from engine_ext.supported import REFUSAL_PREFIX, REFUSALS

    text = pages["refused-configurations.md"]
    assert REFUSAL_PREFIX in text
    positions = [text.index(f"| {ref.inline(r.reason)} |") for r in REFUSALS]
    assert positions == sorted(positions)
    assert "| 1 | --data-parallel-size > 1 without a store" in text
    assert "| 2 | --pipeline-parallel-size > 1" in text


def test_the_refusal_message_is_the_prefix_and_the_reason():
    from engine_ext.supported import REFUSAL_PREFIX, REFUSALS, check_supported
    from pacing.settings.checks import SettingsError

    config = SimpleNamespace(
        additional_config={},
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=2),
    )
    with pytest.raises(SettingsError) as error:
        check_supported(config)
    assert str(error.value) == REFUSAL_PREFIX + REFUSALS[1].reason


# -- Markdown -----------------------------------------------------------------------


def test_text_is_escaped_for_markdown_and_table_cells():
    assert ref.inline("a | b") == "a \\| b"
    assert ref.inline("charged to __anonymous__") == "charged to \\_\\_anonymous\\_\\_"
    assert ref.inline("vllm_xargs.output_rate_user") == "vllm_xargs.output_rate_user"
    assert ref.inline("<tag> *x* [y]") == "&lt;tag> \\*x\\* \\[y]"
    assert ref.inline("keep `a_b` as\n code") == "keep `a_b` as code"
    assert ref.code("a|b") == "<code>a&#124;b</code>"
    assert ref.code("a`b") == "``a`b``"


def test_paths_of_this_machine_are_shown_as_placeholders():
    stable = ref._Stable()
    shown = stable(f"{tempfile.gettempdir()}/x and {ref.ROOT}/y")
    assert shown == "$TMPDIR/x and ./y"
    assert "placeholders" in "".join(stable.note())
    assert ref._Stable().note() == []
