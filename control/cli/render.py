"""``output-rate-ctl``'s output: proto messages as dicts, the dicts as JSON or as
aligned tables, errors as one line on stderr.

Invariant: proto messages become output only through the ``*_dict`` functions,
so ``--json`` prints exactly the values the tables show; nothing here calls the
server, and every error line is one printable line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from control import names
from control.kinds import BY_HOLDER, Kind
from protos.outputrate.v1 import output_rate_pb2 as _pb2

_STATE_COLUMNS = (
    ("USER", "user"),
    ("LIMIT/S", "limit_tokens_per_second"),
    ("SOURCE", "limit_source"),
    ("TIER", "tier"),
    ("RECENT/S", "recent_tokens_per_second"),
    ("NEXT_IN", "next_token_in_s"),
    ("TAT_LEAD", "tat_lead_s"),
    ("CHARGED", "tokens_charged"),
    ("REFUNDS", "refunds"),
    ("SKIPS", "throttled_skips"),
    ("SHADOW", "shadow_skips"),
    ("PREEMPTED", "throttled_preemptions"),
    ("RUNNING", "running_requests"),
    ("THROTTLED", "throttled_requests"),
    ("LATE", "engine_late_s"),
)
#: Added to the states' table while there are bands (every state then names
#: the band that applies to its user).
_BAND_COLUMNS = (("BAND", "band"),)
#: Added to the states' table when any state shows a ceiling (one that
#: applies, or tokens borrowed): the output rate borrowed up to, the tokens
#: borrowed, whether the engine was spare for the user at its last step.
_CEILING_COLUMNS = (
    ("CEIL/S", "ceiling_tokens_per_second"),
    ("BORROWED", "borrowed_tokens"),
    ("MAY_BORROW", "may_borrow"),
)
#: The keys of ``state_dict`` whose value, where any is not zero, shows the
#: ceiling columns.
_CEILING_SHOWN_BY = ("ceiling_tokens_per_second", "borrowed_tokens")
#: Added to the states' table when any state shows a prompt budget (a prompt
#: rate, or prompt tokens charged, held or let through by shadow mode).
_PROMPT_COLUMNS = (
    ("PROMPT/S", "prompt_limit_tokens_per_second"),
    ("P_NEXT_IN", "prompt_next_token_in_s"),
    ("P_TAT_LEAD", "prompt_tat_lead_s"),
    ("P_CHARGED", "prompt_tokens_charged"),
    ("P_HELD", "prompt_held_skips"),
    ("P_SHADOW", "prompt_shadow_holds"),
    ("P_WAIT", "prompt_wait_s"),
)
#: The keys of ``state_dict`` whose value, where any is not zero, shows the
#: prompt columns.
_PROMPT_SHOWN_BY = (
    "prompt_limit_tokens_per_second",
    "prompt_tokens_charged",
    "prompt_held_skips",
    "prompt_shadow_holds",
)
#: Added to the states' table when the engine has a global store (``store``).
_STORE_COLUMNS = (
    ("HELD", "store_held_tokens"),
    ("GLOBAL_TAT", "store_global_tat_lead_s"),
    ("READ_AGO", "store_global_tat_read_age_s"),
    ("STORE", "store_health"),
)
#: Added to the states' table when fair share is on.
_FAIR_SHARE_COLUMNS = (
    ("WEIGHT", "weight"),
    ("SERVICE", "fair_share_service"),
    ("AHEAD", "fair_share_lead"),
    ("FS_PREEMPT", "fair_share_preemptions"),
)
#: The keys of ``_store_dict`` (``store_`` and one of them name a store column).
_STORE_KEYS = ("held_tokens", "global_tat_lead_s", "global_tat_read_age_s", "health")
#: The fields output shows first, in this order (``shown_fields``).
_FIRST = ("tokens_per_second", "tier")
#: Column titles other than the key's (``_title``).
_TITLES = {
    "member_count": "MEMBERS",
    "prompt_tokens_per_second": "PROMPT/S",
    "ceiling_tokens_per_second": "CEIL/S",
}
TEAM_STATE_COLUMNS = (
    ("TEAM", "team"),
    ("TOKENS/S", "tokens_per_second"),
    ("BUDGET", "budget_tokens"),
    ("NEXT_IN", "next_token_in_s"),
    ("TAT_LEAD", "tat_lead_s"),
    ("MEMBERS", "member_count"),
    ("RUNNING", "running_members"),
    ("THROTTLED", "throttled_members"),
    ("CHARGED", "tokens_charged"),
    ("BOUND", "throttled_steps"),
    ("WEIGHT", "weight"),
    ("SERVICE", "fair_share_service"),
    ("PROMPT/S", "prompt_tokens_per_second"),
)


# -- messages as dicts --------------------------------------------------------


def holder_dict(kind: Kind, holder: Any) -> dict[str, Any]:
    """One holder of ``kind`` (a ``Limit``, ``Tier`` or ``Team``): its id, its
    fields (``shown_fields``), its member count for a group. A field not set is
    ``None``, but a flag is a boolean and a field the holder cannot lack is as
    it is; a membership is the group's id."""
    row: dict[str, Any] = {kind.holder: kind.id_of(holder.name)}
    for field in shown_fields(kind):
        value = getattr(holder, field)
        if field in kind.references:
            value = BY_HOLDER[field].id_of(value) or None
        elif not isinstance(value, bool) and field not in kind.required:
            value = value or None
        row[field] = value
    if kind.is_group:
        row["member_count"] = holder.member_count
    return row


