#!/usr/bin/env bash
# One device call for the layer launches: the engine/tail gpu tests (fault timing), the embed/dense/kda
# launch gpu tests at real shapes, and the CLI on cuda with every driven launch kind. Logs -> $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 REQUIRE_CUDA=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"; [ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
S="$OUT/summary.txt"; date -u > "$S"
step() { local log=$1 t=$2; shift 2; echo "=== $*" >> "$OUT/$log"; timeout "$t" "$@" >> "$OUT/$log" 2>&1
         local rc=$?; echo "=== rc=$rc: $*" >> "$S"; tail -n 14 "$OUT/$log" >> "$S"; }
step engine.log 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_gemv.py
step cli.log 120 bash -c 'python3 -m glm53_flash demo --device cuda --checkpoint /tmp/tiny --max-new-tokens 6 &&
  GLM53_MONO_CHECK=1 python3 -m glm53_flash generate --device cuda --checkpoint /tmp/tiny --prompt 3,17,42 --max-new-tokens 4 --json --inject-fault kda:kda.a'
step layers.log ${LAYERS_T:-240} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/test_launch_dense.py tests/test_launch_embed.py tests/test_launch_kda.py
cat "$S"
