"""What `kubectl kustomize k8s/` renders (the base: the server and Envoy, no Namespace, no
model server), and what it renders with each optional component and with all of them:
each object valid against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an
unknown or misspelt field is an error) of the oldest Kubernetes the manifests promise and
of the newest the library ships, all in the namespace and labelled, and Services and
PodDisruptionBudgets selecting existing pods."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.k8s.manifests import (
    COMPONENTS,
    K8S,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    PART_OF,
    ROOT,
    Doc,
    _all,
    _container,
    _is_custom,
    _kustomize,
    _kustomize_overlay,
    _one,
    _pod_labels,
    _port_number,
    _selects,
)


def _names(docs: list[Doc]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_the_base_renders_the_server_and_envoy_only(base: list[Doc]) -> None:
    """No Namespace object (the namespace may exist already) and no model server."""
    names = _names(base)
    assert {
        ("ServiceAccount", "xds-server"),
        ("ServiceAccount", "envoy"),
        ("Role", "xds-server"),
        ("RoleBinding", "xds-server"),
        ("ConfigMap", "xds-server-config"),
        ("Deployment", "xds-server"),
        ("Service", "xds-server"),
        ("PodDisruptionBudget", "xds-server"),
        ("Deployment", "envoy"),
        ("Service", "envoy"),
        ("PodDisruptionBudget", "envoy"),
        ("NetworkPolicy", "xds-server"),
        ("NetworkPolicy", "envoy"),
        ("Issuer", "xds-server-selfsigned"),
        ("Certificate", "xds-server-ca"),
        ("Issuer", "xds-server-ca"),
        ("Certificate", "xds-server-tls"),
        ("Certificate", "envoy-xds-client-tls"),
    } <= names, sorted(names)
    assert any(k == "ConfigMap" and n.startswith("envoy-bootstrap-") for k, n in names)
    assert any(k == "ConfigMap" and n.startswith("envoy-sds-") for k, n in names)
    assert len(base) == 20, sorted(names)
    assert {d["metadata"]["name"] for d in _all(base, "Deployment")} == {"xds-server", "envoy"}


# What each optional component adds to the base. A component added to k8s/components/
# without an entry here fails test_each_component_renders_on_the_base.
ADDED = {
    "namespace": {("Namespace", "xds-server")},
    "example-model-server": {("Deployment", "vllm-llama"), ("NetworkPolicy", "vllm-llama")},
    "monitoring": {
        ("PodMonitor", "xds-server"),
        ("PodMonitor", "envoy"),
        ("PrometheusRule", "xds-server"),
        ("ConfigMap", "xds-server-dashboard"),
    },
    "autoscaling": {("ScaledObject", "vllm-llama")},
}


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_renders_on_the_base(base: list[Doc], component: str) -> None:
    """`kubectl kustomize` of an overlay with the base and this component alone: the base
    as it was, plus the component's objects, each valid and in the namespace."""
    docs = _kustomize_overlay([component])
    assert component in ADDED, f"k8s/components/{component} is new: say what it adds"
    assert _names(docs) == _names(base) | ADDED[component]
    _check_schemas(docs, KUBERNETES_VERSIONS[-1])
    _check_namespace_and_labels(docs)


def test_every_component_renders_together(base: list[Doc], rendered: list[Doc]) -> None:
    assert _names(rendered) == _names(base).union(*ADDED.values())


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: list[Doc], version: str
) -> None:
    """Every object but the custom resources, whose CRDs the library does not know (they
    get checks of their own: test_the_cert_manager_objects_have_the_fields_the_crds_define,
    test_monitoring.py, test_autoscaling.py)."""
    _check_schemas(rendered, version)


def _check_schemas(docs: list[Doc], version: str) -> None:
    problems = []
    for doc in docs:
        if _is_custom(doc):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_validation_is_strict() -> None:
    """The check above would pass anything if strict mode stopped refusing unknown fields."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "replica": 2,  # misspelt
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_everything_is_in_the_namespace_and_labelled_without_touching_selectors(
    rendered: list[Doc],
) -> None:
    _check_namespace_and_labels(rendered)


def _check_namespace_and_labels(docs: list[Doc]) -> None:
    for doc in docs:
        assert _selects(PART_OF, doc["metadata"].get("labels", {})), doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
    for deployment in _all(docs, "Deployment"):
        assert _selects(PART_OF, deployment["spec"]["template"]["metadata"]["labels"])
        assert "app.kubernetes.io/part-of" not in deployment["spec"]["selector"]["matchLabels"]
    for service in _all(docs, "Service"):
        assert "app.kubernetes.io/part-of" not in service["spec"]["selector"]
    for pdb in _all(docs, "PodDisruptionBudget"):
        assert "app.kubernetes.io/part-of" not in pdb["spec"]["selector"]["matchLabels"]
    for policy in _all(docs, "NetworkPolicy"):
        assert "app.kubernetes.io/part-of" not in policy["spec"]["podSelector"]["matchLabels"]


def test_services_and_budgets_select_running_pods(rendered: list[Doc]) -> None:
    deployments = _all(rendered, "Deployment")
    for service in _all(rendered, "Service"):
        (owner,) = [d for d in deployments if _selects(service["spec"]["selector"], _pod_labels(d))]
        container = _container(owner)
        for port in service["spec"]["ports"]:
            _port_number(container, port["targetPort"])
    for pdb in _all(rendered, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        (owner,) = [d for d in deployments if _selects(selector, _pod_labels(d))]
        assert pdb["spec"]["minAvailable"] == 1
        assert owner["spec"]["replicas"] > pdb["spec"]["minAvailable"]
    for deployment in deployments:
        assert _selects(deployment["spec"]["selector"]["matchLabels"], _pod_labels(deployment))
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["resources"]["requests"], container["name"]
            assert container["resources"]["limits"], container["name"]


# Overlays the docs show: a fenced YAML block, or a here-document, that names ../k8s.
_BLOCK = re.compile(r"```yaml\n(.*?)```|<<'EOF'\n(.*?)\nEOF", re.DOTALL)


def _documented_overlays() -> list[tuple[str, str]]:
    found = []
    for doc in (ROOT / "README.md", K8S / "README.md"):
        text = doc.read_text()
        for match in _BLOCK.finditer(text):
            block = textwrap.dedent(match[1] or match[2])
            if "../k8s" in block and "resources:" in block:
                line = text[: match.start()].count("\n") + 1
                found.append((f"{doc.relative_to(ROOT)}:{line}", block))
    return found


DOCUMENTED_OVERLAYS = _documented_overlays()


@pytest.mark.parametrize(
    ("where", "overlay"), DOCUMENTED_OVERLAYS, ids=[where for where, _ in DOCUMENTED_OVERLAYS]
)
def test_the_overlays_the_docs_show_render(where: str, overlay: str, tmp_path: Path) -> None:
    """Each, as a directory beside k8s/ (the registry's placeholder in `images:` kept),
    renders the server and Envoy in the namespace it names."""
    (tmp_path / "k8s").symlink_to(K8S)
    (tmp_path / "my-gateway").mkdir()
    (tmp_path / "my-gateway" / "kustomization.yaml").write_text(overlay)
    docs = _kustomize(tmp_path / "my-gateway")
    namespace = yaml.safe_load(overlay).get("namespace", NAMESPACE)
    for name in ("xds-server", "envoy"):
        deployment = _one(docs, "Deployment", name)
        assert deployment["metadata"]["namespace"] == namespace, where
    assert len(DOCUMENTED_OVERLAYS) >= 3
