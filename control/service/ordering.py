"""How the limits service's lists are paged and ordered: page sizes, resuming
from a page token, and the ``order_by`` of user states.

Invariant: every sort key ends with the user id, which is unique, so keys are
totally ordered and a page token (the last key of a page) resumes with the keys
after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from control.errors import InvalidArgument
from control.pagination import PageTokens
from control.table import shown
from pacing.shared import COLUMNS, Reading

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def page_size(requested: int) -> int:
    """The page size a request asks for (0: the default), capped."""
    if requested < 0:
        raise InvalidArgument(f"page_size must not be negative, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def resume(tokens: PageTokens, scope: str, page_token: str) -> list[Any] | None:
    """The key a page token resumes after (None: the first page)."""
    return tokens.decode(page_token, scope) if page_token else None


@dataclass(frozen=True)
class Order:
    """A parsed ``order_by``: fields with directions; ties broken by user."""

    fields: tuple[tuple[str, bool], ...]  # (field, descending)

    @classmethod
    def parse(cls, order_by: str, *, field: str) -> Order:
        parsed: list[tuple[str, bool]] = []
        for item in filter(None, (part.strip() for part in order_by.split(","))):
            words = item.split()
            name, direction = words[0], words[1:]
            if direction not in ([], ["asc"], ["desc"]):
                raise InvalidArgument(
                    f"{field}: {shown(item)} must be a field name optionally "
                    "followed by asc or desc"
                )
            descending = direction == ["desc"]
            if name == "user":
                if descending:
                    raise InvalidArgument(f"{field}: user can only be sorted ascending")
                break  # user ids are unique: nothing after them matters
            if name not in COLUMNS:
                raise InvalidArgument(
                    f"{field}: cannot sort by {shown(name)}; sortable fields: "
                    f"user, {', '.join(COLUMNS)}"
                )
            if any(name == seen for seen, _ in parsed):
                raise InvalidArgument(f"{field}: {name} appears more than once")
            parsed.append((name, descending))
        return cls(tuple(parsed))

    @property
    def canonical(self) -> str:
        return ",".join(f"{n} desc" if d else n for n, d in self.fields) or "user"

    def keys(self, reading: Reading, users: Sequence[str]) -> list[tuple[Any, ...]]:
        """Each user's sort key, ending with the user id: ascending tuple order
        is the requested order. One pass per field over ``users`` only (this
        runs under the shared limiter's lock)."""
        columns = [
            (reading.column(name, users), -1 if desc else 1)
            for name, desc in self.fields
        ]
        if not columns:
            return [(user,) for user in users]
        if len(columns) == 1:
            ((column, sign),) = columns
            return [(sign * column.get(user, 0), user) for user in users]
        return [
            (*[sign * column.get(user, 0) for column, sign in columns], user)
            for user in users
        ]
