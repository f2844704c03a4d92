"""The policy document as JSON or YAML text: ``loads`` (decode, refusing
duplicate keys, then ``document.parse``) and ``dumps``."""

from __future__ import annotations

import json
from typing import Any, Literal

import yaml

from pacing.policy.document import Document, parse, to_tree
from pacing.policy.errors import PolicyError

Format = Literal["json", "yaml"]


def loads(text: str, fmt: Format, *, source: str | None = None) -> Document:
    """The document ``text`` holds in ``fmt``; ``PolicyError`` said of
    ``source``."""
    try:
        if fmt == "json":
            tree = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            tree = yaml.load(text, Loader=_UniqueKeySafeLoader)
    except _DuplicateKey as exc:
        raise PolicyError(f"duplicate key {exc.args[0]!r}", source=source) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PolicyError(f"not valid {fmt.upper()}: {exc}", source=source) from None
    return parse(tree, source=source)


def dumps(document: Document, fmt: Format) -> str:
    """``document`` in ``fmt`` (``document.to_tree``'s tree)."""
    tree = to_tree(document)
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
    raise PolicyError(
        "cannot tell the format; name the file *.json, *.yaml or *.yml", source=path
    )


def load_inline_or_file(value: str, *, source: str) -> Document:
    """A document given as JSON text (starting with ``{``) or as the path of a
    JSON or YAML file; ``PolicyError`` said of ``source`` (a flag)."""
    if value.lstrip().startswith("{"):
        return loads(value, "json", source=source)
    fmt = format_of(value)
    try:
        with open(value, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise PolicyError(f"{value}: {exc.strerror}", source=source) from None
    except UnicodeDecodeError:
        raise PolicyError(f"{value}: not UTF-8 text", source=source) from None
    return loads(text, fmt, source=f"{source} {value}")


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
