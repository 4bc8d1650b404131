"""Turn benchmark results into the markdown tables and the TTFT CDF plots.

Pure apart from writing the files it is asked to write. The results dict is the documented
`results.json` shape: {"scenarios": {name: {"policies": {policy: summary}}}, ...}; a
summary merged over seeds holds the median of each figure and, under `per_seed`, every
seed's value (bench/runner.py `_merge_seeds`).

The headline is "project vs best peer" (issue 18): the peers are real per-request routers
(bench/peers.py) and the claim worth making is against the best of them in each scenario,
with the spread over seeds and the number of requests behind each percentile, so that a
P99 of a few dozen requests is not read as more than it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.pooling import served_shares

__all__ = [
    "PEER_PREFIX",
    "POLICY_ORDER",
    "best_peer",
    "gap_closure",
    "headline_table",
    "markdown_table",
    "ordered_policies",
    "plot_ttft_cdfs",
    "ttft_counts",
]

POLICY_ORDER = ("round_robin", "least_request", "project", "oracle")
# Peer policies' names (bench/peers.py PEER_POLICIES); matched by prefix so that a
# results.json with a policy this checkout does not know still reports it as a peer.
PEER_PREFIX = ("vllm_router_", "sglang_router_")
_PEER_NAMES = ", ".join(f"{prefix}*" for prefix in PEER_PREFIX)
# Outcomes of a request that never waited on a pod for a first token: no TTFT sample
# (llm_sim.loadgen.stats.ttft_sample).
_NO_TTFT_ERRORS = frozenset({"error:connect", "error:dropped_by_client", "error:protocol"})


def ordered_policies(policies: Mapping[str, Any]) -> list[str]:
    """Every policy of `policies`: those of POLICY_ORDER in that order, then the rest
    (the peers) by name."""
    return [p for p in POLICY_ORDER if p in policies] + sorted(
        p for p in policies if p not in POLICY_ORDER
    )


def gap_closure(
    policies: Mapping[str, Mapping[str, Any]], key: str, *, policy: str = "project"
) -> float | None:
    """(RR − policy) / (RR − oracle) for metric `key`; None when undefined (a policy
    missing, or no gap to close)."""
    try:
        rr, ours, oracle = (float(policies[p][key]) for p in ("round_robin", policy, "oracle"))
    except (KeyError, TypeError):
        return None
    if rr - oracle <= 0:
        return None
    return (rr - ours) / (rr - oracle)


def best_peer(policies: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The peer with the lowest P99 TTFT (the median over seeds), ties broken by P95 and
    then by name; a peer without a figure ranks last. None when no peer ran."""

    def rank(name: str) -> tuple[bool, float, bool, float, str]:
        p99, p95 = policies[name].get("ttft_p99_s"), policies[name].get("ttft_p95_s")
        return (p99 is None, p99 or 0.0, p95 is None, p95 or 0.0, name)

    peers = [p for p in policies if p.startswith(PEER_PREFIX)]
    return min(peers, key=rank) if peers else None


def _seed_values(summary: Mapping[str, Any], key: str) -> list[Any]:
    """Every seed's `key`: `per_seed` when merged over seeds, else the one run's."""
    per_seed = summary.get("per_seed", {})
    return list(per_seed[key]) if key in per_seed else [summary.get(key)]


def ttft_counts(summary: Mapping[str, Any]) -> list[int]:
    """The number of requests behind the TTFT percentiles, per seed: every measured
    request but those refused (an HTTP status other than 200) or never sent or answered
    (connect and protocol errors, dropped by the client); timeouts count, as in
    `ttft_sample`, with the time they had waited."""
    counts = []
    for requests, statuses in zip(
        _seed_values(summary, "requests"), _seed_values(summary, "status_counts"), strict=True
    ):
        excluded = sum(
            n for k, n in (statuses or {}).items() if k != "200" and not k.startswith("error:")
        ) + sum(n for k, n in (statuses or {}).items() if k in _NO_TTFT_ERRORS)
        counts.append(int(requests or 0) - excluded)
    return counts


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:,.0f}"


