"""The controller: debouncing, EDS-only rebuilds, and keeping the last good snapshot.

Timing is on the event loop's clock, which these tests fast-forward (looptime): a sleep of
0.3 s is 0.3 s of the controller's time however busy the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest

from xds_server.config import Band, RoutingConfig, parse_config
from xds_server.controller import LOAD_DECISION_GAP_S, Controller, LoadSource, RemotesSource
from xds_server.envoy.names import band_clusters, long_prompt_clusters
from xds_server.errors import ConfigError
from xds_server.policy.admission import BandLoad
from xds_server.policy.decision import Decider, FleetLoad, PoolLoad
from xds_server.policy.failover import RemoteView
from xds_server.policy.shares import EnvoyDemand
from xds_server.policy.signals import PodSignals
from xds_server.snapshot_builder import SnapshotBuilder
from xds_server.telemetry import Telemetry
from xds_server.tuning import MAX_WEIGHT
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.resources import ResourceType


def config(
    weight: int = 1, *, models: str = "[m]", debounce_s: float = 0.05, max_delay_s: float = 1.0
):  # type: ignore[no-untyped-def]
    return parse_config(
        f"""
        updates: {{debounce_s: {debounce_s}, max_delay_s: {max_delay_s}}}
        pools:
          - name: pool
            models: {models}
            endpoints: [{{address: 10.0.0.1, port: 8000, weight: {weight}}}]
        """
    )


@pytest.fixture
async def running() -> AsyncIterator[tuple[Controller, SnapshotCache, Telemetry]]:
    telemetry, cache = Telemetry(), SnapshotCache()
    controller = Controller(cache=cache, telemetry=telemetry)
    task = asyncio.create_task(controller.run())
    yield controller, cache, telemetry
    task.cancel()


def test_endpoint_only_change_rebuilds_only_endpoints() -> None:
    builder = SnapshotBuilder()
    first = builder.build(config(1))
    second = builder.build(config(2))
    for kept in (ResourceType.CLUSTER, ResourceType.LISTENER, ResourceType.ROUTE):
        assert second.resources[kept] is first.resources[kept]
    assert second.versions[ResourceType.ENDPOINT] != first.versions[ResourceType.ENDPOINT]
    third = builder.build(config(2, models="[m, n]"))
    assert third.versions[ResourceType.ROUTE] != second.versions[ResourceType.ROUTE]
    assert third.versions[ResourceType.CLUSTER] == second.versions[ResourceType.CLUSTER]


@pytest.mark.looptime
async def test_a_burst_of_changes_makes_one_snapshot(running) -> None:  # type: ignore[no-untyped-def]
    controller, cache, telemetry = running
    for weight in range(1, 11):
        controller.submit(config(weight))
        await asyncio.sleep(0.005)
    snapshot = await asyncio.wait_for(controller.settled(), 2)
    assert snapshot is not None
    assert telemetry.registry.get_sample_value("xds_snapshot_updates_total", {"group": ""}) == 1
    entry = cache.entry_for("")
    assert entry is not None and entry.snapshot is snapshot
    [cla] = snapshot.resources[ResourceType.ENDPOINT].values()
    assert cla.message.endpoints[0].lb_endpoints[0].load_balancing_weight.value == 10


@pytest.mark.looptime
async def test_max_delay_bounds_a_never_ending_burst(running) -> None:  # type: ignore[no-untyped-def]
    controller, _, telemetry = running
    loop = asyncio.get_running_loop()
    started = loop.time()
    weight = 1
    while telemetry.registry.get_sample_value("xds_snapshot_updates_total", {"group": ""}) is None:
        weight += 1
        controller.submit(config(weight, debounce_s=0.1, max_delay_s=0.3))
        await asyncio.sleep(0.02)
        assert loop.time() - started < 2, "no snapshot although changes kept coming"
    assert loop.time() - started >= 0.25


@pytest.mark.looptime
async def test_rejected_config_keeps_the_last_good_snapshot(running) -> None:  # type: ignore[no-untyped-def]
    controller, cache, telemetry = running
    controller.submit(config(3))
    good = await asyncio.wait_for(controller.settled(), 2)
    controller.reject(ConfigError("config.yaml: pools.0.name: bad"))
    assert controller.last_error == "config.yaml: pools.0.name: bad"
    assert controller.ready and controller.snapshot is good
    entry = cache.entry_for("")
    assert entry is not None and entry.snapshot is good
    assert telemetry.registry.get_sample_value("xds_config_reloads_total", {"result": "error"}) == 1
    assert telemetry.registry.get_sample_value("xds_config_last_reload_successful") == 0


@pytest.mark.looptime
async def test_the_good_config_restored_clears_the_error(running) -> None:  # type: ignore[no-untyped-def]
    controller, _, telemetry = running
    controller.submit(config(3))
    good = await asyncio.wait_for(controller.settled(), 2)
    controller.reject(ConfigError("config.yaml: pools.0.name: bad"))
    controller.submit(config(3))  # the same config as in force: nothing to rebuild
    assert controller.last_error is None
    assert telemetry.registry.get_sample_value("xds_config_last_reload_successful") == 1
    assert telemetry.registry.get_sample_value("xds_config_reloads_total", {"result": "ok"}) == 2
    assert controller.snapshot is good


class FakeLoad:
    """A LoadSource for the pool named "pool": in-flight counts per band, long prompts per
    endpoint id, and the Envoys (node ids), each with an equal part of the requests."""

    def __init__(
        self, in_flight: dict[Band, int], *, envoys: tuple[str, ...] = (), rate: float = 2.0
    ) -> None:
        self.in_flight = in_flight
        self.envoys = envoys
        self.rate = rate
        self.long_prompts: dict[str, int] = {}

    def fleet_load(self, config: RoutingConfig) -> FleetLoad:
        share = (
            {
                band: EnvoyDemand(in_flight=count // len(self.envoys))
                for band, count in self.in_flight.items()
            }
            if self.envoys
            else {}
        )
        bands = BandLoad(
            in_flight=self.in_flight,
            completions_per_s=self.rate,
            by_envoy=dict.fromkeys(self.envoys, share),
        )
        return FleetLoad(pools={"pool": PoolLoad(bands=bands, long_prompts=self.long_prompts)})


_: type[LoadSource] = FakeLoad


FLOW = """
updates: {debounce_s: 0.01, max_delay_s: 0.1}
balancing: {scrape_interval_s: 0.05}
flow_control:
  {enabled: true, default_pod_concurrency: 10, critical_headroom: 0, sheddable_utilization: 1}
