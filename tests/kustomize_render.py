"""A pure-Python stand-in for ``kustomize build``, for the tests only (nothing
that ships imports it): ``tests/project/test_kubernetes_manifests.py`` uses it where
neither kustomize nor kubectl is on PATH, and checks it against the real one
where one is.

It renders exactly the kustomize features that ``deploy/kubernetes``'s
kustomization.yaml files use, the way kustomize v5 (the one in kubectl 1.32)
does, applied in kustomize's order within each kustomization:

- ``resources``: YAML files (any number of documents) in or below the
  kustomization's directory, and directories holding a kustomization, built
  first, recursively;
- ``patches``, in order: an inline strategic-merge patch (``patch:`` holding one
  object, which must match exactly one resource by apiVersion, kind, name and
  no namespace) and an inline JSON 6902 patch (``patch:`` holding ``add`` and
  ``replace`` operations) with a ``target`` of group, version, kind and name;
- ``namespace``: metadata.namespace of every namespaced object; a Namespace
  object takes it as its name (kustomize's ``metadata/name`` field spec for
  kind Namespace); other cluster-scoped objects are left alone;
- ``labels`` with ``pairs`` (and ``includeSelectors``/``includeTemplates``
  false or absent): metadata.labels only, never selectors or pod templates;
- the output in kustomize's default ("legacy") order.

Anything else raises :class:`Unsupported` naming it, so a kustomization that
uses a feature this does not implement fails instead of rendering something
kustomize would not. Stricter than kustomize: a patch that matches nothing is
an error (:class:`RenderError`).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KUSTOMIZATION_API_VERSION = "kustomize.config.k8s.io/v1beta1"
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources"}
KUSTOMIZATION_FIELDS |= {"patches"}
LABELS_FIELDS = {"pairs", "includeSelectors", "includeTemplates"}
PATCH_FIELDS = {"patch", "target"}
TARGET_FIELDS = {"group", "version", "kind", "name"}
OPERATION_FIELDS = {"op", "path", "value"}
JSON6902_OPS = ("add", "replace")

#: Whether a kind is namespaced (True) or cluster-scoped (False), for
#: ``namespace``. A kind not here is refused: kustomize treats some kinds
#: specially (RoleBinding subjects, APIService, webhooks...), and this does not.
NAMESPACED = {
    **dict.fromkeys(
        (
            "ConfigMap",
            "DaemonSet",
            "Deployment",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Secret",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "StatefulSet",
        ),
        True,
    ),
    **dict.fromkeys(("Namespace", "PriorityClass", "StorageClass"), False),
}

#: Kinds whose pod template is at spec.template, for the merge keys below.
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
_POD_SPEC = ("spec", "template", "spec")
_CONTAINER_LISTS = ("containers", "initContainers")
#: The Kubernetes merge key of each list a strategic-merge patch of a workload
#: may hold (``*`` is any element of a list). A list elsewhere is refused.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    (*_POD_SPEC, "volumes"): "name",
    **{(*_POD_SPEC, field): "name" for field in _CONTAINER_LISTS},
    **{(*_POD_SPEC, field, "*", "env"): "name" for field in _CONTAINER_LISTS},
    **{
        (*_POD_SPEC, field, "*", "volumeMounts"): "mountPath"
        for field in _CONTAINER_LISTS
    },
}

#: kustomize's legacy output order: these kinds first, in this order, then
#: every other kind, then ORDER_LAST.
ORDER_FIRST = (
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
)
ORDER_LAST = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


class RenderError(ValueError):
    """The kustomization cannot be rendered (kustomize would fail too, or
    this is stricter)."""


class Unsupported(RenderError):
    """The kustomization uses a feature this renderer does not implement."""


@dataclass
class _Resource:
    """An object and every (namespace, name) it has had: kustomize matches a
    patch against earlier ids too (a base's object before its namespace)."""

    obj: Obj
    ids: list[tuple[str, str]]

    @property
    def kind(self) -> str:
        kind: str = self.obj["kind"]
        return kind

    @property
    def current_id(self) -> tuple[str, str]:
        metadata = self.obj["metadata"]
        return metadata.get("namespace", ""), metadata["name"]

    def record_id(self) -> None:
        """Remember the current id (after a transformation changed it)."""
        if self.current_id not in self.ids:
            self.ids.append(self.current_id)

    @classmethod
    def of(cls, obj: Obj) -> _Resource:
        """A resource as loaded from its file."""
        resource = cls(obj, [])
        resource.record_id()
        return resource


def build(path: Path) -> list[Obj]:
    """The objects ``kustomize build path`` renders, in its order."""
    resources = _build(Path(path).resolve(), ())
    objects = [resource.obj for resource in resources]
    return sorted(objects, key=functools.cmp_to_key(_legacy_compare))


# --- one kustomization ------------------------------------------------------------


def _kustomization_file(directory: Path) -> Path:
    found = [directory / name for name in KUSTOMIZATION_FILES]
    found = [file for file in found if file.is_file()]
    if len(found) != 1:
        raise RenderError(
            f"{directory}: {len(found)} kustomization files, need exactly one of "
            f"{', '.join(KUSTOMIZATION_FILES)}"
        )
    return found[0]


def _build(directory: Path, stack: tuple[Path, ...]) -> list[_Resource]:
    if directory in stack:
        raise RenderError(f"a cycle of kustomizations through {directory}")
    file = _kustomization_file(directory)
    spec = yaml.safe_load(file.read_text())
    if not isinstance(spec, dict):
        raise RenderError(f"{file}: not a mapping")
    unknown = sorted(set(spec) - KUSTOMIZATION_FIELDS)
    if unknown:
        raise Unsupported(f"{file}: kustomization field(s) {', '.join(unknown)}")
    if spec.get("apiVersion", KUSTOMIZATION_API_VERSION) != KUSTOMIZATION_API_VERSION:
        raise Unsupported(f"{file}: apiVersion {spec['apiVersion']!r}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{file}: kind {spec['kind']!r}")

    resources: list[_Resource] = []
    for entry in _list(spec, "resources", file):
        resources += _resource(directory, entry, (*stack, directory), file)
    _check_unique(resources, file)
    for patch in _list(spec, "patches", file):
        _apply_patch(resources, patch, file)
    if "namespace" in spec:
        _set_namespace(resources, spec["namespace"], file)
    for labels in _list(spec, "labels", file):
        _add_labels(resources, labels, file)
    _check_unique(resources, file)
    return resources


def _list(spec: Obj, field: str, file: Path) -> list[Any]:
    value = spec.get(field) or []
    if not isinstance(value, list):
        raise RenderError(f"{file}: {field} is not a list")
    return value


def _resource(
    directory: Path, entry: Any, stack: tuple[Path, ...], file: Path
) -> list[_Resource]:
    if not isinstance(entry, str):
        raise RenderError(f"{file}: resource {entry!r} is not a path")
    if "://" in entry:
        raise Unsupported(f"{file}: remote resource {entry}")
    path = (directory / entry).resolve()
    if path.is_dir():
        return _build(path, stack)
    if not path.is_file():
        raise RenderError(f"{file}: resource {entry} not found")
    if not path.is_relative_to(directory):
        raise RenderError(f"{file}: resource file {entry} is outside {directory}")
    return [_Resource.of(obj) for obj in _load_objects(path)]


def _load_objects(path: Path) -> list[Obj]:
    objects = []
    for doc in yaml.safe_load_all(path.read_text()):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise RenderError(f"{path}: a document that is not a mapping")
        kind = doc.get("kind")
        if not isinstance(kind, str) or not isinstance(doc.get("apiVersion"), str):
            raise RenderError(f"{path}: a document without apiVersion and kind")
        if kind.endswith("List"):
            raise Unsupported(f"{path}: a {kind} (lists of objects)")
        metadata = doc.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
            raise RenderError(f"{path}: a {kind} without metadata.name")
        if "generateName" in metadata:
            raise Unsupported(f"{path}: metadata.generateName")
        objects.append(doc)
    return objects


def _check_unique(resources: list[_Resource], file: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for resource in resources:
        key = (resource.obj["apiVersion"], resource.kind, *resource.current_id)
        if key in seen:
            raise RenderError(f"{file}: two resources with the id {key}")
        seen.add(key)


# --- namespace and labels ----------------------------------------------------------


def _set_namespace(resources: list[_Resource], namespace: Any, file: Path) -> None:
    if not isinstance(namespace, str) or not namespace:
        raise RenderError(f"{file}: namespace {namespace!r} is not a name")
    for resource in resources:
        namespaced = NAMESPACED.get(resource.kind)
        if namespaced is None:
            raise Unsupported(
                f"{file}: namespace on a {resource.kind} (scope and namespace "
                "fields unknown to this renderer)"
            )
        if namespaced:
            resource.obj["metadata"]["namespace"] = namespace
        elif resource.kind == "Namespace":
            resource.obj["metadata"]["name"] = namespace
        resource.record_id()


def _add_labels(resources: list[_Resource], labels: Any, file: Path) -> None:
    if not isinstance(labels, dict):
        raise RenderError(f"{file}: a labels entry that is not a mapping")
    unknown = sorted(set(labels) - LABELS_FIELDS)
    if unknown:
        raise Unsupported(f"{file}: labels field(s) {', '.join(unknown)}")
    for flag in ("includeSelectors", "includeTemplates"):
        if labels.get(flag, False) is not False:
            raise Unsupported(f"{file}: labels {flag}: {labels[flag]!r}")
    pairs = labels.get("pairs") or {}
    if not isinstance(pairs, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in pairs.items()
    ):
        raise RenderError(f"{file}: labels pairs must map strings to strings")
    for resource in resources:
        metadata = resource.obj["metadata"]
        if metadata.get("labels") is None:
            metadata["labels"] = {}
        metadata["labels"].update(pairs)


# --- patches ---------------------------------------------------------------------


def _apply_patch(resources: list[_Resource], entry: Any, file: Path) -> None:
    if not isinstance(entry, dict):
        raise RenderError(f"{file}: a patches entry that is not a mapping")
    unknown = sorted(set(entry) - PATCH_FIELDS)
    if unknown:
        raise Unsupported(f"{file}: patches field(s) {', '.join(unknown)}")
    if "patch" not in entry:
        raise RenderError(f"{file}: a patches entry without an inline patch")
    docs = [doc for doc in yaml.safe_load_all(entry["patch"]) if doc is not None]
    if len(docs) != 1:
        raise Unsupported(f"{file}: a patch of {len(docs)} documents")
    (patch,) = docs
    if "target" in entry:
        if not isinstance(patch, list):
            raise Unsupported(f"{file}: a strategic-merge patch with a target")
        for resource in _targets(resources, entry["target"], file):
            _json6902(resource.obj, patch, file)
    else:
        if not isinstance(patch, dict):
            raise Unsupported(f"{file}: a JSON 6902 patch without a target")
        _strategic_merge(_patched(resources, patch, file), patch, file)


def _group_version(api_version: str) -> tuple[str, str]:
    group, slash, version = api_version.partition("/")
    return (group, version) if slash else ("", api_version)


def _targets(resources: list[_Resource], target: Any, file: Path) -> list[_Resource]:
    if not isinstance(target, dict):
        raise RenderError(f"{file}: a patch target that is not a mapping")
    unknown = sorted(set(target) - TARGET_FIELDS)
    if unknown:
        raise Unsupported(f"{file}: patch target field(s) {', '.join(unknown)}")
    name = target.get("name")
    if name is not None and not re.fullmatch(r"[A-Za-z0-9.-]+", str(name)):
        # kustomize reads it as an anchored regular expression ("." included,
        # as here); anything beyond a plain name is not implemented.
        raise Unsupported(f"{file}: patch target name pattern {name!r}")

    def selected(resource: _Resource) -> bool:
        group, version = _group_version(resource.obj["apiVersion"])
        actual = {"group": group, "version": version, "kind": resource.kind}
        if any(target.get(field) not in (None, "", actual[field]) for field in actual):
            return False
        return name is None or any(re.fullmatch(name, n) for _, n in resource.ids)

    found = [resource for resource in resources if selected(resource)]
    if not found:
        raise RenderError(f"{file}: patch target {target} matches no resource")
    return found


def _patched(resources: list[_Resource], patch: Obj, file: Path) -> _Resource:
    """The one resource a strategic-merge patch applies to: kustomize matches
    its apiVersion, kind and name, and its (absent) namespace against every id
    the resource has had."""
    metadata = patch.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
        raise RenderError(f"{file}: a strategic-merge patch without metadata.name")
    if "namespace" in metadata:
        raise Unsupported(f"{file}: a strategic-merge patch with a namespace")

    def matches(resource: _Resource) -> bool:
        if (resource.obj["apiVersion"], resource.kind) != (
            patch.get("apiVersion"),
            patch.get("kind"),
        ):
            return False
        unset = ("",) if NAMESPACED.get(resource.kind) is False else ("", "default")
        return any(
            name == metadata["name"] and namespace in unset
            for namespace, name in resource.ids
        )

    found = [resource for resource in resources if matches(resource)]
    if len(found) != 1:
        raise RenderError(
            f"{file}: strategic-merge patch of {patch.get('kind')}/"
            f"{metadata['name']} matches {len(found)} resources, not one"
        )
    return found[0]


def _strategic_merge(resource: _Resource, patch: Obj, file: Path) -> None:
    keys = MERGE_KEYS if resource.kind in WORKLOAD_KINDS else {}
    _check_plain(patch, (), file)
    _merge_map(resource.obj, patch, (), keys, file)


def _where(path: Iterable[str]) -> str:
    return ".".join(path) or "the top"


def _check_plain(value: Any, path: tuple[str, ...], file: Path) -> None:
    """Refuse what a strategic-merge patch would read as an instruction:
    a ``$`` directive, a null (delete) or an empty map or list."""
    if value is None or value == {} or value == []:
        raise Unsupported(
            f"{file}: a null or empty value at {_where(path)} in a strategic-merge "
            "patch (deleting or clearing a field)"
        )
    if isinstance(value, dict):
        for field, item in value.items():
            if not isinstance(field, str) or field.startswith("$"):
                raise Unsupported(
                    f"{file}: strategic-merge directive {field!r} at {_where(path)}"
                )
            _check_plain(item, (*path, field), file)
    elif isinstance(value, list):
        for item in value:
            _check_plain(item, (*path, "*"), file)


def _merge_map(
    target: Obj,
    patch: Obj,
    path: tuple[str, ...],
    keys: dict[tuple[str, ...], str],
    file: Path,
) -> None:
    for field, value in patch.items():
        where = (*path, field)
        if field not in target:
            target[field] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(target[field], dict):
            _merge_map(target[field], value, where, keys, file)
        elif isinstance(value, list) and isinstance(target[field], list):
            key = keys.get(where)
            if key is None:
                raise Unsupported(
                    f"{file}: the list {_where(where)} in a strategic-merge patch "
                    "(no merge key known for it)"
                )
            target[field] = _merge_list(target[field], value, where, key, keys, file)
        elif isinstance(value, (dict, list)) or isinstance(target[field], (dict, list)):
            raise Unsupported(
                f"{file}: a strategic-merge patch changing the type of {_where(where)}"
            )
        else:
            target[field] = value


def _merge_list(
    target: list[Any],
    patch: list[Any],
    path: tuple[str, ...],
    key: str,
    keys: dict[tuple[str, ...], str],
    file: Path,
) -> list[Any]:
    """kustomize's merge of a list by its merge key: the patch's elements
    first, in its order (each merged into the element with its key, if any),
    then the target's other elements in theirs."""
    for element in [*target, *patch]:
        if not isinstance(element, dict) or key not in element:
            raise Unsupported(
                f"{file}: an element of {_where(path)} without its merge key {key}"
            )
    existing = {element[key]: element for element in target}
    merged = []
    for element in patch:
        if any(element[key] == done[key] for done in merged):
            raise RenderError(f"{file}: {_where(path)} {key}={element[key]} twice")
        item = copy.deepcopy(existing.get(element[key], {}))
        _merge_map(item, element, (*path, "*"), keys, file)
        merged.append(item)
    patched = {element[key] for element in patch}
    return merged + [element for element in target if element[key] not in patched]


def _json6902(obj: Obj, operations: list[Any], file: Path) -> None:
    for operation in operations:
        if not isinstance(operation, dict):
            raise RenderError(f"{file}: a JSON 6902 operation that is not a mapping")
        unknown = sorted(set(operation) - OPERATION_FIELDS)
        if unknown:
            raise Unsupported(f"{file}: JSON 6902 field(s) {', '.join(unknown)}")
        op = operation.get("op")
        if op not in JSON6902_OPS:
            raise Unsupported(f"{file}: JSON 6902 op {op!r}")
        if "value" not in operation:
            raise RenderError(f"{file}: JSON 6902 {op} without a value")
        pointer = operation.get("path")
        if not isinstance(pointer, str) or not pointer.startswith("/"):
            raise Unsupported(f"{file}: JSON 6902 path {pointer!r}")
        tokens = [
            token.replace("~1", "/").replace("~0", "~")
            for token in pointer[1:].split("/")
        ]
        parent: Any = obj
        for token in tokens[:-1]:
            parent = _step(parent, token, pointer, file)
        value = copy.deepcopy(operation["value"])
        last = tokens[-1]
        if isinstance(parent, dict):
            if op == "replace" and last not in parent:
                raise RenderError(f"{file}: JSON 6902 replace of missing {pointer}")
            parent[last] = value
        elif isinstance(parent, list):
            if op == "add" and last == "-":
                parent.append(value)
                continue
            index = _index(last, len(parent) + (op == "add"), pointer, file)
            if op == "add":
                parent.insert(index, value)
            else:
                parent[index] = value
        else:
            raise RenderError(f"{file}: JSON 6902 path {pointer} is inside a scalar")


def _index(token: str, size: int, pointer: str, file: Path) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]*", token) or int(token) >= size:
        raise RenderError(f"{file}: JSON 6902 path {pointer}: no index {token}")
    return int(token)


def _step(parent: Any, token: str, pointer: str, file: Path) -> Any:
    if isinstance(parent, dict):
        if token not in parent:
            raise RenderError(f"{file}: JSON 6902 path {pointer}: no {token}")
        return parent[token]
    if isinstance(parent, list):
        return parent[_index(token, len(parent), pointer, file)]
    raise RenderError(f"{file}: JSON 6902 path {pointer} is inside a scalar")


# --- output order ----------------------------------------------------------------


def _rank(kind: str) -> int:
    if kind in ORDER_FIRST:
        return ORDER_FIRST.index(kind) - len(ORDER_FIRST)
    if kind in ORDER_LAST:
        return 1 + ORDER_LAST.index(kind)
    return 0


def _gvk_string(obj: Obj) -> str:
    group, version = _group_version(obj["apiVersion"])
    return "_".join((group or "~G", version or "~V", obj["kind"] or "~K"))


def _legacy_compare(first: Obj, second: Obj) -> int:
    """kustomize's legacy order (its SortOrderTransformer): by kind rank, then
    group_version_kind, then namespace|name."""
    if (first["apiVersion"], first["kind"]) != (second["apiVersion"], second["kind"]):
        ranks = _rank(first["kind"]), _rank(second["kind"])
        if ranks[0] != ranks[1]:
            return -1 if ranks[0] < ranks[1] else 1
        strings = _gvk_string(first), _gvk_string(second)
        both_namespaces = first["kind"] == second["kind"] == "Namespace"
        core = "/" not in first["apiVersion"] or "/" not in second["apiVersion"]
        if both_namespaces and core:
            strings = strings[1], strings[0]  # kustomize's own exception
        return -1 if strings[0] < strings[1] else 1

    def id_string(obj: Obj) -> str:
        metadata = obj["metadata"]
        return f"{metadata.get('namespace') or '~X'}|{metadata['name'] or '~N'}"

    ids = id_string(first), id_string(second)
    return (ids[0] > ids[1]) - (ids[0] < ids[1])
