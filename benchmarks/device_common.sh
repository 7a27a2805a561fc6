# shellcheck shell=bash disable=SC2086,SC2154  # (*_ARGS are split into arguments; nproc is the caller's)
# The steps that benchmarks/device_run.sh (NVIDIA) and benchmarks/device_run_amd.sh (AMD) share.
# Sourced by both (ALL_STEPS set: what "all" means), which then set
#   nproc  ranks per job
#   IPC    this torch's one-node transport: cuda, or hip on a ROCm torch (whose "nccl" backend is RCCL)
# define steps of their own (step_NAME functions) and end with `main BUILD_COMMAND...`.
# DRY=1: the build is skipped and the Python steps run against what is installed.
set -u -o pipefail
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
# the Python entry points use this tree's torch_tdist, installed or built in place (DRY=1)
PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
# Every step, in the order they run (each a step_NAME function; a script runs those it defines).
STEP_ORDER="demo test linkcheck checks integrations rocshmem soak badinput deadpeer moe bench sweep overlap oversweep host titan"
wanted=" ${*:-all} "  # the steps asked for; "build" asks for the build alone
wanted=${wanted// all / $ALL_STEPS }
mkdir -p "$OUT"
rc=0

# main BUILD_COMMAND...: checks the steps asked for, builds (output in $OUT/build.log; a failed
# build ends the script; skipped with DRY=1), runs the steps and exits non-zero if one failed.
main() {
  local word step start known=""
  for step in $STEP_ORDER; do
    if declare -F "step_$step" > /dev/null; then known+=" $step"; fi
  done
  for word in $wanted; do
    [[ " build$known " == *" $word "* ]] || { echo "unknown step '$word' (known: all build$known)"; exit 2; }
  done
  if [[ -n ${DRY:-} ]]; then
    echo "build: skipped (DRY=1)"
  else
    start=$(date +%s)
    "$@" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - start )) s"
  fi
  for step in $known; do
    if [[ "$wanted" == *" $step "* ]]; then "step_$step"; fi
  done
  exit $rc
}

# gpu_checks.py on $nproc ranks: every collective and fused op against the "nccl" backend's result.
step_checks() {
  TDIST_TRANSPORT=${TDIST_TRANSPORT:-$IPC} timeout "${CHECK_TIMEOUT:-400}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" -m tests.gpu_checks ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_checks.log" || rc=1
}
step_demo() {
  timeout 300 python3 -m torch_tdist.demo --nproc "$nproc" 2>&1 | tee "$OUT/demo.log" || rc=1
}
step_soak() {
  timeout 500 python3 -m torch_tdist.soak --nproc "$nproc" --steps "${SOAK_STEPS:-10000}" ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log" || rc=1
}
# The bad-input matrix on 2 GPUs, printing the native stack if a rank crashes.
step_badinput() {
  local preload="${TMPDIR:-/tmp}/tdist_segv_backtrace.so"
  gcc -shared -fPIC -o "$preload" tests/native/segv_backtrace.c || rc=1
  LD_PRELOAD="$preload" TDIST_TRANSPORT=$IPC timeout 300 python3 -m torch.distributed.run --standalone \
    --nproc-per-node 2 -m tests.gpu_bad_input 2>&1 | tee "$OUT/bad_input.log" || rc=1
}
step_moe() {
  timeout 300 python3 -m torch_tdist.examples.moe_all_to_all --nproc "$nproc" --tokens 128 --hidden 7168 \
    --topk 8 --experts-per-rank 8 --steps 10 2>&1 | tee "$OUT/moe.log" || rc=1
}
step_bench() {
  TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-2G} timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/collectives.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || rc=1
}
step_sweep() {
  # one benchmark run per value of an environment variable, in one job (an A/B), e.g.
  # SWEEP_VAR=TDIST_ALGORITHM SWEEP="auto oneshot twoshot" \
  #   BENCH_ARGS="--ops all_reduce --sizes 256K,1M,4M --graph" bash benchmarks/device_run.sh sweep
  local value
  for value in ${SWEEP:?}; do
    echo "== ${SWEEP_VAR:?}=$value" | tee -a "$OUT/bench.log"
    env "$SWEEP_VAR=$value" TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-2G} timeout 300 python3 -m torch.distributed.run \
      --standalone --nproc-per-node "$nproc" benchmarks/collectives.py --out "$OUT/$SWEEP_VAR-$value" \
      ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
}
# OVERLAP_ARGS: overlap.py's own arguments where they differ from BENCH_ARGS.
step_overlap() {
  TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-4G} timeout 500 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/overlap.py --out "$OUT" ${OVERLAP_ARGS-${BENCH_ARGS:-}} 2>&1 | tee "$OUT/overlap.log" || rc=1
}
step_host() {
  timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/host_time.py --out "$OUT" 2>&1 | tee "$OUT/host_time.log" || rc=1
}
step_oversweep() {
  TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-2G} timeout 500 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/overlap_sweep.py --out "$OUT" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/overlap_sweep.log" || rc=1
}
step_titan() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan_site .whl/*.whl || rc=1
  PYTHONPATH=/tmp/titan_site${PYTHONPATH:+:$PYTHONPATH} timeout 570 python3 benchmarks/titan.py "${TITAN_MODE:-bench}" \
    --nproc "$nproc" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/titan.log" || rc=1
}
