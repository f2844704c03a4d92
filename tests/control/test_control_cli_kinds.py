"""``output-rate-ctl`` follows the kinds of rate holder (``control.kinds``):
every field of a kind is in its output, every attribute an argument of its
create and update, so an attribute added to the policy needs no CLI edit."""

from __future__ import annotations

import argparse

import pytest

from control.cli import spelling
from control.cli.args import build_parser
from control.cli.render import holder_columns, holder_dict
from control.kinds import ALL, TEAMS, TIERS, Kind
from protos.outputrate.v1 import output_rate_pb2 as _pb2


def _subcommand(parser: argparse.ArgumentParser, words: str) -> argparse.ArgumentParser:
    for word in words.split():
        (choices,) = (
            action.choices
            for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
        )
        parser = choices[word]
    return parser


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.collection)
def test_the_output_of_a_kind_shows_each_of_its_fields(kind: Kind) -> None:
    row = holder_dict(kind, getattr(_pb2, kind.title)(name=kind.name("x")))
    assert [key for _, key in holder_columns(kind)] == list(row)
    assert set(kind.fields) <= set(row)
    assert row[kind.holder] == "x"


@pytest.mark.parametrize("kind", [TIERS, TEAMS], ids=lambda kind: kind.collection)
def test_create_and_update_of_a_group_kind_take_each_attribute(kind: Kind) -> None:
    parser = build_parser()
    for verb in ("create", "update"):
        sub = _subcommand(parser, spelling.command(kind, verb))
        dests = {action.dest for action in sub._actions}
        assert set(kind.attributes) <= dests
    update = _subcommand(parser, spelling.command(kind, "update"))
    options = [
        option
        for action in update._actions
        for option in action.option_strings
        if action.dest in kind.attributes
    ]
    assert options == spelling.update_options(kind)
