"""The checks of a write request's own fields, made before any lock is taken:
which fields an update changes (its mask), a resource's own rate and weight.

Invariant: nothing here reads the table in force; what a request says is
checked against it later, under the change lock (``writes``,
``table_writes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from control.errors import InvalidArgument
from control.table import shown

#: Update-mask paths of the singletons (the holders': ``control.kinds``): the
#: rate is the only mutable field of ``DefaultLimit``.
RATE_FIELD = "tokens_per_second"
MODE_FIELDS = ("mode", "fair_share")


def mask_fields(
    update_mask: Sequence[str], mutable: Sequence[str], given: set[str]
) -> set[str]:
    """The fields an update changes: those the mask names (``*``: all of
    ``mutable``), or with an empty mask those ``given`` (set in the request),
    or the first mutable field when none is."""
    fields: set[str] = set()
    for path in update_mask:
        if path == "*":
            fields.update(mutable)
        elif path in mutable:
            fields.add(path)
        else:
            raise InvalidArgument(
                f"update_mask: cannot update {shown(path)}; mutable: "
                f"{', '.join(mutable)}"
            )
    if update_mask:
        return fields
    return given or {mutable[0]}


def set_fields(set_: dict[str, bool]) -> set[str]:
    """The fields a request sets (non-default values), for an empty mask."""
    return {name for name, is_set in set_.items() if is_set}
