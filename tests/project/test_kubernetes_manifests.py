"""``deploy/kubernetes/``: every kustomization (the base and each overlay) is
rendered by the real kustomize (``kustomize build``, or ``kubectl kustomize``,
which embeds it) where one is on PATH, else by ``tests/kustomize_render.py``, a
pure-Python renderer of exactly the kustomize features these files use (it
refuses any other; where kustomize is present its output must equal
kustomize's, objects and order), and every object rendered is checked:

- built-in kinds against the Kubernetes API's own JSON schemas
  (``kubernetes-validate``, offline, strict: an unknown field is an error) for
  ``KUBERNETES_VERSION``; the Prometheus operator's ServiceMonitor and
  PrometheusRule against their CRD schemas (``tests/data/prometheus-operator/``,
  written from the operator's CRDs; see their ``$comment``), with ``jsonschema``;
- the PrometheusRule holds exactly ``dashboards/``'s recording and alert rule
  groups, the Grafana ConfigMap exactly the dashboard's JSON text, and both
  files are what ``tools.kubernetes_manifests`` makes now;
- selectors: each Service, ServiceMonitor, NetworkPolicy and StatefulSet
  selects the pods it is meant to, by labels and by port name;
- the engine's command line: parsed by vLLM's own serve parser with this
  plugin's flags, read into the settings the engine would use, and put through
  the control plane's start-up checks (the address rule: loopback, or TLS with a
  token or mTLS), with every file it names laid out as the pod's volumes would
  hold them after the init container ran (the init script itself is run);
- the Redis configuration: a real ``redis-server`` started on it keeps the
  persistence docs/operating/scale-out.md, "How it works" asks for
  (``appendonly yes``, ``appendfsync everysec``), never evicts, and requires
  the password;
- every shell script in the manifests parses (``sh -n``).

Negative tests check that a broken object of each kind is rejected.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from control import preflight
from control.server import (
    BindRefused,
    TlsConfig,
    check_authenticated,
    check_token_over_tls,
)
from pacing.settings.checks import SettingsError
from pacing.settings.model import OutputRateSettings
from pacing.store_url import parse_url
from tests import kustomize_render, serve_parser_harness
from tools import kubernetes_manifests

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAYS = sorted(path for path in (KUBERNETES / "overlays").iterdir() if path.is_dir())
KUSTOMIZATIONS = [BASE, *OVERLAYS]
STORE_OVERLAYS = ("redis", "redis-sentinel")
DOCS = ROOT / "docs" / "operating"
OUR_DOCS = ("kubernetes.md", "production-stack.md", "inference-gateway.md")

#: The Kubernetes release whose API schemas the objects must satisfy (one that
#: kubernetes-validate ships; kubectl 1.32's embedded kustomize renders them).
KUBERNETES_VERSION = "1.32.0"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", kind): json.loads(
        (
            ROOT / "tests" / "data" / "prometheus-operator" / f"{name}.schema.json"
        ).read_text()
    )
    for kind, name in (
        ("ServiceMonitor", "servicemonitor"),
        ("PrometheusRule", "prometheusrule"),
    )
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
ENGINE = "vllm"

# vLLM's serve parser with the plugin's flags (tests/serve_parser_harness.py).
serve_parser = serve_parser_harness.serve_parser


# --- rendering ------------------------------------------------------------------


def kustomize_command() -> list[str] | None:
    """``kustomize build``, else ``kubectl kustomize``; None where neither is
    on PATH."""
    if (kustomize := shutil.which("kustomize")) is not None:
        return [kustomize, "build"]
    if (kubectl := shutil.which("kubectl")) is not None:
        return [kubectl, "kustomize"]
    return None


def kustomize_build(command: list[str], path: Path) -> list[dict[str, Any]]:
    """The objects the real kustomize renders for ``path``, in its order."""
    done = subprocess.run(
        [*command, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"kustomize failed on {path}:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def _render(path: Path) -> tuple[dict[str, Any], ...]:
    """The real kustomize's objects where it is on PATH, else the pure
    renderer's (checked against it below where both exist)."""
    command = kustomize_command()
    if command is None:
        return tuple(kustomize_render.build(path))
    return tuple(kustomize_build(command, path))


