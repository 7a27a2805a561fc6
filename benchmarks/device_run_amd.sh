#!/usr/bin/env bash
# shellcheck disable=SC2317  # (the step_ functions are called by name, from main)
# On an AMD GPU node (MI300X, MI355X) with a ROCm build of torch: build tdist with the rocm extra,
# check it against RCCL (a ROCm torch's "nccl" backend), then benchmark it against RCCL side by side.
# The counterpart of benchmarks/device_run.sh, whose steps (benchmarks/device_common.sh) it shares;
# docs/amd.md lists what each step runs. Logs and the JSON land in $OUT (if set) or benchmarks/results.
#   bash benchmarks/device_run_amd.sh [build|demo|test|linkcheck|checks|integrations|rocshmem|badinput|
#                                      deadpeer|moe|bench|sweep|overlap|oversweep|host|titan|soak|all]...
# all: demo, test, bench, overlap, moe; test: linkcheck, checks, integrations, badinput, deadpeer
# (what tests/test_gpu.py runs in device_run.sh's test, each entry point called here with the HIP
# transport); rocshmem: the checks and the dead peer on the rocshmem transport (a build with ROCSHMEM).
# TDIST_TRANSPORT is hip for every step (rocshmem for that step).
#
# DRY=1: the build is skipped and "all" is checks (--quick), bench and overlap at small sizes: the
# same Python entry points, which on an NVIDIA machine run with the CUDA transports (cuda, nvshmem),
# e.g. after the extension is built there:
#   bash benchmarks/device_run.sh build && DRY=1 bash benchmarks/device_run_amd.sh
#
# Not here: tests/test_gpu.py's run of gpu_checks with torch's NVSHMEM symmetric memory started first
# (--symm-mem-first): tests/gpu_checks.py starts it with the NVSHMEM backend only.
if [[ -n ${DRY:-} ]]; then
  ALL_STEPS="checks bench overlap"
  CHECK_ARGS=${CHECK_ARGS-"--quick"} CHECK_TIMEOUT=${CHECK_TIMEOUT:-300}
  BENCH_ARGS=${BENCH_ARGS-"--sizes 64K,1M --warmup 2 --iters 10 --rounds 1"}
  OVERLAP_ARGS=${OVERLAP_ARGS-"--shapes 2048x1024x2048 --warmup 1 --iters 5 --rounds 1 --preheat-ms 20"}
else
  ALL_STEPS="demo test bench overlap moe"
fi
TEST_STEPS="linkcheck checks integrations badinput deadpeer"
# shellcheck source=benchmarks/device_common.sh
source "$(dirname "$0")/device_common.sh"
wanted=${wanted// test / $TEST_STEPS }

# The transports of the torch installed: hip and rocshmem on a ROCm build, cuda and nvshmem otherwise (DRY=1 on NVIDIA).
read -r gpus IPC SHMEM < <(python3 -c 'import torch; hip = torch.version.hip is not None
print(torch.cuda.device_count(), "hip" if hip else "cuda", "rocshmem" if hip else "nvshmem")') \
  || { echo "torch does not import"; exit 1; }
export TDIST_TRANSPORT=${TDIST_TRANSPORT:-$IPC}
nproc=${NPROC:-$gpus}
{
  python3 -c 'import torch
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(i, p.name, getattr(p, "gcnArchName", ""), p.total_memory >> 20, "MiB")
print("torch", torch.__version__, "hip", torch.version.hip, "cuda", torch.version.cuda)'
  rocm-smi || nvidia-smi
} > "$OUT/gpus.txt" 2>&1

# The rocm extra brings hip-python. Where torch's Triton is the pytorch-triton-rocm distribution
# (pip knows no "triton"), pip would put PyPI's triton over it to meet tdist's requirement: there
# tdist is installed without dependencies and the rocm extra's packages after it.
rocm_extra() {
  python3 -c 'from importlib.metadata import requires
print(" ".join(r.split(";")[0] for r in requires("torch-tdist") if "extra == \"rocm\"" in r))'
}
build_rocm() {
  if python3 -m pip show -q triton > /dev/null 2>&1; then
    python3 -m pip install --no-build-isolation -e ".[rocm]"
  else
    # shellcheck disable=SC2046  # (one argument per requirement)
    python3 -m pip install --no-build-isolation --no-deps -e ".[rocm]" && python3 -m pip install $(rocm_extra)
  fi
}
# tests/test_build.py: the extension links the process's shared libstdc++.
step_linkcheck() {
  timeout 120 python3 -m pytest tests/test_build.py -q -p no:cacheprovider 2>&1 | tee "$OUT/linkcheck.log" || rc=1
}
# tdist's DTensor styles and compiled async TP against torch's on RCCL, bf16.
step_integrations() {
  timeout 600 python3 -m torch.distributed.run --standalone --nproc-per-node $(( nproc < 4 ? nproc : 4 )) \
    -m tests.gpu_integrations 2>&1 | tee "$OUT/gpu_integrations.log" || rc=1
}
# tests/gpu_dead_peer.py on up to 4 ranks as plain processes (torchrun would stop the survivors as
# soon as rank 1 kills itself): rank 1 must end by SIGKILL (137), the survivors with $2.
dead_peer_port=29600  # one port per run: a run's port may still be held when the next starts
dead_peer() {  # dead_peer TRANSPORT SURVIVORS_EXIT_CODE [VAR=VALUE...]
  local transport=$1 survivors=$2 world=$(( nproc < 4 ? nproc : 4 )) pids=() r code want
  shift 2
  for (( r = 0; r < world; r++ )); do
    env "$@" TDIST_TRANSPORT="$transport" RANK="$r" LOCAL_RANK="$r" WORLD_SIZE="$world" MASTER_ADDR=127.0.0.1 \
      MASTER_PORT="$dead_peer_port" timeout 300 python3 -m tests.gpu_dead_peer > "$OUT/dead_peer.$r.log" 2>&1 &
    pids+=($!)
  done 2> /dev/null  # (the ranks write to their logs; this hides the shell's "Killed" line for rank 1)
  for (( r = 0; r < world; r++ )); do
    { wait "${pids[r]}"; } 2> /dev/null
    code=$?
    want=$survivors
    (( r == 1 )) && want=137
    cat "$OUT/dead_peer.$r.log" >> "$OUT/dead_peer.log"
    if (( code != want )); then
      echo "dead peer ($transport $*): rank $r exited with $code, not $want; its output is in $OUT/dead_peer.log"
      rc=1
    fi
  done
  rm -f "$OUT"/dead_peer.?.log
  dead_peer_port=$(( dead_peer_port + 1 ))
}
step_deadpeer() {
  dead_peer "$IPC" 0
  dead_peer "$IPC" 134 TDIST_DEAD_TEARDOWN=1 TDIST_DEAD_CASES=all_reduce  # the process taken down (SIGABRT)
}
step_rocshmem() {
  TDIST_TRANSPORT=$SHMEM timeout "${CHECK_TIMEOUT:-400}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" -m tests.gpu_checks --quick 2>&1 | tee "$OUT/gpu_checks_$SHMEM.log" || rc=1
  dead_peer "$SHMEM" 0
}
main build_rocm
