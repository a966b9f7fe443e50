#!/usr/bin/env bash
# One device call for a performance step (issues 11 / 12), everything under $OUT (<= 8 files):
#   1. GPU tests of the kinds a change touches (TESTS: ';'-separated "[K=V ...] files::-k expr" groups, JOBS at a
#      time, until A_T seconds) -> tests.log;
#      STRESS="args": scripts/stress.py (the hand-off protocols under load) after them -> tests.log;
#   2. in-kernel traces (TRACES="kind:tp[:rows[:flags]] ...", flags ','-separated, e.g. kda:8:1:--ctas-per-sm=1;
#      scripts/diag_layers.py --trace, which also checks the traced outputs' bits; TRACE_ENV="K=V ..." extra
#      environment for them, e.g. GLM53_TRACE_MARKS=1; TRACE_ARGS: more diag_layers flags, e.g. --experts 288)
#      -> trace.log; HOP="args": scripts/bench_hop.py -> trace.log;
#   3. time_layers over TIMING (';'-separated scripts/time_matrix.py argument sets) -> timing.jsonl / .log;
#      BASE=dir (a checkout of the commit before, e.g. `git archive` into .base/) times BASE_TIMING there
#      too, in the same call, for side-by-side ratios (its records carry "tree": "base"; BASE2 / BASE2_TIMING a second
#      tree, e.g. one change of two, "tree": "base2"; BASE3 / BASE3_TIMING a third, "tree": "base3"); TIMING2 with
#      TIMING2_ENV="K=V ...|K=V ..." times this tree again under each '|'-separated environment ("tree":
#      "ours2", "env": that environment);
#   4. the engine-style peer (.peer/, fla-core from .whl/; PEER="args" for baseline_layers.py,
#      PEER_PDL="args" for baseline_pdl.py, empty: skipped) -> its tables in timing.log, peer.jsonl;
#   then the Triton cache, packed newest first (cat triton_cache.part* > .triton_cache.tgz; carry it).
# Stops starting steps DEADLINE seconds after the start (default 540).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 REQUIRE_CUDA=1 OMP_NUM_THREADS=2
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"; [ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
# entries built elsewhere (scripts/prebuild_cache.py) name their files by absolute path: point them here
python3 glm53_flash/offline_build.py fix-groups "$TRITON_CACHE_DIR" > /dev/null 2>&1
T0=$(date +%s); DEADLINE=${DEADLINE:-540}; A_T=${A_T:-200}; JOBS=${JOBS:-8}
S="$OUT/summary.txt"; W=/tmp/gpu_perf; rm -rf $W; mkdir -p $W
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(el) )); }
{ date -u; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; } > "$S" 2>&1

# 1. tests
if [ -n "${TESTS:-}" ]; then
  IFS=';' read -ra groups <<< "$TESTS"; i=0
  for g in "${groups[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    files=${g%%::*}; expr=${g#*::}; i=$((i + 1))
    envs=""; paths=""                            # a group may start with K=V words: its environment
    for w in $files; do case $w in *=*) envs="$envs $w";; *) paths="$paths $w";; esac; done
    ( echo "### [$i] pytest -m gpu $files -k '$expr' (start $(el) s)"
      t=$((A_T - $(el))); [ $t -lt 20 ] && t=20
      timeout $t env $envs python3 -m pytest -q -m gpu -p no:cacheprovider -s --durations=3 $paths -k "$expr"
      echo "### [$i] rc=$? at $(el) s" ) > $W/group_$i.log 2>&1 &
  done
  wait
  cat $W/group_*.log > "$OUT/tests.log"
  { echo "=== tests done at $(el) s"
    for f in $W/group_*.log; do head -n 1 $f; grep -E "passed|failed|error|rc=" $f | tail -n 3; done; } >> "$S"
fi

if [ -n "${STRESS:-}" ]; then
  { echo "### stress.py $STRESS (start $(el) s)"; timeout 150 python3 scripts/stress.py $STRESS 2>&1 | tail -n 5
    echo "### stress rc=$? at $(el) s"; } >> "$OUT/tests.log"
  grep "### stress rc" "$OUT/tests.log" >> "$S"
fi