def render(path: Path) -> list[dict[str, Any]]:
    """The objects kustomize renders for ``path`` (a fresh copy each call)."""
    return copy.deepcopy(list(_render(path)))


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [
        obj
        for obj in objects
        if obj["kind"] == kind and obj["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"{len(found)} {kind}/{name}"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] in WORKLOAD_KINDS]


def ident(path: Path) -> str:
    return path.name if path != BASE else "base"


# --- the pure renderer (tests/kustomize_render.py) ---------------------------------


def test_the_pure_renderer_matches_kustomize():
    """Where kustomize (or kubectl) is on PATH, the pure renderer's objects for
    every kustomization equal kustomize's, in kustomize's own (legacy) order:
    the lists of parsed objects are compared as they are."""
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is on PATH: nothing to compare to")
    for path in KUSTOMIZATIONS:
        real = kustomize_build(command, path)
        pure = kustomize_render.build(path)
        assert [identity(obj) for obj in pure] == [identity(obj) for obj in real], (
            ident(path)
        )
        for pure_obj, real_obj in zip(pure, real, strict=True):
            assert pure_obj == real_obj, (ident(path), identity(real_obj))


def identity(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    metadata = obj["metadata"]
    return (
        obj["apiVersion"],
        obj["kind"],
        metadata.get("namespace", ""),
        metadata["name"],
    )


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


#: A base and an overlay with every feature the renderer implements: a nested
#: kustomization, namespace (the Namespace object renamed) and labels at both
#: levels, a strategic-merge patch merging containers and env by name and
#: volumeMounts by mountPath, and JSON 6902 add (at an index, appended, to a
#: map) and replace (through an escaped key).
FEATURES = {
    "base/kustomization.yaml": """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: inner
labels:
  - pairs: {tier: base}
    includeSelectors: false
resources: [objects.yaml]
""",
    "base/objects.yaml": """\
apiVersion: v1
kind: Namespace
metadata: {name: placeholder}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  annotations: {example.com/note: old}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
        - name: app
          image: app:1
          args: [--one, --three]
          env:
            - {name: A, value: a}
            - {name: B, value: b}
          volumeMounts:
            - {name: data, mountPath: /data}
            - {name: cache, mountPath: /cache}
        - name: sidecar
          image: sidecar:1
---
apiVersion: v1
kind: ConfigMap
metadata: {name: web}
data: {key: value}
""",
    "overlay/kustomization.yaml": """\
namespace: outer
labels:
  - pairs: {tier: overlay, team: t}
resources: [../base, service.yaml]
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata: {name: web}
      spec:
        template:
          spec:
            containers:
              - name: app
                env:
                  - {name: C, value: c}
                  - {name: B, value: changed}
                volumeMounts:
                  - {name: other, mountPath: /data}
  - target: {group: apps, version: v1, kind: Deployment, name: web}
    patch: |-
      - {op: add, path: /spec/template/spec/containers/0/args/1, value: --two}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --four}
      - {op: replace, path: /metadata/annotations/example.com~1note, value: new}
      - {op: add, path: /spec/replicas, value: 3}
""",
    "overlay/service.yaml": """\
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80}]
""",
}
FEATURES_RENDERED = [
    {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "outer", "labels": {"tier": "overlay", "team": "t"}},
    },
    {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "web",
            "namespace": "outer",
            "labels": {"tier": "overlay", "team": "t"},
        },
        "data": {"key": "value"},
    },
    {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "web",
            "namespace": "outer",
            "labels": {"tier": "overlay", "team": "t"},
        },
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    },
    {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "web",
            "namespace": "outer",
            "annotations": {"example.com/note": "new"},
            "labels": {"tier": "overlay", "team": "t"},
        },
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "containers": [
                        {
                            "name": "app",
                            "image": "app:1",
                            "args": ["--one", "--two", "--three", "--four"],
                            # kustomize puts the patch's elements first.
                            "env": [
                                {"name": "C", "value": "c"},
                                {"name": "B", "value": "changed"},
                                {"name": "A", "value": "a"},
                            ],
                            "volumeMounts": [
                                {"name": "other", "mountPath": "/data"},
                                {"name": "cache", "mountPath": "/cache"},
                            ],
                        },
                        {"name": "sidecar", "image": "sidecar:1"},
                    ]
                },
            },
        },
    },
]


def test_the_pure_renderer_on_every_feature_it_implements(tmp_path):
    """Against a hand-written rendering, and against kustomize where it is on
    PATH (which wrote the same)."""
    write_tree(tmp_path, FEATURES)
    assert kustomize_render.build(tmp_path / "overlay") == FEATURES_RENDERED
    command = kustomize_command()
    if command is not None:
        assert kustomize_build(command, tmp_path / "overlay") == FEATURES_RENDERED


