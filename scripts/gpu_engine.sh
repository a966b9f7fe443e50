#!/usr/bin/env bash
# One command on the GPU machine for the engine (layout/, sync/, schedule, tail launch): the gpu-marked
# engine tests (with the tail timing table) and the protocol stress. Logs -> $OUT.
# Usage (device tool): bash scripts/gpu_engine.sh [quick|sweep]   (sweep: only the tail tile sweep)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 REQUIRE_CUDA=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT/engine_env.txt" 2>&1
QUICK=${1:-}
if [ "$QUICK" = sweep ]; then
  ENGINE_TAIL_SWEEP=1 timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
    -k sweep > "$OUT/engine_sweep.log" 2>&1; echo "sweep rc=$?"; tail -n 40 "$OUT/engine_sweep.log"; exit 0
fi
T_TESTS=270; T_STRESS=110; ARGS=""
if [ "$QUICK" = quick ]; then T_TESTS=200; T_STRESS=90; ARGS="--quick"; fi
echo "=== tests" | tee "$OUT/engine_summary.txt"
timeout "$T_TESTS" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
  > "$OUT/engine_tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/engine_summary.txt"
tail -n 30 "$OUT/engine_tests.log" >> "$OUT/engine_summary.txt"
echo "=== stress" | tee -a "$OUT/engine_summary.txt"
timeout "$T_STRESS" python3 scripts/stress.py $ARGS > "$OUT/engine_stress.log" 2>&1
echo "stress rc=$?" | tee -a "$OUT/engine_summary.txt"
tail -n 5 "$OUT/engine_stress.log" >> "$OUT/engine_summary.txt"
cat "$OUT/engine_summary.txt"
