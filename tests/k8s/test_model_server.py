"""The example model server (k8s/components/example-model-server/) matching the pool it is
meant for."""

from __future__ import annotations

from tests.k8s.manifests import (
    Doc,
    _container,
    _flag_values,
    _one,
    _pod_labels,
    _port_number,
    _routing_config,
    _selects,
)
from xds_server.sources.kubernetes import inventory


def test_the_example_model_server_is_what_its_pool_selects(rendered: list[Doc]) -> None:
    config = _routing_config(rendered)
    model_server = _one(rendered, "Deployment", "vllm-llama")
    labels = _pod_labels(model_server)
    container = _container(model_server)
    pools = [p for p in config.pools if p.selector and _selects(p.selector.match_labels, labels)]
    assert len(pools) == 1, "the example model server belongs to exactly one pool"
    pool = pools[0]
    assert pool.selector is not None

    ports = [p["containerPort"] for p in container["ports"]]
    assert pool.selector.target_port in ports
    assert _flag_values(container["args"], "--port") == [str(pool.selector.target_port)]
    assert labels[inventory.ENGINE_LABEL] == pool.engine == "vllm"
    assert labels[inventory.HARDWARE_LABEL] in config.balancing.hardware_capacity
    assert _flag_values(container["args"], "--model") == list(pool.models)
    lora_modules = _flag_values(container["args"], "--lora-modules")
    assert sorted(m.split("=", 1)[0] for m in lora_modules) == sorted(pool.adapters)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        port = _port_number(container, container[probe]["httpGet"]["port"])
        assert port == pool.selector.target_port
    assert container["image"].startswith("vllm/vllm-openai:v")
