"""The autoscaling component's ScaledObject holds together: it scales a Deployment the
manifests define, in the same namespace, on the saturation of a pool the server's config
has, a metric the server exports, as a Value (a ratio: the HPA multiplies the replicas by
it over the threshold, not by it over the replicas)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from xds_server.config import parse_config

K8S = Path(__file__).resolve().parents[2] / "k8s"
COMPONENT = K8S / "components" / "autoscaling"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def test_the_scaled_object_scales_an_example_deployment_on_a_pools_saturation() -> None:
    kustomization = _documents(COMPONENT / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Component"
    (scaled,) = [d for f in kustomization["resources"] for d in _documents(COMPONENT / f)]
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    deployments = {
        (d["metadata"]["name"], d["metadata"].get("namespace"))
        for path in K8S.rglob("*.yaml")
        for d in _documents(path)
        if isinstance(d, dict) and d.get("kind") == "Deployment"
    }
    # An object without a namespace of its own is in the base's (kustomization.yaml).
    base = _documents(K8S / "kustomization.yaml")[0]["namespace"]
    namespaces = {namespace or base for name, namespace in deployments if name == target["name"]}
    assert namespaces == {scaled["metadata"]["namespace"]}, (target, deployments)
    assert target.get("kind", "Deployment") == "Deployment"

    (trigger,) = scaled["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "Value")
    query = trigger["metadata"]["query"]
    pools = re.findall(r'xds_pool_saturation_ratio\{pool="([^"]+)"\}', query)
    routing = parse_config((K8S / "server" / "config.yaml").read_text(encoding="utf-8"))
    assert pools and set(pools) <= {p.name for p in routing.pools}, (pools, query)
    threshold = float(trigger["metadata"]["threshold"])
    assert 0 < threshold <= 1
    # With no figure (no ready pod, no server scraped) the replicas hold: the fallback
    # value is the threshold itself.
    assert query.endswith(f"or vector({trigger['metadata']['threshold']})")