pools:
  - name: pool
    models: [m]
    gpu_aware: false
    endpoints: [{address: 10.0.0.1, port: 8000}, {address: 10.0.0.2, port: 8000}]
"""


@pytest.mark.looptime
async def test_flow_control_sets_band_limits_over_rtds_and_retry_after_over_rds() -> None:
    telemetry, cache = Telemetry(), SnapshotCache()
    load = FakeLoad({"critical": 4, "standard": 10}, envoys=("a", "b"))
    controller = Controller(cache=cache, telemetry=telemetry, load=load)
    task = asyncio.create_task(controller.run())
    standard = "circuit_breakers.pool/standard.default.max_requests"
    sheddable = "circuit_breakers.pool/sheddable.default.max_requests"

    def layer_of(node_id: str) -> dict[str, float]:
        entry = cache.entry_for("", node_id)
        assert entry is not None
        [runtime] = entry.snapshot.resources[ResourceType.RUNTIME].values()
        return dict(runtime.message.layer)

    try:
        controller.submit(parse_config(FLOW))
        first = await asyncio.wait_for(controller.settled(), 2)
        assert first is not None
        # Capacity 20 (2 pods x 10); Standard gets 20 - 4, Sheddable 20 - 14, over the
        # fleet; each Envoy (equal demand) half, and one not named yet its floor (1).
        assert (layer_of("a")[standard], layer_of("b")[standard]) == (8, 8)
        assert layer_of("a")[sheddable] + layer_of("b")[sheddable] == 6
        assert layer_of("new")[standard] == layer_of("new")[sheddable] == 1
        assert layer_of("a")["circuit_breakers.pool/critical.default.max_requests"] >= 1_000_000
        assert controller.decision.admissions["pool"].retry_after_s["sheddable"] == 1

        # The pool fills up: limits move over RTDS alone, Retry-After over RDS alone.
        load.in_flight = {"critical": 10, "standard": 30}
        await asyncio.sleep(0.3)
        second = controller.snapshot
        assert second is not None
        # Standard 20 - 10 over the fleet, but each Envoy holds 15: nothing more starts.
        assert (layer_of("a")[standard], layer_of("b")[standard]) == (5, 5)
        assert layer_of("a")[sheddable] == layer_of("new")[sheddable] == 0
        # 40 in flight for 20 places, 2 completions/s: 21 to finish first, about 10 s.
        assert controller.decision.admissions["pool"].retry_after_s["sheddable"] == 12
        assert second.versions[ResourceType.ROUTE] != first.versions[ResourceType.ROUTE]
        for kept in (ResourceType.CLUSTER, ResourceType.LISTENER, ResourceType.ENDPOINT):
            assert second.versions[kept] == first.versions[kept]
            assert cache.entry_for("", "a").snapshot.versions[kept] == second.versions[kept]  # type: ignore[union-attr]
    finally:
        task.cancel()


LONG_PROMPTS = """
updates: {debounce_s: 0.5, max_delay_s: 1.0}
balancing: {scrape_interval_s: 60, smoothing: 1}
pools:
  - name: pool
    models: [m]
    endpoints: [{address: 10.0.0.1, port: 8000}, {address: 10.0.0.2, port: 8000}]