def _tokens(per_s: float | None) -> str:
    return "–" if per_s is None else f"{per_s:,.0f}"


def _spread(summary: Mapping[str, Any], key: str, unit: Callable[[float | None], str]) -> str:
    """The median over seeds, and the min–max over seeds when there is more than one."""
    values = [float(v) for v in _seed_values(summary, key) if isinstance(v, int | float)]
    median = unit(summary.get(key))
    if len(values) < 2:
        return median
    return f"{median} ({unit(min(values))}–{unit(max(values))})"


def _count(summary: Mapping[str, Any]) -> str:
    """Requests behind the TTFT percentiles per seed, and which one the P99 is."""
    counts = ttft_counts(summary)
    low, high = min(counts), max(counts)
    size = f"{low}" if low == high else f"{low}–{high}"
    if low <= 0:
        return size
    # Nearest rank (llm_sim.loadgen.stats): P99 of n is the ceil(0.99 n)-th fastest.
    slowest = sorted({n - math.ceil(99 / 100 * n) + 1 for n in (low, high)})
    return f"{size} (P99: #{'–'.join(map(str, slowest))} slowest)"


def _closure(policies: Mapping[str, Mapping[str, Any]], policy: str) -> str:
    value = gap_closure(policies, "ttft_p99_s", policy=policy)
    return "–" if value is None else f"{100 * value:.0f}%"