@pytest.mark.parametrize(
    ("kustomization", "extra", "error"),
    [
        (
            "configMapGenerator: [{name: x, literals: [a=b]}]",
            "",
            r"kustomization field\(s\) configMapGenerator",
        ),
        ("commonLabels: {a: b}", "", r"field\(s\) commonLabels"),
        (
            "labels: [{pairs: {a: b}, includeSelectors: true}]",
            "",
            "labels includeSelectors: True",
        ),
        ("labels: [{pairs: {a: b}, fields: []}]", "", r"labels field\(s\) fields"),
        ("patches: [{path: patch.yaml}]", "", r"patches field\(s\) path"),
        (
            "patches: [{target: {kind: Deployment, name: web}, "
            "patch: '[{op: remove, path: /spec/replicas}]'}]",
            "",
            "JSON 6902 op 'remove'",
        ),
        (
            "patches: [{target: {kind: Deployment, labelSelector: a=b}, "
            "patch: '[{op: add, path: /spec/replicas, value: 2}]'}]",
            "",
            r"patch target field\(s\) labelSelector",
        ),
        (
            "patches: [{patch: '{apiVersion: apps/v1, kind: Deployment, "
            "metadata: {name: web}, spec: {template: {spec: {containers: "
            "[{name: app, args: [--x]}]}}}}'}]",
            "",
            r"spec\.template\.spec\.containers\.\*\.args .*no merge key",
        ),
        (
            "patches: [{patch: '{apiVersion: apps/v1, kind: Deployment, "
            "metadata: {name: web}, spec: {$patch: replace}}'}]",
            "",
            r"directive '\$patch'",
        ),
        (
            "patches: [{patch: '{apiVersion: apps/v1, kind: Deployment, "
            "metadata: {name: web}, spec: {replicas: null}}'}]",
            "",
            "null or empty value at spec.replicas",
        ),
        (
            "namespace: x",
            "---\napiVersion: rbac.authorization.k8s.io/v1\n"
            "kind: RoleBinding\nmetadata: {name: r}\n",
            "namespace on a RoleBinding",
        ),
        ("resources: [https://example.com/x.yaml]", "", "remote resource"),
    ],
    ids=[
        "configMapGenerator",
        "commonLabels",
        "includeSelectors-true",
        "label-fields",
        "patch-file",
        "json6902-remove",
        "target-labelSelector",
        "list-without-merge-key",
        "patch-directive",
        "patch-null",
        "rolebinding-namespace",
        "remote-resource",
    ],
)
def test_the_pure_renderer_refuses_what_it_does_not_implement(
    tmp_path, kustomization, extra, error
):
    resources = "" if kustomization.startswith("resources") else "resources: [a.yaml]\n"
    write_tree(
        tmp_path,
        {
            "kustomization.yaml": f"{resources}{kustomization}\n",
            "a.yaml": FEATURES["base/objects.yaml"] + extra,
        },
    )
    with pytest.raises(kustomize_render.Unsupported, match=error):
        kustomize_render.build(tmp_path)


@pytest.mark.parametrize(
    ("patch", "error"),
    [
        (
            "{target: {kind: Deployment, name: api}, "
            "patch: '[{op: add, path: /spec/replicas, value: 2}]'}",
            "matches no resource",
        ),
        (
            "{patch: '{apiVersion: apps/v1, kind: Deployment, metadata: {name: api}}'}",
            "matches 0 resources",
        ),
        (
            "{target: {kind: Deployment, name: web}, "
            "patch: '[{op: replace, path: /spec/paused, value: true}]'}",
            "replace of missing /spec/paused",
        ),
    ],
    ids=["target-matches-nothing", "merge-patch-matches-nothing", "replace-missing"],
)
def test_the_pure_renderer_fails_on_a_patch_that_does_not_apply(tmp_path, patch, error):
    write_tree(
        tmp_path,
        {
            "kustomization.yaml": f"resources: [a.yaml]\npatches: [{patch}]\n",
            "a.yaml": FEATURES["base/objects.yaml"],
        },
    )
    with pytest.raises(kustomize_render.RenderError, match=error):
        kustomize_render.build(tmp_path)


# --- schema validation -------------------------------------------------------------


