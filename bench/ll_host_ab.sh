#!/bin/bash
# The LL host time of this tree next to an earlier tree's, on one machine in one run (issue 35: the host time stays at
# or below what it was when the issue was filed, 80ed924): builds OLD_DIR (that commit's files) into a folder of its
# own, then runs `python -m portep_bench ll-host` with each tree in turn, ROUNDS times each in the order old, new, new,
# old, ... (so that a machine whose speed drifts favours neither), each tree with its own benchmark code, and prints
# bench/portep_bench/ll_host_ab.py's summary: per run the round trip's and the baseline's medians, and each new run's
# round trip over the old run's next to it.
#
# Usage, from the root of this tree after it was installed (the device queues' first job):
#   bash bench/ll_host_ab.sh OLD_DIR [ROUNDS]
#   OLD_DIR  the earlier tree's files, e.g. `mkdir -p .ab-old && git archive 80ed924 | tar -x -C .ab-old` here, then
#            carried to the GPU machine (carry [".ab-old", ...])
# Environment: PORTEP_AB_DIR (default /tmp/portep-queue/ll-host-ab, where the device queue packs its logs): the runs'
# JSON and the old tree's build log; PORTEP_AB_BUILD (default /tmp/portep-ll-ab): the old tree's build and install.
# Exit status: 0; 1 when OLD_DIR is missing or its build or a run fails.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d "${1:-}" ] || { echo "ll_host_ab: no folder '${1:-}' (the earlier tree's files)" >&2; exit 1; }
OLD=$(cd "$1" && pwd)
ROUNDS=${2:-3}
DIR=${PORTEP_AB_DIR:-/tmp/portep-queue/ll-host-ab}
BUILD=${PORTEP_AB_BUILD:-/tmp/portep-ll-ab}
mkdir -p "$DIR" "$BUILD"
echo "ll_host_ab: building $OLD into $BUILD/install"
python3 -m pip install -q --upgrade --no-build-isolation --no-deps --target "$BUILD/install" "$OLD" \
  -Cbuild-dir="$BUILD/build" > "$DIR/old-build.log" 2>&1 || { tail -20 "$DIR/old-build.log"; exit 1; }

ll_host() {  # JSON path: one ll-host run with the portep and portep_bench that python3 imports here
  python3 -c "import portep; print('portep from', portep.__file__)" && python3 -m portep_bench ll-host --json "$1"
}

run_tree() {  # tree name, run number: one ll-host run with that tree's library and benchmark
  local json=$DIR/$1-$2.json
  if [ "$1" = old ]; then
    (cd "$OLD" && export PYTHONPATH="$BUILD/install:$OLD/bench" && ll_host "$json")
  else
    ll_host "$json"
  fi
}

order=()
for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then order+=("old $r" "new $r"); else order+=("new $r" "old $r"); fi
done
files=()
for run in "${order[@]}"; do
  set -- $run
  echo "ll_host_ab: $1 tree, run $2"
  run_tree "$1" "$2" || { echo "ll_host_ab: the $1 tree's run $2 failed" >&2; exit 1; }
  files+=("$DIR/$1-$2.json")
done
python3 -m portep_bench.ll_host_ab old new "${files[@]}"
