"""The bootstrap that points a stock Envoy at this xDS server.

Everything but the connection to the server comes over one ADS stream: the runtime
layer (RTDS) by name, clusters (CDS) and listeners (LDS) by wildcard, then endpoints
(EDS) and routes (RDS) by name. Envoy also opens a load reporting (LRS) stream to the
same server, which tells it how often to report each cluster's requests. The ADS stream
retries on a short backoff, so that a restarted or replaced server gets its Envoys back
within about a second instead of the 10-25 s Envoy's defaults took; the LRS stream
retries on a fixed 5 s timer of its own (Envoy 1.40 reads no retry policy for it). The
result is a plain dict so the CLI can print it as YAML and tests can hand it to
EnvoyProcess; envoy/bootstrap.yaml in the repository is this function's output for a
server on 127.0.0.1:18000, and envoy/README.md explains each field.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from xds_server.envoy import names

__all__ = [
    "ADMIN_CLUSTER",
    "BootstrapTls",
    "CLIENT_CERT_SECRET",
    "INTERNAL_LISTENER_EXTENSION",
    "MAX_DOWNSTREAM_CONNECTIONS",
    "SERVER_CA_SECRET",
    "STATS_LISTENER",
    "STATS_PATH",
    "render_bootstrap",
    "render_sds_files",
]

# A cap on client connections. Envoy warns at start-up without one, and an unbounded
# number of idle connections is an easy way to exhaust file descriptors.
MAX_DOWNSTREAM_CONNECTIONS = 50_000

INTERNAL_LISTENER_EXTENSION = "envoy.bootstrap.internal_listener"

# The stats listener (`stats_port`): Prometheus scrapes Envoy's stats there, never the
# admin interface, which can also change Envoy (drain, runtime, log levels) and stays on
# loopback. The listener answers GET STATS_PATH alone, from the admin interface through
# ADMIN_CLUSTER; every other request gets a 404.
STATS_LISTENER = "envoy_stats"
STATS_PATH = "/stats/prometheus"
ADMIN_CLUSTER = "envoy_admin"
_HCM_FILTER = "envoy.filters.network.http_connection_manager"
_HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"

_HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


_SECRET = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
# The SDS resources (and files) of the xDS client certificate and of the CA it trusts.
CLIENT_CERT_SECRET = "xds_client_certificate"
SERVER_CA_SECRET = "xds_server_ca"


@dataclass(frozen=True, kw_only=True)
class BootstrapTls:
    """Mutual TLS towards the xDS server, with certificates Envoy reads through SDS from
    files: `sds_dir` holds the two SDS files (`render_sds_files`), which point at
    `cert_dir`'s `tls.crt`, `tls.key` and `ca.crt` (a Kubernetes TLS Secret's layout, as
    cert-manager writes it). Envoy watches `cert_dir`, so a rotated certificate is used
    without a restart. `server_name` is the name the server's certificate is for (SNI,
    and the DNS subject alternative name Envoy requires)."""

    cert_dir: str
    sds_dir: str
    server_name: str


def _sds_source(tls: BootstrapTls, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "sds_config": {
            "path_config_source": {
                "path": f"{tls.sds_dir}/{name}.yaml",
                "watched_directory": {"path": tls.sds_dir},
            },
            "resource_api_version": "V3",
        },
    }


def _transport_socket(tls: BootstrapTls) -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _UPSTREAM_TLS,
            "sni": tls.server_name,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [_sds_source(tls, CLIENT_CERT_SECRET)],
                "combined_validation_context": {
                    "default_validation_context": {
                        "match_typed_subject_alt_names": [
                            {"san_type": "DNS", "matcher": {"exact": tls.server_name}}
                        ]
                    },
                    "validation_context_sds_secret_config": _sds_source(tls, SERVER_CA_SECRET),
                },
            },
        },
    }


def render_sds_files(tls: BootstrapTls) -> dict[str, dict[str, Any]]:
    """The SDS files (file name -> content) the bootstrap of `tls` reads: the client
    certificate and key, and the CA the server's certificate must chain to."""
    watched = {"path": tls.cert_dir}
    return {
        f"{CLIENT_CERT_SECRET}.yaml": {
            "resources": [
                {
                    "@type": _SECRET,
                    "name": CLIENT_CERT_SECRET,
                    "tls_certificate": {
                        "certificate_chain": {"filename": f"{tls.cert_dir}/tls.crt"},
                        "private_key": {"filename": f"{tls.cert_dir}/tls.key"},
                        "watched_directory": watched,
                    },
                }
            ]
        },
        f"{SERVER_CA_SECRET}.yaml": {
            "resources": [
                {
                    "@type": _SECRET,
                    "name": SERVER_CA_SECRET,
                    "validation_context": {
                        "trusted_ca": {"filename": f"{tls.cert_dir}/ca.crt"},
                        "watched_directory": watched,
                    },
                }
            ]
        },
    }


