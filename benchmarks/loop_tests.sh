#!/usr/bin/env bash
# Run test files N times, alternating two commits, each from a worktree of its own (so that edits in this
# checkout do not reach them): the before/after failure counts of a change to racy code, side by side.
#   BEFORE=887116d AFTER=HEAD N=20 bash benchmarks/loop_tests.sh tests/service/test_coordinator_takeover.py \
#       tests/workers/test_salvage.py tests/service/test_standby.py
# One line per run in $OUT/results.tsv (round, commit, exit code, pytest's summary, failed tests).
set -u
cd "$(dirname "$0")/.."
N=${N:-20}; BEFORE=${BEFORE:?set BEFORE to a commit}; AFTER=${AFTER:-HEAD}
OUT=${OUT:-/tmp/loop-tests}; mkdir -p "$OUT"
PY=$(pwd)/.venv/bin/python
for v in "$BEFORE" "$AFTER"; do
    d="$OUT/wt-$(git rev-parse --short "$v")"
    [ -d "$d" ] || git worktree add -q --detach "$d" "$v"
done
: > "$OUT/results.tsv"
for i in $(seq 1 "$N"); do
    for v in "$BEFORE" "$AFTER"; do
        rev=$(git rev-parse --short "$v"); d="$OUT/wt-$rev"; log="$OUT/$rev-$i.log"
        (cd "$d" && PYTHONPATH="$d" OMP_NUM_THREADS=1 timeout 900 "$PY" -m pytest -q -rf -p no:randomly "$@" > "$log" 2>&1)
        rc=$?
        printf '%s\t%s\t%s\t%s\t%s\n' "$i" "$rev" "$rc" "$(tail -n 1 "$log")" \
            "$(grep -E '^(FAILED|ERROR)' "$log" | sed 's/ - .*//' | tr '\n' ' ')" >> "$OUT/results.tsv"
    done
done
echo "done: $OUT/results.tsv"
