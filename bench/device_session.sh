#!/bin/bash
# One GPU machine call's worth of work, results under $OUT (the device tool brings that folder back): the build if
# needed, then every GPU test file (tests/gpu/test_*.py), each in its own pytest under the time left, and a report of
# what passed, failed, was skipped and never ran, per file, closed by one summary line; or the benchmark instead.
#
# Usage, from the repository root:  bash bench/device_session.sh [SECONDS] [PART]
#   SECONDS  the call's budget (default 570); each step gets what is left of it, less 25 s for the report
#   PART     all (default): every test file whole, one after another
#            N/M: every M-th test of each file from its N-th; M calls, N = 1..M, run the suite once:
#              bash bench/device_session.sh 570 1/3; bash bench/device_session.sh 570 2/3; ... 3/3 (a call each)
#            bench: no tests; python -m portep_bench --json $OUT/bench.json (its default modes for the GPUs here)
# Environment: OUT (default /tmp/portep-device); PORTEP_GPU_TEST_IDS=FILE: only the test ids listed there, one a line
# (what an earlier call never ran); PORTEP_GPU_TEST_FILES="test_gpu_ll.py ...": only those files (of the part);
# PORTEP_GPU_TESTS_K: a pytest -k expression; PORTEP_GPU_TESTS_DIR (default tests/gpu); PORTEP_DEVICE_BUILD: auto
# (default: build unless build/gpu was built from this tree's sources and portep_testing imports; a fresh machine has
# neither), 1 always, 0 never; PORTEP_DEVICE_PKILL: 1 (the default where there are GPUs) kills every pytest and
# spawn_main process after each file, besides the file's own process group. PORTEP_GPU_LANES=L (default 1): L pytest
# processes side by side, each with its share of the part's tests (lane l of part N/M runs part ((N-1)L + l)/(ML)), so
# that the ranks' start-up (imports, CUDA contexts) of one test overlaps another's GPU work; each lane has its own log
# (tests-lane<l>.log) and kills only its own processes. Ranks share GPUs (PORTEP_TEST_SHARE_GPU=1) with fewer than four
# GPUs: then no GPU test should skip. Back in $OUT, at most four files (with lanes, a log per lane too): summary.txt
# (notes, the report), gpu-tests.json (what was collected and planned, each test's result), tests.log (the collection
# and each file's pytest output), build.log if it built; for bench: summary.txt, build.log, bench.log, bench.json.
# `python3 bench/gpu_test_report.py DIR...` with the folders of the M parts' calls prints the report of them all and the
# one summary line for the closing note.
# Exit status: the report's (1 if a test failed, was skipped or never ran), or the benchmark's.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset CUDA_DEVICE_MAX_CONNECTIONS
OUT=${OUT:-/tmp/portep-device}
BUDGET=${1:-570}
PART=${2:-all}
TESTS_DIR=${PORTEP_GPU_TESTS_DIR:-tests/gpu}
RESERVE=25  # seconds each pytest leaves for its kill grace (10), the cleanup and the report
REPORT=(python3 bench/gpu_test_report.py)
PYTEST=(python3 -m pytest -p no:cacheprovider -q)
KARGS=()
[ -n "${PORTEP_GPU_TESTS_K:-}" ] && KARGS=(-k "$PORTEP_GPU_TESTS_K")
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

sources_hash() {  # the build's inputs: the tree less build outputs, tests (but their native hooks) and docs
  { find . \( -path ./build -o -path ./.git -o -path ./.whl -o -path ./.gl -o -path ./tests -o -path ./docs \
      -o -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache \) -prune -o -type f ! -name '*.pyc' -print0
    find ./tests/native -type f ! -name '*.pyc' -print0 2>/dev/null; } |
    LC_ALL=C sort -z | xargs -0 -r sha1sum | sha1sum | cut -c1-12
}

tree_hash() {  # the files the tests see: every file of the tree but build outputs
  find . \( -path ./build -o -path ./.git -o -path ./.whl -o -path ./.gl -o -name __pycache__ -o -name '*.egg-info' \
    -o -name .pytest_cache \) -prune -o -type f ! -name '*.pyc' -print0 |
    LC_ALL=C sort -z | xargs -0 -r sha1sum | sha1sum | cut -c1-12
}

step() {  # name, seconds wanted, command...: the command under the time left, its output in $OUT/name.log
  local name=$1 want=$2 lim s rc
  shift 2
  lim=$(($(left) - RESERVE))
  [ "$lim" -gt "$want" ] && lim=$want
  if [ "$lim" -lt 20 ]; then note "$name: not started, $(left) s left"; return 124; fi
  s=$(date +%s)
  timeout -k 10 "$lim" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  note "$name: rc=$rc, $(($(date +%s) - s)) s (limit $lim): $(tail -1 "$OUT/$name.log" | cut -c1-150)"
  return $rc
}

