#!/usr/bin/env bash
# The three demonstrations of `kvaddr check --against` on a GPU (docs/ci-gate.md, "Measured on an H200").
#
# Run from the repository root:  PYTHONPATH=. bash scripts/gpu/ab_check.sh
#
#   1. `kvaddr check --against HEAD` over the default workload (batch 64, eager and graph), twice:
#      the same code on both sides; expect exit 0, 0 slower.
#   2. a deliberately slowed step kernel: in a temporary clone, a clock64() spin (SPIN_CYCLES, about
#      10 us at the H200's clock) is put at the start of every __global__ function of the step kernels
#      (kvaddr/kernels/step.cuh when it exists, else the kvaddr_step* kernels of kvaddr/kernels.cu),
#      committed there, and the clone runs `kvaddr check --against HEAD~1` (its parent);
#      expect exit 1 with the fused rows slower.
#   3. commit 86ae9f6 against the current tree on `--profile mixed-chunked-prefill --batch 64`;
#      expect exit 0, same or faster.
#
# Each A/B runs the defaults (--rounds 5, --budget 0.2) but the slowed one (--rounds 3: the spin is
# many times the step). Each default A/B is 10 profile processes of about 5-6 s on an H200 (start-up,
# correctness checks, 12 measurements x 0.2 s), so the four take about 4-5 minutes in all (the first
# compiles kernels.cu, and the slowed clone's kernels once more).
#
# Logs (stdout table, stderr, JSON verdicts of each A/B) go to ${OUT:-/tmp/ab}; a summary table is
# printed last. Exit status: 0 when every demonstration gave the expected exit status, else 1.
set -u -o pipefail

OUT=${OUT:-/tmp/ab}
SPIN_CYCLES=${SPIN_CYCLES:-20000}
ROOT=$(pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvaddr-ab-demo.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
: > "$OUT/summary.tsv"

if [ ! -f kvaddr/gate/ab.py ]; then
    echo "ab_check.sh: run from the repository root of a kvaddr with check --against" >&2
    exit 2
fi

# demo NAME EXPECTED_STATUS DIR CHECK_ARGS...: run one A/B in DIR, keep its logs, record a summary line.
demo() {
    local name=$1 expect=$2 dir=$3
    shift 3
    echo "== $name: kvaddr check $* (expect exit $expect)" >&2
    local started=$SECONDS
    (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m kvaddr.cli check "$@" \
        --json "$OUT/$name.json" >"$OUT/$name.out" 2>"$OUT/$name.err")
    local status=$?
    tail -n 4 "$OUT/$name.err" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" "$expect" "$status" "$((SECONDS - started))" >> "$OUT/summary.tsv"
}

# 1. the same code on both sides, twice
demo head-1 0 "$ROOT" --against HEAD
demo head-2 0 "$ROOT" --against HEAD

# 2. a slowed step kernel, committed in a temporary clone, against its parent
git clone -q "$ROOT" "$WORK/clone"
"$PY" - "$WORK/clone" "$SPIN_CYCLES" <<'PYEOF'
import os, re, sys

root, cycles = sys.argv[1], int(sys.argv[2])
header = os.path.join(root, "kvaddr", "kernels", "step.cuh")
path = header if os.path.isfile(header) else os.path.join(root, "kvaddr", "kernels.cu")
text = open(path).read()
spin = " { const long long kv_spin_t0 = clock64(); while (clock64() - kv_spin_t0 < %dLL) { } }" % cycles
out, pos, patched = [], 0, []
for m in re.finditer(r"__global__", text):
    line_start = text.rfind("\n", 0, m.start()) + 1
    if "//" in text[line_start:m.start()]:
        continue  # a comment
    body = text.index("{", m.end())
    if ";" in text[m.end():body]:
        continue  # a declaration, no body
    names = [n for n in re.findall(r"(\w+)\s*\(", text[m.end():body]) if not n.startswith("__")]
    name = names[0] if names else "?"
    # the step header: every kernel; kernels.cu: the step kernels (kvaddr_step*)
    if path != header and not name.startswith("kvaddr_step"):
        continue
    out.append(text[pos:body + 1] + spin)
    pos = body + 1
    patched.append(name)
out.append(text[pos:])
if not patched:
    sys.exit(f"no step kernel found to slow in {path}")
open(path, "w").write("".join(out))
print(f"slowed {len(patched)} kernel(s) in {os.path.relpath(path, root)}: {', '.join(patched[:6])}"
      + (" ..." if len(patched) > 6 else ""), file=sys.stderr)
PYEOF
git -C "$WORK/clone" -c user.name="kvaddr demo" -c user.email="demo@example.invalid" \
    commit -q -am "a deliberately slowed step kernel (demonstration only)"
demo slowed 1 "$WORK/clone" --against HEAD~1 --rounds 3

# 3. an older commit against the current tree, on the workload that raised the false alarm
demo old-commit 0 "$ROOT" --against "${OLD_REV:-86ae9f6}" --profile mixed-chunked-prefill --batch 64

# the summary
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys

out = sys.argv[1]
rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(out, "summary.tsv")) if line.strip()]
print(f"\n{'demonstration':<12} {'expect':>6} {'exit':>4} {'ok':>3} {'slower':>6} {'same':>5} {'faster':>6} "
      f"{'ambig':>5} {'fused graph:gpu':>16} {'max spread':>10} {'wall s':>7}")
bad = 0
for name, expect, status, secs in rows:
    counts, fused, spread, wall = {}, "-", "-", secs
    try:
        doc = json.load(open(os.path.join(out, f"{name}.json")))
        counts = doc["counts"]["gated"]
        wall = f"{doc['against']['wall_s']:.0f}"
        ratios = [r["ratio"] for r in doc["results"]
                  if r["strategy"] == "fused" and r["mode"] == "graph" and r["ratio"] is not None]
        fused = ", ".join(f"x{x:.3f}" for x in ratios) or "-"
        spreads = [v for r in doc["results"] if r["gated"] and r.get("round_spread")
                   for v in (r["round_spread"]["base"], r["round_spread"]["new"]) if v is not None]
        spread = f"x{max(spreads):.3f}" if spreads else "-"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ok = status == expect
    bad += not ok
    print(f"{name:<12} {expect:>6} {status:>4} {'yes' if ok else 'NO':>3} {counts.get('slower', '-'):>6} "
          f"{counts.get('same', '-'):>5} {counts.get('faster', '-'):>6} {counts.get('ambiguous', '-'):>5} "
          f"{fused:>16} {spread:>10} {wall:>7}")
print(f"\nlogs: {out}/<demonstration>.out / .err / .json")
sys.exit(1 if bad else 0)
PYEOF
