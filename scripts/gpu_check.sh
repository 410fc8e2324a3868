#!/usr/bin/env bash
# The GPU checks in one call, for a lent GPU machine (torch, no Ray):
#   PYTHONPATH=. bash scripts/gpu_check.sh          # results and logs under $OUT (or /tmp/gpu-check)
# It counts the GPUs first.
# One GPU (issue 17's checks, ~15 minutes of device time):
# 1. the CUDA paths' tests (fused AdamW on DTensor, precision, the GPU options), ~4-5 min on an H200;
# 2. benchmarks/gpu.py side by side with the plain loop: 1b, seq 2048, micro batch 4 and 8, compile
#    no and yes (the table in docs/benchmarks.md, "gpu.py: training throughput (GPU)");
# 3. with the time left, a profile of micro batch 4 with compile (what is left between the two loops);
# 4. benchmarks/startup.py at 1b (fresh build, resume vs a cold read, first vs steady save, restart to
#    the first step with and without compile; the table in docs/benchmarks.md, "startup.py: starting at size").
# Two or more GPUs, first (issue 32; "Several GPUs" under gpu.py in docs/benchmarks.md):
# 0. tests/distributed over NCCL, one rank per GPU (ELASTRON_TEST_DEVICE=cuda: every layout the GPUs
#    allow, wider ones skip; a live reshard between two layouts; a hung collective aborted), then
#    benchmarks/live_reshard.py over NCCL (tp=2 -> dp=2 on two of the GPUs).
# PARTS picks parts by name (default: all that apply): multi, tests, bench, profile, startup, float8
# (issue 32's 8b-cut-to-8-layers rows with float8, not in the default: it needs most of a session by
# itself; F8_RECIPES picks the recipes, default none,tensorwise,rowwise), loss (float8 against bf16 over
# 300 steps of the Python standard library's text, read byte by byte, bf16 once and then each recipe of
# LOSS_RECIPES, default tensorwise,rowwise; at 1b, seq 2048, micro batch 4, compile: ~3 minutes on an H200)
# parity (the `1b` bf16 row alone: micro batch 8, compile, against the plain loop; ~1.5 minutes)
# and build (a fresh process's build at 1b against a standby's, and its first `import torch._dynamo`
# alone; ~1 minute); SKIP_STARTUP=1 leaves startup out of the default.
# Without a GPU it runs the single-GPU parts on the CPU defaults (tiny model) in about a minute: a dry run.
# Each part has its own time limit, so a slow one still leaves the others their results.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$NGPU" -ge 1 ]; then
    BENCH=(--device cuda --preset 1b --seq-len 2048 --micro-batches 4,8 --compile no,yes --ac none)
    PROFILE=(--device cuda --preset 1b --seq-len 2048 --micro-batches 4 --compile yes --ac none --profile)
    STARTUP=(--device cuda --preset 1b --layers 0 --reps 2 --saves 3 --compile yes)
    BUILD=(--device cuda --preset 1b --layers 0 --reps 2)
    PARITY=(--device cuda --preset 1b --seq-len 2048 --micro-batches 8 --compile yes --no-interleave --warmup 3 --steps 6)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
else
    BENCH=(--device cpu)
    PROFILE=(--device cpu --profile)
    STARTUP=(--preset tiny --layers 0 --reps 1 --saves 2)
    BUILD=(--preset tiny --layers 0 --reps 1)
    PARITY=(--device cpu)
    echo "no CUDA device: a dry run on the CPU defaults" | tee "$OUT/gpu.txt"
fi
echo "GPUs: $NGPU" | tee -a "$OUT/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__)' | tee -a "$OUT/gpu.txt"
# torchao (train.float8) is not on the lent machines and they have no network: it travels as a wheel in
# the ignored .whl/ (pip download --no-deps torchao==0.18.0 -d .whl; carry .whl), installed here.
if ! "$PY" -c 'import torchao.float8' 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps .whl/torchao-*.whl 2>&1 | tail -n 2
fi
"$PY" -c 'import torchao; print("torchao", torchao.__version__)' 2>/dev/null | tee -a "$OUT/gpu.txt" \
    || echo "torchao: not installed (float8 tests skip)" | tee -a "$OUT/gpu.txt"
DEFAULT_PARTS="tests bench profile"
[ -z "${SKIP_STARTUP:-}" ] && DEFAULT_PARTS="$DEFAULT_PARTS startup"
[ "$NGPU" -ge 2 ] && DEFAULT_PARTS="multi $DEFAULT_PARTS"
PARTS=" ${PARTS:-$DEFAULT_PARTS} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
has_pytest() { "$PY" -c 'import pytest' 2>/dev/null; }

