"""Why the server's wire types are xds-protos, measured again on every run.

The server builds one ClusterLoadAssignment per cluster per change and sends it to every Envoy
(EDS, https://www.envoyproxy.io/docs/envoy/latest/api-v3/service/endpoint/v3/eds.proto). With
weights recomputed from scraped GPU load, that happens every few seconds, so building,
serializing and parsing these messages is the server's hot path.

Two Python libraries carry the Envoy v3 API:

- ``xds-protos``: protoc-generated ``*_pb2`` modules on protobuf's upb C backend, and
  ``*_pb2_grpc`` servicers for grpcio (``envoy.service.discovery.v3.ads_pb2_grpc``).
- ``envoy-data-plane`` 2.x: betterproto2 dataclasses that validate through pydantic on
  construction, serialization and parsing, with no grpcio servicer.

DESIGN.md ("Libraries (measured)") chose xds-protos on these numbers. This script makes the
choice checkable instead of remembered: it builds the same 1,000-endpoint assignment with
both libraries (each endpoint ``10.x.y.z:8000`` with a ``load_balancing_weight`` and
``filter_metadata["envoy.lb"]`` holding a ``lora`` list of two adapter names, as our
assignments do), checks that the two encodings are the same size and parse into each other,
then times build, serialize and parse in this process and each library's import in a fresh
interpreter. The addresses are only data: nothing is contacted. ``--no-metadata`` leaves the
metadata out (about 26.6 kB instead of 78.9 kB), the message DESIGN.md's first figures were
taken on.

Run it with the ``bench`` extra installed::

    python bench/serialization.py            # table
    python -m bench.serialization --json     # machine-readable

Each operation is repeated until about ``--budget`` seconds have been spent on it (at least
``--min-repeats`` times), and the median is reported. envoy-data-plane takes about a tenth of
a second per operation, so it gets few repeats; the whole run stays well under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["main"]

XDS_PROTOS = "xds-protos"
ENVOY_DATA_PLANE = "envoy-data-plane"

# The modules whose import is timed: what the server would import for EDS.
_IMPORTS = {
    XDS_PROTOS: "envoy.config.endpoint.v3.endpoint_pb2",
    ENVOY_DATA_PLANE: "envoy_data_plane.envoy.config.endpoint.v3",
}
_CLUSTER_NAME = "inference-pool"
_PORT = 8000
_METADATA_NAMESPACE = "envoy.lb"
_ADAPTERS = ("sql-lora", "tweet-summary", "chat-es", "code-py", "legal-en", "med-qa")


class EndpointSpec(NamedTuple):
    """What one endpoint of the assignment carries, independent of the library."""

    address: str
    weight: int
    lora: tuple[str, ...]
    """Adapter names for ``filter_metadata["envoy.lb"]["lora"]``; empty means no metadata."""


class Summary(NamedTuple):
    """What a parsed assignment must agree on, whichever library parsed it."""

    endpoint_count: int
    sample_address: str
    sample_weight: int
    sample_lora: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """Seconds per call of one operation: median, min and max over ``repeats`` calls."""

    repeats: int
    median_s: float
    min_s: float
    max_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportTiming:
    """A fresh interpreter importing one module, median over ``repeats`` runs.

    ``import_s`` is the import statement alone, timed inside the child; ``process_s`` is the
    whole ``python -c 'import ...'`` run, interpreter start-up included, timed by the parent.
    """

    module: str
    repeats: int
    import_s: float
    process_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class LibraryResult:
    """One library's figures."""

    name: str
    version: str
    size_bytes: int
    build: Timing
    serialize: Timing
    parse: Timing
    imports: ImportTiming


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """Everything the run measured; ``ratios`` is envoy-data-plane time / xds-protos time."""

    endpoints: int
    metadata: bool
    python: str
    cpus: int | None
    versions: dict[str, str]
    protobuf_backend: str
    byte_identical: bool
    results: dict[str, LibraryResult]
    ratios: dict[str, float]


def endpoint_specs(count: int, *, metadata: bool = True) -> list[EndpointSpec]:
    """Return ``count`` endpoints with distinct 10.x.y.z addresses and varied weights.

    With ``metadata``, each endpoint also lists two LoRA adapters; without, none.
    """
    specs = []
    for i in range(1, count + 1):
        address = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        weight = 1 + (i * 37) % 128
        lora: tuple[str, ...] = ()
        if metadata:
            lora = (_ADAPTERS[i % len(_ADAPTERS)], _ADAPTERS[(i + 1) % len(_ADAPTERS)])
        specs.append(EndpointSpec(address=address, weight=weight, lora=lora))
    return specs


