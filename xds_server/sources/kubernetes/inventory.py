"""From what the Kubernetes API shows to the routing config in force (pure: no I/O).

The operator's routing config (file or ConfigMap) is the base. The cluster adds to it:

- **InferencePool** (`inference.networking.k8s.io/v1`) objects define pools: the selector
  and the first target port come from the object. A config pool of the same name keeps its
  models and tuning and takes the selector when it has none of its own; an InferencePool
  without a config pool becomes a pool of its own whose models are listed in the
  annotation `xds-server.io/models` (comma-separated; default: the pool's name) and whose
  adapters are in `xds-server.io/adapters`. `endpointPickerRef` is ignored: Envoy balances
  by itself here.
- **InferenceModelRewrite** (`inference.networking.x-k8s.io/v1alpha2`) objects add weighted
  splits (`rules[].matches[].model.value` → `rules[].targets[]{modelRewrite, weight}`); a
  split in the config for the same model wins.
- **InferenceObjective** (same group) objects add flow-control objectives: name → integer
  `priority` (negative: Sheddable, 0: Standard, positive: Critical); the config's own
  `flow_control.objectives` win for the same name.
- **Pods** matching a pool's selector become its endpoints (besides any static ones): the
  pod IP and the target port, Ready pods only (the Ready condition and every readiness
  gate), DRAINING once the pod has a deletion timestamp, until it is gone. Labels
  `xds-server.io/hardware` and `xds-server.io/engine` give its hardware class and engine.

An object that cannot be used (a missing field, a model another pool already serves, a
split to a model nobody serves) is left out with a problem that names it; the rest still
applies. Everything is sorted so that two replicas given the same objects build the same
config, hence the same snapshot versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import ValidationError

from xds_server.config import (
    EndpointConfig,
    Engine,
    ModelRewrite,
    PodSelector,
    PoolConfig,
    RoutingConfig,
)

__all__ = [
    "ADAPTERS_ANNOTATION",
    "ClusterView",
    "ENGINE_LABEL",
    "HARDWARE_LABEL",
    "Inventory",
    "MODELS_ANNOTATION",
    "PodWatch",
    "build_inventory",
    "objectives",
    "pod_endpoint",
    "pod_watches",
    "pools_with_selectors",
]

HARDWARE_LABEL = "xds-server.io/hardware"
ENGINE_LABEL = "xds-server.io/engine"
MODELS_ANNOTATION = "xds-server.io/models"
ADAPTERS_ANNOTATION = "xds-server.io/adapters"

_ENGINES: frozenset[str] = frozenset(get_args(Engine))

# Raw API objects (plain JSON dicts), by "namespace/name".
Objects = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True, order=True)
class PodWatch:
    """One pod list + watch: a namespace and a label selector (`a=b,c=d`)."""

    namespace: str
    label_selector: str


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    """What the watchers currently hold."""

    # Pods by the watch that found them.
    pods: Mapping[PodWatch, Objects] = field(default_factory=dict)
    inference_pools: Objects = field(default_factory=dict)
    model_rewrites: Objects = field(default_factory=dict)
    inference_objectives: Objects = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Inventory:
    """The routing config in force, and what in the cluster could not be used."""

    config: RoutingConfig
    problems: tuple[str, ...] = ()


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _qualified_name(obj: Mapping[str, Any]) -> str | None:
    """`namespace/name`, or None when the object lacks either."""
    namespace, name = _metadata(obj).get("namespace"), _metadata(obj).get("name")
    return f"{namespace}/{name}" if namespace and name else None


def _ready(pod: Mapping[str, Any]) -> bool:
    """The Ready condition is True and so is every readiness gate's condition."""
    status = pod.get("status") or {}
    conditions = {
        c.get("type"): c.get("status") == "True"
        for c in status.get("conditions") or ()
        if isinstance(c, Mapping)
    }
    gates = [g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or ()]
    return conditions.get("Ready", False) and all(conditions.get(g, False) for g in gates)


