#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, GEMV bench, time_layers, stress, CLI on cuda. Logs -> $OUT.
# Usage (device tool): bash scripts/gpu_all.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 REQUIRE_CUDA=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
if [ -f .triton_cache.tgz ]; then mkdir -p "$TRITON_CACHE_DIR" && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"; fi
{
  date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT/env.txt" 2>&1
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc" | tee -a "$OUT/summary.txt"; tail -n 25 "$OUT/$name.log" >> "$OUT/summary.txt"
}
step gpu_tests 420 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/
step bench_gemv 180 python3 scripts/bench_gemv.py
for w in bf16 fp8; do for r in 1 8; do for tp in 1 8; do
  step "tl_tail_${w}_r${r}_tp${tp}" 120 python3 scripts/time_layers.py --kind tail --rows $r --weights $w --tp $tp
done; done; done
cat "$OUT"/tl_tail_*.log > "$OUT/time_layers.log" 2>/dev/null; rm -f "$OUT"/tl_tail_*.log
step stress 180 python3 scripts/stress.py
step cli 240 bash -c 'python3 -m glm53_flash demo --device cuda --checkpoint /tmp/tiny && python3 -m glm53_flash generate --device cuda --checkpoint /tmp/tiny --prompt 3,17,42 --max-new-tokens 4 --json --inject-fault tail:$(python3 -m glm53_flash sites --launch tail | head -1 | awk "{print \$2}")'
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
ls -la "$OUT"
