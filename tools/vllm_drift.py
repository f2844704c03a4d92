"""Checks another vLLM release for drift in the internals pacing relies on.

    python -m tools.vllm_drift WHEEL_OR_DIR [WHEEL_OR_DIR ...] [--json]

Reads vLLM's source from a wheel (``.whl``) or a source folder (one holding
``vllm/``, or the ``vllm`` package itself) without importing it (``zipfile`` and
``ast``), and compares every internal of ``tools.vllm_internals`` with the form
vLLM 0.32.0 has: whether it still exists, with the same signature, and, where a
hook depends on it, used from the same places. Exit status: 0 when nothing
drifted, 1 when something did, 2 when a path is not a vLLM wheel or folder.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.vllm_internals import INTERNALS, REGIONS, Internal, Region, Uses

SAME = "same"
SIGNATURE = "changed signature"
MOVED = "call sites moved"
MISSING = "missing"

Scope = ast.Module | ast.ClassDef


class SourceError(Exception):
    """A path that is not a vLLM wheel or source folder."""


class VllmSource:
    """The Python files of one vLLM wheel or source folder, parsed on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        self._parsed: dict[str, tuple[ast.Module, bool] | None] = {}
        if not self.path.exists():
            raise SourceError(f"{self.path}: no such file or folder")
        if self.path.is_dir():
            if (self.path / "vllm" / "__init__.py").is_file():
                self._root = self.path
            elif self.path.name == "vllm" and (self.path / "__init__.py").is_file():
                self._root = self.path.parent
            else:
                raise SourceError(
                    f"{self.path}: not a vLLM source folder (no vllm/__init__.py "
                    "in it, and it is not the vllm package itself)"
                )
        elif zipfile.is_zipfile(self.path):
            self._zip = zipfile.ZipFile(self.path)
            if "vllm/__init__.py" not in self._zip.namelist():
                raise SourceError(
                    f"{self.path}: not a vLLM wheel (no vllm/__init__.py in it)"
                )
        else:
            raise SourceError(
                f"{self.path}: not a vLLM wheel (not a zip file) or source folder"
            )

    def read(self, name: str) -> str | None:
        """The text of ``name`` (a path under the root, ``vllm/...``), if any."""
        if self._zip is not None:
            try:
                return self._zip.read(name).decode()
            except KeyError:
                return None
        assert self._root is not None
        path = self._root / name
        return path.read_text() if path.is_file() else None

    def module(self, dotted: str) -> tuple[ast.Module, bool] | None:
        """A module's syntax tree and whether it is a package, by import path."""
        if dotted not in self._parsed:
            base = dotted.replace(".", "/")
            found = None
            for name, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self.read(name)
                if text is not None:
                    found = (ast.parse(text, name), package)
                    break
            self._parsed[dotted] = found
        return self._parsed[dotted]

    @property
    def version(self) -> str:
        """vLLM's version as its ``_version.py`` or the wheel's name states it."""
        parsed = self.module("vllm._version")
        for node in ast.walk(parsed[0]) if parsed is not None else ():
            if (
                isinstance(node, ast.Assign)
                and any(
                    isinstance(t, ast.Name) and t.id == "__version__"
                    for t in node.targets
                )
                and isinstance(node.value, ast.Constant)
            ):
                return str(node.value.value)
        if self._zip is not None and self.path.name.startswith("vllm-"):
            return self.path.name.split("-")[1]
        return "unknown"


