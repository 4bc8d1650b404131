"""What the modules of tests/k8s share: where the manifests are, the arguments the committed
Envoy bootstrap was rendered with, `kubectl kustomize` (of the base, or of an overlay that
adds components and sets a namespace), and helpers that find objects in what it renders,
read the server's and Envoy's arguments, and lay out their TLS files as their Secrets and
ConfigMaps would."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import pytest
import yaml

from xds_server.app import XdsApplication
from xds_server.cli.parser import build_parser as _parser
from xds_server.config import RoutingConfig, parse_config
from xds_server.envoy import names
from xds_server.envoy.bootstrap import BootstrapTls
from xds_server.settings import ServerSettings, TlsSettings
from xds_testbed.backends import ExampleBackend
from xds_testbed.certs import IssuedCertificate
from xds_testbed.envoy_process import EnvoyProcess

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
EXAMPLES = K8S / "examples" / "inference-extension"
# The optional components an overlay adds to the base (k8s/components/, but cert-manager,
# which the base itself includes): every directory there, whoever added it.
BASE_COMPONENTS = ("cert-manager",)
COMPONENTS = tuple(
    sorted(p.name for p in (K8S / "components").iterdir() if p.name not in BASE_COMPONENTS)
)
NAMESPACE = "xds-server"
PART_OF = {"app.kubernetes.io/part-of": "xds-server"}

# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default
# from 1.30), and the newest schemas the library ships.
KUBERNETES_VERSIONS = ("1.30", "1.37")

# The arguments k8s/envoy/bootstrap.yaml was rendered with (its header comment says so).
BOOTSTRAP_ARGUMENTS: dict[str, Any] = {
    "xds_address": "xds-server",
    "xds_port": 18000,
    "node_id": "envoy",
    "node_cluster": "llm-gateway",
    "admin_port": 9901,
    "stats_port": 9902,
    "tls": BootstrapTls(
        cert_dir="/etc/envoy/tls", sds_dir="/etc/envoy/sds", server_name="xds-server"
    ),
}

Doc = dict[str, Any]


def _kustomize(path: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: it renders the kustomization (apt: kubectl).")
    result = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _kustomize_overlay(
    components: Sequence[str] = (), *, namespace: str | None = None
) -> list[Doc]:
    """What an overlay of the base renders that adds `components` (names in
    k8s/components/) and, given `namespace`, moves everything there: as README.md shows
    it, the base and components by relative path (kustomize refuses absolute ones)."""
    with tempfile.TemporaryDirectory(prefix="overlay-") as directory:
        base = os.path.relpath(K8S, directory)
        overlay: Doc = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [base],
            "components": [f"{base}/components/{name}" for name in components],
        }
        if namespace is not None:
            overlay["namespace"] = namespace
        (Path(directory) / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
        return _kustomize(Path(directory))


def _one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _all(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def _container(deployment: Doc) -> Doc:
    """The pod template's only container."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _port_number(container: Doc, port: int | str) -> int:
    """A probe's or Service's target port, resolved against the container's ports."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"container {container['name']} has no port named {port!r}"
    return numbers[0]  # type: ignore[no-any-return]


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _pod_labels(deployment: Doc) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def _server(docs: list[Doc]) -> Doc:
    return _one(docs, "Deployment", "xds-server")


def _server_args(docs: list[Doc]) -> argparse.Namespace:
    """The server container's args, parsed by the real command line's parser."""
    return _parser().parse_args(_container(_server(docs))["args"])


def _envoy(docs: list[Doc]) -> Doc:
    return _one(docs, "Deployment", "envoy")


def _mounted_volumes(deployment: Doc) -> list[tuple[Doc, Doc]]:
    """(mount, volume) for every volume the pod template's container mounts."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    return [(m, volumes[m["name"]]) for m in _container(deployment).get("volumeMounts", [])]


def _mount_holding(deployment: Doc, path: Path) -> tuple[Doc, Doc]:
    """The (mount, volume) that file `path` of the container is in."""
    found = [
        (mount, volume)
        for mount, volume in _mounted_volumes(deployment)
        if path.is_relative_to(mount["mountPath"])
    ]
    assert found, f"{path} is in no volume of {deployment['metadata']['name']}"
    return max(found, key=lambda pair: len(pair[0]["mountPath"]))


def _routing_configmap(docs: list[Doc]) -> Doc:
    """The ConfigMap the server's `--configmap` argument names."""
    args = _container(_server(docs))["args"]
    return _one(docs, "ConfigMap", args[args.index("--configmap") + 1])


def _routing_config(docs: list[Doc]) -> RoutingConfig:
    configmap = _routing_configmap(docs)
    return parse_config(configmap["data"]["config.yaml"], source="ConfigMap xds-server-config")


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _is_cert_manager(doc: Doc) -> bool:
    return str(doc["apiVersion"]).startswith("cert-manager.io/")