def shown_fields(kind: Kind) -> tuple[str, ...]:
    """``kind.fields`` in the order output shows them: the rate, then the tier
    (where a rate may come from), then the others."""
    first = tuple(field for field in _FIRST if field in kind.fields)
    return (*first, *(field for field in kind.fields if field not in first))


def holder_columns(kind: Kind) -> tuple[tuple[str, str], ...]:
    """The table of ``holder_dict``: a column per key, titled by it."""
    counts = ("member_count",) if kind.is_group else ()
    keys = (kind.holder, *shown_fields(kind), *counts)
    return tuple((_TITLES.get(key, _title(key)), key) for key in keys)


def _title(key: str) -> str:
    """``TOKENS/S`` for ``tokens_per_second``, ``WEIGHT`` for ``weight``."""
    return key.upper().replace("_PER_SECOND", "/S")


def team_state_dict(state: _pb2.TeamState) -> dict[str, Any]:
    return {
        "team": state.team,
        "tokens_per_second": state.tokens_per_second,
        "budget_tokens": state.budget_tokens,
        "next_token_in_s": state.next_token_in.ToNanoseconds() / 1e9,
        "tat_lead_s": state.tat_lead.ToNanoseconds() / 1e9,
        "member_count": state.member_count,
        "running_members": state.running_members,
        "throttled_members": state.throttled_members,
        "tokens_charged": state.tokens_charged,
        "throttled_steps": state.throttled_steps,
        "weight": state.weight,
        "fair_share_service": state.fair_share_service,
        # None: no prompt rate of its own (its members' own ones only).
        "prompt_tokens_per_second": state.prompt_tokens_per_second or None,
    }


def mode_name(mode: _pb2.PacingMode) -> str:
    return _pb2.PacingMode.Mode.Name(mode.mode).lower()


def state_dict(state: _pb2.UserState) -> dict[str, Any]:
    return {
        "user": state.user,
        "limit_tokens_per_second": state.limit_tokens_per_second,
        "tat_lead_s": state.tat_lead.ToNanoseconds() / 1e9,
        "next_token_in_s": state.next_token_in.ToNanoseconds() / 1e9,
        "tokens_charged": state.tokens_charged,
        "refunds": state.refunds,
        "throttled_skips": state.throttled_skips,
        "throttled_preemptions": state.throttled_preemptions,
        "running_requests": state.running_requests,
        "throttled_requests": state.throttled_requests,
        "recent_tokens_per_second": state.recent_tokens_per_second,
        "limit_source": _pb2.UserState.LimitSource.Name(state.limit_source).lower(),
        "tier": names.tier_id(state.tier) or None,
        "shadow_skips": state.shadow_skips,
        "pacing_mode": _pb2.PacingMode.Mode.Name(state.pacing_mode).lower(),
        "engine_late_s": state.engine_late.ToNanoseconds() / 1e9,
        "store": _store_dict(state.store) if state.HasField("store") else None,
        "fair_share": state.fair_share,
        "weight": state.weight,
        "fair_share_service": state.fair_share_service,
        "fair_share_preemptions": state.fair_share_preemptions,
        # None: not backlogged at the last step (not in the gap).
        "fair_share_lead": state.fair_share_lead
        if state.fair_share_backlogged
        else None,
        "prompt_limit_tokens_per_second": state.prompt_limit_tokens_per_second,
        "prompt_tat_lead_s": state.prompt_tat_lead.ToNanoseconds() / 1e9,
        "prompt_next_token_in_s": state.prompt_next_token_in.ToNanoseconds() / 1e9,
        "prompt_tokens_charged": state.prompt_tokens_charged,
        "prompt_held_skips": state.prompt_held_skips,
        "prompt_shadow_holds": state.prompt_shadow_holds,
        "prompt_wait_s": state.prompt_wait.ToNanoseconds() / 1e9,
        "ceiling_tokens_per_second": state.ceiling_tokens_per_second,
        "borrowed_tokens": state.borrowed_tokens,
        "may_borrow": state.may_borrow,
        # None: no bands.
        "band": state.band or None,
    }


