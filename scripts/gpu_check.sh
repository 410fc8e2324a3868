#!/usr/bin/env bash
# Issue 17's GPU checks in one call, for a lent GPU machine (torch, no Ray; 15 minutes of device time):
#   PYTHONPATH=. bash scripts/gpu_check.sh          # results and logs under $OUT (or /tmp/gpu-check)
# 1. the CUDA paths' tests (fused AdamW on DTensor, precision, the GPU options), ~4-5 min on an H200;
# 2. benchmarks/gpu.py side by side with the plain loop: 1b, seq 2048, micro batch 4 and 8, compile
#    no and yes (the table in docs/benchmarks.md, "Training throughput (GPU)");
# 3. with the time left, a profile of micro batch 4 with compile (what is left between the two loops);
# 4. benchmarks/startup.py at 1b (fresh build, resume vs a cold read, first vs steady save, restart to
#    the first step with and without compile; the table in docs/benchmarks.md, "Starting at size").
#    SKIP_STARTUP=1 leaves it out.
# Without a GPU it runs the same on the CPU defaults (tiny model) in about a minute: a dry run.
# Each part has its own time limit, so a slow one still leaves the others their results.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    BENCH=(--device cuda --preset 1b --seq-len 2048 --micro-batches 4,8 --compile no,yes --ac none)
    PROFILE=(--device cuda --preset 1b --seq-len 2048 --micro-batches 4 --compile yes --ac none --profile)
    STARTUP=(--device cuda --preset 1b --layers 0 --reps 2 --saves 3 --compile yes)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
else
    BENCH=(--device cpu)
    PROFILE=(--device cpu --profile)
    STARTUP=(--preset tiny --layers 0 --reps 1 --saves 2)
    echo "no CUDA device: a dry run on the CPU defaults" | tee "$OUT/gpu.txt"
fi
"$PY" -c 'import torch; print("torch", torch.__version__)' | tee -a "$OUT/gpu.txt"

status=0
echo "== tests"
if "$PY" -c 'import pytest' 2>/dev/null; then
    timeout 330 "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_gpu_options.py \
        tests/parallel/test_precision.py tests/distributed/test_fused_optimizer.py > "$OUT/tests.log" 2>&1
    rc=$?; tail -n 15 "$OUT/tests.log"; [ $rc -eq 0 ] || status=$rc
else
    echo "pytest is not installed here: tests skipped" | tee "$OUT/tests.log"; status=1
fi

echo "== benchmark: ${BENCH[*]}"
timeout 420 "$PY" benchmarks/gpu.py "${BENCH[@]}" --json "$OUT/gpu.json" > "$OUT/gpu.log" 2>&1
rc=$?; tail -n 40 "$OUT/gpu.log"; [ $rc -eq 0 ] || status=$rc

echo "== profile: ${PROFILE[*]}"
timeout "${PROFILE_TIMEOUT_S:-150}" "$PY" benchmarks/gpu.py "${PROFILE[@]}" --json "$OUT/profile.json" \
    > "$OUT/profile.log" 2>&1
rc=$?; tail -n 60 "$OUT/profile.log"; [ $rc -eq 0 ] || echo "profile: exit $rc (informational)"

if [ -z "${SKIP_STARTUP:-}" ]; then
    echo "== startup: ${STARTUP[*]}"
    timeout "${STARTUP_TIMEOUT_S:-420}" "$PY" benchmarks/startup.py "${STARTUP[@]}" --json "$OUT/startup.json" \
        > "$OUT/startup.log" 2>&1
    rc=$?; tail -n 25 "$OUT/startup.log"; [ $rc -eq 0 ] || status=$rc
fi
exit $status
