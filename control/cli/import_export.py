"""``output-rate-ctl export`` and ``import``: the whole limits table (default,
user entries, tiers, teams) to and from a JSON or YAML file.

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
from typing import TextIO

from control import names
from control.cli.client import EXIT_OK, Client, UsageError
from control.cli.render import encodes, holder_dict, print_error, print_json
from control.errors import InvalidArgument
from control.kinds import TEAMS, TIERS, USERS
from control.table import TableDocument, dumps, format_of, loads
from protos.outputrate.v1 import output_rate_pb2 as _pb2


def export(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    table = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
    entries = [holder_dict(USERS, limit) for limit in table.limits]
    tiers = [holder_dict(TIERS, tier) for tier in table.tiers]
    teams = [holder_dict(TEAMS, team) for team in table.teams]
    doc = TableDocument(
        default_rate=table.default_tokens_per_second or None,
        user_rates={
            e["user"]: e["tokens_per_second"]
            for e in entries
            if e["tokens_per_second"] is not None
        },
        etag=table.etag,
        tier_rates={
            t["tier"]: t["tokens_per_second"]
            for t in tiers
            if t["tokens_per_second"] is not None
        },
        exempt_tiers=frozenset(t["tier"] for t in tiers if t["exempt"]),
        memberships={e["user"]: e["tier"] for e in entries if e["tier"] is not None},
        exempt_users=frozenset(e["user"] for e in entries if e["exempt"]),
        user_weights={e["user"]: e["weight"] for e in entries if e["weight"]},
        tier_weights={t["tier"]: t["weight"] for t in tiers if t["weight"]},
        team_rates={t["team"]: t["tokens_per_second"] for t in teams},
        team_members={e["user"]: e["team"] for e in entries if e["team"] is not None},
        team_weights={t["team"]: t["weight"] for t in teams if t["weight"]},
    )
    if args.file in (None, "-"):
        out.write(dumps(doc, "json"))
    else:
        text = dumps(doc, format_of(args.file))
        try:
            Path(args.file).write_text(text)
        except OSError as exc:
            raise UsageError(f"cannot write {args.file}: {exc.strerror}") from None
        print(
            f"exported {len(entries)} entries, {len(tiers)} tiers and "
            f"{len(teams)} teams to {args.file}",
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
    default = doc.default_rate
    if default is None:  # keep the current default, as read with its etag
        current = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
        default = current.default_tokens_per_second
        etag = etag or ("" if args.force else current.etag)
    table = client.call(
        "ReplaceLimitsTable",
        _pb2.ReplaceLimitsTableRequest(
            limits_table=_pb2.LimitsTable(
                default_tokens_per_second=default,
                limits=[
                    _pb2.Limit(
                        name=names.limit_name(user),
                        tokens_per_second=doc.user_rates.get(user, 0),
                        tier=(
                            names.tier_name(doc.memberships[user])
                            if user in doc.memberships
                            else ""
                        ),
                        exempt=user in doc.exempt_users,
                        weight=doc.user_weights.get(user, 0.0),
                        team=(
                            names.team_name(doc.team_members[user])
                            if user in doc.team_members
                            else ""
                        ),
                    )
                    for user in sorted(doc.users())
                ],
                tiers=[
                    _pb2.Tier(
                        name=names.tier_name(tier),
                        tokens_per_second=doc.tier_rates.get(tier, 0),
                        exempt=tier in doc.exempt_tiers,
                        weight=doc.tier_weights.get(tier, 0.0),
                    )
                    for tier in sorted(doc.tiers)
                ],
                teams=[
                    _pb2.Team(
                        name=names.team_name(team),
                        tokens_per_second=rate,
                        weight=doc.team_weights.get(team, 0.0),
                    )
                    for team, rate in sorted(doc.team_rates.items())
                ],
                etag=etag,
            )
        ),
    )
    if doc.mode is not None:  # the mode is not part of the table and its etag
        print_error(
            f"note: {source} names mode {doc.mode}, which import leaves as it "
            "is; use set-mode to change it"
        )
    if doc.fair_share is not None:  # nor is the fair-share switch
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
