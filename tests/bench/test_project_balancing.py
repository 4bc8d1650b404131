"""`python -m bench run --project-balancing`: balancing keys reach the project policy only."""

from __future__ import annotations

from bench.__main__ import _parser
from bench.runner import _routing
from bench.scenarios import build_scenario


def test_project_balancing_applies_to_the_project_policy_only() -> None:
    args = _parser().parse_args(
        ["run", "--project-balancing", '{"active_request_bias": 1, "hash_balance_factor": 200}']
    )
    assert args.project_balancing == {"active_request_bias": 1, "hash_balance_factor": 200}
    scenario = build_scenario("c", duration_s=1)
    endpoints = [("127.0.0.1", 9)]
    project = _routing(scenario, "project", endpoints, project_balancing=args.project_balancing)
    assert project.balancing.active_request_bias == 1
    assert project.balancing.hash_balance_factor == 200
    baseline = _routing(
        scenario, "least_request", endpoints, project_balancing=args.project_balancing
    )
    assert baseline.balancing == type(baseline.balancing)()
    assert not baseline.pools[0].weights_from_metrics
