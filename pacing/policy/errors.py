"""The one error of a policy that breaks a rule: where (the field path, as
Kubernetes writes it) and what, in the same words from every entry point."""

from __future__ import annotations

import re
from collections.abc import Sequence

#: One step of a field path: an object key or a list index.
PathPart = str | int

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
#: Characters of a key shown in a path (messages must not echo unbounded input).
_SHOWN_KEY = 64


def render_path(path: Sequence[PathPart] | str) -> str:
    """``path`` as ``users.user-a.tokens_per_second``: plain keys after a dot,
    other keys quoted in brackets (``users['a.b']``), list indices in brackets.
    A ``str`` is a path rendered already (a flag, a request field)."""
    if isinstance(path, str):
        return path
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part) and len(part) <= _SHOWN_KEY:
            text += f".{part}" if text else part
        else:
            text += f"[{shown(part)}]"
    return text


def shown(value: object, limit: int = _SHOWN_KEY) -> str:
    """``value`` for a message: quoted, escaped (``repr`` escapes every
    unprintable character, so the result always encodes), cut after ``limit``
    characters."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class PolicyError(ValueError):
    """A policy that breaks a rule. ``str()`` is ``source: path: message`` (the
    parts that are known); ``path`` is the rendered field path, ``""`` for the
    whole document."""

    def __init__(
        self,
        message: str,
        path: Sequence[PathPart] | str = (),
        *,
        source: str | None = None,
    ) -> None:
        self.message = message
        self.parts: Sequence[PathPart] | str = (
            path if isinstance(path, str) else tuple(path)
        )
        self.path = render_path(path)
        self.source = source
        super().__init__(
            ": ".join(part for part in (source, self.path, message) if part)
        )

    def at(self, source: str) -> PolicyError:
        """The same error, said of ``source`` (a file name, a flag)."""
        return PolicyError(self.message, self.parts, source=source)


def unknown_group(
    kind: str, name: object, path: Sequence[PathPart] | str
) -> PolicyError:
    """The one error of a membership or a weight of a group that does not exist."""
    return PolicyError(f"unknown {kind} {shown(name)}", path)
