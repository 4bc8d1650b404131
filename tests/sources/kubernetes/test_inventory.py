"""The routing config in force from the base config and what the Kubernetes API shows."""

from __future__ import annotations

from typing import Any

from xds_server.config import parse_config
from xds_server.sources.kubernetes.inventory import (
    ENGINE_LABEL,
    HARDWARE_LABEL,
    MODELS_ANNOTATION,
    ClusterView,
    PodWatch,
    build_inventory,
    objectives,
    pod_endpoint,
    pod_watches,
)

BASE = """
pools:
  - name: llama
    models: [llama-3.1-8b]
    adapters: [sql-lora]
    selector: {match_labels: {app: llama}, target_port: 8000}
    endpoints: [{address: 10.9.9.9, port: 8000}]
  - name: qwen
    models: [qwen3]
"""
LLAMA = PodWatch(namespace="ml", label_selector="app=llama")


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    ready: bool = True,
    deleting: bool = False,
    gates: dict[str, bool] | None = None,
    labels: dict[str, str] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    conditions += [
        {"type": g, "status": "True" if v else "False"} for g, v in (gates or {}).items()
    ]
    metadata: dict[str, Any] = {"name": name, "namespace": "ml", "labels": labels or {}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if ip is not None:
        status["podIP"] = ip
    return {
        "metadata": metadata,
        "spec": {"readinessGates": [{"conditionType": g} for g in gates or {}]},
        "status": status,
    }


def inference_pool(name: str, *, labels: dict[str, str], port: int = 8000, **annotations: str):  # type: ignore[no-untyped-def]
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations},
        "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": port}]},
    }


def test_ready_running_pods_are_endpoints_with_their_labels() -> None:
    endpoint = pod_endpoint(
        pod("a", labels={HARDWARE_LABEL: "h100", ENGINE_LABEL: "sglang"}), port=8000
    )
    assert endpoint is not None
    assert (endpoint.address, endpoint.port, endpoint.hardware, endpoint.engine) == (
        "10.0.0.1",
        8000,
        "h100",
        "sglang",
    )
    assert not endpoint.draining
    # The session ring places keys by the pod's name, not its IP.
    assert endpoint.name == endpoint.ring_key == "ml/a"
    # Its namespace and name label its metrics (model_server_namespace, model_server_pod).
    assert (endpoint.namespace, endpoint.pod_name) == ("ml", "a")
    # An engine label we cannot read is ignored (the pool's engine applies).
    assert pod_endpoint(pod("a", labels={ENGINE_LABEL: "nope"}), port=1).engine is None  # type: ignore[union-attr]


def test_unready_ipless_and_finished_pods_are_not_endpoints() -> None:
    assert pod_endpoint(pod("a", ready=False), port=8000) is None
    assert pod_endpoint(pod("a", ip=None), port=8000) is None
    assert pod_endpoint(pod("a", phase="Succeeded"), port=8000) is None
    assert pod_endpoint(pod("a", gates={"gate/x": False}), port=8000) is None
    assert pod_endpoint(pod("a", gates={"gate/x": True}), port=8000) is not None


def test_a_terminating_pod_drains_until_it_is_gone() -> None:
    for ready in (True, False):
        endpoint = pod_endpoint(pod("a", ready=ready, deleting=True), port=8000)
        assert endpoint is not None and endpoint.draining


def test_selected_pods_join_the_static_endpoints_sorted() -> None:
    base = parse_config(BASE)
    pods = {"ml/b": pod("b", "10.0.0.2"), "ml/a": pod("a", "10.0.0.10"), "ml/c": pod("c", None)}
    inventory = build_inventory(base, ClusterView(pods={LLAMA: pods}), namespaces=["ml"])
    llama = inventory.config.pools[0]
    assert [(e.address, e.port, e.ring_key) for e in llama.endpoints] == [
        ("10.0.0.10", 8000, "ml/a"),
        ("10.0.0.2", 8000, "ml/b"),
        ("10.9.9.9", 8000, "10.9.9.9:8000"),
    ]
    assert inventory.problems == ()
    # The same objects in another order give the same config (replicas agree).
    again = build_inventory(
        base, ClusterView(pods={LLAMA: dict(reversed(pods.items()))}), namespaces=["ml"]
    )
    assert again.config == inventory.config


def test_a_pod_named_like_a_configured_endpoint_is_hashed_by_address() -> None:
    """Names place keys on the session ring, so two endpoints of a pool never share one."""
    base = parse_config(BASE.replace("9.9, port: 8000}", "9.9, port: 8000, name: ml/a}"))
    pods = {"ml/a": pod("a", "10.0.0.10"), "ml/b": pod("b", "10.0.0.2")}
    inventory = build_inventory(base, ClusterView(pods={LLAMA: pods}), namespaces=["ml"])
    assert [e.ring_key for e in inventory.config.pools[0].endpoints] == [
        "10.0.0.10:8000",
        "ml/b",
        "ml/a",
    ]