def render_bootstrap(
    *,
    xds_address: str,
    xds_port: int,
    node_id: str,
    node_cluster: str,
    admin_port: int,
    delta: bool = False,
    tls: BootstrapTls | None = None,
    stats_port: int | None = None,
    stats_address: str = "0.0.0.0",
) -> dict[str, Any]:
    """An Envoy v3 bootstrap that takes all of its configuration from the ADS server at
    `xds_address:xds_port` (an IP address, or a DNS name such as a Kubernetes Service).

    `delta` selects incremental xDS (DELTA_GRPC) instead of state of the world (GRPC).
    The admin interface listens on 127.0.0.1:`admin_port` only (0 picks a free port).
    `tls` connects to the server over mutual TLS (None: plaintext).
    `stats_port` adds the stats listener on `stats_address:stats_port` (STATS_LISTENER;
    None: none), which needs a fixed `admin_port` to forward to.
    """
    if stats_port is not None and admin_port == 0:
        raise ValueError("the stats listener forwards to the admin port: give a fixed admin port")
    try:
        ipaddress.ip_address(xds_address)
    except ValueError:
        # A name: resolve it, and again when it changes (a Service's ClusterIP is stable,
        # a headless Service's pods are not).
        discovery: dict[str, Any] = {"type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED"}
    else:
        discovery = {"type": "STATIC"}
    if tls is not None:
        discovery = {**discovery, "transport_socket": _transport_socket(tls)}
    return {
        "node": {"id": node_id, "cluster": node_cluster},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC" if delta else "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [
                    {
                        "envoy_grpc": {
                            "cluster_name": names.XDS_CLUSTER,
                            # Jittered exponential backoff from 0.1 s, doubling up to 1 s.
                            # Envoy's own backs off up to 30 s: an Envoy that lost its
                            # server for a few seconds (a restart, a rollout) waited 10-25 s
                            # more once the server was back (measured). A failed attempt
                            # costs a refused connection, or a DNS answer with no endpoint
                            # behind the Service, so hundreds of Envoys retrying once a
                            # second are cheap; the jitter spreads them over that second.
                            "retry_policy": {
                                "retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}
                            },
                        }
                    }
                ],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "cluster_manager": {
            # Load reports (LRS) to the same server, which sets the interval: per cluster,
            # the requests in flight and those finished since the last report.
            "load_stats_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": names.XDS_CLUSTER}}],
            }
        },
        "static_resources": {
            **(
                {"listeners": [_stats_listener(stats_address, stats_port)]}
                if stats_port is not None
                else {}
            ),
            "clusters": [
                *([_admin_cluster(admin_port)] if stats_port is not None else []),
                {
                    "name": names.XDS_CLUSTER,
                    **discovery,
                    "connect_timeout": "1s",
                    # gRPC needs HTTP/2 to the server; keepalive pings notice a dead
                    # server (or a silently dropped connection) within seconds, so Envoy
                    # reconnects instead of waiting on a stream that will never answer.
                    "typed_extension_protocol_options": {
                        _HTTP_PROTOCOL_OPTIONS: {
                            "@type": f"type.googleapis.com/{_HTTP_PROTOCOL_OPTIONS}",
                            "explicit_http_config": {
                                "http2_protocol_options": {
                                    "connection_keepalive": {"interval": "30s", "timeout": "5s"}
                                }
                            },
                        }
                    },
                    "load_assignment": {
                        "cluster_name": names.XDS_CLUSTER,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": xds_address,
                                                    "port_value": xds_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ]
        },
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        # Internal listeners (no socket): a pool's spilling pods point its session
        # requests at one (listeners.py, `balancing.spill_to`). Without this extension
        # Envoy refuses those listeners.
        "bootstrap_extensions": [
            {
                "name": INTERNAL_LISTENER_EXTENSION,
                "typed_config": {
                    "@type": (
                        "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3."
                        "InternalListener"
                    )
                },
            }
        ],
        "layered_runtime": {
            "layers": [
                # Empty now; a named place for runtime defaults, overridden by the
                # layers below.
                {"name": "static", "static_layer": {}},
                # The server's runtime keys over ADS (RTDS), e.g. per-band limits
                # circuit_breakers.<cluster>.default.max_requests, changed without a CDS
                # push. Envoy waits for this layer at start-up: the server always sends it.
                {
                    "name": names.RUNTIME_LAYER_NAME,
                    "rtds_layer": {
                        "name": names.RUNTIME_LAYER_NAME,
                        "rtds_config": {"ads": {}, "resource_api_version": "V3"},
                    },
                },
                # Last, so it wins: `POST /runtime_modify` on the admin port overrides any
                # key by hand, for operators and tests.
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": (
                            "type.googleapis.com/envoy.extensions.resource_monitors."
                            "downstream_connections.v3.DownstreamConnectionsConfig"
                        ),
                        "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS,
                    },
                }
            ]
        },
    }


def _stats_listener(address: str, port: int) -> dict[str, Any]:
    """STATS_LISTENER on `address:port`: GET STATS_PATH to the admin interface, else 404."""
    get = {"name": ":method", "string_match": {"exact": "GET"}}
    routes = [
        {"match": {"path": STATS_PATH, "headers": [get]}, "route": {"cluster": ADMIN_CLUSTER}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    hcm = {
        "@type": f"type.googleapis.com/{_HCM}",
        "stat_prefix": STATS_LISTENER,
        "codec_type": "AUTO",
        "route_config": {
            "name": STATS_LISTENER,
            "virtual_hosts": [{"name": STATS_LISTENER, "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "name": STATS_LISTENER,
        "address": {"socket_address": {"address": address, "port_value": port}},
        "filter_chains": [{"filters": [{"name": _HCM_FILTER, "typed_config": hcm}]}],
    }


def _admin_cluster(admin_port: int) -> dict[str, Any]:
    """The admin interface on loopback, as the stats listener's upstream."""
    return {
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": "127.0.0.1",
                                        "port_value": admin_port,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