def headline_table(results: Mapping[str, Any]) -> str:
    """The "project vs best peer" table: per scenario, the project's row and its best
    peer's. Scenarios without the project or without a peer are named below it; without
    any such scenario, one line says why there is no table."""
    scenarios = results["scenarios"]
    paired = {
        name: peer
        for name, scenario in scenarios.items()
        if "project" in scenario["policies"]
        and (peer := best_peer(scenario["policies"])) is not None
    }
    if not paired:
        return (
            f"No scenario ran both the project and a peer ({_PEER_NAMES}): no"
            " project-vs-best-peer table."
        )
    seeds = int(results.get("seeds", 1))
    spread = (
        f"Figures are the median over {seeds} seeds, the min–max over seeds in brackets."
        if seeds > 1
        else "One seed: no spread."
    )
    lines = [
        "### Project vs best peer",
        "",
        f"Best peer: the {_PEER_NAMES} policy with the lowest P99 TTFT (median over seeds;"
        f" ties by P95). {spread} Gap closure: (RR − policy) / (RR − oracle) on P99 TTFT"
        " (– without round robin and oracle runs, or when RR is not slower than the"
        " oracle). n: requests behind each TTFT percentile, per seed (nearest rank).",
        "",
        "| scenario | policy | TTFT p95 ms | TTFT p99 ms | output tok/s "
        "| gap closure P99 | n per seed |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, peer in paired.items():
        policies = scenarios[name]["policies"]
        for policy, label in (("project", "project"), (peer, f"best peer: {peer}")):
            s = policies[policy]
            lines.append(
                f"| {name} | {label} | {_spread(s, 'ttft_p95_s', _ms)} "
                f"| {_spread(s, 'ttft_p99_s', _ms)} "
                f"| {_spread(s, 'output_tokens_per_s', _tokens)} "
                f"| {_closure(policies, policy)} | {_count(s)} |"
            )
    if missing := [n for n in scenarios if n not in paired]:
        lines += ["", f"Not in this table (no project or no peer run): {', '.join(missing)}."]
    if not any("oracle" in scenarios[n]["policies"] for n in paired):
        lines += ["", "No oracle in this run: no gap closure."]
    return "\n".join(lines)


def _statuses(counts: Mapping[str, int]) -> str:
    errors = {k: v for k, v in sorted(counts.items()) if k != "200"}
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def markdown_table(results: Mapping[str, Any]) -> str:
    """The headline (project vs best peer), then one table per scenario: a row per
    policy, peers included, then the project's gap closure for P95/P99 TTFT."""
    lines: list[str] = [headline_table(results), ""]
    for name, scenario in results["scenarios"].items():
        policies = scenario["policies"]
        lines += [
            f"### Scenario {name}: {scenario.get('title', '')}",
            "",
            "| policy | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | TPOT p50 ms | E2E p99 ms "
            "| output tok/s | requests | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for policy in ordered_policies(policies):
            s = policies[policy]
            lines.append(
                f"| {policy} | {_ms(s.get('ttft_p50_s'))} | {_ms(s.get('ttft_p95_s'))} "
                f"| {_ms(s.get('ttft_p99_s'))} | {_ms(s.get('tpot_p50_s'))} "
                f"| {_ms(s.get('e2e_p99_s'))} "
                f"| {s.get('output_tokens_per_s', 0):,.0f} | {s.get('requests', 0)} "
                f"| {_statuses(s.get('status_counts', {}))} |"
            )
        lines += ["", *_pooled_table(policies, seeds=results.get("seed_list"))]
        if shares := _served_table(scenario):
            lines += ["", *shares]
        if "capacity_tokens_per_s" in scenario:
            lines += ["", *_overload_table(scenario)]
        if any("max_admitted_over_limit" in s for s in policies.values()):
            lines += ["", *_replicas_lines(policies)]
        if any("requests_to_dead_pod_after_s" in s for s in policies.values()):
            lines += ["", *_faults_table(policies)]
        if any("key_stickiness" in s for s in policies.values()):
            lines += ["", *_keys_table(policies)]
        if any("group_homes" in s for s in policies.values()):
            lines += ["", _group_homes_line(policies)]
        closures = []
        for key, label in (("ttft_p95_s", "P95"), ("ttft_p99_s", "P99")):
            value = gap_closure(policies, key)
            closures.append(f"{label} TTFT {'–' if value is None else f'{100 * value:.0f}%'}")
        lines += ["", "Gap closure (RR − project) / (RR − oracle): " + ", ".join(closures), ""]
        warmup = next((s["warmup_s"] for s in policies.values() if "warmup_s" in s), None)
        if warmup:
            lines += [
                f"Requests arriving after {warmup:g} s of warm-up (whole-run figures in"
                " results.json, `whole_run`). Prefix-cache hit rate, adapter loads, adapter"
                " hits: "
                + "; ".join(
                    f"{p} {_rate(policies[p].get('prefix_cache_hit_rate'))},"
                    f" {policies[p].get('adapter_loads', 0)},"
                    f" {_rate(policies[p].get('adapter_hit_fraction'))}"
                    for p in ordered_policies(policies)
                )
                + ".",
                "",
            ]
    reaction = results.get("reaction")
    if reaction:
        lines.append(
            f"Reaction time (pod metrics change -> Envoy applies the weight), {reaction['trials']} "
            f"trials: p50 {_ms(reaction['reaction_p50_s'])} ms, "
            f"p99 {_ms(reaction['reaction_p99_s'])} ms "
            f"(target {_ms(reaction['target_s'])} ms)."
        )
    if results.get("machine_saturated"):
        lines.append(
            "**Warning:** the machine was saturated during at least one run; see results.json."
        )
    return "\n".join(lines) + "\n"


def _pooled_cell(figures: Mapping[str, Any] | None, key: str) -> str:
    """A pooled percentile in ms, with each seed's own as min–median–max when it has a
    spread: `181 (seeds 153–170–221)`."""
    if not figures:
        return "–"
    cell = _ms(figures.get(f"{key}_s"))
    spread = figures.get(f"{key}_seeds_s")
    if figures.get("seeds", 1) < 2 or not spread:
        return cell
    low, median, high = (_ms(spread[k]) for k in ("min", "median", "max"))
    return f"{cell} (seeds {low}–{median}–{high})"


def _pooled_table(
    policies: Mapping[str, Mapping[str, Any]], *, seeds: Sequence[int] | None
) -> list[str]:
    """Latencies over every seed's requests pooled, with each seed's P95 and P99 as
    min–median–max (bench/pooling.py); nothing for results without them."""
    rows = [p for p in ordered_policies(policies) if "pooled" in policies[p]]
    if not rows:
        return []
    which = f"seeds {', '.join(map(str, seeds))}" if seeds else "the seeds"
    lines = [
        f"Pooled over {which}: each percentile of all their requests together; in brackets"
        " each seed's own, min–median–max.",
        "",
        "| policy | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | TPOT p50 ms | E2E p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy in rows:
        pooled = policies[policy]["pooled"]
        ttft, tpot, e2e = (pooled.get(kind) for kind in ("ttft", "tpot", "e2e"))
        lines.append(
            f"| {policy} | {_pooled_cell(ttft, 'p50')} | {_pooled_cell(ttft, 'p95')} "
            f"| {_pooled_cell(ttft, 'p99')} | {_pooled_cell(tpot, 'p50')} "
            f"| {_pooled_cell(e2e, 'p99')} |"
        )
    return lines


def _pod_capacities(scenario: Mapping[str, Any]) -> dict[str, float] | None:
    """Each pod's nominal capacity from results.json's `pods`; equal for results without
    it whose pods share one profile; None otherwise."""
    pods = scenario.get("pods") or []
    if pods and all("capacity_requests_per_s" in p for p in pods):
        return {p["name"]: float(p["capacity_requests_per_s"]) for p in pods}
    if pods and len({p.get("profile") for p in pods}) == 1:
        return {p["name"]: 1.0 for p in pods}
    return None


def _served_table(scenario: Mapping[str, Any]) -> list[str]:
    """Each pod's share of the requests served (summed over seeds) against its share of
    the fleet's capacity, and the largest |share / capacity share − 1| per policy."""
    capacity = _pod_capacities(scenario)
    policies = scenario["policies"]
    rows = [p for p in ordered_policies(policies) if policies[p].get("served_by")]
    if capacity is None or not rows:
        return []
    shares = {p: served_shares(policies[p]["served_by"], capacity) for p in rows}
    fleet = sum(capacity.values())
    header = " | ".join(f"{pod} ({100 * c / fleet:.0f}%)" for pod, c in capacity.items())
    lines = [
        "Requests served per pod, summed over seeds: each pod's share, against its share of"
        " the fleet's nominal capacity (in the header); largest deviation"
        " = max |share / capacity share − 1|.",
        "",
        f"| policy | {header} | largest deviation |",
        f"|---|{'---:|' * len(capacity)}---:|",
    ]
    for policy, figures in shares.items():
        cells = " | ".join(
            "–" if p["share"] is None else f"{100 * p['share']:.1f}%"
            for p in figures["pods"].values()
        )
        deviation = figures["max_deviation"]
        lines.append(
            f"| {policy} | {cells} | {'–' if deviation is None else f'{100 * deviation:.0f}%'} |"
        )
    return lines


def _group_homes_line(policies: Mapping[str, Mapping[str, Any]]) -> str:
    """Where each policy kept the prefix groups (bench/affinity.py, `group_homes`)."""

    def homes(figures: Mapping[str, Any]) -> str:
        ratio = figures.get("requests_max_over_mean")
        return (
            f"{'/'.join(f'{g:g}' for g in figures.get('groups_per_pod', []))},"
            f" {'–' if ratio is None else f'{ratio:.2f}'},"
            f" {figures.get('off_home_requests', 0):g}"
        )

    return (
        "Prefix groups per pod (busiest first; median over seeds), the busiest pod's"
        " requests over the mean pod's, requests away from their group's pod: "
        + "; ".join(
            f"{p} {homes(policies[p]['group_homes'])}"
            for p in ordered_policies(policies)
            if "group_homes" in policies[p]
        )
        + "."
    )


def _overload_table(scenario: Mapping[str, Any]) -> list[str]:
    """Scenario f's flow-control figures: refusals per band, Critical TTFT, goodput."""
    capacity = float(scenario["capacity_tokens_per_s"])
    lines = [
        f"Fleet capacity (single-pod saturation probes): {capacity:,.0f} output tokens/s.",
        "",
        "| policy | refused critical / standard / sheddable | first refusal s (std / shed) "
        "| TTFT p99 ms at half load (critical only) → critical in overload "
        "| goodput tok/s (of capacity) "
        "| 429 without Retry-After | 5xx |",
        "|---|---|---|---|---|---:|---:|",
    ]
    policies = scenario["policies"]
    for policy in ordered_policies(policies):
        s = policies[policy]
        refused = s.get("refused_by_band", {})
        first = s.get("first_refusal_s_by_band", {})
        goodput = float(s.get("goodput_tokens_per_s", 0.0))
        ratio = s.get("critical_ttft_p99_ratio")

        def seconds(band: str) -> str:
            value = first.get(band)  # noqa: B023
            return "–" if value is None else f"{value:.1f}"

        lines.append(
            f"| {policy} "
            f"| {refused.get('critical', 0)} / {refused.get('standard', 0)} "
            f"/ {refused.get('sheddable', 0)} "
            f"| {seconds('standard')} / {seconds('sheddable')} "
            f"| {_ms(s.get('ttft_p99_half_load_s'))} "
            f"({_ms(s.get('critical_ttft_p99_half_load_s'))}) → "
            f"{_ms(s.get('critical_ttft_p99_overload_s'))}"
            f"{'' if ratio is None else f' ({ratio:.2f}x)'} "
            f"| {goodput:,.0f} ({100 * goodput / capacity:.0f}%) "
            f"| {s.get('retry_after_missing', 0)} | {s.get('server_errors', 0)} |"
        )
    return lines


def _replicas_lines(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Scenario f2's figures: admitted concurrency over the limit, and the split."""
    lines = []
    for policy in ordered_policies(policies):
        s = policies[policy]
        if "max_admitted_over_limit" not in s:
            continue
        split = s.get("split", {})
        shares = split.get("shares", {})
        by_envoy = split.get("by_envoy", {})
        envoys = ", ".join(
            f"{node} {100 * share:.0f}% ({by_envoy.get(node, {}).get('requests', 0)} requests,"
            f" {by_envoy.get(node, {}).get('status_counts', {}).get('429', 0)} refused)"
            for node, share in shares.items()
        )
        lines.append(
            f"{policy}: {s.get('envoys')} Envoys on replicas {', '.join(s.get('replicas', []))}"
            f" ({envoys}). Standard+Sheddable admitted over the pool limit"
            f" ({s.get('admitted_limit')}): at most {s.get('max_admitted_over_limit')}"
            f" (target ≤ {s.get('envoys')}); every band over it:"
            f" at most {s.get('max_all_bands_over_limit')}."
        )
    return lines


def _seconds(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def _faults_table(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Scenario g's figures: what clients saw of the faults, and what Envoy did."""
    lines = [
        "| policy | failed before headers | cut streams (no token yet) | non-JSON errors "
        "| last request to the dead pod, s after the kill "
        "| types re-versioned on restart | reconnect s |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for policy in ordered_policies(policies):
        s = policies[policy]
        changed = s.get("versions_changed_on_restart")
        lines.append(
            f"| {policy} | {s.get('failed_before_headers')} "
            f"| {s.get('cut_streams')} ({s.get('cut_streams_without_tokens')}) "
            f"| {s.get('non_json_errors')} "
            f"| {_seconds(s.get('requests_to_dead_pod_after_s'))} "
            f"| {'–' if changed is None else ', '.join(changed) or 'none'} "
            f"| {_seconds(s.get('reconnect_s'))} |"
        )
    faults = next((s["faults"] for s in policies.values() if "faults" in s), None)
    if faults is not None:
        lines += [
            "",
            f"Faults (s from the trace's start, first policy's run): {faults['killed_pod']} killed"
            f" at {faults['kill_s']:.2f} ({faults['killed_connections']} connections cut),"
            f" {faults['reset_pod']} reset at {faults['reset_s']:.2f}"
            f" ({faults['reset_connections']} requests without a first token),"
            f" {faults['killed_pod']} back at {faults['revive_s']:.2f}, the control plane"
            f" killed at {faults['control_plane_kill_s']:.2f}.",
        ]
    return lines


def _share(value: Any) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _calm_keys(group: Mapping[str, Any] | None) -> str:
    """The project's `light_calm` group (bench/affinity.py); other policies have none."""
    if not group:
        return "–"
    weighted, worst = _share(group.get("weighted")), _share(group.get("min"))
    return f"{weighted} ({worst} min; {group.get('keys', 0)} keys)"


def _keys_table(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Scenario h's figures (bench/affinity.py): key stickiness and the heavy keys' spill."""
    lines = [
        "| policy | light keys of unloaded pods: on home (median, min; keys) "
        "| … of never-queued pods | … of pods the server never spilled (its ring's home) "
        "| heavy keys on home "
        "| spill reaction ms p50 / max (spilled / episodes) | stayed max ms "
        "| unspilled (longest ms) / idle | server decision ms p50 / max |",
        "|---|---|---|---|---|---|---:|---|---|",
    ]
    for policy in ordered_policies(policies):
        s = policies[policy]
        sticky = s.get("key_stickiness") or {}
        unloaded = sticky.get("light_unloaded") or {}
        never = sticky.get("light_never_queued") or {}
        calm = sticky.get("light_calm")
        heavy = sticky.get("heavy") or {}
        spill = s.get("spill_reaction_s") or {}
        lines.append(
            f"| {policy} | {_share(unloaded.get('weighted'))} ({_share(unloaded.get('median'))},"
            f" {_share(unloaded.get('min'))}; {unloaded.get('keys', 0)}) "
            f"| {_share(never.get('weighted'))} ({never.get('keys', 0)} keys) "
            f"| {_calm_keys(calm)} "
            f"| {' / '.join(_share(v) for _, v in sorted(heavy.items())) or '–'} "
            f"| {_ms(spill.get('median'))} / {_ms(spill.get('max'))}"
            f" ({spill.get('spilled', 0)} / {spill.get('episodes', 0)}) "
            f"| {_ms(spill.get('stayed_max_s'))} "
            f"| {spill.get('unspilled', 0)} ({_ms(spill.get('unspilled_longest_s'))})"
            f" / {spill.get('idle', 0)} "
            f"| {_ms(spill.get('decision_median'))} / {_ms(spill.get('decision_max'))} |"
        )
    return lines


def plot_ttft_cdfs(
    ttfts: Mapping[str, Mapping[str, Sequence[float]]], *, titles: Mapping[str, str], out_dir: Path
) -> list[Path]:
    """One PNG per scenario: the TTFT CDF of every policy (log x axis). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for scenario, by_policy in ttfts.items():
        figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
        for policy in ordered_policies(by_policy):
            samples = sorted(by_policy[policy])
            if not samples:
                continue
            fractions = [(i + 1) / len(samples) for i in range(len(samples))]
            axes.step(samples, fractions, where="post", label=policy)
        axes.set_xscale("log")
        axes.set_xlabel("time to first token (s)")
        axes.set_ylabel("fraction of requests")
        axes.set_title(f"Scenario {scenario}: {titles.get(scenario, '')}")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(loc="lower right")
        path = out_dir / f"ttft_cdf_{scenario}.png"
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written