"""


def _weights(snapshot) -> dict[str, int]:  # type: ignore[no-untyped-def]
    cla = snapshot.resources[ResourceType.ENDPOINT]["pool"].message
    weights = {}
    for lb_endpoint in cla.endpoints[0].lb_endpoints:
        address = lb_endpoint.endpoint.address.socket_address
        weights[f"{address.address}:{address.port_value}"] = lb_endpoint.load_balancing_weight.value
    return weights


@pytest.mark.looptime
async def test_a_long_prompt_reported_in_flight_cuts_its_pods_weight_at_once() -> None:
    telemetry, cache = Telemetry(), SnapshotCache()
    load = FakeLoad({})
    pods = {
        key: PodSignals(silent_s=0.1, waiting=0, running=2)
        for key in ("10.0.0.1:8000", "10.0.0.2:8000")
    }
    controller = Controller(cache=cache, telemetry=telemetry, signals=lambda now: pods, load=load)
    task = asyncio.create_task(controller.run())
    try:
        controller.submit(parse_config(LONG_PROMPTS))
        first = await asyncio.wait_for(controller.settled(), 2)
        assert _weights(first) == {"10.0.0.1:8000": MAX_WEIGHT, "10.0.0.2:8000": MAX_WEIGHT}

        # Another cluster's load changing is no reason to re-score.
        load.long_prompts = {"10.0.0.2:8000": 1}
        controller.load_changed({"pool"})
        await asyncio.sleep(0.2)
        assert controller.snapshot is first

        # The long-prompt cluster's is, without waiting for the debounce (0.5 s).
        controller.load_changed({"pool/long"})
        await asyncio.sleep(0.1)
        assert controller.snapshot is not None
        weights = _weights(controller.snapshot)
        assert weights["10.0.0.1:8000"] == MAX_WEIGHT
        assert weights["10.0.0.2:8000"] == pytest.approx(MAX_WEIGHT / 100, rel=0.15)

        # The long prompt finished: the weight is back as soon as that is reported.
        load.long_prompts = {}
        controller.load_changed({"pool/long"})
        await asyncio.sleep(0.1)
        assert _weights(controller.snapshot) == _weights(first)
    finally:
        task.cancel()


# LONG_PROMPTS' pool with session affinity, keeping key buckets (the default).
BUCKET_POOL = LONG_PROMPTS.replace("smoothing: 1}", "smoothing: 1, new_key_prefill_s: 2}").replace(
    "models: [m]", "models: [m]\n    session_affinity: true"
)


@pytest.mark.looptime
async def test_a_key_new_to_its_pod_passes_the_pod_over_for_new_keys_at_once() -> None:
    """A key's first request on a pod, logged, takes the pod out of the spares within the
    debounce (0.5 s), with no new metrics (scraped every 60 s); the window asked for is
    the config's."""
    telemetry, cache = Telemetry(), SnapshotCache()
    pods = {
        key: PodSignals(silent_s=0.1, waiting=0, running=2)
        for key in ("10.0.0.1:8000", "10.0.0.2:8000")
    }
    firsts: dict[str, Mapping[str, int]] = {}
    windows: list[float] = []

    def first_requests(within_s: float) -> Mapping[str, Mapping[str, int]]:
        windows.append(within_s)
        return firsts

    controller = Controller(
        cache=cache,
        telemetry=telemetry,
        signals=lambda now: pods,
        first_requests=first_requests,
    )

    def spares() -> set[str]:
        return {e.id for e in controller.decision.pools["pool"].endpoints if e.key_spare}

    task = asyncio.create_task(controller.run())
    try:
        controller.submit(parse_config(BUCKET_POOL))
        first = await asyncio.wait_for(controller.settled(), 2)
        assert spares() == set(pods) and set(windows) == {2.0}

        firsts = {"pool": {"10.0.0.2:8000": 1}}
        controller.keys_changed({"other"})
        await asyncio.sleep(1.0)
        assert controller.snapshot is first, "another pool's keys are no reason to decide"
        controller.keys_changed({"pool"})
        await asyncio.sleep(0.4)
        assert controller.snapshot is first, "not before the debounce"
        await asyncio.sleep(0.2)
        assert spares() == {"10.0.0.1:8000"}
        assert controller.snapshot is not first
    finally:
        task.cancel()


