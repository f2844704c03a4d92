"""``output-rate-ctl export`` and ``import``: the whole limits table (default,
user entries, tiers, teams, bands and objectives) to and from a JSON or YAML
file.

Invariant: an import replaces the table in one ``ReplaceLimitsTable`` call,
guarded by the file's etag (for a file with neither etag nor default, by the
etag read with the current default), unless ``--force``; a file that does not
parse is refused locally as ``INVALID_ARGUMENT`` before anything is sent. The
pacing mode is not part of the table: import leaves it and says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO, cast

from control.cli.client import EXIT_OK, Client, UsageError
from control.cli.render import encodes, print_error, print_json
from control.errors import InvalidArgument
from control.kinds import ALL, Kind, attributes_unwire, attributes_wire
from control.table import dumps, format_of, loads
from pacing.policy.document import Document
from pacing.policy.model import ATTRIBUTES, GroupKind, Limits, Policy, User
from protos.outputrate.v1 import output_rate_pb2 as _pb2


def export(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    table = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
    doc = Document(_policy_of(table), table.etag)
    entries, tiers, teams = (len(getattr(table, k.collection)) for k in ALL)
    if args.file in (None, "-"):
        out.write(dumps(doc, "json"))
    else:
        text = dumps(doc, format_of(args.file))
        try:
            Path(args.file).write_text(text)
        except OSError as exc:
            raise UsageError(f"cannot write {args.file}: {exc.strerror}") from None
        print(
            f"exported {entries} entries, {tiers} tiers and {teams} teams to "
            f"{args.file}",
            file=sys.stderr,
        )
    return EXIT_OK


def import_table(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    source = "stdin" if args.file == "-" else args.file
    fmt = "json" if args.file == "-" else format_of(args.file)
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{source}: not UTF-8 ({exc.reason})") from None
    try:
        doc = loads(text, fmt, source=source)
    except RecursionError:  # e.g. 100k "[": the parsers recurse per level
        raise InvalidArgument(
            f"{source}: not valid {fmt.upper()}: nested too deeply"
        ) from None
    if doc.etag is not None and not encodes(doc.etag):
        raise InvalidArgument(f"{source}: etag must be well-formed Unicode")
    etag = "" if args.force else (doc.etag or "")
    given = attributes_wire(doc.policy.default, ATTRIBUTES["default"])
    default = _pb2.DefaultLimit(**given)
    if doc.policy.default_rate is None:  # keep the current default, as read
        current = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
        default = current.default  # with its etag
        default.tokens_per_second = current.default_tokens_per_second
        for name, value in given.items():  # but what the file's default sets
            if value:
                setattr(default, name, value)
        etag = etag or ("" if args.force else current.etag)
    wire: dict[str, Any] = {
        kind.collection: [
            getattr(_pb2, kind.title)(name=kind.name(holder_id), **values)
            for holder_id, values in _wire_of(doc.policy, kind)
        ]
        for kind in ALL
    }
    table = client.call(
        "ReplaceLimitsTable",
        _pb2.ReplaceLimitsTableRequest(
            limits_table=_pb2.LimitsTable(
                default_tokens_per_second=default.tokens_per_second,
                etag=etag,
                default=default,
                bands=doc.policy.bands,
                objectives=[
                    _pb2.Objective(name=name, band=band)
                    for name, band in sorted(doc.policy.objectives.items())
                ],
                **wire,
            )
        ),
    )
    if doc.policy.mode is not None:  # the mode is not part of the table and its etag
        print_error(
            f"note: {source} names mode {doc.policy.mode}, which import leaves as it "
            "is; use set-mode to change it"
        )
    if doc.policy.fair_share is not None:  # nor is the fair-share switch
        print_error(
            f"note: {source} names fair_share, which import leaves as it is; "
            "use set-fair-share to change it"
        )
    entries, tiers, teams = len(table.limits), len(table.tiers), len(table.teams)
    if args.json:
        print_json(
            out,
            {"imported": entries, "tiers": tiers, "teams": teams, "etag": table.etag},
        )
    else:
        print(
            f"imported {entries} entries, {tiers} tiers and {teams} teams; "
            f"etag {table.etag}",
            file=out,
        )
    return EXIT_OK


def _policy_of(table: _pb2.LimitsTable) -> Policy:
    """The policy a ``LimitsTable`` the server sent holds."""
    groups: dict[GroupKind, dict[str, Limits]] = {}
    users: dict[str, User] = {}
    for kind in ALL:
        for message in getattr(table, kind.collection):
            values = {name: getattr(message, name) for name in kind.fields}
            limits, memberships = kind.unwire(values)
            holder_id = kind.id_of(message.name)
            if kind.is_group:
                groups.setdefault(cast(GroupKind, kind.holder), {})[holder_id] = limits
            else:
                users[holder_id] = User(limits, memberships)
    default = Limits(table.default_tokens_per_second or None)
    if table.HasField("default"):
        attributes = ATTRIBUTES["default"]
        values = {name: getattr(table.default, name) for name in attributes}
        default = attributes_unwire(values, attributes)
    return Policy(
        default=default,
        groups=groups,
        users=users,
        bands=tuple(table.bands),
        objectives={o.name: o.band for o in table.objectives},
    )


def _wire_of(policy: Policy, kind: Kind) -> list[tuple[str, dict[str, object]]]:
    """Each holder of ``kind`` in ``policy`` with its fields as the API carries
    them, in id order."""
    if kind.is_group:
        holders = policy.groups[cast(GroupKind, kind.holder)]
        return [(i, kind.wire(holders[i], {})) for i in sorted(holders)]
    return [
        (user, kind.wire(entry.limits, entry.groups))
        for user, entry in sorted(policy.users.items())
    ]
