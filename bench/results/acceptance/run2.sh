#!/usr/bin/env bash
# The rest of issue 35's acceptance runs, cut to fit the session: b and d on seeds 4-8
# against their best real router, then each variant once (seed 4) against the best real
# router of its scenario (and the oracle for e@flat-adapters, round robin for h@key-skew).
# From the worktree at 5354417, like run.sh.
set -u
tree=/tmp/bench-tree
out=/work/main/bench/results/acceptance
py=/work/main/.venv/bin/python
cd "$tree"
export PYTHONPATH=$tree:$tree/testbed
while kill -0 7838 2>/dev/null; do sleep 5; done
run() { # name scenario policies [extra args]
  local name=$1 sc=$2 pol=$3; shift 3
  [ -f "$out/$name/results.md" ] && return
  echo "$(date -u +%T) start $name" >> $out/progress.log
  flock /tmp/bench.lock $py -m bench run --scenarios "$sc" --policies "$pol" --out "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$(date -u +%T) done $name rc=$?" >> $out/progress.log
}
echo "$(date -u +%T) a-seeds-4-8 finished (run.sh)" >> $out/progress.log
S=--seed-list=4,5,6,7,8
V=--seed-list=4
run e-flat-adapters e project,vllm_router_cache_aware,oracle $V --variant flat-adapters
run b-seeds-4-8 b project,vllm_router_cache_aware $S
run d-seeds-4-8 d project,vllm_router_cache_aware $S
run c-more-prefixes c project,vllm_router_consistent_hash $V --variant more-prefixes
run h-key-skew h project,round_robin $V --variant key-skew
run ad-gpu-mix a,d project,vllm_router_cache_aware $V --variant gpu-mix
run bd-burst-shape b,d project,vllm_router_cache_aware $V --variant burst-shape
echo "$(date -u +%T) all done" >> $out/progress.log
