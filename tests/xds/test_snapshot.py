"""Snapshots: consistency, deterministic versions, and the serialize-once wire fragments."""

from __future__ import annotations

import subprocess
import sys

import pytest
from envoy.service.discovery.v3 import discovery_pb2

from tests.xds import fixtures
from xds_server.errors import InconsistentSnapshotError
from xds_server.xds.resources import ResourceType
from xds_server.xds.snapshot import Snapshot

POOLS = {"a": [("10.0.0.1", 80, 1)], "b": [("10.0.0.2", 80, 3)]}


def test_cluster_without_assignment_is_inconsistent() -> None:
    with pytest.raises(InconsistentSnapshotError, match="CLUSTER 'a' references ENDPOINT 'a'"):
        Snapshot.build({ResourceType.CLUSTER: [fixtures.cluster("a")]})


def test_listener_without_route_config_is_inconsistent() -> None:
    with pytest.raises(InconsistentSnapshotError, match="LISTENER 'l' references ROUTE 'r'"):
        Snapshot.build({ResourceType.LISTENER: [fixtures.api_listener("l", "r")]})


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(InconsistentSnapshotError, match="two CLUSTER resources are named 'a'"):
        Snapshot.build({ResourceType.CLUSTER: [fixtures.cluster("a"), fixtures.cluster("a")]})


def test_wrong_message_type_is_refused() -> None:
    with pytest.raises(TypeError, match="must be a Cluster"):
        Snapshot.build({ResourceType.CLUSTER: [fixtures.assignment("a", [])]})


def test_versions_are_content_hashes_independent_of_order() -> None:
    one = fixtures.snapshot(POOLS, listeners={"l": "a"})
    two = fixtures.snapshot(dict(reversed(list(POOLS.items()))), listeners={"l": "a"})
    assert one.versions == two.versions
    changed = fixtures.snapshot({**POOLS, "b": [("10.0.0.2", 80, 4)]}, listeners={"l": "a"})
    assert changed.versions[ResourceType.ENDPOINT] != one.versions[ResourceType.ENDPOINT]
    for unchanged in (ResourceType.CLUSTER, ResourceType.LISTENER, ResourceType.ROUTE):
        assert changed.versions[unchanged] == one.versions[unchanged]


def test_versions_are_the_same_in_another_process() -> None:
    """A restarted server (or another replica) computes the same versions."""
    code = (
        "from tests.xds import fixtures;"
        f"s = fixtures.snapshot({POOLS!r}, listeners={{'l': 'a'}});"
        "print(sorted((t.short, v) for t, v in s.versions.items()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    here = fixtures.snapshot(POOLS, listeners={"l": "a"})
    assert out.strip() == str(sorted((t.short, v) for t, v in here.versions.items()))


def test_replace_reuses_other_types() -> None:
    snap = fixtures.snapshot(POOLS, listeners={"l": "a"})
    replaced = snap.replace(
        ResourceType.ENDPOINT, [fixtures.assignment(n, [("10.9.9.9", 80, 1)]) for n in POOLS]
    )
    assert (
        replaced.resources[ResourceType.CLUSTER]["a"] is snap.resources[ResourceType.CLUSTER]["a"]
    )
    assert replaced.versions[ResourceType.ENDPOINT] != snap.versions[ResourceType.ENDPOINT]
    with pytest.raises(InconsistentSnapshotError):
        snap.replace(ResourceType.ENDPOINT, [])


def test_concatenated_fragments_parse_as_one_response() -> None:
    snap = fixtures.snapshot(POOLS)
    header = discovery_pb2.DiscoveryResponse(
        version_info="v", type_url="t", nonce="n"
    ).SerializeToString()
    resources = list(snap.resources[ResourceType.ENDPOINT].values())
    parsed = discovery_pb2.DiscoveryResponse.FromString(
        header + b"".join(r.sotw_fragment for r in resources)
    )
    assert (parsed.version_info, parsed.type_url, parsed.nonce) == ("v", "t", "n")
    assert [a.value for a in parsed.resources] == [r.packed.value for r in resources]
    delta = discovery_pb2.DeltaDiscoveryResponse.FromString(
        b"".join(r.delta_fragment for r in resources)
    )
    assert [(r.name, r.version) for r in delta.resources] == [
        (r.name, r.version) for r in resources
    ]


def test_replace_checks_the_merged_snapshot() -> None:
    snap = fixtures.snapshot(POOLS, listeners={"l": "a"})
    clusters = [fixtures.cluster(n, connect_timeout_ms=2000) for n in POOLS]
    replaced = snap.replace(ResourceType.CLUSTER, clusters)
    assert replaced.versions[ResourceType.CLUSTER] != snap.versions[ResourceType.CLUSTER]
    assert replaced.versions[ResourceType.ENDPOINT] == snap.versions[ResourceType.ENDPOINT]
    relisted = snap.replace(ResourceType.LISTENER, [fixtures.api_listener("l", "route-l")])
    assert relisted.versions == snap.versions
    with pytest.raises(InconsistentSnapshotError):
        snap.replace(ResourceType.CLUSTER, [*clusters, fixtures.cluster("c")])


def test_a_snapshot_without_runtime_is_valid_and_replacing_runtime_changes_only_rtds() -> None:
    snap = fixtures.snapshot(POOLS, listeners={"l": "a"})
    assert snap.names(ResourceType.RUNTIME) == frozenset()
    with_layer = snap.replace(ResourceType.RUNTIME, [fixtures.runtime({"k": 1})])
    assert with_layer.names(ResourceType.RUNTIME) == {fixtures.RUNTIME_LAYER}
    changed = {t for t in ResourceType if with_layer.versions[t] != snap.versions[t]}
    assert changed == {ResourceType.RUNTIME}
    assert "rtds" in with_layer.to_json()
