"""The monitoring component: PodMonitors that scrape ports the pods declare; alert rules that
promtool (Debian's, unpacked by ./dev) accepts and that fire on the problems they name and
not before (alerts_test.yaml); an importable Grafana dashboard whose queries promtool
accepts too; and every metric and label the rules and the dashboard use is one a running
gateway exports, on the server's /metrics or Envoy's stats listener."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import promql_parser
import pytest
import yaml

from llm_sim.fleet import Fleet, PodSpec
from llm_sim.profiles import H100
from tests.k8s.manifests import (
    K8S,
    Doc,
    _all,
    _bootstrap,
    _container,
    _envoy,
    _one,
    _pod_labels,
    _port_number,
    _selects,
    _server,
    _server_args,
)
from xds_server.config import RoutingConfig
from xds_server.envoy.bootstrap import STATS_LISTENER, STATS_PATH
from xds_testbed.gateway import run_local_gateway
from xds_testbed.server_process import free_port

COMPONENT = K8S / "components" / "monitoring"
RULES = COMPONENT / "prometheusrule.yaml"
DASHBOARD = COMPONENT / "dashboards" / "xds-server.json"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yaml")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# What the dashboard's variables stand for when its queries are checked.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": "llm", "$pool": "llama"}
# Labels Prometheus gives every scraped target (the Prometheus Operator's for a PodMonitor):
# on every series in Prometheus, on none in /metrics.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "service"}

# The fields of the Prometheus Operator's CRDs (monitoring.coreos.com/v1) used here, and
# the others they define at that level: an unknown field would be dropped or refused.
_POD_MONITOR_SPEC = {
    "selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels",
    "sampleLimit", "targetLimit", "labelLimit", "labelNameLengthLimit",
    "labelValueLengthLimit", "attachMetadata", "scrapeProtocols", "scrapeClass",
    "keepDroppedTargets", "selectorMechanism", "bodySizeLimit", "fallbackScrapeProtocol",
    "convertClassicHistogramsToNHCB", "nativeHistogramBucketLimit",
    "nativeHistogramMinBucketFactor", "scrapeClassicHistograms",
}  # fmt: skip
_POD_METRICS_ENDPOINT = {
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval",
    "scrapeTimeout", "honorLabels", "honorTimestamps", "trackTimestampsStaleness",
    "metricRelabelings", "relabelings", "proxyUrl", "followRedirects", "enableHttp2",
    "filterRunning", "tlsConfig", "bearerTokenSecret", "basicAuth", "authorization",
    "oauth2", "noProxy", "proxyFromEnvironment", "proxyConnectHeader",
}  # fmt: skip
_RULE_GROUP = {
    "name", "interval", "rules", "limit", "partial_response_strategy", "query_offset",
    "labels",
}  # fmt: skip
_RULE = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


def _promtool() -> str:
    found = Path(sys.executable).with_name("promtool")
    path = str(found) if found.exists() else shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: `./dev test` unpacks it from Debian's prometheus "
            "package into .venv/bin (apt-get download prometheus)."
        )
    return path


def _run_promtool(*args: str, cwd: Path) -> str:
    result = subprocess.run(
        [_promtool(), *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result.stdout


def _rule_groups() -> list[Doc]:
    rule = yaml.safe_load(RULES.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    return rule["spec"]["groups"]  # type: ignore[no-any-return]


def _alerts() -> dict[str, Doc]:
    alerts = [rule for group in _rule_groups() for rule in group["rules"]]
    names = [rule["alert"] for rule in alerts]
    assert len(set(names)) == len(names), names
    return {rule["alert"]: rule for rule in alerts}


def test_the_alert_rules_pass_promtools_check(tmp_path: Path) -> None:
    """The PrometheusRule's groups are a Prometheus rule file: promtool parses every
    expression and annotation template."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": _rule_groups()}))
    output = _run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert f"SUCCESS: {len(_alerts())} rules found" in output


