"""Session keys from Envoy's upstream log: hashed at once, counted with decay, bounded."""

from __future__ import annotations

import math

import pytest
import xxhash
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2

from xds_server.app import LoggedKeyCounts
from xds_server.envoy import names
from xds_server.telemetry import Telemetry
from xds_server.xds.session_keys import KeySeen, SessionKeys, SessionKeyStream, key_hash


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(
    key: str | None, *, cluster: str = "p/session", port: int | None = 8000
) -> accesslog_pb2.HTTPAccessLogEntry:
    """An UpstreamPoolReady entry of the session-key log; `port` None: the stream went to a
    spilling pod's internal listener (no socket address)."""
    address = address_pb2.Address()
    if port is not None:
        address.socket_address.CopyFrom(
            address_pb2.SocketAddress(address="10.0.0.1", port_value=port)
        )
    else:
        # As Envoy 1.40 logs it: the spill listener, the spilling pod's ring key.
        address.envoy_internal_address.server_listener_name = "p/spill"
        address.envoy_internal_address.endpoint_id = "10.0.0.1:8000"
    headers = {names.SESSION_HEADER: key} if key is not None else {}
    return accesslog_pb2.HTTPAccessLogEntry(
        common_properties=accesslog_pb2.AccessLogCommon(
            access_log_type=accesslog_pb2.UpstreamPoolReady,
            upstream_cluster=cluster,
            upstream_remote_address=address,
        ),
        request=accesslog_pb2.HTTPRequestProperties(request_headers=headers),
    )


CLUSTERS = frozenset({"p", "p/session", "p/session/critical", "q/session"})


def store(clock: Clock, telemetry: Telemetry | None = None, **bounds: float) -> SessionKeys:
    return SessionKeys(
        header=names.SESSION_HEADER,
        pool_of=names.session_pool,
        telemetry=telemetry or Telemetry(),
        known_clusters=lambda: CLUSTERS,
        clock=clock,
        **bounds,  # type: ignore[arg-type]
    )


def test_a_key_is_kept_as_envoys_xxhash64_seed_0_with_its_count_and_pod() -> None:
    keys = store(Clock())
    for _ in range(3):
        assert keys.logged(entry("user-7")) is None
    assert key_hash("user-7") == xxhash.xxh64_intdigest(b"user-7", seed=0)
    assert keys.snapshot() == {"p": {key_hash("user-7"): KeySeen(3.0, "10.0.0.1:8000")}}


def test_the_clear_key_is_not_kept() -> None:
    keys = store(Clock())
    keys.logged(entry("alice-secret-key"))
    assert "alice-secret-key" not in repr(vars(keys))


def test_counts_halve_every_half_life_and_a_key_unseen_for_long_is_forgotten() -> None:
    clock = Clock()
    keys = store(clock, half_life_s=10.0, forget_after_s=100.0)
    keys.logged(entry("a"))
    keys.logged(entry("a"))
    clock.now += 10
    assert keys.snapshot()["p"][key_hash("a")].count == pytest.approx(1.0)
    keys.logged(entry("a"))
    clock.now += 20
    assert keys.snapshot()["p"][key_hash("a")].count == pytest.approx(0.5)
    # A snapshot at a time of the caller's choosing.
    assert keys.snapshot(clock.now + 10)["p"][key_hash("a")].count == pytest.approx(0.25)
    clock.now += 101
    assert keys.snapshot() == {}


def test_a_key_takes_the_pod_it_was_last_served_by_and_spilled_requests_count_without_moving_it(
) -> None:
    keys = store(Clock())
    keys.logged(entry("a", port=8000))
    keys.logged(entry("a", port=8001))
    keys.logged(entry("a", port=None))
    keys.logged(entry("b", port=None))
    pool = keys.snapshot()["p"]
    assert pool[key_hash("a")] == KeySeen(3.0, "10.0.0.1:8001")
    assert pool[key_hash("b")] == KeySeen(1.0, None)