def test_a_band_is_admitted_in_every_lane_and_long_prompts_are_found_in_each_band() -> None:
    config = parse_config(FLOW.replace("gpu_aware: false", "session_affinity: true"))
    (pool,) = config.pools
    assert config.lanes(pool) == ("pool", "session", "long")
    assert band_clusters(config, pool)["standard"] == [
        "pool/standard",
        "pool/session/standard",
        "pool/long/standard",
    ]
    assert long_prompt_clusters(config, pool) == [
        "pool/long/critical",
        "pool/long/standard",
        "pool/long/sheddable",
    ]
    plain = parse_config(LONG_PROMPTS)
    assert long_prompt_clusters(plain, plain.pools[0]) == ["pool/long"]
    off = parse_config(FLOW)
    assert off.lanes(off.pools[0]) == ("pool",)
    assert long_prompt_clusters(off, off.pools[0]) == []


WARM = """
updates: {debounce_s: 0.01, max_delay_s: 0.1}
balancing: {scrape_interval_s: 0.25, scrape_timeout_s: 1.0, smoothing: 1}
pools:
  - name: pool
    models: [m]
    endpoints: [{address: 10.0.0.1, port: 8000}, {address: 10.0.0.2, port: 8000}]
"""


@pytest.mark.looptime
async def test_the_first_snapshot_waits_for_every_pods_first_scrape() -> None:
    telemetry, cache = Telemetry(), SnapshotCache()
    pods: dict[str, PodSignals] = {"10.0.0.1:8000": PodSignals(silent_s=0, waiting=0, running=2)}
    controller = Controller(
        cache=cache, telemetry=telemetry, signals=lambda now: dict(pods), load=None
    )
    task = asyncio.create_task(controller.run())
    try:
        controller.submit(parse_config(WARM))
        await asyncio.sleep(0.5)
        # B has not answered yet: pushing now would give it a placeholder weight.
        assert controller.snapshot is None
        pods["10.0.0.2:8000"] = PodSignals(silent_s=0, waiting=4, running=2)
        controller.metrics_changed()
        first = await asyncio.wait_for(controller.settled(), 2)
        assert first is not None
        weights = _weights(first)
        assert weights["10.0.0.2:8000"] < weights["10.0.0.1:8000"] == MAX_WEIGHT
    finally:
        task.cancel()


