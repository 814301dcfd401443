#!/bin/bash
# One device call's worth of GPU work, logs under $OUT (the device tool brings that folder back): build, the GPU
# tests, the benchmarks. With two GPUs: every GPU test, then `python -m portep_bench` (gpu-ll, then gpu-ht, each
# next to NCCL), then the four-rank forwarding tests on the two GPUs if time is left. With one GPU: the GPU tests with
# both ranks sharing it (correctness only), then `python -m portep_bench` (the HT loopback, then ll-host). The
# benchmark's tables also go to $OUT/bench.json.
# Each step gets what is left of the budget (first argument, seconds; default 570), so a slow step cannot eat the
# logs of the others. Usage, from the repository root: bash bench/device_session.sh [seconds]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CUDA_DEVICE_MAX_CONNECTIONS
OUT=${OUT:-/tmp/portep-device}
mkdir -p "$OUT"
BUDGET=${1:-570}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

step() {  # name, seconds wanted, command...
  local name=$1 want=$2 lim s rc
  shift 2
  lim=$(left)
  [ "$lim" -gt "$want" ] && lim=$want
  if [ "$lim" -lt 20 ]; then note "$name: skipped, $(left) s left"; return; fi
  s=$(date +%s)
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  note "$name: rc=$rc, $(($(date +%s) - s)) s (limit $lim): $(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1)"
  pkill -9 -f "pytest|spawn_main" 2>/dev/null
  sleep 1
}

: > "$OUT/summary.txt"
note "commit $(git log --oneline -1 2>/dev/null | cut -c1-60); $(git status --short 2>/dev/null | wc -l) files changed"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
note "GPUs: $GPUS"
step build 300 python3 -m pip install --no-build-isolation --no-deps . -Ccmake.define.PORTEP_BUILD_TESTING=ON \
  -Cbuild-dir=build/gpu
python3 -c "import portep._ll_torch, portep_testing, portep.backends.cuda.engine, portep.backends.cuda.ht" \
  >> "$OUT/summary.txt" 2>&1 ||
  note "import failed: see build.log"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rs --durations=15"
if [ "$GPUS" -ge 2 ]; then
  step tests 330 $PYTEST tests/gpu/test_gpu_ll_fast_path.py tests/gpu/test_gpu_ht.py tests/gpu/test_gpu_ll.py tests/gpu/test_gpu_fifo.py tests/gpu/test_gpu_layout.py
  step bench 230 python3 -m portep_bench --json "$OUT/bench.json"
  # the forwarding tests want four GPUs: their four ranks share the two (correctness only), if time is left
  step forwarding 150 env PORTEP_TEST_SHARE_GPU=1 $PYTEST tests/gpu/test_gpu_ht.py -k forwarding
else
  export PORTEP_TEST_SHARE_GPU=1
  step tests 440 $PYTEST tests/gpu/test_gpu_ll_fast_path.py tests/gpu/test_gpu_ht.py tests/gpu/test_gpu_ll.py tests/gpu/test_gpu_fifo.py tests/gpu/test_gpu_layout.py
  step bench 110 python3 -m portep_bench --json "$OUT/bench.json"
fi
note "total $(($(date +%s) - T0)) s"