def test_each_pods_return_share_counts_requests_back_on_their_keys_last_pod() -> None:
    """Per endpoint: a key's first request, its first on another pod are no returns, a
    spilled one (pod unknown) is not counted; the sums halve every `return_half_life_s`.
    The pool's gauge pools its pods' sums decayed to the snapshot."""
    clock = Clock()
    telemetry = Telemetry()
    keys = store(clock, telemetry, return_half_life_s=10.0)
    assert keys.return_shares() == {}

    def gauge() -> float | None:
        return telemetry.registry.get_sample_value("xds_session_key_returns", {"pool": "p"})

    a, b = "10.0.0.1:8000", "10.0.0.1:8001"
    keys.logged(entry("x", port=8000))  # first
    keys.logged(entry("x", port=8000))  # returned
    keys.logged(entry("x", port=8001))  # moved: first on b
    keys.logged(entry("x", port=None))  # spilled: not counted
    keys.logged(entry("y", cluster="q/session"))
    assert keys.return_shares() == {"p": {a: 0.5, b: 0.0}, "q": {a: 0.0}}
    clock.now += 10.0
    keys.logged(entry("x", port=8001))  # returned to b, worth twice its first
    assert keys.return_shares()["p"][b] == pytest.approx(1 / (0.5 + 1))
    keys.snapshot()
    # a's sums (1 of 2) and b's (1 of 1.5), a's decayed by half since.
    assert gauge() == pytest.approx((0.5 + 1) / (1 + 1.5))
    # Forgotten with the keys: no share, and no gauge.
    clock.now += 10_000.0
    keys.snapshot()
    assert keys.return_shares() == {} and gauge() is None


def test_the_endpoints_with_returns_are_bounded_per_pool() -> None:
    keys = store(Clock(), max_keys=2)
    for port in (8000, 8001, 8002):
        keys.logged(entry(f"k{port}", port=port))
    assert set(keys.return_shares()["p"]) == {"10.0.0.1:8001", "10.0.0.1:8002"}


def test_first_requests_of_keys_on_a_pod_count_for_the_window_given() -> None:
    """A key's first request, and its first on another pod, count on that pod while they
    are newer than `within_s`; a return, or a spilled request (pod unknown), does not."""
    clock = Clock()
    keys = store(clock)
    a, b = "10.0.0.1:8000", "10.0.0.1:8001"
    keys.logged(entry("x", port=8000))  # first
    keys.logged(entry("x", port=8000))  # returned
    keys.logged(entry("x", port=None))  # spilled
    clock.now += 0.3
    keys.logged(entry("y", port=8000))  # first
    keys.logged(entry("x", port=8001))  # moved: first on b
    keys.logged(entry("z", cluster="q/session"))
    assert keys.first_requests(1.0) == {"p": {a: 2, b: 1}, "q": {a: 1}}
    assert keys.first_requests(0.1) == {"p": {a: 1, b: 1}, "q": {a: 1}}
    clock.now += 1.0
    assert keys.first_requests(1.0) == {}


def test_first_requests_are_bounded_per_pool_the_latest_kept() -> None:
    keys = store(Clock(), max_keys=2)
    for port in (8000, 8001, 8002):
        keys.logged(entry(f"k{port}", port=port))
    assert keys.first_requests(60.0) == {"p": {"10.0.0.1:8001": 1, "10.0.0.1:8002": 1}}


def test_the_controllers_first_requests_are_the_same_object_while_the_same() -> None:
    clock = Clock()
    keys = store(clock)
    counts = LoggedKeyCounts(keys, clock=clock)
    none = counts.first_requests(0.5)
    assert none == {} and counts.first_requests(0.5) is none
    keys.logged(entry("alice"))
    seen = counts.first_requests(0.5)
    assert seen == {"p": {"10.0.0.1:8000": 1}} and counts.first_requests(0.5) is seen
    clock.now += 1.0
    assert counts.first_requests(0.5) == {}


def test_pools_come_from_session_clusters_with_or_without_a_band() -> None:
    keys = store(Clock())
    keys.logged(entry("a", cluster="p/session/critical"))
    keys.logged(entry("b", cluster="q/session"))
    snapshot = keys.snapshot()
    assert {pool: set(k) for pool, k in snapshot.items()} == {
        "p": {key_hash("a")},
        "q": {key_hash("b")},
    }