@pytest.mark.looptime
async def test_a_pod_that_never_answers_delays_the_first_snapshot_only_briefly() -> None:
    telemetry, cache = Telemetry(), SnapshotCache()
    pods = {"10.0.0.1:8000": PodSignals(silent_s=0, waiting=0, running=2)}
    controller = Controller(cache=cache, telemetry=telemetry, signals=lambda now: pods)
    task = asyncio.create_task(controller.run())
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        controller.submit(parse_config(WARM))
        assert await asyncio.wait_for(controller.settled(), 5) is not None
        # A scrape timeout and an interval (1.25 s), and at most one interval more.
        assert 1.25 <= loop.time() - started <= 1.6
    finally:
        task.cancel()


@pytest.mark.looptime
async def test_decisions_due_to_load_come_at_most_every_50_ms() -> None:
    """However often load changes are reported (an Envoy toggling long prompts), Envoys
    are not pushed more often than LOAD_DECISION_GAP_S."""
    telemetry, cache = Telemetry(), SnapshotCache()
    load = FakeLoad({})
    pods = {
        key: PodSignals(silent_s=0.1, waiting=0, running=2)
        for key in ("10.0.0.1:8000", "10.0.0.2:8000")
    }
    controller = Controller(cache=cache, telemetry=telemetry, signals=lambda now: pods, load=load)
    task = asyncio.create_task(controller.run())
    try:
        controller.submit(parse_config(LONG_PROMPTS))
        await asyncio.wait_for(controller.settled(), 2)
        pushes = 0
        for i in range(200):  # every 5 ms for 1 s; a long prompt on for 35 ms, off for 35
            load.long_prompts = {"10.0.0.2:8000": 1} if (i // 7) % 2 else {}
            before = controller.snapshot
            controller.load_changed({"pool/long"})
            await asyncio.sleep(0.005)
            pushes += controller.snapshot is not before
        assert 5 <= pushes <= 1.0 / LOAD_DECISION_GAP_S + 2
    finally:
        task.cancel()


@pytest.mark.looptime
@pytest.mark.parametrize(
    ("owner", "stage"), [(SnapshotBuilder, "build_steps"), (Decider, "steps")]
)
async def test_an_internal_error_while_deciding_or_building_keeps_the_last_snapshot_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, owner: object, stage: str
) -> None:
    telemetry, cache = Telemetry(), SnapshotCache()
    controller = Controller(cache=cache, telemetry=telemetry)
    task = asyncio.create_task(controller.run())
    try:
        controller.submit(config(1))
        good = await asyncio.wait_for(controller.settled(), 2)

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug")

        with monkeypatch.context() as patch:
            patch.setattr(owner, stage, broken)
            controller.submit(config(2))
            await asyncio.sleep(1)
            assert controller.snapshot is good and "a bug" in (controller.last_error or "")
        # The controller is still running: the next config is applied.
        controller.submit(config(3))
        await asyncio.sleep(1)
        assert controller.snapshot is not good and not task.done()
    finally:
        task.cancel()