# 2. traces
for kt in ${TRACES:-}; do
  IFS=: read -r k tp r xa <<< "$kt"; xa=${xa//,/ }
  [ "$(left)" -lt 60 ] && { echo "trace $kt not started (deadline)" >> "$S"; continue; }
  echo "##### trace $k tp $tp rows ${r:-1} ${TRACE_ARGS:-} $xa" >> "$OUT/trace.log"
  timeout 120 env ${TRACE_ENV:-} python3 scripts/diag_layers.py --kind $k --tp $tp --rows ${r:-1} --pos 8191 --trace \
    ${TRACE_ARGS:-} $xa 2>&1 \
    | grep -v "task#" >> "$OUT/trace.log"
done
if [ -n "${HOP:-}" ]; then
  { echo "##### bench_hop.py $HOP"; timeout 150 python3 scripts/bench_hop.py $HOP --json-out $W/hop.jsonl 2>&1 | tail -n 40; } \
    >> "$OUT/trace.log"
fi
[ -f "$OUT/trace.log" ] && echo "=== traces done at $(el) s" >> "$S"

# 3. timings (ours, then the base tree's)
run_matrix() {   # $1 = tree, $2 = jsonl, $3 = ';'-separated sets, $4 = extra environment
  IFS=';' read -ra sets <<< "$3"
  for a in "${sets[@]}"; do
    [ "$(left)" -lt 40 ] && { echo "not started (deadline): $1 $a" >> "$S"; continue; }
    echo "=== [$1] time_matrix $a (start $(el) s)" >> "$OUT/timing.log"
    ( cd "$1" && env ${4:-} PYTHONPATH=. TRITON_CACHE_DIR="$TRITON_CACHE_DIR" timeout $(( $(left) + 30 )) \
        python3 scripts/time_matrix.py $a --json-out "$2" --deadline $(( $(left) - 30 )) ) >> "$OUT/timing.log" 2>&1
    echo "=== rc=$? [$1] time_matrix $a (end $(el) s)" >> "$S"
  done
}
[ -n "${TIMING:-}" ] && run_matrix "$PWD" "$W/ours.jsonl" "$TIMING"
if [ -n "${TIMING2:-}" ]; then
  IFS='|' read -ra envsets <<< "${TIMING2_ENV:-}"; [ ${#envsets[@]} -eq 0 ] && envsets=("")
  for e in "${envsets[@]}"; do
    echo "=== environment: $e" >> "$OUT/timing.log"
    run_matrix "$PWD" "$W/ours2.part.jsonl" "$TIMING2" "$e"
    python3 -c "import json,sys; [print(json.dumps({'env': sys.argv[1], **json.loads(l)})) for l in open(sys.argv[2]) if l.strip()]" \
      "$e" "$W/ours2.part.jsonl" >> "$W/ours2.jsonl" 2>/dev/null; rm -f "$W/ours2.part.jsonl"
  done
fi
[ -n "${BASE:-}" ] && [ -n "${BASE_TIMING:-}" ] && run_matrix "$PWD/$BASE" "$W/base.jsonl" "$BASE_TIMING"
[ -n "${BASE2:-}" ] && [ -n "${BASE2_TIMING:-}" ] && run_matrix "$PWD/$BASE2" "$W/base2.jsonl" "$BASE2_TIMING"
[ -n "${BASE3:-}" ] && [ -n "${BASE3_TIMING:-}" ] && run_matrix "$PWD/$BASE3" "$W/base3.jsonl" "$BASE3_TIMING"
python3 - "$W" "$OUT/timing.jsonl" <<'PY'
import json, os, sys
with open(sys.argv[2], "a") as out:
    for tree in ("ours", "ours2", "base", "base2", "base3"):
        f = os.path.join(sys.argv[1], tree + ".jsonl")
        for line in (open(f) if os.path.exists(f) else []):
            if line.strip():
                out.write(json.dumps({"tree": tree, **json.loads(line)}) + "\n")
    f = os.path.join(sys.argv[1], "hop.jsonl")
    for line in (open(f) if os.path.exists(f) else []):
        out.write(line)
PY
[ -f "$OUT/timing.log" ] && grep -E "^(=== \[|!!)|launch tp|torch ops" "$OUT/timing.log" >> "$S"

# 4. the peer
if [ -n "${PEER:-}${PEER_PDL:-}" ] && [ "$(left)" -gt 60 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
  { [ -n "${PEER:-}" ] && OUT= PYTHONPATH=/tmp/site timeout $(left) python3 .peer/baseline_layers.py $PEER --out $W/peer
    [ -n "${PEER_PDL:-}" ] && [ "$(left)" -gt 40 ] && \
      OUT= PYTHONPATH=/tmp/site timeout $(left) python3 .peer/baseline_pdl.py $PEER_PDL --out $W/peer_pdl
  } >> "$OUT/timing.log" 2>&1
  cat $W/peer*/table.txt >> "$OUT/timing.log" 2>/dev/null
  for d in peer peer_pdl; do [ -f $W/$d/results.jsonl ] && sed "s/^{/{\"peer\": \"$d\", /" $W/$d/results.jsonl \
    >> "$OUT/peer.jsonl"; done
  echo "=== peer done at $(el) s" >> "$S"
fi

# the cache for the next call: parts under the 16 MB file limit, newest entries first, as many as fit
( cd "$TRITON_CACHE_DIR" && ls -1t | tar czf - -T - 2>/dev/null ) | split -b 15m - "$W/triton_cache.part"
room=$(( 8 - $(ls "$OUT" | wc -l) )); ls "$W"/triton_cache.part* 2>/dev/null | head -n $room | xargs -r -I{} mv {} "$OUT/"
echo "=== end at $(el) s" >> "$S"
cat "$S"