status=0
if want multi; then
    if [ "$NGPU" -lt 2 ]; then
        echo "== multi: $NGPU GPU(s), needs 2 or more: skipped"
    elif has_pytest; then
        echo "== multi: tests/distributed over NCCL, one rank per GPU ($NGPU)"
        ELASTRON_TEST_DEVICE=cuda timeout "${MULTI_TESTS_TIMEOUT_S:-1500}" "$PY" -m pytest -q -p no:cacheprovider \
            -rs --durations=15 tests/distributed --ignore=tests/distributed/test_gpu_options.py \
            > "$OUT/multi-tests.log" 2>&1
        rc=$?; tail -n 40 "$OUT/multi-tests.log"; [ $rc -eq 0 ] || status=$rc
        echo "== multi: live reshard over NCCL, tp=2 -> dp=2"
        ELASTRON_TEST_DEVICE=cuda CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} \
            timeout "${MULTI_BENCH_TIMEOUT_S:-600}" "$PY" benchmarks/live_reshard.py --layers 28 --old tp=2 \
            --new dp=2 --reps 3 --json "$OUT/live-reshard-nccl.json" > "$OUT/live-reshard-nccl.log" 2>&1
        rc=$?; grep -E '^(\||State|send/recv)' "$OUT/live-reshard-nccl.log" || tail -n 30 "$OUT/live-reshard-nccl.log"
        [ $rc -eq 0 ] || status=$rc
    else
        echo "pytest is not installed here: multi-GPU tests skipped" | tee "$OUT/multi-tests.log"; status=1
    fi
fi

if want tests; then
    echo "== tests"
    if has_pytest; then
        timeout 330 "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_gpu_options.py \
            tests/parallel/test_precision.py tests/distributed/test_fused_optimizer.py > "$OUT/tests.log" 2>&1
        rc=$?; tail -n 15 "$OUT/tests.log"; [ $rc -eq 0 ] || status=$rc
    else
        echo "pytest is not installed here: tests skipped" | tee "$OUT/tests.log"; status=1
    fi
fi

if want bench; then
    echo "== benchmark: ${BENCH[*]}"
    timeout 420 "$PY" benchmarks/gpu.py "${BENCH[@]}" --json "$OUT/gpu.json" > "$OUT/gpu.log" 2>&1
    rc=$?; tail -n 40 "$OUT/gpu.log"; [ $rc -eq 0 ] || status=$rc
fi

if want parity; then
    echo "== parity: ${PARITY[*]}"
    timeout "${PARITY_TIMEOUT_S:-240}" "$PY" benchmarks/gpu.py "${PARITY[@]}" --json "$OUT/parity.json" > "$OUT/parity.log" 2>&1
    rc=$?; tail -n 12 "$OUT/parity.log"; [ $rc -eq 0 ] || status=$rc
fi

if want profile; then
    echo "== profile: ${PROFILE[*]}"
    timeout "${PROFILE_TIMEOUT_S:-150}" "$PY" benchmarks/gpu.py "${PROFILE[@]}" --json "$OUT/profile.json" \
        > "$OUT/profile.log" 2>&1
    rc=$?; tail -n 60 "$OUT/profile.log"; [ $rc -eq 0 ] || echo "profile: exit $rc (informational)"
fi

if want float8; then
    if [ "$NGPU" -ge 1 ]; then
        F8=(--device cuda --preset 8b --layers 8 --seq-len 4096 --micro-batches 2 --compile yes
            --float8 "${F8_RECIPES:-none,tensorwise,rowwise}" --no-interleave --warmup 3 --steps 6)
    else
        F8=(--device cpu --layers 2 --seq-len 16 --micro-batches 1 --float8 none,tensorwise)
    fi
    echo "== float8: ${F8[*]}"
    timeout "${FLOAT8_TIMEOUT_S:-540}" "$PY" benchmarks/gpu.py "${F8[@]}" --json "$OUT/float8.json" \
        > "$OUT/float8.log" 2>&1
    rc=$?; tail -n 20 "$OUT/float8.log"; [ $rc -eq 0 ] || status=$rc
fi

if want loss; then
    if [ "$NGPU" -ge 1 ]; then
        LOSS=(--device cuda --preset 1b --seq-len 2048 --micro-batches 4 --compile yes
              --loss-steps 300 --loss-window 50)
    else
        LOSS=(--device cpu --layers 2 --seq-len 16 --micro-batches 1 --loss-steps 3 --loss-window 2)
    fi
    STDLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    echo "== float8 loss: ${LOSS[*]} --loss-compare ${LOSS_RECIPES:-tensorwise,rowwise}"
    timeout "${LOSS_TIMEOUT_S:-420}" "$PY" benchmarks/gpu.py "${LOSS[@]}" --loss-compare "${LOSS_RECIPES:-tensorwise,rowwise}" \
        --data "$STDLIB" --suffixes .py --json "$OUT/float8-loss.json" > "$OUT/float8-loss.log" 2>&1
    rc=$?; tail -n 8 "$OUT/float8-loss.log"; [ $rc -eq 0 ] || status=$rc
fi

if want build; then
    echo "== build: ${BUILD[*]}"
    timeout "${BUILD_TIMEOUT_S:-240}" "$PY" benchmarks/startup.py "${BUILD[@]}" --build-only --json "$OUT/build.json" \
        > "$OUT/build.log" 2>&1
    rc=$?; tail -n 8 "$OUT/build.log"; [ $rc -eq 0 ] || status=$rc
fi

if want startup; then
    echo "== startup: ${STARTUP[*]}"
    timeout "${STARTUP_TIMEOUT_S:-420}" "$PY" benchmarks/startup.py "${STARTUP[@]}" --json "$OUT/startup.json" \
        > "$OUT/startup.log" 2>&1
    rc=$?; tail -n 25 "$OUT/startup.log"; [ $rc -eq 0 ] || status=$rc
fi
exit $status