async def test_cancelled_as_it_is_woken_the_controller_stops() -> None:
    """Python 3.11's `asyncio.wait_for` returns the result, swallowing the cancellation,
    when its awaitable completes in the same loop pass as the cancel: a controller woken as
    the server stops then ran on, and the server's shutdown waited for it forever."""
    telemetry, cache = Telemetry(), SnapshotCache()
    pods = {"10.0.0.1:8000": PodSignals(silent_s=0, waiting=0, running=2)}
    controller = Controller(cache=cache, telemetry=telemetry, signals=lambda now: pods)
    task = asyncio.create_task(controller.run())
    controller.submit(parse_config(WARM))
    assert await asyncio.wait_for(controller.settled(), 10) is not None
    # Waiting for the next scrape interval, with a timeout: woken and cancelled at once.
    controller.metrics_changed()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


SESSION_POOL = """
updates: {debounce_s: 0.05}
pools:
  - name: gpu
    models: [m]
    session_affinity: true
    endpoints: [{address: 10.0.0.1, port: 8000}]
"""


@pytest.mark.looptime
async def test_an_envoy_refusing_the_spill_listener_turns_spills_to_the_ring(running) -> None:  # type: ignore[no-untyped-def]
    controller, _, telemetry = running
    controller.submit(parse_config(SESSION_POOL))
    first = await asyncio.wait_for(controller.settled(), 2)
    assert first is not None and "gpu/spill" in first.resources[ResourceType.LISTENER]
    # Other NACKs change nothing: another type, another listener, or no listener named.
    controller.envoy_rejected("n", ResourceType.CLUSTER, "'gpu/spill': cluster trouble")
    controller.envoy_rejected("n", ResourceType.LISTENER, "error adding listener 'other'")
    controller.envoy_rejected("n", ResourceType.LISTENER, "gpu/spillover is not a name here")
    assert controller.spill_fallback is None
    assert telemetry.registry.get_sample_value("xds_spill_to_ring_fallback") == 0
    controller.envoy_rejected(
        "old",
        ResourceType.LISTENER,
        "Error adding/updating listener(s) gpu/spill: error adding listener named 'gpu/spill':"
        " InternalListener bootstrap extension is mandatory\n",
    )
    assert controller.spill_fallback is not None and "'old'" in controller.spill_fallback
    assert telemetry.registry.get_sample_value("xds_spill_to_ring_fallback") == 1
    await asyncio.sleep(0.1)
    snapshot = await asyncio.wait_for(controller.settled(), 2)
    assert snapshot is not None
    assert "gpu/spill" not in snapshot.resources[ResourceType.LISTENER]
    assert "gpu/spill" not in snapshot.resources[ResourceType.ROUTE]
    # The config as given is still what the server reports; it stays "ring" after a change.
    assert controller.config is not None and controller.config.balancing.spill_to == "pool"
    controller.submit(parse_config(SESSION_POOL.replace("port: 8000", "port: 8001")))
    await asyncio.sleep(0.1)
    changed = await asyncio.wait_for(controller.settled(), 2)
    assert changed is not None and changed is not snapshot
    assert "gpu/spill" not in changed.resources[ResourceType.LISTENER]


class SteadyLoad(FakeLoad):
    """A FakeLoad that hands out the same object while its figures stand, as the server's
    EnvoyLoad does."""

    def __init__(self, in_flight: dict[Band, int], *, envoys: tuple[str, ...] = ()) -> None:
        super().__init__(in_flight, envoys=envoys)
        self._last: tuple[dict[Band, int], FleetLoad] | None = None

    def fleet_load(self, config: RoutingConfig) -> FleetLoad:
        if self._last is None or self._last[0] != self.in_flight:
            self._last = (dict(self.in_flight), super().fleet_load(config))
        return self._last[1]