# -- finding classes and members -----------------------------------------------


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those under ``if`` and ``try``
    (``TYPE_CHECKING`` blocks excluded: nothing there exists at run time)."""
    for node in tree.body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                yield from node.orelse
                continue
            yield from node.body
            yield from node.orelse
        elif isinstance(node, ast.Try):
            yield from node.body
        else:
            yield node


def _absolute(module: str, package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def find_class(
    source: VllmSource, module: str, name: str, hops: int = 0
) -> tuple[str, ast.ClassDef] | None:
    """The class ``module.name`` and the module defining it, following
    re-exports (``from vllm.x import Name``) within vLLM."""
    parsed = source.module(module)
    if parsed is None or hops > 8:
        return None
    tree, package = parsed
    found: tuple[str, ast.ClassDef] | None = None
    for node in _top_level(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = (module, node)
    if found is not None:
        return found
    for node in _top_level(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, package, node)
            for alias in node.names:
                if (alias.asname or alias.name) == name and target.startswith("vllm"):
                    return find_class(source, target, alias.name, hops + 1)
    return None


def class_chain(
    source: VllmSource, module: str, cls: ast.ClassDef
) -> list[tuple[str, ast.ClassDef]]:
    """``cls`` and the bases vLLM defines, in lookup order (depth first)."""
    chain = [(module, cls)]
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = find_class(source, module, base.id)
            if found is not None:
                chain.extend(
                    entry
                    for entry in class_chain(source, *found)
                    if entry[1] not in [c for _, c in chain]
                )
    return chain


def _body_members(cls: ast.ClassDef) -> dict[str, ast.stmt]:
    """Names the class body binds (the last binding wins, as at run time)."""
    members: dict[str, ast.stmt] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            members[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    members[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = node
    return members


def _sets_on_self(cls: ast.ClassDef, name: str) -> bool:
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == name
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            return True
    return False


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [ast.unparse(d) for d in node.decorator_list]


def _is_property(node: ast.stmt) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        d.split(".")[-1] in ("property", "cached_property") for d in _decorators(node)
    )


def render_signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Decorators, then parameter names, kinds and defaults (no annotations)."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (
        len(positional) - len(args.defaults)
    ) + list(args.defaults)
    parts: list[str] = []
    for index, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        parts.append(
            arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}"
        )
        if args.posonlyargs and index == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        parts.append(
            arg.arg if kw_default is None else f"{arg.arg}={ast.unparse(kw_default)}"
        )
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    decorators = "".join(f"@{d} " for d in _decorators(node))
    return f"{decorators}{prefix}({', '.join(parts)})"


def _form(node: ast.stmt) -> str:
    if _is_property(node):
        return "property"
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return "method"
    return "class attribute"


# -- where upstream uses a name --------------------------------------------------


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner is not None else None
    return None


def _direct_nodes(statements: Sequence[ast.stmt]) -> Iterator[ast.AST]:
    """Every node under ``statements`` but inside nested loops and functions."""
    stack: list[ast.AST] = list(statements)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(
                child,
                ast.For
                | ast.AsyncFor
                | ast.While
                | ast.FunctionDef
                | ast.AsyncFunctionDef
                | ast.Lambda,
            ):
                stack.append(child)


def _region(
    loop: ast.For | ast.AsyncFor | ast.While, regions: Sequence[Region]
) -> str | None:
    header: ast.expr = loop.test if isinstance(loop, ast.While) else loop.iter
    for region in regions:
        if region.mentions is None:
            return region.name
        nodes = (
            ast.walk(header)
            if region.where == "header"
            else _direct_nodes([*loop.body, *loop.orelse])
        )
        if any(
            isinstance(n, ast.expr) and _dotted(n) == region.mentions for n in nodes
        ):
            return region.name
    return None


def _matches(node: ast.AST, name: str, uses: Uses) -> bool:
    if not isinstance(node, ast.Attribute) or node.attr != name:
        return False
    if uses.receiver is not None and _dotted(node.value) != uses.receiver:
        return False
    if uses.access == "write":
        return isinstance(node.ctx, ast.Store | ast.Del)
    return isinstance(node.ctx, ast.Load)


def _statement(node: ast.stmt) -> str:
    """The kind of statement an occurrence sits in, e.g. "if → break"."""
    if isinstance(node, ast.If):
        ends = node.body[-1]
        if isinstance(ends, ast.Break | ast.Continue | ast.Return):
            return f"if → {type(ends).__name__.lower()}"
        return "if"
    kind = type(node).__name__
    return {"Assign": "assignment", "AnnAssign": "assignment"}.get(kind, kind.lower())


def _occurrences(
    method: ast.FunctionDef | ast.AsyncFunctionDef, name: str, uses: Uses
) -> list[tuple[str, int]]:
    """(label, line) of each use of ``name`` in ``method``."""
    regions = REGIONS.get(f"{uses.owner}.{method.name}", ())
    calls = {id(call.func) for call in ast.walk(method) if isinstance(call, ast.Call)}
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, path: tuple[str, ...], statement: str) -> None:
        if isinstance(node, ast.For | ast.AsyncFor | ast.While):
            region = _region(node, regions)
            if region is not None:
                path = (*path, region)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            path = (*path, f"def {getattr(node, 'name', 'lambda')}")
        if isinstance(node, ast.stmt):
            statement = _statement(node)
        if _matches(node, name, uses) and (
            uses.access == "write" or (uses.access == "call") == (id(node) in calls)
        ):
            label = " > ".join((method.name, *path)).replace(" > ", ": ", 1)
            if uses.statement:
                label = f"{label} ({statement})"
            found.append((label, getattr(node, "lineno", 0)))
        for child in ast.iter_child_nodes(node):
            visit(child, path, statement)

    for child in ast.iter_child_nodes(method):
        visit(child, (), "")
    return found


def uses_of(source: VllmSource, name: str, uses: Uses) -> list[tuple[str, int]] | None:
    """Where ``owner``'s methods use ``name``: (label, line) sorted by label, or
    None when the owner class is gone."""
    found = find_class(source, uses.module, uses.owner)
    if found is None:
        return None
    occurrences: list[tuple[str, int]] = []
    for node in found[1].body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
            uses.method is None or node.name == uses.method
        ):
            occurrences.extend(_occurrences(node, name, uses))
    return sorted(occurrences)


# -- the check -------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """One internal's status in one vLLM source."""

    internal: str
    status: str
    detail: str
    by: str


