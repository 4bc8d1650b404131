from __future__ import annotations

import pytest

from xds_server.config import RoutingConfig, parse_config

CONFIG_YAML = """
listener:
  address: 127.0.0.1
  port: 8080
  request_timeout_s: 0
  stream_idle_timeout_s: 120
  connect_timeout_s: 0.5
  max_request_bytes: 10485760
pools:
  - name: alpha
    models: [model-a, org/Model-A.2]
    endpoints:
      - {address: 10.0.0.1, port: 8000, weight: 3}
      - {address: 10.0.0.2, port: 8000}
  - name: beta
    models: ["50%-model"]
    endpoints:
      - {address: 10.0.1.1, port: 9000, weight: 7}
  - name: empty
    models: [model-e]
"""


@pytest.fixture
def config() -> RoutingConfig:
    return parse_config(CONFIG_YAML)


# Hash homes: the session cluster's own Maglev ring (key buckets: test_build_key_buckets.py).
AFFINITY_YAML = """
listener: {address: 127.0.0.1, port: 8080}
balancing: {hash_balance_factor: 175, key_homes: hash}
pools:
  - name: llm
    models: [base]
    adapters: [lora-b, lora-a]
    session_affinity: true
    endpoints:
      - {address: 10.0.0.2, port: 8000, hardware: h100}
      - {address: 10.0.0.1, port: 8000}
  - name: rr
    balancing: round_robin
    models: [rr-model]
    adapters: [rr-lora]
  - name: plain
    models: [plain-model]
    endpoints:
      - {address: 10.0.1.1, port: 9000}
"""


@pytest.fixture
def affinity_config() -> RoutingConfig:
    """Pools with LoRA adapters and session affinity (`llm`), adapters only (`rr`, round
    robin) and neither (`plain`)."""
    return parse_config(AFFINITY_YAML)