def validate(obj: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError (kubernetes-validate's is one) when
    ``obj`` breaks its kind's schema."""
    crd_schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd_schema is not None:
        jsonschema.Draft202012Validator(crd_schema).validate(obj)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_every_rendered_object_satisfies_its_schema(path):
    objects = render(path)
    assert objects
    for obj in objects:
        try:
            validate(obj)
        except jsonschema.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} in {ident(path)}: "
                f"{exc.message} at {list(exc.absolute_path)}"
            )


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_everything_is_in_the_namespace_and_part_of_the_app(path):
    for obj in render(path):
        metadata = obj["metadata"]
        if obj["kind"] == "Namespace":
            assert metadata["name"] == "vllm-output-rate"
        else:
            assert metadata.get("namespace") == "vllm-output-rate", metadata["name"]
        assert metadata["labels"]["app.kubernetes.io/part-of"] == "vllm-output-rate"


def _broken(kind: str, name: str, path: list[Any], value: Any) -> dict[str, Any]:
    obj = named(render(BASE), kind, name)
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    ("kind", "name", "path", "value"),
    [
        # A misspelt field (strict validation: unknown fields are errors).
        (
            "StatefulSet",
            ENGINE,
            ["spec", "template", "spec", "containers", 0, "imagePullPolicyy"],
            "Always",
        ),
        # A wrong type.
        ("StatefulSet", ENGINE, ["spec", "replicas"], "two"),
        ("Service", ENGINE, ["spec", "ports", 0, "port"], "eight thousand"),
        ("NetworkPolicy", ENGINE, ["spec", "ingres"], []),
        ("ConfigMap", "output-rate-limits", ["data", "limits.yaml"], {"a": 1}),
        # The operator's kinds.
        ("ServiceMonitor", ENGINE, ["spec", "endpoints", 0, "portName"], "http"),
        ("ServiceMonitor", ENGINE, ["spec", "endpoints", 0, "interval"], "15 s"),
        ("ServiceMonitor", ENGINE, ["spec", "endpoints", 0, "scheme"], "grpc"),
        (
            "PrometheusRule",
            "vllm-output-rate",
            ["spec", "groups", 1, "rules", 0, "for"],
            "15 minutes",
        ),
        (
            "PrometheusRule",
            "vllm-output-rate",
            ["spec", "groups", 1, "rules", 0, "record"],
            "both_record_and_alert",
        ),
        ("PrometheusRule", "vllm-output-rate", ["spec", "group"], []),
    ],
    ids=[
        "misspelt-container-field",
        "replicas-not-a-number",
        "port-not-a-number",
        "misspelt-policy-field",
        "configmap-value-not-a-string",
        "misspelt-endpoint-field",
        "interval-not-a-duration",
        "scheme-not-http",
        "for-not-a-duration",
        "record-and-alert",
        "misspelt-rule-field",
    ],
)
def test_a_broken_object_is_rejected(kind, name, path, value):
    with pytest.raises(jsonschema.ValidationError):
        validate(_broken(kind, name, path, value))


def test_a_missing_required_field_is_rejected():
    monitor = named(render(BASE), "ServiceMonitor", ENGINE)
    del monitor["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    service = named(render(BASE), "Service", ENGINE)
    del service["spec"]["ports"][0]["port"]
    with pytest.raises(jsonschema.ValidationError):
        validate(service)


def test_an_unknown_kind_is_not_silently_accepted():
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "v1", "kind": "Servise", "metadata": {"name": "x"}})


# --- what comes from dashboards/ -------------------------------------------------


