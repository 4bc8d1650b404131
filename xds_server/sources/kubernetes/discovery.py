"""Kubernetes discovery: the watches the inventory needs, and the config in force from them.

One list + watch per kind of Inference Extension object and namespace, and one per pod
selector and namespace (kopf-style: each a `ResourceWatcher` task). The pod watches follow
the pools: a config change or a new InferencePool that adds a selector starts a watch, one
that drops it stops the watch.

Every change from any watch marks the inventory dirty; it is rebuilt once per event-loop
turn (inventory.build_inventory, pure) and handed to `on_config`, whose debounce folds
bursts into one push. Nothing is published until every watch has listed once: a restarted
server must not push empty endpoint sets while its pod lists are still on the way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import kubernetes

from xds_server.config import RoutingConfig
from xds_server.settings import WatchSettings
from xds_server.sources.kubernetes.inventory import (
    ClusterView,
    PodWatch,
    build_inventory,
    objectives,
    pod_watches,
    pools_with_selectors,
)
from xds_server.sources.kubernetes.watch import ResourceKind, ResourceWatcher, watch_options
from xds_server.telemetry.kubernetes_api import KubernetesTelemetry

__all__ = ["INFERENCE_KINDS", "KubernetesDiscovery"]

logger = logging.getLogger(__name__)

# (group, version, plural) of the Inference Extension objects this server reads.
INFERENCE_KINDS = {
    "inferencepools": ("inference.networking.k8s.io", "v1"),
    "inferencemodelrewrites": ("inference.networking.x-k8s.io", "v1alpha2"),
    "inferenceobjectives": ("inference.networking.x-k8s.io", "v1alpha2"),
}


class KubernetesDiscovery:
    """Pods and Inference Extension objects, watched, turned into the config in force.

    Mutable state: the base config (`set_base`), the watchers and their tasks, the last
    problems reported. Use `run()` as a task; cancelling it stops every watch.
    """

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        *,
        namespaces: Iterable[str],
        on_config: Callable[[RoutingConfig], None],
        telemetry: KubernetesTelemetry | None = None,
        watch: WatchSettings | None = None,
    ) -> None:
        self._api = api_client
        self.namespaces = tuple(dict.fromkeys(namespaces))
        self._on_config = on_config
        self._telemetry = telemetry
        self._options = watch_options(watch or WatchSettings())
        self._base: RoutingConfig | None = None
        self._inference: dict[str, list[ResourceWatcher]] = {}
        self._pods: dict[PodWatch, ResourceWatcher] = {}
        self._tasks: dict[object, asyncio.Task[None]] = {}
        self._dirty = False
        self._running = False
        self.problems: tuple[str, ...] = ()
        self.published: RoutingConfig | None = None

    def set_base(self, config: RoutingConfig) -> None:
        """Put the operator's config (file or ConfigMap) under the cluster's additions."""
        self._base = config
        self._changed()

    async def run(self) -> None:
        """Watch until cancelled."""
        self._running = True
        try:
            for plural, (group, version) in INFERENCE_KINDS.items():
                self._inference[plural] = [
                    self._start(
                        (plural, ns),
                        ResourceKind(group=group, version=version, plural=plural, namespace=ns),
                    )
                    for ns in self.namespaces
                ]
            self._changed()
            await asyncio.Event().wait()
        finally:
            self._running = False
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def debug(self) -> dict[str, Any]:
        """What /debug/config shows of the cluster: watches, problems, objectives."""
        return {
            "namespaces": list(self.namespaces),
            "pod_watches": [
                {
                    "namespace": w.namespace,
                    "selector": w.label_selector,
                    "synced": watcher.synced,
                    "pods": len(watcher.objects),
                }
                for w, watcher in sorted(self._pods.items())
            ],
            "inference_extension": {
                plural: {"installed": not any(w.absent for w in watchers)}
                for plural, watchers in self._inference.items()
            },
            "objectives": self.objectives(),
            "problems": list(self.problems),
        }

    def objectives(self) -> dict[str, dict[str, Any]]:
        """InferenceObjectives by name (priority, pool), recorded for flow control."""
        return objectives(self._merged("inferenceobjectives"))

    def _start(self, key: object, kind: ResourceKind) -> ResourceWatcher:
        watcher = ResourceWatcher(
            self._api, kind, on_change=self._changed, telemetry=self._telemetry, **self._options
        )
        self._tasks[key] = asyncio.create_task(watcher.run(), name=f"watch-{kind.plural}")
        return watcher

    def _changed(self) -> None:
        """Rebuild once, at the end of this event-loop turn, however many events came."""
        if self._dirty or not self._running:
            return
        self._dirty = True
        asyncio.get_running_loop().call_soon(self._publish)

    def _merged(self, plural: str) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for watcher in self._inference.get(plural, ()):
            merged.update(watcher.objects)
        return merged

    def _synced(self, watchers: Iterable[ResourceWatcher]) -> bool:
        return all(w.synced or w.absent for w in watchers)

    def _follow_selectors(self, wanted: set[PodWatch]) -> None:
        for watch in sorted(wanted - self._pods.keys()):
            logger.info(
                "Watching pods in namespace %s with labels %s.",
                watch.namespace,
                watch.label_selector,
            )
            self._pods[watch] = self._start(
                watch,
                ResourceKind(
                    group="",
                    version="v1",
                    plural="pods",
                    namespace=watch.namespace,
                    label_selector=watch.label_selector,
                ),
            )
        for watch in sorted(self._pods.keys() - wanted):
            logger.info(
                "No pool selects pods in namespace %s with labels %s any more; watch stopped.",
                watch.namespace,
                watch.label_selector,
            )
            del self._pods[watch]
            self._tasks.pop(watch).cancel()

    def _publish(self) -> None:
        self._dirty = False
        base = self._base
        inference = [w for watchers in self._inference.values() for w in watchers]
        if base is None or not self._running or not self._synced(inference):
            return
        pools = self._merged("inferencepools")
        wanted = pod_watches(pools_with_selectors(base, pools)[0], namespaces=self.namespaces)
        self._follow_selectors(wanted)
        if not self._synced(self._pods.values()):
            return
        view = ClusterView(
            pods={w: watcher.objects for w, watcher in self._pods.items()},
            inference_pools=pools,
            model_rewrites=self._merged("inferencemodelrewrites"),
            inference_objectives=self._merged("inferenceobjectives"),
        )
        inventory = build_inventory(base, view, namespaces=self.namespaces)
        for problem in sorted(set(inventory.problems) - set(self.problems)):
            logger.warning("%s", problem)
        self.problems = inventory.problems
        if inventory.config != self.published:
            self.published = inventory.config
            self._on_config(inventory.config)