def test_pod_watches_follow_selectors_and_namespaces() -> None:
    base = parse_config(BASE)
    assert pod_watches(base.pools, namespaces=["ml", "ml2"]) == {
        LLAMA,
        PodWatch(namespace="ml2", label_selector="app=llama"),
    }


def test_inference_pools_define_pools_or_complete_config_pools() -> None:
    base = parse_config(BASE)
    view = ClusterView(
        inference_pools={
            "ml/qwen": inference_pool("qwen", labels={"app": "qwen"}, port=9000),
            "ml/mistral": inference_pool(
                "mistral", labels={"app": "mistral"}, **{MODELS_ANNOTATION: "mistral-7b, m2"}
            ),
            "ml/plain": inference_pool("plain", labels={"app": "plain"}),
            "ml/llama": inference_pool("llama", labels={"app": "other"}),
        },
        pods={PodWatch(namespace="ml", label_selector="app=qwen"): {"ml/q": pod("q", "10.1.0.1")}},
    )
    inventory = build_inventory(base, view, namespaces=["ml"])
    pools = {p.name: p for p in inventory.config.pools}
    # A config pool keeps its own selector; one without takes the InferencePool's.
    assert pools["llama"].selector is not None
    assert pools["llama"].selector.match_labels == {"app": "llama"}
    assert pools["qwen"].selector is not None and pools["qwen"].selector.target_port == 9000
    assert [(e.address, e.port) for e in pools["qwen"].endpoints] == [("10.1.0.1", 9000)]
    assert pools["mistral"].models == ("mistral-7b", "m2")
    assert pools["plain"].models == ("plain",)
    assert inventory.problems == ()


def test_unusable_inference_pools_are_reported_and_skipped() -> None:
    base = parse_config(BASE)
    broken = inference_pool("broken", labels={"app": "x"})
    del broken["spec"]["targetPorts"]
    view = ClusterView(
        inference_pools={
            "ml/broken": broken,
            "ml/clash": inference_pool("clash", labels={"a": "b"}, **{MODELS_ANNOTATION: "qwen3"}),
            "ml/Bad_Name": inference_pool("Bad_Name", labels={"a": "b"}),
        }
    )
    inventory = build_inventory(base, view, namespaces=["ml"])
    assert [p.name for p in inventory.config.pools] == ["llama", "qwen"]
    assert len(inventory.problems) == 3
    assert (
        "InferencePool ml/broken: spec.selector.matchLabels and spec.targetPorts"
        in (inventory.problems[1])
    )
    assert "models already served by another pool: qwen3" in inventory.problems[2]


def test_model_rewrites_become_splits_unless_the_config_has_one() -> None:
    base = parse_config(
        BASE + "model_rewrites: [{model: fixed, targets: [{model: qwen3, weight: 1}]}]\n"
    )

    def rewrite(model: str, *targets: tuple[str, int]) -> dict[str, Any]:
        return {
            "spec": {
                "rules": [
                    {
                        "matches": [{"model": {"value": model}}],
                        "targets": [{"modelRewrite": t, "weight": w} for t, w in targets],
                    }
                ]
            }
        }

    view = ClusterView(
        model_rewrites={
            "ml/canary": rewrite("chat", ("llama-3.1-8b", 90), ("qwen3", 10)),
            "ml/fixed": rewrite("fixed", ("llama-3.1-8b", 1)),
            "ml/dangling": rewrite("lost", ("nobody", 1)),
        }
    )
    inventory = build_inventory(base, view, namespaces=["ml"])
    splits = {
        r.model: [(t.model, t.weight) for t in r.targets] for r in inventory.config.model_rewrites
    }
    assert splits == {"chat": [("llama-3.1-8b", 90), ("qwen3", 10)], "fixed": [("qwen3", 1)]}
    assert inventory.problems == (
        "InferenceModelRewrite ml/dangling: no pool serves nobody; rule for 'lost' ignored.",
    )


def test_objectives_keep_integer_priorities() -> None:
    found = objectives(
        {
            "ml/batch": {
                "metadata": {"name": "batch"},
                "spec": {"priority": -1, "poolRef": {"name": "llama"}},
            },
            "ml/odd": {"metadata": {"name": "odd"}, "spec": {"priority": "high"}},
        }
    )
    assert found == {"batch": {"priority": -1, "pool": "llama"}}


def test_inference_objectives_become_flow_control_objectives() -> None:
    base = parse_config(BASE + "flow_control: {objectives: {batch: 1}}\n")

    def objective(name: str, priority: int) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": {"priority": priority}}

    view = ClusterView(
        inference_objectives={"ml/batch": objective("batch", -1), "ml/chat": objective("chat", 2)}
    )
    config = build_inventory(base, view, namespaces=["ml"]).config
    # The config's own entry wins for the same name.
    assert config.flow_control.objectives == {"batch": 1, "chat": 2}