def test_every_alert_fires_on_its_problem_and_not_before(tmp_path: Path) -> None:
    """`promtool test rules` with alerts_test.yaml: series that show each problem, over
    two replicas, and the alerts (labels included) that must and must not fire; every
    alert of the rule file has a case."""
    groups = _rule_groups()
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    _run_promtool("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    tested = {check["alertname"] for case in cases for check in case["alert_rule_test"]}
    firing = {
        check["alertname"]
        for case in cases
        for check in case["alert_rule_test"]
        if check.get("exp_alerts")
    }
    assert tested == firing == set(_alerts())


def test_every_alert_has_a_severity_and_says_what_to_do() -> None:
    for group in _rule_groups():
        assert set(group) <= _RULE_GROUP, set(group) - _RULE_GROUP
    for name, rule in _alerts().items():
        assert set(rule) <= _RULE, (name, set(rule) - _RULE)
        assert re.fullmatch(r"XdsServer[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert promql_parser.parse_duration(rule["for"]), name
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), name


def _dashboard() -> Doc:
    document: Doc = json.loads(DASHBOARD.read_text())
    return document


def _panels(dashboard: Doc) -> Iterator[Doc]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _dashboard_queries() -> dict[str, str]:
    """Each query of the dashboard (`panel title/refId` -> PromQL), its variables given
    values (GRAFANA_VARIABLES)."""
    queries = {}
    for panel in _panels(_dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert not re.search(r"\$[A-Za-z_{]", expr), f"{panel['title']}: {expr}"
            queries[f"{panel['title']}/{target['refId']}"] = expr
    return queries


def test_the_dashboard_is_importable_and_its_queries_pass_promtool(tmp_path: Path) -> None:
    """Grafana's JSON model: a uid, panels on the 24-column grid with unique ids, each
    query on the data source the importer picks (a `datasource` variable, so it needs no
    __inputs), every variable it uses defined; and promtool parses every query (as a
    recording rule)."""
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {f"${name}" for name in variables} | {"$__rate_interval"} >= set(GRAFANA_VARIABLES)
    panels = list(_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids)
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"

    records = [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, expr in enumerate(_dashboard_queries().values())
    ]
    (tmp_path / "queries.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]})
    )
    output = _run_promtool("check", "rules", "queries.yaml", cwd=tmp_path)
    assert f"SUCCESS: {len(records)} rules found" in output


def test_the_dashboard_configmap_carries_the_dashboard(rendered: list[Doc]) -> None:
    """For Grafana's dashboard sidecar: its default label, and the file as committed."""
    configmap = _one(rendered, "ConfigMap", "xds-server-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["xds-server.json"]) == _dashboard()


def test_the_pod_monitors_scrape_ports_the_pods_declare(rendered: list[Doc]) -> None:
    """One PodMonitor per Deployment: the server's admin port at /metrics, keeping the
    series' own `endpoint` label (honorLabels); Envoy's stats listener at STATS_PATH."""
    monitors = {m["metadata"]["name"]: m for m in _all(rendered, "PodMonitor")}
    deployments = {"xds-server": _server(rendered), "envoy": _envoy(rendered)}
    assert set(monitors) == set(deployments)
    for name, monitor in monitors.items():
        assert set(monitor["spec"]) <= _POD_MONITOR_SPEC, set(monitor["spec"])
        selected = [
            d["metadata"]["name"]
            for d in _all(rendered, "Deployment")
            if _selects(monitor["spec"]["selector"]["matchLabels"], _pod_labels(d))
        ]
        assert selected == [name]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert set(endpoint) <= _POD_METRICS_ENDPOINT, set(endpoint)
    (server,) = monitors["xds-server"]["spec"]["podMetricsEndpoints"]
    port = _port_number(_container(deployments["xds-server"]), server["port"])
    assert port == _server_args(rendered).admin_port
    assert server["path"] == "/metrics" and server["honorLabels"] is True
    (envoy,) = monitors["envoy"]["spec"]["podMetricsEndpoints"]
    _, _, bootstrap = _bootstrap(rendered)
    (listener,) = [
        item for item in bootstrap["static_resources"]["listeners"]
        if item["name"] == STATS_LISTENER
    ]  # fmt: skip
    port = _port_number(_container(deployments["envoy"]), envoy["port"])
    assert port == listener["address"]["socket_address"]["port_value"]
    assert envoy["path"] == STATS_PATH


def _selectors(expr: str) -> tuple[list[tuple[str, set[str]]], list[tuple[set[str], Any]]]:
    """The metrics a query reads, each with the labels it matches on, and its aggregations'
    grouping labels, each with its expression."""
    selectors: list[tuple[str, set[str]]] = []
    groupings: list[tuple[set[str], Any]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            selectors.append((node.name, {m.name for m in node.matchers.matchers}))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            groupings.append((set(node.modifier.labels), node.expr))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return selectors, groupings


def _made_labels(node: Any) -> set[str]:
    """Labels a query makes itself: label_replace's destination, a histogram's `le`."""
    made = {"le"}

    def visit(inner: Any) -> None:
        if isinstance(inner, promql_parser.Call) and inner.func.name == "label_replace":
            made.add(inner.args[1].val)

    promql_parser.walk(node, visit)
    return made


_TYPE = re.compile(r"# TYPE (\S+) (\S+)")
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? \S+")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def _exported(text: str) -> dict[str, set[str] | None]:
    """Every series name a Prometheus text page exports, as Prometheus stores it (a
    histogram's `_bucket`, `_sum` and `_count`), and the label names its samples carry:
    None for a family declared with no sample yet. (prometheus_client's parser would add
    `_total` to Envoy's counters, which Prometheus does not.)"""
    found: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        if declared := _TYPE.fullmatch(line):
            name, kind = declared.groups()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            for suffix in suffixes:
                found.setdefault(name + suffix, None)
        elif line and not line.startswith("#"):
            sample = _SAMPLE.fullmatch(line)
            assert sample is not None, line
            labels = set(_LABEL.findall(sample[2] or ""))
            found[sample[1]] = (found.get(sample[1]) or set()) | labels
    return found


async def _a_running_gateways_pages(tmp_path: Path) -> tuple[str, str]:
    """The server's /metrics and Envoy's stats page, from a gateway with what the rules
    and the dashboard are about: a GPU-aware pool of two simulated vLLM pods, flow control
    on (bands), Envoy's stats listener, and requests answered through it."""
    pods = [PodSpec(name=f"llama-{i}", profile=H100) for i in range(2)]
    async with Fleet(pods, model=MODEL) as fleet:
        config = RoutingConfig.model_validate(
            {
                "listener": {"address": "127.0.0.1", "port": 0},
                "balancing": {"scrape_interval_s": 0.1},
                "flow_control": {"enabled": True},
                "pools": [
                    {
                        "name": "llama",
                        "models": [MODEL],
                        "endpoints": [
                            {"address": "127.0.0.1", "port": p.port, "name": p.name,
                             "hardware": "h100"}
                            for p in fleet.pods
                        ],
                    }
                ],
            }
        )  # fmt: skip
        path = tmp_path / "config.json"
        path.write_text(config.model_dump_json())
        stats_port = free_port()
        async with (
            run_local_gateway(path, config_poll_s=3600, stats_port=stats_port) as gateway,
            aiohttp.ClientSession() as http,
        ):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            for _ in range(4):
                async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    await response.read()
            server_url = f"http://127.0.0.1:{gateway.app.admin_port}/metrics"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while True:  # until the pods have been scraped and weighed
                async with http.get(server_url) as response:
                    server = await response.text()
                if "xds_pool_saturation_ratio{" in server or loop.time() > deadline:
                    break
                await asyncio.sleep(0.1)
            async with http.get(f"http://127.0.0.1:{stats_port}{STATS_PATH}") as response:
                envoy = await response.text()
    return server, envoy


async def test_every_metric_and_label_used_is_exported_by_a_running_gateway(
    tmp_path: Path,
) -> None:
    """Each metric the alerts and the dashboard read is on the server's /metrics or Envoy's
    stats page of a running gateway; each label they match or group on is on its samples
    (where it has samples), or is a target label Prometheus adds, or one the query makes.
    And no server series carries a target label: honorLabels (the PodMonitor) then only
    keeps the per-pod series' own `endpoint`."""
    server, envoy = await _a_running_gateways_pages(tmp_path)
    exported = _exported(server) | _exported(envoy)
    queries = {f"alert {name}": rule["expr"] for name, rule in _alerts().items()}
    queries |= {f"dashboard {key}": expr for key, expr in _dashboard_queries().items()}
    assert len(queries) > 20
    problems = []
    for where, expr in queries.items():
        selectors, groupings = _selectors(expr)
        assert selectors, where
        for metric, labels in selectors:
            carried = exported.get(metric, set())
            if metric not in exported:
                problems.append(f"{where}: {metric} is not exported")
            elif carried is not None and not labels <= carried | TARGET_LABELS:
                problems.append(f"{where}: {metric} has no {labels - carried}")
        for labels, inner in groupings:
            inner_metrics = [metric for metric, _ in _selectors(inner.prettify())[0]]
            if any(exported.get(metric) is None for metric in inner_metrics):
                continue  # no sample to read labels from (no NACK, no peer here)
            known = TARGET_LABELS | _made_labels(inner)
            known = known.union(*(exported[metric] or set() for metric in inner_metrics))
            if not labels <= known:
                problems.append(f"{where}: nothing has {labels - known} to group by")
    assert not problems, "\n".join(problems)
    server_labels = set().union(*(labels or set() for labels in _exported(server).values()))
    assert "endpoint" in server_labels
    assert not server_labels & TARGET_LABELS, server_labels & TARGET_LABELS