def _found(source: VllmSource, internal: Internal) -> tuple[str, str] | str:
    """(the form found, where) or the reason it is missing."""
    found = find_class(source, internal.module, internal.owner)
    if found is None:
        if source.module(internal.module) is None:
            return f"module {internal.module} is gone"
        return f"class {internal.owner} is gone from {internal.module}"
    module, cls = found
    if internal.kind == "class":
        return ", ".join(ast.unparse(b) for b in cls.bases), module
    for _, owner in class_chain(source, module, cls):
        member = _body_members(owner).get(internal.name)
        inherited = owner is not cls
        if member is not None and inherited and internal.direct:
            return (
                f"only inherited from {owner.name}; the hook replaces it on "
                f"{internal.owner} itself"
            )
        if member is not None:
            if internal.kind == "method" and isinstance(
                member, ast.FunctionDef | ast.AsyncFunctionDef
            ):
                form = render_signature(member)
            else:
                form = _form(member)
            return form, module
        if internal.kind == "attribute" and _sets_on_self(owner, internal.name):
            return "instance attribute", module
    return f"{internal.label} is gone"


def _moved(uses: Uses, occurrences: list[tuple[str, int]]) -> str:
    """How the places differ from the expected ones ("" when they do not),
    with the lines where they are now."""
    was = Counter(uses.expected)
    now = Counter(label for label, _ in occurrences)
    changes = []
    for label in sorted(was.keys() | now.keys()):
        if was[label] != now[label]:
            lines = ", ".join(str(line) for at, line in occurrences if at == label)
            where = f" ({'lines' if ',' in lines else 'line'} {lines})" if lines else ""
            changes.append(f"{label}: {was[label]} in 0.32, {now[label]} here{where}")
    if not changes:
        return ""
    return f"{uses.access} sites in {uses.owner}: {'; '.join(changes)}"


def check(source: VllmSource, internal: Internal) -> Result:
    """Compares one internal in ``source`` with what 0.32.0 has."""
    found = _found(source, internal)
    if isinstance(found, str):
        return Result(internal.label, MISSING, found, internal.by)
    form, _ = found
    problems: list[tuple[str, str]] = []
    if form != internal.expected:
        problems.append(
            (
                SIGNATURE,
                f"was {internal.expected or '(no bases)'}; now {form or '(no bases)'}",
            )
        )
    if internal.uses is not None:
        occurrences = uses_of(source, internal.name, internal.uses)
        if occurrences is None:
            problems.append((MISSING, f"{internal.uses.owner} is gone"))
        else:
            moved = _moved(internal.uses, occurrences)
            if moved:
                problems.append((MOVED, moved))
    if not problems:
        return Result(internal.label, SAME, "", internal.by)
    return Result(
        internal.label,
        problems[0][0],
        "; ".join(detail for _, detail in problems),
        internal.by,
    )


def check_all(
    source: VllmSource, internals: Sequence[Internal] = INTERNALS
) -> list[Result]:
    return [check(source, internal) for internal in internals]


def drifted(results: Sequence[Result]) -> list[Result]:
    return [result for result in results if result.status != SAME]


def render_table(source: VllmSource, results: Sequence[Result]) -> str:
    """One source's report as a plain-text table."""
    rows = [("internal", "status", "detail")] + [
        (r.internal, r.status, r.detail) for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [
        f"vLLM {source.version} ({source.path}): "
        f"{len(drifted(results))} of {len(results)} internals drifted"
    ]
    for index, (internal, status, detail) in enumerate(rows):
        lines.append(
            f"{internal:<{widths[0]}} | {status:<{widths[1]}} | {detail}".rstrip()
        )
        if index == 0:
            lines.append(f"{'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * 6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.vllm_drift",
        description="Compare the vLLM internals pacing relies on with vLLM 0.32.0.",
    )
    parser.add_argument("sources", nargs="+", metavar="WHEEL_OR_DIR")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    try:
        sources = [VllmSource(path) for path in args.sources]
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reports = [(source, check_all(source)) for source in sources]
    if args.json:
        document = [
            {
                "source": str(source.path),
                "version": source.version,
                "drifted": len(drifted(results)),
                "results": [asdict(result) for result in results],
            }
            for source, results in reports
        ]
        print(json.dumps(document, indent=2))
    else:
        print("\n\n".join(render_table(source, results) for source, results in reports))
    return 1 if any(drifted(results) for _, results in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
