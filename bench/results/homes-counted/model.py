"""An offline model of scenario c's key homes: what moving keys by counted requests can buy.

32 prefix groups of equal popularity arrive at 6.67 requests/s (c's rate) over a weighted
Maglev table of four pods (Envoy's algorithm: each pod fills slots in turn, as often as its
weight allows, at offset + skip * next). A request finishes 2.5 s after it arrives, and the
rule under test sees the finished counts every 65 ms (the decision rate measured on c's busy
pool, counted-tol-0.2-log/moves.log). Spills, queueing and quantization beyond the weight
ladder are left out. Measured after the 16 s warm-up, as the benchmark does: a group's
first request on a pod (a prefix miss), and the largest |served share / capacity share - 1|.

    python bench/results/homes-counted/model.py 40     # seeds 0..39, about 2 minutes
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

TABLE_SIZE = 65537
LADDER = 1.15
MAX_WEIGHT = 100_000


def maglev(hosts: list[tuple[int, int]], weights: list[int]) -> np.ndarray:
    top = max(weights)
    offset = [o for o, _ in hosts]
    skip = [s for _, s in hosts]
    following = [0] * len(hosts)
    due = [float(top)] * len(hosts)
    table = np.full(TABLE_SIZE, -1, dtype=np.int64)
    filled, turn = 0, 1
    while filled < TABLE_SIZE:
        for i, weight in enumerate(weights):
            if filled >= TABLE_SIZE:
                break
            if turn * weight < due[i]:
                continue
            due[i] += top
            slot = (offset[i] + skip[i] * following[i]) % TABLE_SIZE
            while table[slot] != -1:
                following[i] += 1
                slot = (offset[i] + skip[i] * following[i]) % TABLE_SIZE
            table[slot] = i
            following[i] += 1
            filled += 1
        turn += 1
    return table


def quantized(factors: list[float]) -> list[int]:
    top = max(factors)
    steps = [round(math.log(top / f) / math.log(LADDER)) for f in factors]
    return [max(1, round(MAX_WEIGHT / LADDER**k)) for k in steps]


@dataclass
class Counted:
    """Move when some pod's share of the requests finished since the last move is off its
    share by more than `tolerance` and `z` standard deviations of chance, once `min_n`
    requests are in and `min_s` seconds passed; at most `max_moves` moves (0: no limit)."""

    tolerance: float = 0.2
    z: float = 2.5
    min_n: int = 0
    min_s: float = 2.6
    max_moves: int = 0
    base: list[int] | None = None
    since: float = 0.0
    moves: int = 0

    def decide(self, finished: list[int], factors: list[float], now: float) -> list[float] | None:
        if self.base is None:
            self.base, self.since = finished, now
            return None
        served = [f - b for f, b in zip(finished, self.base, strict=True)]
        n, pods = sum(served), len(served)
        if now - self.since < self.min_s or n < max(1, self.min_n):
            return None
        if self.max_moves and self.moves >= self.max_moves:
            return None
        target = 1 / pods
        share = [s / n for s in served]
        spread = math.sqrt(target * (1 - target) / n)
        if not any(
            abs(s / target - 1) > self.tolerance and abs(s - target) > self.z * spread
            for s in share
        ):
            return None
        slots = [f / sum(factors) for f in factors]
        above = [i for i in range(pods) if share[i] > target]
        below = [i for i in range(pods) if share[i] < target]
        released = sum(slots[i] * (1 - target / share[i]) for i in above)
        if released <= 0 or not below:
            return None
        density = sum(share[i] - target for i in above) / released
        new = list(slots)
        for i in above:
            new[i] = slots[i] * target / share[i]
        for i in below:
            new[i] = slots[i] + (target - share[i]) / density
        self.base, self.since, self.moves = finished, now, self.moves + 1
        return [min(4.0, max(0.25, s / target)) for s in new]


@dataclass
class Hash:
    """Never moves: Maglev's homes."""

    moves: int = 0

    def decide(self, finished: list[int], factors: list[float], now: float) -> None:
        return None