build() {  # pip install with the test hooks, unless build/gpu already holds this tree's build and it imports
  local want stamp=build/gpu/portep-sources.sha1 mode=${PORTEP_DEVICE_BUILD:-auto}
  want=$(sources_hash)
  if [ "$mode" = 0 ]; then note "build: skipped (PORTEP_DEVICE_BUILD=0)"; return; fi
  if [ "$mode" = auto ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] &&
    python3 -c "import portep, portep_testing" 2>/dev/null; then
    note "build: skipped, build/gpu was built from these sources ($want) and portep_testing imports"
    return
  fi
  rm -f "$stamp"
  step build 300 python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.PORTEP_BUILD_TESTING=ON \
    -Cbuild-dir=build/gpu || return 1
  mkdir -p build/gpu && echo "$want" > "$stamp"
  python3 -c "import portep._ll_torch, portep_testing, portep.backends.cuda.engine, portep.backends.cuda.ht" \
    >> "$OUT/summary.txt" 2>&1 || { note "import failed: see build.log"; return 1; }
}

cleanup() {  # pid of a `timeout` (the leader of its process group): whatever that pytest left running
  kill -9 -- "-$1" 2>/dev/null
  [ "$PKILL" = 1 ] && [ "$LANES" = 1 ] && pkill -9 -f "pytest|spawn_main" 2>/dev/null
  sleep 1
}

collect() {  # every test file's test ids, into $RAW/collect.txt (the report's and the plan's list)
  local lim rc=124 n
  shopt -s nullglob
  printf '%s\n' "$TESTS_DIR"/test_*.py > "$RAW/files.txt"
  mapfile -t FILES < "$RAW/files.txt"
  [ "${#FILES[@]}" -gt 0 ] || { note "no $TESTS_DIR/test_*.py"; return 1; }
  lim=$(($(left) - RESERVE))
  [ "$lim" -gt 180 ] && lim=180
  echo "===== collect: ${FILES[*]} ${KARGS[*]}" >> "$OUT/tests.log"
  if [ "$lim" -ge 5 ]; then
    timeout -k 10 "$lim" "${PYTEST[@]}" --collect-only --continue-on-collection-errors "${KARGS[@]}" "${FILES[@]}" \
      > "$RAW/collect.txt" 2>&1
    rc=$?
  fi
  cat "$RAW/collect.txt" >> "$OUT/tests.log" 2>/dev/null
  echo "collect_rc=$rc" >> "$RAW/meta.txt"
  n=$(grep -c '::' "$RAW/collect.txt" 2>/dev/null)
  note "collect: rc=$rc, ${n:-0} tests in ${#FILES[@]} files"
}

run_file() {  # lane folder, lane log, test file, file of its ids for this part ('': the file whole, with -k)
  local raw=$1 log=$2 f=$3 ids=$4 stem lim s rc pid args start
  stem=$(basename "$f" .py)
  start=$(wc -l < "$log")
  lim=$(($(left) - RESERVE))
  if [ "$lim" -lt 5 ]; then note "$f: not started, $(left) s left"; return; fi
  if [ -n "$ids" ]; then mapfile -t args < "$ids"; else args=("$f" "${KARGS[@]}"); fi
  echo "===== $f: ${ids:+$(wc -l < "$ids") tests of part $(part_of "$raw"), }limit $lim s" >> "$log"
  s=$(date +%s)
  # SIGINT at the limit: pytest stops as on ^C and still writes the junit XML of the tests that ended
  timeout -s INT -k 10 "$lim" "${PYTEST[@]}" -rfEs --durations=10 --junitxml="$raw/junit-$stem.xml" "${args[@]}" \
    >> "$log" 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$f" "$rc" "$(($(date +%s) - s))" "$lim" >> "$raw/runs.tsv"
  cleanup "$pid"
  note "$f: rc=$rc, $(($(date +%s) - s)) s (limit $lim): $(tail -n "+$((start + 1))" "$log" |
    grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' | tail -1 | tr -d =)"
  if [ "$LANES" = 1 ]; then  # what has ended, should the call be cut
    "${REPORT[@]}" report --quiet --json "$OUT/gpu-tests.json" "$raw"
  fi
}

part_of() { sed -n 's/^part=//p' "$1/meta.txt"; }

