"""Changes of the default limit and of the mode (with the fair-share switch).
The holders' changes are in ``holders``, the whole table's in
``table_writes``.

Each change checks its request's own fields first (``write_requests``), then,
holding ``commits.changes``, checks it against what is in force and commits it
through ``TableCommits.commit``.

Invariant: every check runs before ``TableCommits.commit``, so a refused
change leaves the table, the mode and their etags as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from control import names
from control.errors import InvalidArgument
from control.resources import PacingMode, check_etag, pacing_mode
from control.service.commits import TableCommits
from control.service.write_requests import (
    MODE_FIELDS,
    RATE_FIELD,
    mask_fields,
    set_fields,
)
from control.table import check_default_band
from pacing.modes import Mode
from pacing.policy.errors import PolicyError
from pacing.policy.model import ATTRIBUTES, RULES, Limits


def update_default(
    commits: TableCommits,
    name: str,
    values: Mapping[str, object],
    update_mask: Sequence[str],
) -> Limits:
    """Changes the default's attributes that ``update_mask`` selects (empty:
    those set, else the rate); returns the default. Its rate cannot be cleared
    (pacing stays on), nor its band while there are bands; a band set is one
    of the policy's bands."""
    names.check_singleton(name, names.DEFAULT_LIMIT, field="default_limit.name")
    attributes = ATTRIBUTES["default"]
    given = {attribute for attribute in attributes if values.get(attribute)}
    fields = mask_fields(update_mask, attributes, given)
    changes: dict[str, Any] = {}
    for attribute in attributes:
        if attribute not in fields:
            continue
        value = values.get(attribute)
        if value or attribute == RATE_FIELD:
            where = f"default_limit.{attribute}"
            try:
                changes[attribute] = RULES[attribute](value, field=where)
            except PolicyError as error:
                raise InvalidArgument(str(error)) from None
        else:
            changes[attribute] = getattr(Limits(), attribute)
    with commits.changes:
        current = commits.current()
        default = dataclasses.replace(current.default, **changes)
        try:
            default.check("default_limit")
        except PolicyError as error:
            raise InvalidArgument(str(error)) from None
        if "band" in fields:
            check_default_band(default.band, current.bands, field="default_limit.band")
        rate = default.tokens_per_second
        commits.commit(
            dataclasses.replace(current, default=default),
            None
            if rate is None  # pacing off, and the rate not asked for
            else lambda limiter, now: limiter.set_default_rate(rate, now),
        )
    return default


def update_pacing_mode(
    commits: TableCommits,
    name: str,
    mode: Mode | None,
    update_mask: Sequence[str],
    *,
    etag: str,
    fair_share: bool,
    mode_set: bool,
) -> PacingMode:
    """Switches the pacing mode and fair share as ``update_mask`` selects
    (empty: those set; ``mode_set``: the request holds a mode, ``None`` when it
    is not one we know, refused). Switching fair share on where the engine
    cannot run it: FailedPrecondition."""
    names.check_singleton(name, names.PACING_MODE, field="pacing_mode.name")
    given = set_fields({"mode": mode_set, "fair_share": fair_share})
    fields = mask_fields(update_mask, MODE_FIELDS, given)
    if "mode" in fields and mode is None:
        raise InvalidArgument("pacing_mode.mode must be ENFORCE, SHADOW or OFF")
    with commits.changes:
        current = commits.current()
        assert current.mode is not None  # current() always reads the mode
        assert current.fair_share is not None  # and the switch
        check_etag(
            etag,
            commits.etags.mode(current.mode, current.fair_share),
            names.PACING_MODE,
        )
        new_mode = mode if mode is not None and "mode" in fields else current.mode
        switch = fair_share if "fair_share" in fields else current.fair_share
        new = dataclasses.replace(current, mode=new_mode, fair_share=switch)
        commits.commit(new, None, table=False)
    return pacing_mode(commits.etags, new_mode, switch)