# xds-protos ------------------------------------------------------------------------------


def build_xds_protos(specs: Sequence[EndpointSpec]) -> Any:
    """Build the assignment as an ``endpoint_pb2.ClusterLoadAssignment``."""
    from envoy.config.endpoint.v3 import endpoint_pb2

    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=_CLUSTER_NAME)
    locality = cla.endpoints.add()
    for spec in specs:
        lb_endpoint = locality.lb_endpoints.add()
        socket_address = lb_endpoint.endpoint.address.socket_address
        socket_address.address = spec.address
        socket_address.port_value = _PORT
        lb_endpoint.load_balancing_weight.value = spec.weight
        if not spec.lora:
            continue
        lora = lb_endpoint.metadata.filter_metadata[_METADATA_NAMESPACE].fields["lora"]
        for name in spec.lora:
            lora.list_value.values.add().string_value = name
    return cla


def parse_xds_protos(data: bytes) -> Any:
    """Parse wire bytes into an ``endpoint_pb2.ClusterLoadAssignment``."""
    from envoy.config.endpoint.v3 import endpoint_pb2

    return endpoint_pb2.ClusterLoadAssignment.FromString(data)


def summarize_xds_protos(cla: Any, *, sample: int) -> Summary:
    """Summarize a parsed xds-protos assignment at endpoint index ``sample``."""
    lb_endpoints = [lb for locality in cla.endpoints for lb in locality.lb_endpoints]
    lb = lb_endpoints[sample]
    lora = []
    if _METADATA_NAMESPACE in lb.metadata.filter_metadata:
        lora = lb.metadata.filter_metadata[_METADATA_NAMESPACE].fields["lora"].list_value.values
    return Summary(
        endpoint_count=len(lb_endpoints),
        sample_address=lb.endpoint.address.socket_address.address,
        sample_weight=lb.load_balancing_weight.value,
        sample_lora=tuple(value.string_value for value in lora),
    )


# envoy-data-plane ------------------------------------------------------------------------


def build_envoy_data_plane(specs: Sequence[EndpointSpec]) -> Any:
    """Build the assignment as envoy-data-plane's betterproto2 ``ClusterLoadAssignment``."""
    from envoy_data_plane.envoy.config.core import v3 as core
    from envoy_data_plane.envoy.config.endpoint import v3 as endpoint
    from envoy_data_plane.google import protobuf

    lb_endpoints = [
        endpoint.LbEndpoint(
            endpoint=endpoint.Endpoint(
                address=core.Address(
                    socket_address=core.SocketAddress(address=spec.address, port_value=_PORT)
                )
            ),
            load_balancing_weight=spec.weight,
            metadata=None
            if not spec.lora
            else core.Metadata(
                filter_metadata={
                    _METADATA_NAMESPACE: protobuf.Struct(
                        fields={
                            "lora": protobuf.Value(
                                list_value=protobuf.ListValue(
                                    values=[protobuf.Value(string_value=n) for n in spec.lora]
                                )
                            )
                        }
                    )
                }
            ),
        )
        for spec in specs
    ]
    return endpoint.ClusterLoadAssignment(
        cluster_name=_CLUSTER_NAME,
        endpoints=[endpoint.LocalityLbEndpoints(lb_endpoints=lb_endpoints)],
    )


def serialize_envoy_data_plane(cla: Any) -> bytes:
    """Encode a betterproto2 message (``bytes(message)`` is betterproto2's spelling)."""
    return bytes(cla)


def parse_envoy_data_plane(data: bytes) -> Any:
    """Parse wire bytes into envoy-data-plane's ``ClusterLoadAssignment``."""
    from envoy_data_plane.envoy.config.endpoint import v3 as endpoint

    return endpoint.ClusterLoadAssignment.parse(data)


def summarize_envoy_data_plane(cla: Any, *, sample: int) -> Summary:
    """Summarize a parsed envoy-data-plane assignment at endpoint index ``sample``."""
    lb_endpoints = [lb for locality in cla.endpoints for lb in locality.lb_endpoints]
    lb = lb_endpoints[sample]
    lora = []
    if lb.metadata is not None and _METADATA_NAMESPACE in lb.metadata.filter_metadata:
        lora = lb.metadata.filter_metadata[_METADATA_NAMESPACE].fields["lora"].list_value.values
    return Summary(
        endpoint_count=len(lb_endpoints),
        sample_address=lb.endpoint.address.socket_address.address,
        # betterproto2 unwraps google.protobuf.UInt32Value into a plain int.
        sample_weight=lb.load_balancing_weight,
        sample_lora=tuple(value.string_value for value in lora),
    )