@dataclass
class FirstSight:
    """Each group homed, at its first request, on the pod with the fewest requests in
    flight, and never moved (vllm-router's sticky_least_loaded): it needs to see the key."""

    moves: int = 0
    homes: dict[int, int] = field(default_factory=dict)

    def decide(self, finished: list[int], factors: list[float], now: float) -> None:
        return None

    def home(self, group: int, in_flight: list[int]) -> int:
        if group not in self.homes:
            self.homes[group] = min(range(len(in_flight)), key=in_flight.__getitem__)
        return self.homes[group]


@dataclass
class Outcome:
    misses_after_warmup: int
    largest_deviation: float
    moves: list[float] = field(default_factory=list)


def run(rule: Counted | Hash | FirstSight, seed: int, *, measured_s: float = 32.0) -> Outcome:
    groups, pods, rate, warm, tick, latency = 32, 4, 6.67, 16.0, 0.065, 2.5
    duration = warm + measured_s
    rng = random.Random(seed)
    hosts = [(rng.randrange(TABLE_SIZE), rng.randrange(TABLE_SIZE - 1) + 1) for _ in range(pods)]
    slot_of = [rng.randrange(TABLE_SIZE) for _ in range(groups)]
    factors = [1.0] * pods
    table = maglev(hosts, quantized(factors))
    arrivals, at = [], 0.0
    while at < duration:
        at += rng.expovariate(rate)
        arrivals.append((at, rng.randrange(groups)))
    visited: list[set[int]] = [set() for _ in range(groups)]
    finished, served = [0] * pods, [0] * pods
    pending: list[tuple[float, int]] = []
    misses, moves, now, next_arrival = 0, [], 0.0, 0
    while now < duration:
        now += tick
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            at, group = arrivals[next_arrival]
            next_arrival += 1
            if isinstance(rule, FirstSight):
                in_flight = [sum(1 for _, p in pending if p == i) for i in range(pods)]
                pod = rule.home(group, in_flight)
            else:
                pod = int(table[slot_of[group]])
            if pod not in visited[group]:
                visited[group].add(pod)
                misses += at >= warm
            served[pod] += at >= warm
            pending.append((at + latency, pod))
        for done_at, pod in pending:
            if done_at <= now:
                finished[pod] += 1
        pending = [p for p in pending if p[0] > now]
        new = rule.decide(list(finished), factors, now)
        if new is not None and new != factors:
            factors = new
            moves.append(round(now, 1))
            table = maglev(hosts, quantized(factors))
    total = sum(served)
    deviation = max(abs(s / total * pods - 1) for s in served)
    return Outcome(misses_after_warmup=misses, largest_deviation=deviation, moves=moves)


RULES: dict[str, Callable[[], Counted | Hash | FirstSight]] = {
    "hash (main)": lambda: Hash(),
    "counted, as tried (tolerance 0.2, 2.5 s.d.)": lambda: Counted(),
    "counted, 80 requests, 3 s.d., tolerance 0.25": lambda: Counted(tolerance=0.25, z=3, min_n=80),
    "counted, one move only, 40 requests, 3 s.d.": lambda: Counted(
        tolerance=0.25, z=3, min_n=40, max_moves=1
    ),
    "first sight, least in flight (sees each key)": lambda: FirstSight(),
}


def main(seeds: int) -> None:
    print(
        "| rule | misses after warm-up, median (max) | largest deviation, median (max)"
        " | seeds within 25% | moves, median (max) |"
    )
    print("|---|---|---|---|---|")
    for name, make in RULES.items():
        outcomes = [run(make(), seed) for seed in range(seeds)]
        misses = sorted(o.misses_after_warmup for o in outcomes)
        deviation = sorted(o.largest_deviation for o in outcomes)
        moves = sorted(len(o.moves) for o in outcomes)
        within = sum(d <= 0.25 for d in deviation)
        half = seeds // 2
        print(
            f"| {name} | {misses[half]} ({misses[-1]})"
            f" | {deviation[half]:.2f} ({deviation[-1]:.2f})"
            f" | {within}/{seeds} | {moves[half]} ({moves[-1]}) |"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