def test_unknown_clusters_other_lanes_oversized_and_missing_keys_are_dropped_and_counted() -> None:
    telemetry = Telemetry()
    keys = store(Clock(), telemetry, max_key_bytes=16)
    stream = SessionKeyStream(stream_id=1, keys=keys, telemetry=telemetry)
    stream.log(
        [
            entry("a", cluster="gone/session"),
            entry("a", cluster="p"),
            entry("x" * 17),
            entry("é" * 9),  # 9 characters, 18 bytes
            entry(None),
            entry("x" * 16),
        ]
    )
    registry = telemetry.registry

    def dropped(reason: str) -> float | None:
        return registry.get_sample_value(
            "xds_session_key_dropped_entries_total", {"reason": reason}
        )

    assert dropped("unknown_cluster") == 1
    assert dropped("not_session") == 1
    assert dropped("oversized_key") == 2
    assert dropped("no_key") == 1
    assert registry.get_sample_value("xds_session_key_entries_total") == 1
    assert set(keys.snapshot()["p"]) == {key_hash("x" * 16)}
    assert registry.get_sample_value("xds_session_keys", {"pool": "p"}) == 1


def test_over_the_bound_the_smallest_counts_go_and_the_busy_keys_stay() -> None:
    clock = Clock()
    keys = store(clock, max_keys=16)
    busy = [f"busy-{i}" for i in range(4)]
    for key in busy:
        for _ in range(5):
            keys.logged(entry(key))
    for i in range(100):
        clock.now += 0.001
        keys.logged(entry(f"once-{i}"))
        assert len(keys.snapshot()["p"]) <= 16
    pool = keys.snapshot()["p"]
    assert {key_hash(k) for k in busy} <= set(pool)
    # The newest single keys are kept over the older ones they replaced (a count of one
    # decays least for the newest).
    assert key_hash("once-99") in pool and key_hash("once-0") not in pool


def test_an_older_count_decays_below_a_newer_one_when_evicting() -> None:
    clock = Clock()
    keys = store(clock, max_keys=8, half_life_s=1.0)
    for _ in range(4):
        keys.logged(entry("old"))
    clock.now += 10  # 4 requests, 10 half-lives ago: about 0.004
    for i in range(8):
        keys.logged(entry(f"new-{i}"))
    assert key_hash("old") not in keys.snapshot()["p"]


def test_the_snapshot_is_a_read_only_copy() -> None:
    keys = store(Clock())
    keys.logged(entry("a"))
    snapshot = keys.snapshot()
    keys.logged(entry("b"))
    assert set(snapshot["p"]) == {key_hash("a")}
    with pytest.raises(TypeError):
        snapshot["p"][1] = KeySeen(1.0, None)  # type: ignore[index]


def test_a_new_key_or_a_moved_key_bumps_the_revision_and_tells_the_subscriber() -> None:
    keys = store(Clock())
    told: list[frozenset[str]] = []
    keys.subscribe(lambda pools: told.append(frozenset(pools)))
    keys.logged(entry("a", port=8000))
    keys.logged(entry("a", port=8000))
    keys.logged(entry("a", port=None))
    assert (keys.revision, told) == (1, [{"p"}])
    keys.logged(entry("a", port=8001))
    keys.logged(entry("b", cluster="q/session"))
    assert (keys.revision, told) == (3, [{"p"}, {"p"}, {"q"}])


def test_bounds_must_be_positive() -> None:
    for bound in ("half_life_s", "return_half_life_s", "max_keys"):
        with pytest.raises(ValueError, match="positive"):
            store(Clock(), **{bound: 0})
    assert math.isfinite(store(Clock(), max_keys=1)._decay)


def test_the_controllers_counts_are_the_same_object_until_keys_are_logged() -> None:
    """LoggedKeyCounts (app.py): an idle pool's decision is skipped by identity, so its
    counts stay the same object until a key is new or moves, or keys were logged and the
    refresh interval passed."""
    clock = Clock()
    keys = store(clock)
    counts = LoggedKeyCounts(keys, clock=clock, refresh_s=2.0)
    first = counts()
    assert first == {} and counts() is first
    keys.logged(entry("alice"))
    seen = counts()
    assert seen == {"p": {key_hash("alice"): pytest.approx(1.0)}}
    clock.now += 5.0
    assert counts() is seen, "nothing logged since"
    keys.logged(entry("alice"))
    assert counts()["p"][key_hash("alice")] > seen["p"][key_hash("alice")], "refreshed"
    again = counts()
    keys.logged(entry("alice"))
    clock.now += 1.0
    assert counts() is again, "logged, but within the refresh interval"
    keys.logged(entry("bob"))
    assert key_hash("bob") in counts()["p"], "a new key: at once"


