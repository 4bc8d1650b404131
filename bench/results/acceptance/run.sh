#!/usr/bin/env bash
# Issue 35 acceptance: seeds 4-8 for a,b,c,d,e,h against each scenario's best real router
# on seeds 1-3, then each variant once (seed 4). Run from a worktree at a fixed commit
# (5354417) so that work landing meanwhile does not change the code under test.
set -u
tree=/tmp/bench-tree
out=/work/main/bench/results/acceptance
py=/work/main/.venv/bin/python
cd "$tree"
export PYTHONPATH=$tree:$tree/testbed
run() { # name scenario policies [extra args]
  local name=$1 sc=$2 pol=$3; shift 3
  [ -f "$out/$name/results.md" ] && return
  echo "$(date -u +%T) start $name" >> $out/progress.log
  flock /tmp/bench.lock $py -m bench run --scenarios "$sc" --policies "$pol" --out "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$(date -u +%T) done $name rc=$?" >> $out/progress.log
}
S=--seed-list=4,5,6,7,8
run h-seeds-4-8 h project,round_robin $S
run c-seeds-4-8 c project,vllm_router_consistent_hash,vllm_router_sticky_least_loaded $S
run e-seeds-4-8 e project,vllm_router_cache_aware $S
run a-seeds-4-8 a project,vllm_router_sticky_least_loaded $S
run b-seeds-4-8 b project,vllm_router_cache_aware $S
run d-seeds-4-8 d project,vllm_router_cache_aware $S
V=--seed-list=4
run e-flat-adapters e project,vllm_router_cache_aware,oracle $V --variant flat-adapters
run c-more-prefixes c project,vllm_router_consistent_hash,vllm_router_sticky_least_loaded,oracle $V --variant more-prefixes
run h-key-skew h project,round_robin $V --variant key-skew
run ad-gpu-mix a,d project,vllm_router_sticky_least_loaded,vllm_router_cache_aware $V --variant gpu-mix
run bd-burst-shape b,d project,vllm_router_cache_aware $V --variant burst-shape
echo "$(date -u +%T) all done" >> $out/progress.log