# Measuring -------------------------------------------------------------------------------


def time_op(
    op: Callable[[], object], *, budget_s: float, min_repeats: int, max_repeats: int
) -> Timing:
    """Time ``op`` after one warm-up call, repeating it to fill about ``budget_s`` seconds.

    The warm-up call also sets the repeat count, clamped to ``[min_repeats, max_repeats]``.
    The garbage collector is left on, as it is in the server, but is run once before timing.
    """
    start = time.perf_counter()
    op()
    warm_s = time.perf_counter() - start
    repeats = max(min_repeats, min(max_repeats, int(budget_s / max(warm_s, 1e-9))))
    gc.collect()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return Timing(
        repeats=repeats,
        median_s=statistics.median(samples),
        min_s=min(samples),
        max_s=max(samples),
    )


def time_import(module: str, *, repeats: int) -> ImportTiming:
    """Import ``module`` in ``repeats`` fresh interpreters, after one untimed warm-up run.

    The warm-up run writes any missing ``.pyc`` files, so compiling is not counted. ``-P``
    keeps the current directory off ``sys.path``, so the installed package is the one timed.
    """
    code = (
        "import time\n"
        "start = time.perf_counter()\n"
        f"import {module}\n"
        "print(time.perf_counter() - start)\n"
    )
    command = [sys.executable, "-P", "-c", code]
    subprocess.run(command, check=True, capture_output=True)
    import_samples = []
    process_samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        completed = subprocess.run(command, check=True, capture_output=True, text=True)
        process_samples.append(time.perf_counter() - start)
        import_samples.append(float(completed.stdout.strip()))
    return ImportTiming(
        module=module,
        repeats=repeats,
        import_s=statistics.median(import_samples),
        process_s=statistics.median(process_samples),
    )


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _check(condition: bool, message: str) -> None:
    # Not `assert`: the cross-check must hold under `python -O` as well.
    if not condition:
        raise AssertionError(message)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(
    *,
    endpoints: int,
    metadata: bool,
    budget_s: float,
    min_repeats: int,
    max_repeats: int,
    import_repeats: int,
) -> Report:
    """Cross-check both libraries on an ``endpoints``-endpoint assignment, then time them."""
    from google.protobuf.internal import (  # type: ignore[import-untyped, unused-ignore]
        api_implementation,
    )

    specs = endpoint_specs(endpoints, metadata=metadata)
    sample = len(specs) // 2
    expected = Summary(
        endpoint_count=len(specs),
        sample_address=specs[sample].address,
        sample_weight=specs[sample].weight,
        sample_lora=specs[sample].lora,
    )

    _progress(f"Cross-checking both encodings of {endpoints:,} endpoints.")
    xds_message = build_xds_protos(specs)
    edp_message = build_envoy_data_plane(specs)
    xds_bytes: bytes = xds_message.SerializeToString()
    edp_bytes = serialize_envoy_data_plane(edp_message)
    _check(
        len(xds_bytes) == len(edp_bytes),
        f"Encodings differ in size: xds-protos {len(xds_bytes)} B, "
        f"envoy-data-plane {len(edp_bytes)} B.",
    )
    summaries = {
        "xds-protos parsing xds-protos": summarize_xds_protos(
            parse_xds_protos(xds_bytes), sample=sample
        ),
        "xds-protos parsing envoy-data-plane": summarize_xds_protos(
            parse_xds_protos(edp_bytes), sample=sample
        ),
        "envoy-data-plane parsing envoy-data-plane": summarize_envoy_data_plane(
            parse_envoy_data_plane(edp_bytes), sample=sample
        ),
        "envoy-data-plane parsing xds-protos": summarize_envoy_data_plane(
            parse_envoy_data_plane(xds_bytes), sample=sample
        ),
    }
    for what, summary in summaries.items():
        _check(summary == expected, f"{what} gave {summary}, expected {expected}.")

    def timed(op: Callable[[], object]) -> Timing:
        return time_op(op, budget_s=budget_s, min_repeats=min_repeats, max_repeats=max_repeats)

    ops: dict[str, tuple[Callable[[], object], Callable[[], object], Callable[[], object]]] = {
        XDS_PROTOS: (
            lambda: build_xds_protos(specs),
            xds_message.SerializeToString,
            lambda: parse_xds_protos(xds_bytes),
        ),
        ENVOY_DATA_PLANE: (
            lambda: build_envoy_data_plane(specs),
            lambda: serialize_envoy_data_plane(edp_message),
            lambda: parse_envoy_data_plane(edp_bytes),
        ),
    }
    sizes = {XDS_PROTOS: len(xds_bytes), ENVOY_DATA_PLANE: len(edp_bytes)}
    results = {}
    for name, (build, serialize, parse) in ops.items():
        _progress(f"Timing {name}: build, serialize, parse, import.")
        results[name] = LibraryResult(
            name=name,
            version=_version(name),
            size_bytes=sizes[name],
            build=timed(build),
            serialize=timed(serialize),
            parse=timed(parse),
            imports=time_import(_IMPORTS[name], repeats=import_repeats),
        )

    xds, edp = results[XDS_PROTOS], results[ENVOY_DATA_PLANE]
    ratios = {
        "build": edp.build.median_s / xds.build.median_s,
        "serialize": edp.serialize.median_s / xds.serialize.median_s,
        "parse": edp.parse.median_s / xds.parse.median_s,
        "import": edp.imports.import_s / xds.imports.import_s,
    }
    return Report(
        endpoints=endpoints,
        metadata=metadata,
        python=platform.python_version(),
        cpus=os.cpu_count(),
        versions={
            name: _version(name)
            for name in ("xds-protos", "protobuf", "envoy-data-plane", "betterproto2", "pydantic")
        },
        protobuf_backend=api_implementation.Type(),
        byte_identical=xds_bytes == edp_bytes,
        results=results,
        ratios=ratios,
    )


