#!/usr/bin/env bash
# One device call for the layer launches (issues 4 and 5), logs -> $OUT (<= 8 files).
#   phase A: the real-shape GPU tests of embed/dense/kda/sparse/nextn, one pytest process per
#            (kind, tp, format) group, JOBS at a time (compiles are CPU-bound, fault waits are wall-clock
#            bound: both overlap), and the CLI on cuda with every driven kind under MONO_CHECK;
#   phase B: time_layers over the matrix (scripts/time_matrix.py), alone on the GPU, until DEADLINE
#            seconds after the start;
#   then the Triton cache is packed for the next call (parts; cat them into .triton_cache.tgz and carry it).
#   first (alone on the GPU): a traced launch of each TRACES entry (kind:tp, scripts/diag_layers.py --trace).
# Env: PHASE_A=0 skips the tests; TESTS="spec ..." overrides the test groups ("file::-k expr" each);
#      TRACES="kind:tp ..." (default "dense:8 kda:1 sparse:8", empty: none);
#      SUITE=dsa: only the sparse TP8 and nextn tests and timings (what the 64-bit budget fix must show),
#      no traces unless TRACES is given.
#      TIMING="argsets" (';'-separated time_matrix argument sets) overrides the timing plan.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 REQUIRE_CUDA=1 OMP_NUM_THREADS=2
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"; [ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
T0=$(date +%s); DEADLINE=${DEADLINE:-540}; A_T=${A_T:-330}; JOBS=${JOBS:-12}
S="$OUT/summary.txt"; W=/tmp/gpu_matrix; rm -rf $W; mkdir -p $W
{ date -u; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -12
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; } > "$S" 2>&1
el() { echo $(( $(date +%s) - T0 )); }

[ "${SUITE:-}" = dsa ] && TRACES=${TRACES-}          # the dsa suite fills its call with tests and timings
for kt in ${TRACES-dense:8 kda:1 sparse:8}; do
  echo "##### trace ${kt%%:*} tp ${kt#*:}" >> "$OUT/trace.log"
  timeout 90 python3 scripts/diag_layers.py --kind ${kt%%:*} --tp ${kt#*:} --rows 1 --pos 8191 --trace 2>&1 \
    | grep -v "task#" >> "$OUT/trace.log"
done
[ -f "$OUT/trace.log" ] && echo "=== traces done at $(el) s" >> "$S"

if [ "${PHASE_A:-1}" = 1 ]; then
  groups=()                        # DSA kinds split by position: their cases are the slow ones
  for tp in tp1 tp8; do for f in bf16 fp8; do
    for p in 640 8191 65535; do
      groups+=("tests/test_launch_sparse.py::$tp and $f and $p" "tests/test_launch_nextn.py::$tp and $f and $p")
    done
    groups+=("tests/test_launch_kda.py::$tp and $f" "tests/test_launch_dense.py tests/test_launch_embed.py::$tp and $f")
  done; done
  if [ "${SUITE:-}" = dsa ]; then
    groups=()
    for f in bf16 fp8; do for p in 640 8191 65535; do
      groups+=("tests/test_launch_sparse.py::tp8 and $f and $p")
      for tp in tp1 tp8; do groups+=("tests/test_launch_nextn.py::$tp and $f and $p"); done
    done; done
  fi
  [ -n "${TESTS:-}" ] && IFS=';' read -ra groups <<< "$TESTS"
  i=0
  ( python3 -m glm53_flash demo --device cuda --checkpoint /tmp/tiny --max-new-tokens 6 &&
    GLM53_MONO_CHECK=1 python3 -m glm53_flash generate --device cuda --checkpoint /tmp/tiny --prompt 3,17,42 \
      --max-new-tokens 4 --json --kernels tail,embed,dense,kda,sparse --inject-fault sparse:sparse.att
    echo "rc=$?" ) > $W/cli.log 2>&1 &
  for g in "${groups[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    files=${g%%::*}; expr=${g#*::}; i=$((i + 1))
    ( echo "### [$i] pytest -m gpu $files -k '$expr' (start $(el) s)"
      t=$((A_T - $(el))); [ $t -lt 20 ] && t=20
      timeout $t python3 -m pytest -q -m gpu -p no:cacheprovider -s --durations=3 $files -k "$expr"
      echo "### [$i] rc=$? at $(el) s" ) > $W/group_$i.log 2>&1 &
  done
  wait
  cat $W/cli.log $W/group_*.log > "$OUT/tests.log"
  { echo "=== phase A done at $(el) s"; tail -n 12 $W/cli.log
    for f in $W/group_*.log; do head -n 1 $f; grep -E "passed|failed|error|rc=" $f | tail -n 3; done; } >> "$S"
fi

# phase B: timing, most-used kinds first (31 kda layers, 11 sparse, 2 dense, embed, nextn)
[ "${SUITE:-}" = dsa ] && [ -z "${TIMING:-}" ] && TIMING="--kinds sparse --tp 8 --rows 1,8 --weights bf16,fp8 --pos 8191;--kinds nextn --tp 1,8 --rows 1,8 --weights bf16,fp8 --pos 8191;--kinds sparse --tp 8 --rows 1,8 --weights bf16,fp8 --pos 640,65535"
plan=${TIMING:-"--kinds kda --tp 1,8 --rows 1,8 --weights bf16,fp8;--kinds sparse --tp 1,8 --rows 1,8 --weights bf16,fp8 --pos 8191;--kinds dense,embed --tp 1,8 --rows 1,8 --weights bf16,fp8;--kinds nextn --tp 1,8 --rows 1,8 --weights bf16,fp8 --pos 8191;--kinds sparse --tp 1,8 --rows 1,8 --weights bf16,fp8 --pos 640,65535"}
IFS=';' read -ra sets <<< "$plan"
for a in "${sets[@]}"; do
  left=$((DEADLINE - $(el))); [ $left -lt 30 ] && { echo "not started (deadline): $a" >> "$S"; continue; }
  echo "=== time_matrix $a (start $(el) s)" >> "$OUT/timing.log"
  timeout $((left + 60)) python3 scripts/time_matrix.py $a --json-out "$OUT/timing.jsonl" --deadline $((left - 25)) \
    >> "$OUT/timing.log" 2>&1
  echo "=== rc=$? time_matrix $a (end $(el) s)" >> "$S"
done
[ -f "$OUT/timing.log" ] && grep -E "^(#####|!!|not started)|launch tp|torch ops" "$OUT/timing.log" >> "$S"
# the cache for the next call (carry .triton_cache.tgz = cat triton_cache.part*): parts under the 16 MB file limit,
# newest entries first, and no more parts than $OUT's 8-file limit leaves room for: a cut archive still
# extracts its leading entries, so the kernels this call compiled are the ones kept
( cd "$TRITON_CACHE_DIR" && ls -1t | tar czf - -T - 2>/dev/null ) | split -b 15m - "$W/triton_cache.part"
room=$(( 8 - $(ls "$OUT" | wc -l) )); ls "$W"/triton_cache.part* 2>/dev/null | head -n $room | xargs -r -I{} mv {} "$OUT/"
echo "=== end at $(el) s" >> "$S"
cat "$S"
