#!/usr/bin/env bash
# Record profiles/baselines/h200.json on the H200, then test the regression gate:
#   1. record: `kvaddr profile --save` over the shipped workload profiles (profiles/*.toml, when
#      `kvaddr profile --profile` exists), else over --batch 1,8,64,256,1024 of deepseek-v3.2 and glm-5;
#   2. two consecutive `kvaddr check --baseline` runs: both must exit 0 (no false alarm);
#   3. scripts/gpu/slow_fused_check.py: the same check with the fused step slowed; it must exit 1,
#      naming the shape and the strategy.
# Each check's gated verdict lines are printed; full tables and JSON documents go to $LOG_DIR.
#
# Environment (all optional):
#   BASELINE   the baseline file                     [profiles/baselines/h200.json]
#   BUDGET     --budget, seconds per strategy, mode   [0.5]
#   PROFILES   profile files or names to record       [profiles/*.toml]
#   PHASE      all: record, then check | record: record only | check: the three checks of an existing BASELINE
#              (each phase is one profile pass per run; six shipped profiles at BUDGET 0.5 take a few minutes each)
#   EXTRA      --extra-launches of the slowed run     [8]
#   BATCHES    batch sizes when there are no profiles [1,8,64,256,1024]
#   DEVICE     --device of the recording              [cuda] (cpu: a dry run of this script without a GPU)
#   LOG_DIR    where tables, JSON and a copy of the baseline go  [$OUT on the device machine, else a temp dir]
set -uo pipefail
cd "$(dirname "$0")/../.."

BASELINE=${BASELINE:-profiles/baselines/h200.json}
BUDGET=${BUDGET:-0.5}
EXTRA=${EXTRA:-8}
BATCHES=${BATCHES:-1,8,64,256,1024}
DEVICE=${DEVICE:-cuda}
LOG_DIR=${LOG_DIR:-${OUT:-$(mktemp -d)}}
mkdir -p "$LOG_DIR" "$(dirname "$BASELINE")"

# This checkout's kvaddr, for the recording, the checks and the slowed check alike.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
kv() {
    python3 -m kvaddr.cli "$@"
}

# Print the gated verdict lines of a comparison document, then its counts.
verdicts() {
    python3 - "$1" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for row in doc["results"]:
    if row["gated"]:
        print("  " + row["line"])
print("  gated counts:", ", ".join(f"{k} {v}" for k, v in doc["counts"]["gated"].items() if v))
EOF
}

set -e
kv info
PHASE=${PHASE:-all}
case "$PHASE" in all|record|check) ;; *) echo "PHASE must be all, record or check, got $PHASE" >&2; exit 2;; esac
if [ "$PHASE" != check ]; then
    rm -f "$BASELINE"
    shopt -s nullglob
    shipped=(profiles/*.toml)
    if kv profile --help | grep -q -- '--profile' && [ ${#shipped[@]} -gt 0 ]; then
        # shellcheck disable=SC2206
        list=(${PROFILES:-${shipped[@]}})
        for p in "${list[@]}"; do
            if [ -f "$p" ] && ! grep -q '^\[profile\]' "$p"; then
                echo "== $p has no [profile] table; skipped"
                continue
            fi
            echo "== recording $p"
            kv profile --profile "$p" --device "$DEVICE" --budget "$BUDGET" --save "$BASELINE" \
                > "$LOG_DIR/record-$(basename "$p" .toml).txt"
        done
    else
        for model in deepseek-v3.2 glm-5; do
            echo "== recording $model, batches $BATCHES"
            kv profile --model "$model" --batch "$BATCHES" --device "$DEVICE" --budget "$BUDGET" \
                --save "$BASELINE" > "$LOG_DIR/record-$model.txt"
        done
    fi
fi
cp "$BASELINE" "$LOG_DIR/" 2>/dev/null || true
set +e
if [ "$PHASE" = record ]; then
    echo "== recorded $BASELINE (a copy in $LOG_DIR)"
    exit 0
fi

status=0
for i in 1 2; do
    echo "== check $i: kvaddr check --baseline $BASELINE"
    kv check --baseline "$BASELINE" --json "$LOG_DIR/check-$i.json" > "$LOG_DIR/check-$i.txt"
    rc=$?
    [ -f "$LOG_DIR/check-$i.json" ] && verdicts "$LOG_DIR/check-$i.json"
    echo "check $i: exit $rc (want 0)"
    [ "$rc" = 0 ] || status=1
done

echo "== slowed: python scripts/gpu/slow_fused_check.py --baseline $BASELINE --extra-launches $EXTRA"
python3 scripts/gpu/slow_fused_check.py --baseline "$BASELINE" --extra-launches "$EXTRA" \
    --json "$LOG_DIR/check-slow.json" > "$LOG_DIR/check-slow.txt"
rc=$?
[ -f "$LOG_DIR/check-slow.json" ] && verdicts "$LOG_DIR/check-slow.json"
echo "slowed check: exit $rc (want 1)"
if [ "$rc" != 1 ] || ! python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(not any(": fused, " in s for s in d["slower"]))' \
        "$LOG_DIR/check-slow.json"; then
    status=1
fi

echo "== logs in $LOG_DIR"
if [ "$status" = 0 ]; then echo "RESULT: PASS (two clean checks, the slowed fused step caught)"; else echo "RESULT: FAIL"; fi
exit "$status"