lane_part() {  # lane number: its part of the call's part (all -> l/L; N/M -> ((N-1)L + l)/(ML))
  local l=$1 n=1 m=1
  [ "$LANES" = 1 ] && { echo "$PART"; return; }
  if [[ $PART =~ ^([0-9]+)/([0-9]+)$ ]]; then n=${BASH_REMATCH[1]}; m=${BASH_REMATCH[2]}; fi
  echo "$(((n - 1) * LANES + l))/$((m * LANES))"
}

run_lane() {  # lane folder, its log: the planned files one after another
  local raw=$1 log=$2 f ids
  while IFS=$'\t' read -r f ids; do run_file "$raw" "$log" "$f" "$ids"; done < "$raw/plan.tsv"
}

tests() {
  local l raw log rc lanes=()
  : > "$OUT/tests.log"
  collect || return 1
  for l in $(seq 1 "$LANES"); do
    raw=$RAW
    log=$OUT/tests.log
    if [ "$LANES" != 1 ]; then
      raw=$RAW/lane$l
      log=$OUT/tests-lane$l.log
      mkdir -p "$raw"
      cp "$RAW/files.txt" "$RAW/collect.txt" "$raw/"
      sed "s|^part=.*|part=$(lane_part "$l")|" "$RAW/meta.txt" > "$raw/meta.txt"
      : > "$log"
    fi
    if ! "${REPORT[@]}" plan "$raw" "$(lane_part "$l")" ${PORTEP_GPU_TEST_FILES:-} > "$raw/plan.tsv" \
      2> "$raw/plan.err"; then
      note "$(cat "$raw/plan.err")"
      wait  # lanes already started
      return 2
    fi
    run_lane "$raw" "$log" &
    lanes+=("$raw")
  done
  wait
  "${REPORT[@]}" report --planned-only --json "$OUT/gpu-tests.json" "${lanes[@]}" | tee -a "$OUT/summary.txt"
  rc=${PIPESTATUS[0]}
  return "$rc"
}

if ! [[ $PART =~ ^(all|bench|([0-9]+)/([0-9]+))$ ]] || [ "${BASH_REMATCH[2]:-1}" -lt 1 ] ||
  [ "${BASH_REMATCH[2]:-1}" -gt "${BASH_REMATCH[3]:-1}" ]; then
  echo "PART: all, N/M (1 <= N <= M) or bench, not '$PART'" >&2
  exit 2
fi
mkdir -p "$OUT"
: > "$OUT/summary.txt"
RAW=$(mktemp -d "${TMPDIR:-/tmp}/portep-gpu-tests.XXXXXX")
trap 'rm -rf "$RAW"' EXIT
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
PKILL=${PORTEP_DEVICE_PKILL:-$([ "$GPUS" -gt 0 ] && echo 1 || echo 0)}
LANES=${PORTEP_GPU_LANES:-1}
if ! [[ $LANES =~ ^[1-9][0-9]*$ ]]; then echo "PORTEP_GPU_LANES: a positive number, not '$LANES'" >&2; exit 2; fi
[ "$GPUS" -lt 4 ] && export PORTEP_TEST_SHARE_GPU=${PORTEP_TEST_SHARE_GPU:-1}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo none)
TREE=$(tree_hash)
printf '%s\n' "part=$PART" "lanes=$LANES" "commit=$COMMIT" "tree=$TREE" "gpus=$GPUS" "k=${PORTEP_GPU_TESTS_K:-}" \
  "files=${PORTEP_GPU_TEST_FILES:-}" "share_gpu=${PORTEP_TEST_SHARE_GPU:-}" "budget=$BUDGET" > "$RAW/meta.txt"
note "commit $COMMIT ($(git status --short 2>/dev/null | wc -l) files changed), tree $TREE; GPUs: $GPUS;" \
  "part $PART${PORTEP_GPU_TEST_FILES:+ of $PORTEP_GPU_TEST_FILES}${PORTEP_GPU_TESTS_K:+ -k '$PORTEP_GPU_TESTS_K'};" \
  "budget $BUDGET s; PORTEP_TEST_SHARE_GPU=${PORTEP_TEST_SHARE_GPU:-}"
if ! build; then  # the tests would run an older install, or none
  note "build failed: nothing run; total $(($(date +%s) - T0)) s, exit 1"
  exit 1
fi
if [ "$PART" = bench ]; then
  step bench "$BUDGET" python3 -m portep_bench --json "$OUT/bench.json"
  RC=$?
else
  tests
  RC=$?
fi
note "total $(($(date +%s) - T0)) s, exit $RC"
exit "$RC"