# The API groups of the custom resources the manifests use, whose CRDs kubernetes-validate
# does not know: cert-manager's, the Prometheus Operator's, KEDA's.
CUSTOM_GROUPS = ("cert-manager.io", "monitoring.coreos.com", "keda.sh")


def _is_custom(doc: Doc) -> bool:
    return str(doc["apiVersion"]).split("/")[0] in CUSTOM_GROUPS


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values of `flag` in `args`: `--flag=v`, or `--flag v1 v2 ...` up to the next flag."""
    values = []
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == flag:
            for value in args[i + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
    return values


def _bootstrap(docs: list[Doc]) -> tuple[Doc, str, Doc]:
    """The bootstrap ConfigMap the Envoy pods mount, the key Envoy reads, and its document."""
    envoy = _envoy(docs)
    container = _container(envoy)
    path = Path(container["args"][container["args"].index("-c") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(
        v for v in envoy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    configmap = _one(docs, "ConfigMap", volume["configMap"]["name"])
    return configmap, path.name, yaml.safe_load(configmap["data"][path.name])


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _one_pool_config(backend: ExampleBackend, *, tmp_path: Path) -> Path:
    """A routing config file: model `m` on `backend`, the listener on a free port."""
    config = tmp_path / "config.yaml"
    pool = {
        "name": "pool",
        "models": ["m"],
        "gpu_aware": False,
        "endpoints": [{"address": backend.host, "port": backend.port}],
    }
    config.write_text(
        yaml.safe_dump({"listener": {"address": "127.0.0.1", "port": 0}, "pools": [pool]})
    )
    return config


# The Secret keys the server and Envoy read: a Kubernetes TLS Secret's, plus the CA's
# certificate (cert-manager writes all three; a Secret of your own must have them too).
SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}


def _server_tls_secret(docs: list[Doc]) -> tuple[str, Path]:
    """The Secret the server's TLS files are read from, and where it is mounted."""
    mount, volume = _mount_holding(_server(docs), _server_args(docs).tls_cert)
    assert "secret" in volume, f"the server's certificate is not from a Secret: {volume}"
    return volume["secret"]["secretName"], Path(mount["mountPath"])


def _xds_cluster(bootstrap: Doc) -> Doc:
    """The bootstrap's cluster to the xDS server (the other static one is the stats
    listener's way to admin)."""
    clusters = bootstrap["static_resources"]["clusters"]
    (cluster,) = [c for c in clusters if c["name"] == "xds_cluster"]
    return cluster  # type: ignore[no-any-return]


def _xds_endpoint(bootstrap: Doc) -> Doc:
    """The socket address the bootstrap dials the xDS server at."""
    endpoint = _xds_cluster(bootstrap)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    return endpoint["endpoint"]["address"]["socket_address"]  # type: ignore[no-any-return]


def _xds_tls_context(bootstrap: Doc) -> Doc:
    """The UpstreamTlsContext of the bootstrap's cluster to the xDS server."""
    cluster = _xds_cluster(bootstrap)
    socket = cluster.get("transport_socket")
    assert socket is not None, "Envoy's xds_cluster has no transport socket: plaintext"
    assert socket["name"] == "envoy.transport_sockets.tls"
    context: Doc = socket["typed_config"]
    assert context["@type"].endswith("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext")
    return context


def _sds_paths(context: Doc) -> list[Path]:
    """The files the TLS context reads its certificate and its trusted CA from (SDS)."""
    common = context["common_tls_context"]
    sources = [
        *common["tls_certificate_sds_secret_configs"],
        common["combined_validation_context"]["validation_context_sds_secret_config"],
    ]
    return [Path(s["sds_config"]["path_config_source"]["path"]) for s in sources]


def _envoy_sds_files(docs: list[Doc]) -> tuple[Path, Doc, dict[str, str]]:
    """Where Envoy's SDS files are mounted, the ConfigMap they come from, and the files
    (name -> text), as the bootstrap names them."""
    _, _, bootstrap = _bootstrap(docs)
    paths = _sds_paths(_xds_tls_context(bootstrap))
    (sds_dir,) = {path.parent for path in paths}
    mount, volume = _mount_holding(_envoy(docs), paths[0])
    assert Path(mount["mountPath"]) == sds_dir
    configmap = _one(docs, "ConfigMap", volume["configMap"]["name"])
    assert {path.name for path in paths} <= set(configmap["data"])
    return sds_dir, configmap, configmap["data"]


def _filenames(obj: Any) -> list[str]:
    """Every `filename` in an Envoy config document (a DataSource's file)."""
    if isinstance(obj, Mapping):
        own = [obj["filename"]] if isinstance(obj.get("filename"), str) else []
        return own + [f for value in obj.values() for f in _filenames(value)]
    if isinstance(obj, list):
        return [f for value in obj for f in _filenames(value)]
    return []