# Output ----------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _timing_cell(timing: Timing) -> str:
    return f"{_duration(timing.median_s)} (n={timing.repeats})"


def format_table(report: Report) -> str:
    """Render the report as a small text table, medians with repeat counts."""
    xds, edp = report.results[XDS_PROTOS], report.results[ENVOY_DATA_PLANE]
    v = report.versions
    lines = [
        f"ClusterLoadAssignment, {report.endpoints:,} endpoints "
        f"({'with' if report.metadata else 'without'} envoy.lb lora metadata); "
        f"Python {report.python}, {report.cpus} CPUs",
        f"xds-protos {v['xds-protos']} (protobuf {v['protobuf']}, "
        f"{report.protobuf_backend} backend) vs envoy-data-plane {v['envoy-data-plane']} "
        f"(betterproto2 {v['betterproto2']}, pydantic {v['pydantic']})",
        "",
        f"{'':<11}{'xds-protos':<22}{'envoy-data-plane':<22}envoy-data-plane / xds-protos",
    ]
    for op in ("build", "serialize", "parse"):
        xds_timing: Timing = getattr(xds, op)
        edp_timing: Timing = getattr(edp, op)
        lines.append(
            f"{op:<11}{_timing_cell(xds_timing):<22}{_timing_cell(edp_timing):<22}"
            f"{report.ratios[op]:,.0f}x"
        )
    lines.append(
        f"{'import':<11}{_duration(xds.imports.import_s):<22}"
        f"{_duration(edp.imports.import_s):<22}{report.ratios['import']:,.1f}x"
    )
    lines.append(
        f"{'  process':<11}{_duration(xds.imports.process_s):<22}"
        f"{_duration(edp.imports.process_s):<22}"
        f"(python -c 'import ...', median of {xds.imports.repeats})"
    )
    identical = "byte-identical" if report.byte_identical else "same size, bytes differ"
    lines.append(
        f"{'size':<11}{f'{xds.size_bytes:,} B':<22}{f'{edp.size_bytes:,} B':<22}"
        f"{identical}, each parses the other's"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print a table, or JSON with ``--json``."""
    parser = argparse.ArgumentParser(
        description="Time xds-protos against envoy-data-plane on a ClusterLoadAssignment."
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--endpoints", type=int, default=1000, help="endpoints (default 1000)")
    parser.add_argument(
        "--metadata",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give each endpoint envoy.lb metadata with a lora list (default on)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=2.0,
        help="seconds to spend timing each operation of each library (default 2)",
    )
    parser.add_argument("--min-repeats", type=int, default=5, help="(default 5)")
    parser.add_argument("--max-repeats", type=int, default=1000, help="(default 1000)")
    parser.add_argument(
        "--import-repeats", type=int, default=3, help="fresh interpreters per import (default 3)"
    )
    args = parser.parse_args(argv)
    if args.endpoints < 1:
        parser.error("--endpoints must be at least 1")

    try:
        import envoy_data_plane  # noqa: F401
    except ImportError:
        parser.exit(
            2,
            "envoy-data-plane is not installed; install the bench extra: "
            "pip install -e '.[bench]'\n",
        )

    report = run(
        endpoints=args.endpoints,
        metadata=args.metadata,
        budget_s=args.budget,
        min_repeats=args.min_repeats,
        max_repeats=args.max_repeats,
        import_repeats=args.import_repeats,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