def pod_endpoint(pod: Mapping[str, Any], *, port: int) -> EndpointConfig | None:
    """The endpoint a pod is, or None while it should get no traffic at all.

    A running pod with an IP is an endpoint when Ready; once it has a deletion timestamp it
    is a DRAINING endpoint (no new requests, in-flight ones finish) until it disappears.
    """
    status = pod.get("status") or {}
    address = status.get("podIP")
    if not address or status.get("phase") != "Running":
        return None
    terminating = _metadata(pod).get("deletionTimestamp") is not None
    if not terminating and not _ready(pod):
        return None
    labels = _metadata(pod).get("labels") or {}
    engine = labels.get(ENGINE_LABEL)
    try:
        return EndpointConfig(
            address=address,
            port=port,
            name=_qualified_name(pod),
            namespace=_metadata(pod).get("namespace") or None,
            hardware=labels.get(HARDWARE_LABEL) or None,
            engine=engine if engine in _ENGINES else None,
            draining=terminating,
        )
    except ValidationError:
        return None


def _listed(annotation: Any) -> tuple[str, ...]:
    if not isinstance(annotation, str):
        return ()
    return tuple(dict.fromkeys(m.strip() for m in annotation.split(",") if m.strip()))


def _selector_of(obj: Mapping[str, Any]) -> PodSelector:
    """An InferencePool's selector; raises ValueError/ValidationError when it has none."""
    spec = obj.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels")
    ports = spec.get("targetPorts") or ()
    if not labels or not ports or not isinstance(ports[0], Mapping):
        raise ValueError("spec.selector.matchLabels and spec.targetPorts are required")
    namespace = _metadata(obj).get("namespace")
    return PodSelector.model_validate(
        {
            "match_labels": labels,
            "target_port": ports[0].get("number"),
            "namespaces": (namespace,) if namespace else (),
        }
    )


def pools_with_selectors(
    base: RoutingConfig, inference_pools: Objects
) -> tuple[tuple[PoolConfig, ...], tuple[str, ...]]:
    """The base config's pools with the InferencePools merged in (module docstring), and
    a problem per InferencePool left out."""
    pools = {p.name: p for p in base.pools}
    owner = {m: p.name for p in base.pools for m in (*p.models, *p.adapters)}
    problems = []
    for key in sorted(inference_pools):
        obj = inference_pools[key]
        name = _metadata(obj).get("name", "")
        try:
            selector = _selector_of(obj)
        except (ValueError, ValidationError) as exc:
            problems.append(f"InferencePool {key}: {_reason(exc)}; ignored.")
            continue
        existing = pools.get(name)
        if existing is not None:
            if existing.selector is None:
                pools[name] = existing.model_copy(update={"selector": selector})
            continue
        annotations = _metadata(obj).get("annotations") or {}
        models = _listed(annotations.get(MODELS_ANNOTATION)) or (name,)
        adapters = _listed(annotations.get(ADAPTERS_ANNOTATION))
        taken = sorted(m for m in (*models, *adapters) if m in owner)
        if taken:
            problems.append(
                f"InferencePool {key}: models already served by another pool: "
                f"{', '.join(taken)}; ignored."
            )
            continue
        try:
            pool = PoolConfig(name=name, models=models, adapters=adapters, selector=selector)
        except ValidationError as exc:
            problems.append(f"InferencePool {key}: {_reason(exc)}; ignored.")
            continue
        pools[name] = pool
        owner.update({m: name for m in (*models, *adapters)})
    return tuple(pools.values()), tuple(problems)


def pod_watches(pools: Iterable[PoolConfig], *, namespaces: Iterable[str]) -> set[PodWatch]:
    """The pod watches the pools' selectors need (`namespaces`: where selectors without
    their own namespaces look)."""
    default = tuple(namespaces)
    return {
        PodWatch(namespace=ns, label_selector=pool.selector.label_selector)
        for pool in pools
        if pool.selector is not None
        for ns in pool.selector.namespaces or default
    }