def _envoy_tls_secret(docs: list[Doc]) -> tuple[str, Path]:
    """The Secret Envoy's certificate files are read from (through its SDS files), and
    where it is mounted."""
    _, _, files = _envoy_sds_files(docs)
    paths = {Path(f) for text in files.values() for f in _filenames(yaml.safe_load(text))}
    (cert_dir,) = {path.parent for path in paths}
    assert {path.name for path in paths} == SECRET_KEYS
    mount, volume = _mount_holding(_envoy(docs), cert_dir)
    assert Path(mount["mountPath"]) == cert_dir
    assert "secret" in volume, f"Envoy's certificate is not from a Secret: {volume}"
    return volume["secret"]["secretName"], cert_dir


def _certificate_for(docs: list[Doc], secret: str) -> Doc:
    """The cert-manager Certificate that writes Secret `secret`."""
    found = [d for d in _all(docs, "Certificate") if d["spec"]["secretName"] == secret]
    assert len(found) == 1, f"expected one Certificate writing Secret {secret}: {len(found)}"
    return found[0]


class _Pki(NamedTuple):
    """The server's and Envoy's certificate directories, laid out as their Secrets."""

    server: IssuedCertificate
    envoy: IssuedCertificate


def _server_tls_settings(docs: list[Doc], *, cert_dir: Path) -> TlsSettings:
    """The Deployment's TLS arguments, with `cert_dir` in place of the Secret's mount."""
    args = _server_args(docs)
    _, mount = _server_tls_secret(docs)

    def local(path: Path) -> Path:
        return cert_dir / path.relative_to(mount)

    return TlsSettings(
        cert=local(args.tls_cert),
        key=local(args.tls_key),
        client_ca=local(args.tls_client_ca),
        envoy_identity=args.envoy_identity,
        peer_identity=args.peer_identity,
        peer_server_name=args.peer_server_name,
    )


def _relocated(obj: Any, moves: Mapping[Path, Path]) -> Any:
    """`obj` (a parsed document) with every path in a directory of `moves` moved."""
    if isinstance(obj, Mapping):
        return {key: _relocated(value, moves) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_relocated(value, moves) for value in obj]
    if isinstance(obj, str) and obj.startswith("/"):
        for old, new in moves.items():
            if Path(obj).is_relative_to(old):
                return str(new / Path(obj).relative_to(old))
    return obj


def _local_envoy_bootstrap(docs: list[Doc], *, root: Path, cert_dir: Path) -> Doc:
    """The pod's bootstrap, reading the pod's SDS files (written into `root`/sds) and the
    certificate files in `cert_dir`: the mounts' paths moved to these. Its stats listener
    moves to a free port on loopback (the pod's port is fixed, and tests run side by
    side)."""
    _, _, bootstrap = _bootstrap(docs)
    sds_dir, _, files = _envoy_sds_files(docs)
    _, tls_dir = _envoy_tls_secret(docs)
    moves = {sds_dir: root / "sds", tls_dir: cert_dir}
    (root / "sds").mkdir()
    for name, text in files.items():
        (root / "sds" / name).write_text(yaml.safe_dump(_relocated(yaml.safe_load(text), moves)))
    document: Doc = _relocated(bootstrap, moves)
    for listener in document["static_resources"].get("listeners", []):
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=0)
    return document


@contextlib.asynccontextmanager
async def _pod_envoy(
    docs: list[Doc],
    pki: _Pki,
    tmp_path: Path,
    *,
    address: str | None = None,
    envoy_path: str | None = None,
) -> AsyncIterator[EnvoyProcess]:
    """The server with the Deployment's TLS arguments (one pool: model `m` on an example
    backend), and a real Envoy with the pod's bootstrap, SDS files, certificate and node id
    (`envoy_path`: its binary). Envoy dials the server's local port at `address` (None: the
    bootstrap's own). Yields Envoy once the server has it as a node and a request for `m`
    went through it."""
    args = _container(_envoy(docs))["args"]
    node_id = _flag(args, "--service-node").replace("$(POD_NAME)", "envoy-7d9f8-abcde")
    tls = _server_tls_settings(docs, cert_dir=pki.server.directory)
    async with ExampleBackend(backend_id="a") as backend:
        settings = ServerSettings(
            config_path=_one_pool_config(backend, tmp_path=tmp_path),
            xds_port=0,
            admin_port=0,
            tls=tls,
        )
        async with XdsApplication(settings) as app:
            await app.wait_ready(within_s=20)
            bootstrap = _local_envoy_bootstrap(docs, root=tmp_path, cert_dir=pki.envoy.directory)
            dialled = _xds_endpoint(bootstrap)
            dialled.update(address=address or dialled["address"], port_value=app.xds_port)
            async with (
                EnvoyProcess(
                    bootstrap, envoy_path=envoy_path, extra_args=["--service-node", node_id]
                ) as envoy,
                aiohttp.ClientSession() as http,
            ):
                await envoy.wait_live(timeout=30)
                port = await envoy.listener_port(names.LISTENER_NAME)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                async with http.post(url, json=_CHAT) as response:
                    assert response.status == 200
                assert node_id in {r.node_id for r in app.registry.streams()}
                yield envoy
