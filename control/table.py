"""The limits table as a document: validation of user ids and rates, and the
JSON/YAML format shared by the config file and the CLI's import/export.

Format (JSON shown; YAML is the same tree)::

    {
      "default_tokens_per_second": 100,
      "users": {"user-a": 100, "user-b": 500},
      "etag": "..."
    }

- ``default_tokens_per_second``: optional; an integer in 1..1000000.
- ``users``: optional; user id -> integer tokens/s. User ids follow the one
  rule of ``pacing.identity.validate_user`` (1..256 UTF-8 bytes of
  well-formed Unicode without control, format or separator characters).
- ``etag``: optional; written by ``output-rate-ctl export`` so that ``import``
  fails when the table changed in between. The config file ignores it.

Anything else (unknown keys, fractional or boolean rates, duplicate keys) is an
error naming the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from control.errors import InvalidArgument
from pacing.identity import validate_user
from pacing.limiter import validate_rate

#: Most explicit limits one table may hold: bounds memory, the size of one
#: ``GetLimitsTable`` reply (about 27 MB at 256-byte ids) and of the config file.
MAX_EXPLICIT_LIMITS = 100_000

DEFAULT_KEY = "default_tokens_per_second"
USERS_KEY = "users"
ETAG_KEY = "etag"

Format = Literal["json", "yaml"]


@dataclass(frozen=True)
class TableDocument:
    """A validated table document; ``default_rate`` is ``None`` when absent."""

    default_rate: int | None = None
    user_rates: Mapping[str, int] = field(default_factory=dict)
    etag: str | None = None


def check_user(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid user id, else raises InvalidArgument."""
    try:
        return validate_user(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def shown(value: object, limit: int = 64) -> str:
    """``value`` for an error message: quoted, escaped (``repr`` escapes every
    unprintable character, surrogates included, so the result always encodes),
    cut after ``limit`` characters (messages must not echo unbounded input)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_rate(value: object, *, field: str) -> int:
    """Returns ``value`` if it is a valid tokens/s limit (an integer in
    1..``MAX_RATE``), else raises InvalidArgument."""
    try:
        return validate_rate(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_table_size(count: int) -> None:
    """Raises InvalidArgument when a table would hold more than
    ``MAX_EXPLICIT_LIMITS`` explicit limits."""
    if count > MAX_EXPLICIT_LIMITS:
        raise InvalidArgument(
            f"a table holds at most {MAX_EXPLICIT_LIMITS} explicit limits, got {count}"
        )


def parse_document(doc: object, *, source: str) -> TableDocument:
    """Validates a decoded document (see the module docstring); errors name
    ``source`` and the field."""
    if not isinstance(doc, Mapping):
        raise InvalidArgument(
            f"{source}: must be an object with {DEFAULT_KEY!r} and {USERS_KEY!r}, "
            f"got {type(doc).__name__}"
        )
    unknown = sorted(str(key) for key in doc if key not in _KEYS)
    if unknown:
        listed = ", ".join(map(shown, unknown[:_MAX_LISTED]))
        if len(unknown) > _MAX_LISTED:
            listed += f" and {len(unknown) - _MAX_LISTED} more"
        raise InvalidArgument(
            f"{source}: unknown field(s) {listed}; "
            f"expected {', '.join(map(repr, _KEYS))}"
        )
    default = doc.get(DEFAULT_KEY)
    if default is not None:
        default = check_rate(default, field=f"{source}: {DEFAULT_KEY}")
    users = doc.get(USERS_KEY) or {}
    if not isinstance(users, Mapping):
        raise InvalidArgument(
            f"{source}: {USERS_KEY} must be an object mapping user ids to tokens "
            f"per second, got {type(users).__name__}"
        )
    check_table_size(len(users))
    rates = {
        check_user(user, field=f"{source}: user id {shown(user)}"): check_rate(
            rate, field=f"{source}: {USERS_KEY}[{shown(user)}]"
        )
        for user, rate in users.items()
    }
    etag = doc.get(ETAG_KEY)
    if etag is not None and not isinstance(etag, str):
        raise InvalidArgument(f"{source}: {ETAG_KEY} must be a string")
    return TableDocument(default_rate=default, user_rates=rates, etag=etag)


def loads(text: str, fmt: Format, *, source: str) -> TableDocument:
    """Decodes and validates a document in ``fmt``."""
    try:
        if fmt == "json":
            doc = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            doc = yaml.load(text, Loader=_UniqueKeySafeLoader)
    except _DuplicateKey as exc:
        raise InvalidArgument(f"{source}: duplicate key {exc.args[0]!r}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"{source}: not valid {fmt.upper()}: {exc}") from None
    return parse_document(doc, source=source)


def dumps(doc: TableDocument, fmt: Format) -> str:
    """Encodes ``doc`` in ``fmt``, users sorted by id, ``etag`` only when set."""
    tree: dict[str, Any] = {}
    if doc.default_rate is not None:
        tree[DEFAULT_KEY] = doc.default_rate
    tree[USERS_KEY] = dict(sorted(doc.user_rates.items()))
    if doc.etag is not None:
        tree[ETAG_KEY] = doc.etag
    if fmt == "json":
        return json.dumps(tree, indent=2, ensure_ascii=False) + "\n"
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)


def format_of(path: str) -> Format:
    """The format a file name implies: ``.json`` is JSON, ``.yaml``/``.yml`` YAML."""
    lowered = path.lower()
    if lowered.endswith(".json"):
        return "json"
    if lowered.endswith((".yaml", ".yml")):
        return "yaml"
    raise InvalidArgument(
        f"{path}: cannot tell the format; name the file *.json, *.yaml or *.yml"
    )


_KEYS = (DEFAULT_KEY, USERS_KEY, ETAG_KEY)
#: Unknown fields named in one error message.
_MAX_LISTED = 5


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _UniqueKeySafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate mapping keys (it would keep the
    last one silently, hiding a typo'd table)."""

    def construct_mapping(
        self, node: yaml.MappingNode, deep: bool = False
    ) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str):  # other keys fail validation anyway
                if key in seen:
                    raise _DuplicateKey(key)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)