def test_the_prometheus_rule_is_exactly_the_dashboards_rules():
    rule = named(render(BASE), "PrometheusRule", "vllm-output-rate")
    recording = yaml.safe_load(kubernetes_manifests.RECORDING_RULES.read_text())
    alerts = yaml.safe_load(kubernetes_manifests.ALERT_RULES.read_text())
    assert rule["spec"]["groups"] == recording["groups"] + alerts["groups"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_grafana_configmap_is_exactly_the_dashboard():
    configmap = named(render(BASE), "ConfigMap", "vllm-output-rate-dashboard")
    text = kubernetes_manifests.DASHBOARD.read_text()
    assert configmap["data"] == {"output_rate_dashboard.json": text}
    assert json.loads(configmap["data"]["output_rate_dashboard.json"]) == json.loads(
        text
    )
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_generated_files_are_current():
    stale = kubernetes_manifests.stale()
    assert not stale, (
        f"{[str(path.relative_to(ROOT)) for path in stale]} differ from dashboards/: "
        "run python -m tools.kubernetes_manifests"
    )
    assert kubernetes_manifests.main(["--check"]) == 0


def test_the_check_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "prometheus-rule.yaml"
    stale.write_text("# an old rule file\n")
    monkeypatch.setattr(kubernetes_manifests, "PROMETHEUS_RULE_FILE", stale)
    assert kubernetes_manifests.stale() == [stale]
    monkeypatch.setattr(kubernetes_manifests, "ROOT", tmp_path)
    assert kubernetes_manifests.main(["--check"]) == 1
    assert "prometheus-rule.yaml is stale" in capsys.readouterr().err


# --- selectors -----------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions, or a
    Service's plain map) matches ``labels``."""
    match_labels = selector.get("matchLabels", {})
    expressions = selector.get("matchExpressions", [])
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        match_labels = selector
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    for expression in expressions:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def pod_templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [workload["spec"]["template"] for workload in workloads(objects)]


def selected_pods(
    objects: list[dict[str, Any]], selector: dict[str, Any]
) -> list[dict[str, Any]]:
    return [
        template
        for template in pod_templates(objects)
        if selects(selector, template["metadata"]["labels"])
    ]


def container_port_names(template: dict[str, Any]) -> set[str]:
    return {
        port["name"]
        for container in template["spec"]["containers"]
        for port in container.get("ports", [])
        if "name" in port
    }


def workload_name(objects: list[dict[str, Any]], template: dict[str, Any]) -> str:
    return next(
        w["metadata"]["name"]
        for w in workloads(objects)
        if w["spec"]["template"] is template
    )


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_each_workload_selects_its_own_pods_only(path):
    objects = render(path)
    for workload in workloads(objects):
        selector = workload["spec"]["selector"]
        assert selects(selector, workload["spec"]["template"]["metadata"]["labels"])
        others = [
            w["metadata"]["name"]
            for w in workloads(objects)
            if w is not workload
            and selects(selector, w["spec"]["template"]["metadata"]["labels"])
        ]
        assert not others, f"{workload['metadata']['name']} also selects {others}"
        if workload["kind"] == "StatefulSet":
            governing = named(objects, "Service", workload["spec"]["serviceName"])
            assert governing["spec"].get("clusterIP") == "None"


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_each_service_selects_pods_with_its_target_ports(path):
    objects = render(path)
    for service in of_kind(objects, "Service"):
        pods = selected_pods(objects, service["spec"]["selector"])
        name = service["metadata"]["name"]
        assert len({workload_name(objects, pod) for pod in pods}) == 1, name
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                assert target in container_port_names(pods[0]), (name, target)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_the_service_monitor_scrapes_the_engines_api_service_once(path):
    objects = render(path)
    monitor = named(objects, "ServiceMonitor", ENGINE)
    services = [
        service
        for service in of_kind(objects, "Service")
        if selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    ]
    assert [service["metadata"]["name"] for service in services] == [ENGINE]
    port_names = {port["name"] for port in services[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    engines = selected_pods(objects, services[0]["spec"]["selector"])
    assert [workload_name(objects, pod) for pod in engines] == [ENGINE]


def test_the_service_monitor_restores_vllm_metric_names():
    """dashboards/README.md's relabel rule for Prometheus 2.x."""
    monitor = named(render(BASE), "ServiceMonitor", ENGINE)
    (relabel,) = monitor["spec"]["endpoints"][0]["metricRelabelings"]
    assert relabel == {
        "sourceLabels": ["__name__"],
        "regex": "vllm_(.+)",
        "targetLabel": "__name__",
        "replacement": "vllm:$1",
        "action": "replace",
    }


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_each_network_policy_selects_pods_and_their_ports(path):
    objects = render(path)
    for policy in of_kind(objects, "NetworkPolicy"):
        name = policy["metadata"]["name"]
        pods = selected_pods(objects, policy["spec"]["podSelector"])
        assert pods, f"NetworkPolicy {name} selects no pod"
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                if isinstance(port["port"], str):
                    assert all(
                        port["port"] in container_port_names(pod) for pod in pods
                    ), (name, port["port"])
            for peer in rule["from"]:
                # A peer in this namespace (no namespaceSelector) must be pods
                # this kustomization makes.
                if "namespaceSelector" not in peer:
                    assert selected_pods(objects, peer["podSelector"]), (name, peer)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_every_engine_port_is_behind_a_network_policy(path):
    objects = render(path)
    engine = named(objects, "StatefulSet", ENGINE)["spec"]["template"]
    allowed = {
        port["port"]
        for policy in of_kind(objects, "NetworkPolicy")
        if selects(policy["spec"]["podSelector"], engine["metadata"]["labels"])
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }
    assert container_port_names(engine) == allowed


# --- the engine's command line ------------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(NAME)`` expansion in command and args: a defined
    variable is replaced, ``$$`` is a ``$``, anything else stays."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        text,
    )


def engine_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    template = named(objects, "StatefulSet", ENGINE)["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == ENGINE]
    return container


def engine_argv(objects: list[dict[str, Any]]) -> list[str]:
    container = engine_container(objects)
    env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    assert container["command"] == ["python3", "-m", "engine_ext.serve"]
    return [expand(arg, env) for arg in container["args"]]


def flag_values(argv: list[str]) -> dict[str, str]:
    values = {}
    for arg in argv:
        flag, equals, value = arg.partition("=")
        if flag.startswith("--"):
            values[flag] = value if equals else ""
    return values


class PodFiles:
    """The files the engine's container sees, under ``root``: each volume
    mounted at ``root`` + its mountPath, holding what Kubernetes puts there
    (a ConfigMap's keys, a Secret's items with stand-in content, an empty
    directory for the rest), after the init containers' scripts ran on it."""

    def __init__(self, objects: list[dict[str, Any]], root: Path) -> None:
        template = named(objects, "StatefulSet", ENGINE)["spec"]["template"]
        spec = template["spec"]
        self.root = root
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        claims = {
            claim["metadata"]["name"]
            for claim in named(objects, "StatefulSet", ENGINE)["spec"].get(
                "volumeClaimTemplates", []
            )
        }
        self.mounts: dict[str, dict[str, Any]] = {}
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            for mount in container.get("volumeMounts", []):
                if mount["mountPath"] == "/dev/shm":
                    continue
                name = mount["name"]
                assert name in volumes or name in claims, f"no volume {name}"
                if container["name"] == ENGINE:
                    self.mounts[mount["mountPath"]] = mount
                directory = self.path(mount["mountPath"])
                if directory.exists():
                    continue
                directory.mkdir(parents=True)
                self._fill(directory, volumes.get(name), objects)
        for init in spec.get("initContainers", []):
            self._run(init)

    def path(self, path: str) -> Path:
        assert path.startswith("/"), path
        return self.root / path.lstrip("/")

    def rewrite(self, text: str) -> str:
        """``text`` with every mount path moved under ``root``."""
        for mount_path in sorted(self.mounts, key=len, reverse=True):
            text = text.replace(mount_path, str(self.path(mount_path)))
        return text

    def mount_of(self, path: str) -> dict[str, Any]:
        """The engine container's mount that holds ``path``."""
        holding = [
            mount
            for mount_path, mount in self.mounts.items()
            if path.startswith(mount_path.rstrip("/") + "/")
        ]
        assert holding, f"{path} is on no volume of the engine container"
        return max(holding, key=lambda mount: len(mount["mountPath"]))

    @staticmethod
    def _fill(
        directory: Path, volume: dict[str, Any] | None, objects: list[dict[str, Any]]
    ) -> None:
        if volume is None or "emptyDir" in volume:
            return
        if "configMap" in volume:
            data = named(objects, "ConfigMap", volume["configMap"]["name"])["data"]
            for key, value in data.items():
                (directory / key).write_text(value)
        elif "secret" in volume:
            for item in volume["secret"]["items"]:
                (directory / item["path"]).write_text(f"stand-in {item['key']}\n")
        else:
            raise AssertionError(f"unexpected volume {volume}")

    def _run(self, init: dict[str, Any]) -> None:
        command = init["command"]
        assert command[:2] == ["sh", "-c"], command
        init_mounts = {mount["mountPath"] for mount in init["volumeMounts"]}
        script = command[2]
        for mount_path in sorted(init_mounts, key=len, reverse=True):
            script = script.replace(mount_path, str(self.path(mount_path)))
        subprocess.run(["sh", "-c", script], check=True, timeout=30)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_the_engine_starts_on_its_flags_and_files(
    path, serve_parser, tmp_path, monkeypatch
):
    """Everything the API-server process checks before the model loads: vLLM's
    parser takes the flags, the settings read them (the store's password file
    included), and the control plane's start-up checks pass on the files the
    pod holds (the limits file the init container put there, the TLS and token
    files of the Secrets). Only binding the port is left out."""
    objects = render(path)
    argv = engine_argv(objects)
    files = PodFiles(objects, tmp_path)
    args = serve_parser.parse_args([files.rewrite(arg) for arg in argv])
    settings = OutputRateSettings.from_cli_args(args)
    assert settings.policy.default_rate == 100
    assert settings.require_user
    assert settings.user_source.kind == "header"
    monkeypatch.setattr(preflight, "check_port_free", lambda address: None)
    preflight.check(settings.control, settings.policy.default_rate)
    limits = Path(settings.control.config_path)
    assert limits.is_file()
    assert limits.stat().st_mode & 0o777 == 0o600
    # The limits file is rewritten in its directory: a writable volume that
    # survives restarts (the StatefulSet's claim), never a ConfigMap.
    flags = flag_values(argv)
    mount = files.mount_of(flags["--user-output-rate-config"])
    assert not mount.get("readOnly", False)
    claims = named(objects, "StatefulSet", ENGINE)["spec"]["volumeClaimTemplates"]
    assert mount["name"] in {claim["metadata"]["name"] for claim in claims}


def test_a_missing_file_fails_the_start_up_checks(serve_parser, tmp_path):
    """The check above is real: a flag naming a file the pod does not hold
    fails it."""
    objects = render(KUBERNETES / "overlays" / "redis")
    files = PodFiles(objects, tmp_path)
    (files.path("/var/run/secrets/output-rate-store") / "password").unlink()
    args = serve_parser.parse_args([files.rewrite(arg) for arg in engine_argv(objects)])
    with pytest.raises(SettingsError, match="--output-rate-store-password-file"):
        OutputRateSettings.from_cli_args(args)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_the_control_plane_is_loopback_or_tls_with_authentication(path):
    """docs/security.md, "Where each port may be reached": beyond loopback
    only with TLS and a token, or mTLS; the checks are the control plane's own
    (control.server)."""
    flags = flag_values(engine_argv(render(path)))
    address = flags["--output-rate-control-address"]
    token = "token" if "--output-rate-control-token-file" in flags else None
    tls = None
    if "--output-rate-control-tls-cert" in flags:
        client_ca = b"ca" if "--output-rate-control-tls-client-ca" in flags else None
        tls = TlsConfig(cert_chain=b"cert", private_key=b"key", client_ca=client_ca)
    check_authenticated(address, auth_token=token, tls=tls)
    check_token_over_tls(address, auth_token=token, tls=tls)
    if path == BASE:
        assert address == "127.0.0.1:50151"
    else:
        assert path.name != "control-mtls" or (token and tls and tls.client_ca)


def test_the_control_plane_rule_would_catch_an_exposed_address():
    """The same checks refuse the control-mtls overlay's address without its
    TLS and token flags."""
    flags = flag_values(engine_argv(render(KUBERNETES / "overlays" / "control-mtls")))
    address = flags["--output-rate-control-address"]
    assert address == "0.0.0.0:50151"
    with pytest.raises(BindRefused):
        check_authenticated(address, auth_token=None, tls=None)
    with pytest.raises(BindRefused):
        check_token_over_tls(address, auth_token="token", tls=None)


@pytest.mark.parametrize("name", STORE_OVERLAYS)
def test_store_overlays_point_every_engine_at_their_redis(name):
    objects = render(KUBERNETES / "overlays" / name)
    statefulset = named(objects, "StatefulSet", ENGINE)
    flags = flag_values(engine_argv(objects))
    address = parse_url(flags["--output-rate-store"])
    assert "@" not in flags["--output-rate-store"]  # no password in the URL
    assert "--output-rate-store-password-file" in flags
    replicas = statefulset["spec"]["replicas"]
    assert replicas >= 2
    assert int(flags["--output-rate-store-expected-engines"]) == replicas
    # Every host the URL names is a pod or Service this overlay makes.
    services = {service["metadata"]["name"] for service in of_kind(objects, "Service")}
    redis_sets = {
        workload["metadata"]["name"]: workload
        for workload in workloads(objects)
        if workload["metadata"]["name"] != ENGINE
    }
    for host, port in address.nodes:
        if "." in host:  # a pod's stable name: <statefulset>-<n>.<service>
            pod, service = host.split(".", 1)
            workload, _, ordinal = pod.rpartition("-")
            assert redis_sets[workload]["spec"]["serviceName"] == service
            assert int(ordinal) < redis_sets[workload]["spec"]["replicas"]
        else:
            assert host in services
        assert port in {
            port["port"]
            for service in of_kind(objects, "Service")
            for port in service["spec"]["ports"]
        }


# --- Redis ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _redis(port: int, *command: str, password: str | None = None) -> str:
    env = {**os.environ}
    env.pop("REDISCLI_AUTH", None)
    if password is not None:
        env["REDISCLI_AUTH"] = password
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), "--raw", *command],
        capture_output=True,
        text=True,
        timeout=10,
        env=env,
        check=False,
    )
    return (done.stdout + done.stderr).strip()