def _endpoints(
    pool: PoolConfig, pods: Mapping[PodWatch, Objects], *, namespaces: tuple[str, ...]
) -> tuple[EndpointConfig, ...]:
    found = {(e.address, e.port): e for e in pool.endpoints}
    names = {e.ring_key for e in pool.endpoints}
    if pool.selector is not None:
        for ns in pool.selector.namespaces or namespaces:
            watch = PodWatch(namespace=ns, label_selector=pool.selector.label_selector)
            for key in sorted(pods.get(watch, {})):
                endpoint = pod_endpoint(pods[watch][key], port=pool.selector.target_port)
                if endpoint is None or (endpoint.address, endpoint.port) in found:
                    continue
                if endpoint.ring_key in names:
                    # A configured endpoint has this name: the pod is hashed by address.
                    endpoint = endpoint.model_copy(update={"name": None})
                found[(endpoint.address, endpoint.port)] = endpoint
                names.add(endpoint.ring_key)
    return tuple(found[k] for k in sorted(found))


def _rewrites(
    base: RoutingConfig, objects: Objects, served: set[str]
) -> tuple[tuple[ModelRewrite, ...], tuple[str, ...]]:
    rewrites = {r.model: r for r in base.model_rewrites}
    configured = set(rewrites)
    problems = []
    for key in sorted(objects):
        spec = objects[key].get("spec") or {}
        for rule in spec.get("rules") or ():
            targets = [
                {"model": t.get("modelRewrite"), "weight": t.get("weight", 1)}
                for t in rule.get("targets") or ()
            ]
            for match in rule.get("matches") or ():
                model = ((match or {}).get("model") or {}).get("value")
                if model in configured:
                    continue
                try:
                    rewrite = ModelRewrite.model_validate({"model": model, "targets": targets})
                except ValidationError as exc:
                    problems.append(f"InferenceModelRewrite {key}: {_reason(exc)}; rule ignored.")
                    continue
                unserved = sorted(t.model for t in rewrite.targets if t.model not in served)
                if unserved:
                    problems.append(
                        f"InferenceModelRewrite {key}: no pool serves {', '.join(unserved)}; "
                        f"rule for {model!r} ignored."
                    )
                    continue
                rewrites[rewrite.model] = rewrite
    return tuple(rewrites[m] for m in sorted(rewrites)), tuple(problems)


def build_inventory(
    base: RoutingConfig, view: ClusterView, *, namespaces: Iterable[str]
) -> Inventory:
    """The config in force: `base` plus what `view` shows (module docstring)."""
    default = tuple(namespaces)
    pools, pool_problems = pools_with_selectors(base, view.inference_pools)
    pools = tuple(
        p.model_copy(update={"endpoints": _endpoints(p, view.pods, namespaces=default)})
        for p in pools
    )
    served = {m for p in pools for m in (*p.models, *p.adapters)}
    rewrites, rewrite_problems = _rewrites(base, view.model_rewrites, served)
    # Objectives name bands for flow control; one in the config wins over the cluster's.
    priorities = {name: o["priority"] for name, o in objectives(view.inference_objectives).items()}
    flow_control = base.flow_control.model_copy(
        update={"objectives": {**priorities, **base.flow_control.objectives}}
    )
    config = base.model_copy(
        update={"pools": pools, "model_rewrites": rewrites, "flow_control": flow_control}
    )
    return Inventory(config=config, problems=(*pool_problems, *rewrite_problems))


def objectives(objects: Objects) -> dict[str, dict[str, Any]]:
    """InferenceObjectives by name: their integer priority and pool (for flow control)."""
    found = {}
    for key in sorted(objects):
        spec = objects[key].get("spec") or {}
        priority = spec.get("priority", 0)
        if isinstance(priority, int) and not isinstance(priority, bool):
            found[_metadata(objects[key]).get("name", key)] = {
                "priority": priority,
                "pool": (spec.get("poolRef") or {}).get("name"),
            }
    return found


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
    return str(exc)
