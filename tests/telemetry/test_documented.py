"""docs/metrics.md and the server's /metrics name the same metrics: every family a server
registers (Kubernetes and peers included) is documented, and every metric the page
documents is registered, under the name Prometheus shows (a counter with its `_total`)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xds_server.app import XdsApplication
from xds_server.settings import KubernetesSettings, ServerSettings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_NAME = re.compile(r"`((?:xds|process|python)_[a-z_]+)`")


def documented() -> set[str]:
    """The metric names in the first column of the page's metric table."""
    names = set()
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            names.update(_NAME.findall(cells[1]))
    return names


async def test_the_docs_and_the_registry_name_the_same_metrics() -> None:
    kubernetes = KubernetesSettings(
        namespace="ns", watch_namespaces=("ns",), configmap="config", api_host="http://127.0.0.1:1"
    )
    app = XdsApplication(ServerSettings(kubernetes=kubernetes, peers_selector="app=xds-server"))
    text = generate_latest(app.telemetry.registry).decode()
    registered = {
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in text_string_to_metric_families(text)
        if not family.name.endswith("_created")
    }
    docs = documented()
    assert {"xds_pool_saturation_ratio", "xds_build_info", "python_info"} <= docs
    assert not registered - docs, f"not in docs/metrics.md: {sorted(registered - docs)}"
    assert not docs - registered, f"documented, not registered: {sorted(docs - registered)}"