def _require_redis() -> str:
    binary = shutil.which("redis-server")
    if binary is None or shutil.which("redis-cli") is None:
        message = (
            "redis-server/redis-cli not on PATH: "
            "bash scripts/setup.sh --with-test-services"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.mark.parametrize("overlay", STORE_OVERLAYS)
def test_redis_keeps_the_persistence_the_readme_asks_for(overlay, tmp_path):
    """The overlay's redis.conf on a real redis-server (its paths moved to a
    temporary directory, loopback only): AOF fsynced every second, no
    eviction, and no command without the password."""
    binary = _require_redis()
    (config,) = [
        configmap["data"]["redis.conf"]
        for configmap in of_kind(render(KUBERNETES / "overlays" / overlay), "ConfigMap")
        if "redis.conf" in configmap["data"]
    ]
    # Written out, not left to Redis's defaults (which may change), and
    # checked below to be in force.
    assert re.search(r"^appendonly yes$", config, re.M)
    assert re.search(r"^appendfsync everysec$", config, re.M)
    include = re.search(r"^include (\S+)$", config, re.M)
    assert include, "the password comes from an included file"
    password = "pa55-word"
    (tmp_path / "runtime.conf").write_text(f'requirepass "{password}"\n')
    port = _free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(
        config.replace(include[1], str(tmp_path / "runtime.conf"))
        .replace("dir /data", f"dir {tmp_path}")
        .replace("bind * -::*", "bind 127.0.0.1")
        .replace("port 6379", f"port {port}")
    )
    server = subprocess.Popen(
        [binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while _redis(port, "PING", password=password) != "PONG":
            assert server.poll() is None, "redis-server did not start on the config"
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.05)
        assert "NOAUTH" in _redis(port, "SET", "x", "1")
        for key, value in (
            ("appendonly", "yes"),
            ("appendfsync", "everysec"),
            ("maxmemory-policy", "noeviction"),
        ):
            answer = _redis(port, "CONFIG", "GET", key, password=password)
            assert answer.split() == [key, value]
    finally:
        server.terminate()
        server.wait(timeout=10)


# --- scripts ---------------------------------------------------------------------


def shell_scripts(objects: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(where, script) for every ConfigMap key ending in .sh and every
    ``sh -c`` command or exec probe of a container."""
    for configmap in of_kind(objects, "ConfigMap"):
        for key, value in configmap.get("data", {}).items():
            if key.endswith(".sh"):
                yield f"{configmap['metadata']['name']}/{key}", value
    for workload in workloads(objects):
        spec = workload["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            probes = [
                container.get(probe, {}).get("exec", {}).get("command", [])
                for probe in ("startupProbe", "readinessProbe", "livenessProbe")
            ]
            for command in [container.get("command", []), *probes]:
                if command[:2] == ["sh", "-c"]:
                    yield where, command[2]


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=ident)
def test_every_shell_script_parses(path):
    scripts = list(shell_scripts(render(path)))
    assert scripts
    for where, script in scripts:
        done = subprocess.run(
            ["sh", "-n", "-c", script], capture_output=True, text=True, timeout=10
        )
        assert done.returncode == 0, f"{where}: {done.stderr}"


def test_a_broken_script_would_be_caught():
    done = subprocess.run(["sh", "-n", "-c", "if true; then echo"], capture_output=True)
    assert done.returncode != 0


# --- docs ------------------------------------------------------------------------


def test_the_docs_name_every_overlay_and_only_existing_ones():
    page = (DOCS / "kubernetes.md").read_text()
    named_overlays = set(re.findall(r"deploy/kubernetes/overlays/([\w-]+)", page))
    assert named_overlays == {path.name for path in OVERLAYS}


@pytest.mark.parametrize("page", OUR_DOCS)
def test_the_docs_link_only_within_docs(page):
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        file = target.split("#", 1)[0]
        assert file.endswith(".md"), (page, target)
        assert (DOCS / file).resolve().is_relative_to(ROOT / "docs"), (page, target)
        assert (DOCS / file).is_file(), (page, target)