@pytest.mark.looptime
async def test_an_idle_fleet_is_not_decided_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every scrape interval the controller looks; while the config, the pods' signals and
    the Envoys' load are the objects it decided on last (and its memory came back as it
    went in), it decides nothing: an idle fleet of any size costs a few lookups."""
    decisions: list[object] = []
    steps = Decider.steps

    def counted(self: Decider, *args: object, **kwargs: object) -> object:
        decisions.append(args)
        return steps(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Decider, "steps", counted)
    telemetry, cache = Telemetry(), SnapshotCache()
    pods = {
        "10.0.0.1:8000": PodSignals(silent_s=0, waiting=0, running=2),
        "10.0.0.2:8000": PodSignals(silent_s=0, waiting=0, running=2),
    }
    signals = dict(pods)
    load = SteadyLoad({"critical": 1, "standard": 2}, envoys=("a", "b"))
    controller = Controller(
        cache=cache, telemetry=telemetry, signals=lambda now: signals, load=load
    )
    task = asyncio.create_task(controller.run())
    try:
        controller.submit(parse_config(WARM.replace("pools:", FLOW_ON + "pools:")))
        assert await asyncio.wait_for(controller.settled(), 10) is not None
        await asyncio.sleep(1.0)  # the memory settles (smoothing 1: at once)
        settled = len(decisions)
        await asyncio.sleep(5.0)  # twenty scrape intervals, nothing new
        assert len(decisions) == settled
        # New signals (a new object, as the source hands out on a new page): decided.
        signals = {**pods, "10.0.0.1:8000": PodSignals(silent_s=0, waiting=3, running=8)}
        controller.metrics_changed()
        await asyncio.sleep(0.5)
        assert len(decisions) > settled
        assert controller.decision.pools["pool"].endpoints[0].weight != (
            controller.decision.pools["pool"].endpoints[1].weight
        )
    finally:
        task.cancel()


FLOW_ON = "flow_control: {enabled: true}\n"


FAILOVER = """
updates: {debounce_s: 0.01, max_delay_s: 0.1}
balancing: {scrape_interval_s: 0.05}
flow_control: {enabled: true, default_pod_concurrency: 10}
pools:
  - name: pool
    models: [m]
    endpoints: [{address: 10.0.0.1, port: 8000}, {address: 10.0.0.2, port: 8000}]
    remotes: [{name: east, address: 192.0.2.1, port: 8080}]
"""


class FakeRemotes:
    """A RemotesSource: every remote at its configured address, no summary."""

    def views(self, config: RoutingConfig) -> Mapping[str, Mapping[str, RemoteView]]:
        return {
            p.name: {r.name: RemoteView(addresses=(r.address,)) for r in p.remotes}
            for p in config.pools
        }


_remotes: type[RemotesSource] = FakeRemotes


@pytest.mark.looptime
async def test_a_pool_failing_over_is_not_admitted_by_its_own_pods_capacity() -> None:
    telemetry, cache = Telemetry(), SnapshotCache()
    load = FakeLoad({"standard": 4}, envoys=("a",))
    pods = {
        key: PodSignals(silent_s=0, waiting=0, running=2)
        for key in ("10.0.0.1:8000", "10.0.0.2:8000")
    }
    controller = Controller(
        cache=cache,
        telemetry=telemetry,
        signals=lambda now: dict(pods),
        load=load,
        remotes=FakeRemotes(),
    )
    task = asyncio.create_task(controller.run())
    key = "circuit_breakers.pool/standard.default.max_requests"

    def layer() -> dict[str, float]:
        entry = cache.entry_for("", "a")
        assert entry is not None
        [runtime] = entry.snapshot.resources[ResourceType.RUNTIME].values()
        return dict(runtime.message.layer)

    try:
        controller.submit(parse_config(FAILOVER))
        await asyncio.wait_for(controller.settled(), 2)
        assert not controller.decision.failover["pool"].active
        assert "pool" in controller.decision.admissions
        assert key in layer()

        # Every pod down: all traffic to the remote, and no band limit from a capacity of 0.
        for name in pods:
            pods[name] = PodSignals(silent_s=1, waiting=0, running=0, down=True)
        controller.metrics_changed()
        await asyncio.sleep(0.3)
        plan = controller.decision.failover["pool"]
        assert plan.active and plan.share == 0
        assert "pool" not in controller.decision.admissions
        assert key not in layer()
        assert controller.failover_memory["pool"].failovers == 1
    finally:
        task.cancel()