def _store_dict(view: _pb2.StoreView) -> dict[str, Any]:
    age = view.global_tat_read_age
    return {
        "held_tokens": view.held_tokens,
        "global_tat_lead_s": view.global_tat_lead.ToNanoseconds() / 1e9,
        "global_tat_read_age_s": age.ToNanoseconds() / 1e9
        if view.HasField("global_tat_read_age")
        else None,
        "health": _pb2.StoreView.Health.Name(view.health).lower(),
    }


# -- one result, as JSON or as text -------------------------------------------


def emit(
    out: TextIO,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    single: bool = False,
) -> None:
    """Rows as JSON (one object when ``single``) or as an aligned table."""
    if args.json:
        print_json(out, rows[0] if single else rows)
    else:
        print_table(out, rows, columns)


def emit_holder(out: TextIO, args: argparse.Namespace, kind: Kind, holder: Any) -> None:
    emit(out, args, [holder_dict(kind, holder)], holder_columns(kind), single=True)


def emit_mode(out: TextIO, args: argparse.Namespace, mode: _pb2.PacingMode) -> None:
    if args.json:
        print_json(out, {"pacing_mode": mode_name(mode), "fair_share": mode.fair_share})
    else:
        print(f"pacing mode: {mode_name(mode)}", file=out)
        print(f"fair share: {'on' if mode.fair_share else 'off'}", file=out)


def emit_default(
    out: TextIO, args: argparse.Namespace, default: _pb2.DefaultLimit
) -> None:
    """The default's rate, prompt rate, ceiling and band (``None`` in JSON, no
    line in text: none)."""
    prompt = default.prompt_tokens_per_second
    ceiling = default.ceiling_tokens_per_second
    band = default.band
    if args.json:
        print_json(
            out,
            {
                "default_tokens_per_second": default.tokens_per_second,
                "default_prompt_tokens_per_second": prompt or None,
                "default_ceiling_tokens_per_second": ceiling or None,
                "default_band": band or None,
            },
        )
    else:
        print(f"default: {default.tokens_per_second} tokens/s", file=out)
        if prompt:
            print(f"default prompt rate: {prompt} prompt tokens/s", file=out)
        if ceiling:
            print(f"default ceiling: {ceiling} tokens/s", file=out)
        if band:
            print(f"default band: {band}", file=out)


def print_states(out: TextIO, mode: str, states: list[dict[str, Any]]) -> None:
    """States (``state_dict``) as a table under a line with the pacing mode;
    with the band's column while there are bands (any state names one), the
    ceiling's columns when any state shows one, the prompt budget's when any
    state shows one, the fair-share columns when fair share is on, and the
    store's when any state has a store view."""
    fair_share = any(state["fair_share"] for state in states)
    print(f"pacing mode: {mode}{', fair share on' if fair_share else ''}", file=out)
    bands = any(state["band"] for state in states)
    ceiling = any(state[key] for state in states for key in _CEILING_SHOWN_BY)
    prompt = any(state[key] for state in states for key in _PROMPT_SHOWN_BY)
    columns = (
        _STATE_COLUMNS
        + (_BAND_COLUMNS if bands else ())
        + (_CEILING_COLUMNS if ceiling else ())
        + (_PROMPT_COLUMNS if prompt else ())
        + (_FAIR_SHARE_COLUMNS if fair_share else ())
    )
    if any(state["store"] for state in states):
        rows = [_with_store_columns(state) for state in states]
        print_table(out, rows, columns + _STORE_COLUMNS)
    else:
        print_table(out, states, columns)


def _with_store_columns(state: dict[str, Any]) -> dict[str, Any]:
    store = state["store"] or {}
    return {**state, **{f"store_{key}": store.get(key) for key in _STORE_KEYS}}


# -- formats ------------------------------------------------------------------


def print_json(out: TextIO, value: Any, indent: int | None = 2) -> None:
    print(json.dumps(value, indent=indent, ensure_ascii=False), file=out)


def print_error(line: str) -> None:
    print(one_line(line), file=sys.stderr)


def one_line(text: str) -> str:
    """``text`` on one printable line: multi-line messages (YAML errors) joined,
    other unprintable characters (lone surrogates too) escaped."""
    joined = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return "".join(
        ch if ch.isprintable() and encodes(ch) else ascii(ch)[1:-1] for ch in joined
    )


def encodes(text: str) -> bool:
    """Whether ``text`` is well-formed Unicode (protobuf strings must be)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def print_table(
    out: TextIO, rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]
) -> None:
    cells = [[title for title, _ in columns]]
    cells += [[_cell(key, row[key]) for _, key in columns] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        # The first column (user ids) is left-aligned, numbers right-aligned.
        line = [row[0].ljust(widths[0])]
        line += [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        print("  ".join(line).rstrip(), file=out)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key.endswith("_s"):
        return f"{value * 1000:.0f}ms" if value < 10 else f"{value:.1f}s"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)