def test_the_controllers_return_shares_are_read_with_the_own_keys() -> None:
    """LoggedKeyCounts.returns: the own Envoys' return shares, the same object until the
    own keys are read anew (a new key at once, else every refresh interval)."""
    clock = Clock()
    keys = store(clock)
    counts = LoggedKeyCounts(keys, clock=clock, refresh_s=2.0)
    assert counts.returns() == {}
    keys.logged(entry("alice"))
    first = counts.returns()
    assert first == {"p": {"10.0.0.1:8000": 0.0}} and counts.returns() is first
    keys.logged(entry("alice"))
    assert counts.returns() is first, "within the refresh interval"
    clock.now += 2.0
    assert counts.returns()["p"]["10.0.0.1:8000"] == pytest.approx(0.5, rel=0.1)


def test_peers_keys_are_added_to_the_own_and_the_own_alone_is_reported() -> None:
    """LoggedKeyCounts adds the peers' keys (peering/links.py) to this replica's own for
    the controller; peers are sent the own keys only (theirs would come back doubled),
    the same report object until the own keys change."""
    clock = Clock()
    keys = store(clock)
    peer_keys: list[dict[str, dict[int, float]]] = [{}]
    counts = LoggedKeyCounts(keys, clock=clock, peers=lambda: peer_keys[0])
    keys.logged(entry("alice"))
    own = counts()
    assert own == {"p": {key_hash("alice"): pytest.approx(1.0)}}
    report = counts.report()
    assert report.pools == {"p": ((key_hash("alice"), 1.0),)} and counts.report() is report
    peer_keys[0] = {"p": {key_hash("alice"): 2.0, 5: 1.0}, "q": {6: 3.0}}
    added = counts()
    assert added == {"p": {key_hash("alice"): 3.0, 5: 1.0}, "q": {6: 3.0}}
    assert counts() is added, "the same object while neither part changed"
    assert counts.report() is report, "the peers' keys are not reported"
    keys.logged(entry("bob"))
    assert key_hash("bob") in counts()["p"]
    assert {h for h, _ in counts.report().pools["p"]} == {key_hash("alice"), key_hash("bob")}


def test_where_keys_were_served_the_own_envoys_first_and_reported_for_bucketed_pools() -> None:
    """LoggedKeyCounts.served_by: the pod each key was last served by, the own Envoys'
    word over the peers'; peers are sent the own only, and only for the pools that keep
    key buckets (the controller's table names them)."""
    clock = Clock()
    keys = store(clock)
    peer_said = {"p": {key_hash("alice"): "10.0.0.9:8000", 7: "x:1"}}
    peers: list[dict[str, dict[int, str]]] = [peer_said]
    tables: list[tuple[dict[str, dict[str, tuple[int, ...]]], dict[str, tuple[str, ...]]]] = [
        ({}, {})
    ]
    counts = LoggedKeyCounts(
        keys, clock=clock, peers_served_by=lambda: peers[0], buckets=lambda: tables[0]
    )
    keys.logged(entry("alice", port=8001))
    keys.logged(entry("bob", port=None))  # only through the spill listener: no pod
    served = counts.served_by()
    assert served == {"p": {key_hash("alice"): "10.0.0.1:8001", 7: "x:1"}}
    assert counts.served_by() is served, "the same object while neither part changed"
    assert counts.report().served_by == {}, "no pool keeps buckets"
    tables[0] = ({"p": {}}, {"p": ("10.0.0.1:8001",)})
    report = counts.report()
    assert report.served_by == {"p": {key_hash("alice"): "10.0.0.1:8001"}}
    assert report.spares == {"p": ("10.0.0.1:8001",)}
