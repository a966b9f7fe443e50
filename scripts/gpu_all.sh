#!/usr/bin/env bash
# One call on the GPU machine for the engine issue: GPU tests (tail, GEMV, stress, faults, determinism),
# time_layers tail tables, the CLI on cuda, then the task-family GPU tests. Logs -> $OUT (<= 8 files).
# Usage (device tool, carry .triton_cache.tgz if present): bash scripts/gpu_all.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 REQUIRE_CUDA=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
S="$OUT/summary.txt"
{ date -u; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -5
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > "$S" 2>&1
step() {  # step LOG TIMEOUT CMD...: append CMD's output to $OUT/LOG, its rc and tail to the summary
  local log=$1 t=$2; shift 2
  echo "=== $*" >> "$OUT/$log"
  timeout "$t" "$@" >> "$OUT/$log" 2>&1; local rc=$?
  echo "=== rc=$rc: $*" >> "$S"; tail -n 6 "$OUT/$log" >> "$S"
}
step engine_tests.log 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_gemv.py
step stress.log 120 python3 scripts/stress.py
for args in "--tp 1 --rows 1 --weights bf16" "--tp 1 --rows 8 --weights bf16" "--tp 1 --rows 1 --weights fp8" \
            "--tp 8 --rows 1 --weights bf16" "--tp 8 --rows 8 --weights bf16" "--tp 8 --rows 1 --weights fp8"; do
  step time_layers.log 60 python3 scripts/time_layers.py --kind tail $args --windows 9
done
step cli.log 120 bash -c 'python3 -m glm53_flash demo --device cuda --checkpoint /tmp/tiny --max-new-tokens 6 &&
  GLM53_MONO_CHECK=1 python3 -m glm53_flash generate --device cuda --checkpoint /tmp/tiny --prompt 3,17,42 --max-new-tokens 4 --json --inject-fault tail:tail.cand'
step families.log ${FAMILY_T:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_mhc.py tests/test_kernels_kda.py \
  tests/test_kernels_mlp.py tests/test_kernels_indexer.py tests/test_kernels_mla.py tests/test_kernels_moe.py
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
cat "$S"
