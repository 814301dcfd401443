#!/bin/bash
# A queue of GPU machine jobs that outlives one call: the first call starts it in the background (jobs in the file's
# order, each alone unless marked to share the GPU, its output in its own log), and every call (the first too) waits
# up to SECONDS for it, then packs its logs into one archive under $OUT (the device tool brings back only a few files
# per call). The queue runs on between calls while the machine stays warm, so long cases (16 time-sliced ranks) need
# not fit one call; running jobs one at a time keeps one case's ranks from starving another's of the GPU. The jobs
# run in a copy of the repository taken when the queue starts ($Q/tree, build/ left out): each device call copies the
# working tree and its carried paths over the checkout again, which deletes directories that running jobs stand in
# (a conformance case whose folder was replaced mid-run fails at os.getcwd()).
#
# Usage, from the repository root:  bash bench/device_queue.sh JOBS [SECONDS]
#   JOBS     a file of shell commands, one a line, run from the repository root; blank lines and # comments are
#            skipped; "SECS:command" runs the command under a limit of SECS seconds (exit status 124 past it);
#            "&SECS:command" (or "&command") starts it beside the jobs that follow, up to a line "wait" or the next job
#            without "&", which wait for every job started so far (correctness cases that mostly wait on each
#            other's time slices can share the GPU; timings should run alone)
#   SECONDS  how long this call waits for the queue (default 560; 0: start it and return)
# Environment: OUT (default /tmp/portep-device): queue.tgz (every log) and progress.txt land there;
# PORTEP_QUEUE_DIR (default /tmp/portep-queue): the queue's folder on the machine (jobs, logs, progress.txt, pid).
# A call after the queue started runs nothing new (a second JOBS file is ignored until that folder is removed).
# Exit status: 0, or 1 when JOBS is missing.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
Q=${PORTEP_QUEUE_DIR:-/tmp/portep-queue}

run_job() {  # number, limit (0: none), command: one job, its log and its two progress lines
  local n=$1 secs=$2 cmd=$3 start rc
  echo "$(date +%T) job $n start: $cmd" >> "$Q/progress.txt"
  start=$(date +%s)
  if [ "$secs" -gt 0 ]; then
    timeout -k 10 "$secs" bash -c "$cmd" > "$Q/job-$n.log" 2>&1 < /dev/null
  else
    bash -c "$cmd" > "$Q/job-$n.log" 2>&1 < /dev/null
  fi
  rc=$?
  echo "$(date +%T) job $n rc=$rc after $(($(date +%s) - start)) s" >> "$Q/progress.txt"
}

run_queue() {  # every job of $Q/jobs.txt in order ("&" jobs side by side up to the next "wait"), then "queue done"
  local n=0 line secs cmd beside
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  while IFS= read -r line || [ -n "$line" ]; do
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    if [[ $line =~ ^[[:space:]]*wait[[:space:]]*$ ]]; then
      wait
      continue
    fi
    beside=0
    if [[ $line == \&* ]]; then beside=1 line=${line:1}; fi
    n=$((n + 1)) secs=0 cmd=$line
    if [[ $line =~ ^([0-9]+):(.*)$ ]]; then secs=${BASH_REMATCH[1]} cmd=${BASH_REMATCH[2]}; fi
    if [ "$beside" = 1 ]; then
      run_job "$n" "$secs" "$cmd" &
    else
      wait
      run_job "$n" "$secs" "$cmd"
    fi
  done < "$Q/jobs.txt"
  wait
  echo "$(date +%T) queue done" >> "$Q/progress.txt"
}

if [ "${1:-}" = "--run" ]; then
  run_queue
  exit 0
fi
JOBS=${1:-}
WAIT=${2:-560}
OUT=${OUT:-/tmp/portep-device}
[ -f "$JOBS" ] || { echo "device_queue: no jobs file '$JOBS'" >&2; exit 1; }
mkdir -p "$OUT" "$Q"
if [ ! -f "$Q/pid" ]; then
  cp "$JOBS" "$Q/jobs.txt"
  mkdir -p "$Q/tree"
  if ! tar -C . --exclude=./build -cf - . | tar -C "$Q/tree" -xf -; then
    echo "device_queue: cannot copy the tree" >&2
    exit 1
  fi
  setsid bash "$Q/tree/bench/device_queue.sh" --run > "$Q/queue.out" 2>&1 < /dev/null &
  echo $! > "$Q/pid"
  jobs=$(grep -cvE '^[[:space:]]*(#|$|wait[[:space:]]*$)' "$Q/jobs.txt")
  echo "device_queue: started ($jobs jobs), pid $(cat "$Q/pid")"
else
  echo "device_queue: already running since an earlier call, pid $(cat "$Q/pid")"
fi
T0=$(date +%s)
while [ $(($(date +%s) - T0)) -lt "$WAIT" ] && ! grep -q "queue done" "$Q/progress.txt" 2> /dev/null; do
  sleep 2
done
touch "$Q/progress.txt"
tar czf "$OUT/queue.tgz" -C "$Q" --exclude=./tree . 2> /dev/null
cp "$Q/progress.txt" "$OUT/progress.txt"
cat "$Q/progress.txt"
