"""The Inference Extension examples (k8s/examples/inference-extension/): their CRDs are
not in kubernetes-validate, so they get a structural check against the fields the CRDs
require, and they go through the server's own inventory code, which must use them without
a problem."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.k8s.manifests import (
    NAMESPACE,
    Doc,
    _all,
    _one,
    _pod_labels,
    _routing_config,
)
from xds_server.config import parse_config
from xds_server.sources.kubernetes import inventory


def _require(obj: Mapping[str, Any], path: str, kind: type | tuple[type, ...]) -> Any:
    value: Any = obj
    for part in path.split("."):
        assert isinstance(value, Mapping) and part in value, f"missing {path}"
        value = value[part]
    assert isinstance(value, kind) and not isinstance(value, bool), f"{path}: {value!r}"
    return value


def _check_inference_pool(obj: Doc) -> None:
    assert obj["apiVersion"] == "inference.networking.k8s.io/v1"
    labels = _require(obj, "spec.selector.matchLabels", dict)
    assert labels and all(isinstance(v, str) for v in labels.values())
    ports = _require(obj, "spec.targetPorts", list)
    assert 1 <= len(ports) <= 8
    assert all(isinstance(p["number"], int) and 1 <= p["number"] <= 65535 for p in ports)
    # Required by the v1 CRD; xds-server ignores it.
    _require(obj, "spec.endpointPickerRef.name", str)


def _check_inference_objective(obj: Doc) -> None:
    assert obj["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    _require(obj, "spec.priority", int)
    _require(obj, "spec.poolRef.name", str)


def _check_inference_model_rewrite(obj: Doc) -> None:
    assert obj["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    _require(obj, "spec.poolRef.name", str)
    rules = _require(obj, "spec.rules", list)
    assert rules
    for rule in rules:
        for match in _require(rule, "matches", list):
            assert _require(match, "model.value", str)
        targets = _require(rule, "targets", list)
        assert targets
        for target in targets:
            assert _require(target, "modelRewrite", str)
            assert 1 <= _require(target, "weight", int) <= 1_000_000


_CHECKS = {
    "InferencePool": _check_inference_pool,
    "InferenceObjective": _check_inference_objective,
    "InferenceModelRewrite": _check_inference_model_rewrite,
}


def test_the_inference_extension_examples_have_the_fields_the_crds_require(
    examples: list[Doc],
) -> None:
    assert {d["kind"] for d in examples} == set(_CHECKS)
    for doc in examples:
        assert doc["metadata"]["namespace"] == NAMESPACE
        _CHECKS[doc["kind"]](doc)


def _view(examples: list[Doc]) -> inventory.ClusterView:
    def keyed(kind: str) -> dict[str, Doc]:
        return {
            f"{d['metadata']['namespace']}/{d['metadata']['name']}": d for d in _all(examples, kind)
        }

    return inventory.ClusterView(
        inference_pools=keyed("InferencePool"), model_rewrites=keyed("InferenceModelRewrite")
    )


def _example_pod(rendered: list[Doc]) -> Doc:
    """A running, ready pod of the example model server, as the API would list it."""
    labels = _pod_labels(_one(rendered, "Deployment", "vllm-llama"))
    return {
        "metadata": {"name": "vllm-llama-0", "namespace": NAMESPACE, "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_the_server_uses_the_inference_extension_examples(
    rendered: list[Doc], examples: list[Doc]
) -> None:
    """Migrating: a routing config that only names the pool and its models; the selector,
    the canary split and the priorities come from the Inference Extension objects."""
    base = parse_config(
        "pools:\n"
        "  - name: llama\n"
        "    models: [meta-llama/Llama-3.1-8B-Instruct]\n"
        "    adapters: [sql-lora, chat-lora]\n"
    )
    view = _view(examples)
    pool_obj = _one(examples, "InferencePool", "llama")
    watch = inventory.PodWatch(
        namespace=NAMESPACE,
        label_selector=",".join(
            f"{k}={v}" for k, v in sorted(pool_obj["spec"]["selector"]["matchLabels"].items())
        ),
    )
    pod = _example_pod(rendered)
    pods = {f"{NAMESPACE}/{pod['metadata']['name']}": pod}
    view = inventory.ClusterView(
        pods={watch: pods},
        inference_pools=view.inference_pools,
        model_rewrites=view.model_rewrites,
    )
    result = inventory.build_inventory(base, view, namespaces=[NAMESPACE])
    assert result.problems == ()

    pools = {p.name: p for p in result.config.pools}
    assert set(pools) == {"llama", "llama-70b"}
    llama = pools["llama"]
    assert llama.selector is not None
    assert llama.selector.match_labels == pool_obj["spec"]["selector"]["matchLabels"]
    assert llama.selector.target_port == pool_obj["spec"]["targetPorts"][0]["number"]
    (endpoint,) = llama.endpoints
    assert (endpoint.address, endpoint.port, endpoint.hardware) == ("10.0.0.7", 8000, "h100")
    assert pools["llama-70b"].models == ("meta-llama/Llama-3.3-70B-Instruct",)

    (rewrite,) = result.config.model_rewrites
    assert rewrite.model == "llama"
    assert {(t.model, t.weight) for t in rewrite.targets} == {
        ("meta-llama/Llama-3.1-8B-Instruct", 90),
        ("meta-llama/Llama-3.3-70B-Instruct", 10),
    }

    objectives = {
        f"{d['metadata']['namespace']}/{d['metadata']['name']}": d
        for d in _all(examples, "InferenceObjective")
    }
    assert inventory.objectives(objectives) == {
        "interactive": {"priority": 10, "pool": "llama"},
        "batch": {"priority": -1, "pool": "llama"},
    }


def test_the_examples_add_nothing_the_deployed_config_refuses(
    rendered: list[Doc], examples: list[Doc]
) -> None:
    """Applying the examples next to the base deployment: the config's pool keeps its own
    selector, the second pool and the split are added, and nothing is refused."""
    result = inventory.build_inventory(
        _routing_config(rendered), _view(examples), namespaces=[NAMESPACE]
    )
    assert result.problems == ()
    assert {p.name for p in result.config.pools} == {"llama", "llama-70b"}
