#!/usr/bin/env bash
# shellcheck disable=SC2317  # (the step_ functions are called by name, from main)
# On a GPU machine: build the extension against the machine's torch, check every collective on
# GPUs (the demo, against references), then benchmark tdist against NCCL side by side.
# Logs and the JSON land in $OUT (if set) or benchmarks/results.
#   bash benchmarks/device_run.sh [build|demo|test|checks|bench|sweep|overlap|oversweep|host|titan|soak|moe|badinput|all]...
# (several in one invocation run in this script's order and share one build; all: demo, test, bench, moe;
# build: the build alone; DRY=1 skips it)
# checks: tests/gpu_checks.py on $NPROC ranks with ${CHECK_ARGS} (e.g. "--quick --only every_op").
# badinput: the CUDA bad-input matrix on 2 GPUs, printing the native stack if a rank crashes.
# bench: benchmarks/collectives.py with ${BENCH_ARGS} (python benchmarks/plot.py <json> draws its plot).
# sweep: one bench run per value of an environment variable (an A/B in one job).
# overlap: benchmarks/overlap.py (torch_tdist.ops against NCCL + matmul and torch's symm_mem).
# oversweep: benchmarks/overlap_sweep.py ${SWEEP_ARGS} (the ops over Llama-3 layer shapes and row counts,
#   eager and in CUDA graphs, with host times).
# host: benchmarks/host_time.py (host time per call, layer by layer: the overlap ops and a small all_reduce).
# titan: benchmarks/titan.py ${TITAN_MODE:-bench} ${BENCH_ARGS} with torchtitan from the wheels in .whl/
#   (carried to a machine without internet: README, "torchtitan"), e.g.
#   NPROC=4 BENCH_ARGS="--repeat 2" bash benchmarks/device_run.sh titan
# (benchmarks/timeline.py shows what one call of an op does on the GPU, stream by stream.)
# The steps live in benchmarks/device_common.sh, shared with the AMD script (device_run_amd.sh).
ALL_STEPS="demo test bench moe"
# shellcheck source=benchmarks/device_common.sh
source "$(dirname "$0")/device_common.sh"
IPC=cuda
nproc=${NPROC:-$(nvidia-smi -L | wc -l)}
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$OUT/gpus.txt" 2>&1
step_test() {
  # TEST_K (a pytest -k expression) runs some of them (to split a long run into shorter ones),
  # e.g. TEST_K="4-cuda or bad_input"
  TDIST_CHECK_TIMEOUT=${TDIST_CHECK_TIMEOUT:-150} timeout 900 python3 -m pytest tests/test_build.py tests/test_gpu.py \
    -q -s -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
}
main python3 -m pip install --no-build-isolation --no-deps -e .
