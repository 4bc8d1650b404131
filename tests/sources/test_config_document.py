"""Parsing in a child process: the same answers as `parse_config`, a time bound that kills
the child, a crash that is the child's alone; which pools a config leaves empty, and which
it empties (refused)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import eventually
from tests.sources.stalls import giant_document, slow_document
from xds_server.config import ParseLimits, parse_config
from xds_server.errors import ConfigError
from xds_server.sources.config_document import (
    emptied_pools,
    parse_in_child,
    pools_without_endpoints,
    refuse_emptied_pools,
)

FULL = """
listener: {address: 127.0.0.1, port: 8081, max_request_bytes: 4096}
pools:
  - name: llama
    models: [llama, llama-instruct]
    adapters: [sql-lora]
    session_affinity: true
    endpoints: [{address: 10.0.0.1, port: 8000, weight: 3, hardware: h100}]
    selector: {match_labels: {app: llama}, target_port: 8000}
model_rewrites: [{model: chat, targets: [{model: llama, weight: 1}]}]
balancing: {hardware_capacity: {h100: 13}}
flow_control: {enabled: true, objectives: {batch: -1}}
"""


def children() -> set[int]:
    """This process's child processes (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


async def test_the_child_answers_as_parse_config_does() -> None:
    assert await parse_in_child(FULL, source="c.yaml") == parse_config(FULL)
    bad = "pools: [{name: A_, models: [m]}]"
    with pytest.raises(ConfigError) as expected:
        parse_config(bad, source="c.yaml")
    with pytest.raises(ConfigError) as caught:
        await parse_in_child(bad.encode(), source="c.yaml")
    assert str(caught.value) == str(expected.value)


async def test_a_document_over_the_cap_never_reaches_a_child() -> None:
    before = children()
    giant = giant_document(50)
    with pytest.raises(ConfigError) as caught:
        await parse_in_child(giant, source="c.yaml")
    assert (
        str(caught.value) == f"c.yaml: refused: {len(giant)} bytes, over the limit of 1048576 bytes"
    )
    assert children() == before


async def test_a_parse_over_the_time_bound_is_refused_and_its_child_killed() -> None:
    before = children()
    with pytest.raises(ConfigError) as caught:
        await parse_in_child(slow_document(), source="c.yaml", timeout_s=0.05)
    assert str(caught.value) == "c.yaml: refused: parsing took longer than 0.05 s"
    assert children() == before


async def test_a_cancelled_parse_kills_its_child() -> None:
    before = children()
    parse = asyncio.create_task(parse_in_child(slow_document(), source="c.yaml"))
    await eventually(lambda: children() - before, what="the child")
    parse.cancel()
    with pytest.raises(asyncio.CancelledError):
        await parse
    assert children() == before


async def test_a_parser_that_dies_is_a_refused_config() -> None:
    # Without a depth limit, 5,000 nested lists exhaust the child's Python stack.
    with pytest.raises(ConfigError) as caught:
        await parse_in_child(
            "- " * 5000 + "x", source="c.yaml", limits=ParseLimits(max_depth=10**6)
        )
    assert str(caught.value).startswith("c.yaml: refused: the config parser failed (RecursionError")


@pytest.mark.parametrize(
    ("pool", "followed", "empty"),
    [
        ("endpoints: [{address: 10.0.0.1, port: 80}]", False, False),
        ("endpoints: [{address: 10.0.0.1, port: 80}]", True, False),
        ("selector: {match_labels: {app: a}, target_port: 80}", True, False),
        ("selector: {match_labels: {app: a}, target_port: 80}", False, True),
        ("endpoints: []", True, True),
        ("endpoints: []", False, True),
    ],
)
def test_pools_without_endpoints(pool: str, followed: bool, empty: bool) -> None:
    config = parse_config(
        f"pools: [{{name: a, models: [m], {pool}}}, "
        "{name: b, models: [n], endpoints: [{address: 10.0.0.2, port: 80}]}]"
    )
    assert pools_without_endpoints(config, selectors_followed=followed) == (("a",) if empty else ())


