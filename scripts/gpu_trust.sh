#!/usr/bin/env bash
# One device call for the trust tools (issue 14), everything under $OUT:
#   1. dumps (`python -m glm53_flash dump`, every kind, widths 1,2,4,8) of each build in BUILDS ("tp:weights:preset"
#      words; default TP1 / TP8 loopback x bf16 / FP8, tiny / tiny-tp8), each twice and compared byte for byte
#      (`compare`); the builds run in parallel (their compiles are CPU work), the two dumps of one build in turn
#      -> dumps.log;
#   2. scripts/stress.py --launches (every kind) over each build in STRESS_BUILDS ("tp:weights:preset:replays"),
#      with the --flip-bit control -> stress.log, stress.jsonl;
#   3. compute-sanitizer memcheck / racecheck / synccheck over one dump (one launch of each kind, width W_SAN,
#      tiny, TP1 unless SAN_BUILD="tp:weights:preset"), spin budgets raised to 60 s -> sanitizer.log;
#   then the Triton cache, packed (cat triton_cache.part* > .triton_cache.tgz; carry it).
# Stops starting steps DEADLINE seconds after the start (default 540).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"; [ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
T0=$(date +%s); DEADLINE=${DEADLINE:-540}
BUILDS=${BUILDS:-"1:bf16:tiny 8:bf16:tiny-tp8 1:fp8:tiny 8:fp8:tiny-tp8"}
STRESS_BUILDS=${STRESS_BUILDS:-"1:bf16:tiny:30000 8:bf16:tiny-tp8:30000"}
W_SAN=${W_SAN:-1}; SAN_BUILD=${SAN_BUILD:-"1:bf16:tiny"}; SAN_TOOLS=${SAN_TOOLS:-"memcheck racecheck synccheck"}
S="$OUT/summary.txt"; W=/tmp/gpu_trust; rm -rf $W; mkdir -p $W
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(el) )); }
{ date -u; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; uname -r
  compute-sanitizer --version 2>&1 | tail -n 1; } > "$S" 2>&1

# 1. dumps, twice per build, compared
i=0
for b in $BUILDS; do
  IFS=: read -r tp fmt pre <<< "$b"; i=$((i + 1))
  ( for n in 1 2; do
      echo "### dump tp $tp $fmt $pre run $n (start $(el) s)"
      timeout $(( $(left) > 30 ? $(left) : 30 )) python3 -m glm53_flash dump --out $W/d${i}_$n --device cuda \
        --tp $tp --weights $fmt --preset $pre 2>&1 | tail -n 3
      echo "### rc=$? at $(el) s"
    done
    echo "### compare tp $tp $fmt $pre"; python3 -m glm53_flash compare $W/d${i}_1 $W/d${i}_2 2>&1 | tail -n 8
    echo "### compare rc=$?" ) > $W/dump_$i.log 2>&1 &
done
wait
cat $W/dump_*.log > "$OUT/dumps.log"
{ echo "=== dumps done at $(el) s"; grep -h -E "^### (compare|rc)" $W/dump_*.log; } >> "$S"

# 2. stress over every kind
for b in $STRESS_BUILDS; do
  IFS=: read -r tp fmt pre n <<< "$b"
  [ "$(left)" -lt 60 ] && { echo "stress $b not started (deadline)" >> "$S"; continue; }
  { echo "### stress.py --launches (all) --tp $tp --weights $fmt --preset $pre --replays $n --flip-bit (start $(el) s)"
    timeout $(( $(left) - 20 )) python3 scripts/stress.py --launches embed,dense,kda,sparse,nextn,tail --tp $tp \
      --weights $fmt --preset $pre --replays $n --flip-bit 2> $W/stress_err.log | tee -a "$OUT/stress.jsonl"
    echo "### stress rc=${PIPESTATUS[0]} at $(el) s"; grep -v " built$" $W/stress_err.log | tail -n 20; } >> "$OUT/stress.log"
done
[ -f "$OUT/stress.log" ] && grep -E "^### stress rc|^\{" "$OUT/stress.log" >> "$S"

# 3. sanitizers over one launch of each kind
IFS=: read -r stp sfmt spre <<< "$SAN_BUILD"
for tool in $SAN_TOOLS; do
  [ "$(left)" -lt 60 ] && { echo "sanitizer $tool not started (deadline)" >> "$S"; continue; }
  { echo "### compute-sanitizer --tool $tool: dump --tp $stp --weights $sfmt --preset $spre --widths $W_SAN (start $(el) s)"
    timeout $(( $(left) - 20 )) compute-sanitizer --tool $tool --target-processes all --print-limit 20 \
      python3 -m glm53_flash dump --out $W/san_$tool --device cuda --tp $stp --weights $sfmt --preset $spre \
      --widths $W_SAN --timeout-s 60 2>&1 | tail -n 40
    echo "### sanitizer $tool rc=${PIPESTATUS[0]} at $(el) s"; } >> "$OUT/sanitizer.log"
done
[ -f "$OUT/sanitizer.log" ] && grep -E "^### sanitizer|ERROR SUMMARY|RACECHECK SUMMARY|error" "$OUT/sanitizer.log" \
  | head -n 20 >> "$S"

# the cache for the next call: parts under the 16 MB file limit, newest entries first, as many as fit (8 files)
( cd "$TRITON_CACHE_DIR" && ls -1t | tar czf - -T - 2>/dev/null ) | split -b 15m - "$W/triton_cache.part"
room=$(( 8 - $(ls "$OUT" | wc -l) )); ls "$W"/triton_cache.part* 2>/dev/null | head -n $room | xargs -r -I{} mv {} "$OUT/"
echo "=== end at $(el) s" >> "$S"
cat "$S"
