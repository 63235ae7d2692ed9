#!/usr/bin/env bash
# This checkout against an older revision, on one GPU, from the repository root:
#   bash scripts/gpu/compare_main.sh OLD_REV
# OLD_REV's tree is extracted with git archive into a temporary folder; then
#   1. benchmarks/compare_trees.py --old TMP --new . --rounds 2 (the public API's paths, old and new
#      alternating in fresh processes), compare_trees.log;
#   2. each tree's own benchmarks, each against its own package (PYTHONPATH = that tree): floor_step.py,
#      bench_vllm.py, bench_attention.py --quick and bench_host.py, {old,new}_<benchmark>.log.
# Logs under $OUT (default /tmp/kvaddr-compare). Graph timings use 100 copies and 15 replays (the
# scripts' defaults are 200 and 30) to fit the time. A failing command is reported and the rest run;
# exit 1 if any failed. Expected time on an H200: about 6-7 minutes (compare_trees 2-3 min with cold
# kernel caches, then about 2 min per tree), 8 at most with warm caches.
set -u -o pipefail
if [[ $# -ne 1 ]]; then
  echo "usage: bash scripts/gpu/compare_main.sh OLD_REV" >&2
  exit 2
fi
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvaddr-compare}
mkdir -p "$OUT"
NEW=$(pwd)
OLD=$(mktemp -d /tmp/kvaddr-old-XXXXXX)
trap 'rm -rf "$OLD"' EXIT
git archive "$1" | tar -x -C "$OLD" || { echo "compare_main: git archive $1 failed" >&2; exit 2; }
echo "old: $1 ($(git rev-parse --short "$1")) in $OLD; new: $NEW ($(git rev-parse --short HEAD), plus any uncommitted change)"
export PYTHONUNBUFFERED=1
failed=""

run() {  # run NAME TIMEOUT TREE ARGS...: one command in TREE with that tree's package, logged as NAME
  local name=$1 limit=$2 tree=$3
  shift 3
  echo "== $name: $*"
  (cd "$tree" && PYTHONPATH="$tree" timeout "$limit" python3 "$@") > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "-- $name: exit $rc"
  [[ $rc == 0 ]] || failed+=" $name"
}

run compare_trees 300 "$NEW" benchmarks/compare_trees.py --old "$OLD" --new "$NEW" --rounds 2 --json "$OUT/compare_trees.json"
for side in old new; do
  tree=$([[ $side == old ]] && echo "$OLD" || echo "$NEW")
  run "${side}_floor_step" 120 "$tree" benchmarks/floor_step.py --copies 100 --replays 15
  run "${side}_bench_vllm" 150 "$tree" benchmarks/bench_vllm.py --copies 100 --replays 15 --host-samples 7
  run "${side}_bench_attention" 120 "$tree" benchmarks/bench_attention.py --quick
  run "${side}_bench_host" 90 "$tree" benchmarks/bench_host.py
done
echo "logs in $OUT"
if [[ -n $failed ]]; then
  echo "compare_main: FAILED:$failed"
  exit 1
fi
echo "compare_main: every command exited 0"