LISTED = "endpoints: [{address: 10.0.0.1, port: 80}, {address: 10.0.0.3, port: 80}]"
SELECTOR = "selector: {match_labels: {app: a}, target_port: 80}"
OTHER = "{name: b, models: [n], endpoints: [{address: 10.0.0.2, port: 80}]}"


def _pools(*pools: str) -> str:
    return "pools: [" + ", ".join(pools) + "]"


@pytest.mark.parametrize(
    ("before", "after", "followed", "emptied"),
    [
        # A list of endpoints that goes from some to none: emptied, with or without
        # Kubernetes, whether the list is gone or written empty.
        (LISTED, "endpoints: []", False, True),
        (LISTED, "endpoints: []", True, True),
        (LISTED, "", False, True),  # no `endpoints` key at all
        # ...unless the pool says so.
        (LISTED, "allow_empty: true", False, False),
        (LISTED, "endpoints: [], allow_empty: true", True, False),
        # Endpoints left: not emptied.
        (LISTED, "endpoints: [{address: 10.0.0.3, port: 80}]", False, False),
        # A selector that is followed brings its pods (or none, for a while): not emptied.
        (LISTED, SELECTOR, True, False),
        (f"{LISTED}, {SELECTOR}", SELECTOR, True, False),
        # ...but one nothing follows (no Kubernetes) brings nothing: emptied.
        (LISTED, SELECTOR, False, True),
        # A pool that listed none had nothing to lose (accepted with the warning).
        ("endpoints: []", "endpoints: []", False, False),
        (SELECTOR, "endpoints: []", True, False),
    ],
)
def test_emptied_pools(before: str, after: str, followed: bool, emptied: bool) -> None:
    old = parse_config(_pools(f"{{name: a, models: [m], {before}}}", OTHER))
    new = parse_config(_pools(f"{{name: a, models: [m], {after}}}", OTHER))
    assert emptied_pools(old, new, selectors_followed=followed) == (("a",) if emptied else ())


def test_new_and_removed_pools_and_the_first_config_empty_nothing() -> None:
    old = parse_config(_pools(f"{{name: a, models: [m], {LISTED}}}", OTHER))
    # The first config since the server started: nothing to compare with.
    first = parse_config(_pools("{name: a, models: [m]}", OTHER))
    assert emptied_pools(None, first, selectors_followed=False) == ()
    # A pool new in the config, empty: it never had endpoints.
    added = parse_config(
        _pools(f"{{name: a, models: [m], {LISTED}}}", OTHER, "{name: c, models: [o]}")
    )
    assert emptied_pools(old, added, selectors_followed=False) == ()
    # A pool removed, with its models: not emptied.
    removed = parse_config(_pools(OTHER))
    assert emptied_pools(old, removed, selectors_followed=False) == ()
    # A renamed pool is a new pool.
    renamed = parse_config(_pools("{name: a2, models: [m]}", OTHER))
    assert emptied_pools(old, renamed, selectors_followed=False) == ()


def test_the_refusal_names_each_emptied_pool_and_what_it_had() -> None:
    old = parse_config(_pools(f"{{name: a, models: [m], {LISTED}}}", OTHER))
    new = parse_config(_pools("{name: a, models: [m]}", "{name: b, models: [n]}"))
    assert emptied_pools(old, new, selectors_followed=False) == ("a", "b")
    with pytest.raises(ConfigError) as caught:
        refuse_emptied_pools(old, new, source="c.yaml", selectors_followed=False)
    assert str(caught.value) == (
        "c.yaml: refused: it would leave 2 pool(s) that listed endpoints with none:"
        " 'a' (had 2), 'b' (had 1), and their models answered 503 no_healthy_upstream"
        " (`allow_empty: true` on a pool empties it on purpose)"
    )
    refuse_emptied_pools(old, old, source="c.yaml", selectors_followed=False)  # nothing emptied
