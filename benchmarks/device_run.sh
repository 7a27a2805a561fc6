#!/usr/bin/env bash
# On a GPU machine: build the extension against the machine's torch, check every collective on
# GPUs (the demo, against references), then benchmark tdist against NCCL side by side.
# Logs and the JSON land in $OUT (if set) or benchmarks/results.
#   bash benchmarks/device_run.sh [demo|test|checks|bench|sweep|overlap|host|titan|soak|moe|badinput|all]...
# (several in one invocation run in this script's order and share one build; all: demo, test, bench, moe)
# checks: tests/gpu_checks.py on $NPROC ranks with ${CHECK_ARGS} (e.g. "--quick --only every_op").
# badinput: the CUDA bad-input matrix on 2 GPUs, printing the native stack if a rank crashes.
# bench: benchmarks/collectives.py with ${BENCH_ARGS} (python benchmarks/plot.py <json> draws its plot).
# sweep: one bench run per value of an environment variable (an A/B in one job).
# overlap: benchmarks/overlap.py (torch_tdist.ops against NCCL + matmul and torch's symm_mem).
# host: benchmarks/host_time.py (host time per call, layer by layer; pipelined overlapped ops).
# titan: benchmarks/titan.py ${TITAN_MODE:-bench} ${BENCH_ARGS} with torchtitan from the wheels in .whl/
#   (carried to a machine without internet: README, "torchtitan"), e.g.
#   NPROC=4 BENCH_ARGS="--repeat 2" bash benchmarks/device_run.sh titan
# (benchmarks/timeline.py shows what one call of an op does on the GPU, stream by stream.)
set -u -o pipefail
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
wanted=" ${*:-all} "
wants() { [[ "$wanted" == *" $1 "* ]] || { [[ "$wanted" == *" all "* ]] && [[ " demo test bench moe " == *" $1 "* ]]; }; }
nproc=${NPROC:-$(nvidia-smi -L | wc -l)}
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$OUT/gpus.txt" 2>&1
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
rc=0
if wants demo; then
  timeout 300 python3 -m torch_tdist.demo --nproc "$nproc" 2>&1 | tee "$OUT/demo.log" || rc=1
fi
if wants test; then
  # TEST_K (a pytest -k expression) runs some of them (to split a long run into shorter ones),
  # e.g. TEST_K="4-cuda or bad_input"
  TDIST_CHECK_TIMEOUT=${TDIST_CHECK_TIMEOUT:-150} timeout 900 python3 -m pytest tests/test_build.py tests/test_gpu.py \
    -q -s -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if wants checks; then
  TDIST_TRANSPORT=${TDIST_TRANSPORT:-cuda} timeout ${CHECK_TIMEOUT:-400} python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" -m tests.gpu_checks ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_checks.log" || rc=1
fi
if wants soak; then
  timeout 500 python3 -m torch_tdist.soak --nproc "$nproc" --steps "${SOAK_STEPS:-10000}" ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log" || rc=1
fi
if wants badinput; then
  preload="${TMPDIR:-/tmp}/tdist_segv_backtrace.so"
  gcc -shared -fPIC -o "$preload" tests/native/segv_backtrace.c || rc=1
  LD_PRELOAD="$preload" TDIST_TRANSPORT=cuda timeout 300 python3 -m torch.distributed.run --standalone \
    --nproc-per-node 2 -m tests.gpu_bad_input 2>&1 | tee "$OUT/bad_input.log" || rc=1
fi
if wants moe; then
  timeout 300 python3 -m torch_tdist.examples.moe_all_to_all --nproc "$nproc" --tokens 128 --hidden 7168 \
    --topk 8 --experts-per-rank 8 --steps 10 2>&1 | tee "$OUT/moe.log" || rc=1
fi
if wants bench; then
  TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-2G} timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/collectives.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if wants sweep; then
  # one benchmark run per value of an environment variable, in one job (an A/B), e.g.
  # SWEEP_VAR=TDIST_ALGORITHM SWEEP="auto oneshot twoshot" \
  #   BENCH_ARGS="--ops all_reduce --sizes 256K,1M,4M --graph" bash benchmarks/device_run.sh sweep
  for value in ${SWEEP:?}; do
    echo "== ${SWEEP_VAR:?}=$value" | tee -a "$OUT/bench.log"
    env "$SWEEP_VAR=$value" TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-2G} timeout 300 python3 -m torch.distributed.run \
      --standalone --nproc-per-node "$nproc" benchmarks/collectives.py --out "$OUT/$SWEEP_VAR-$value" \
      ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
fi
if wants overlap; then
  TDIST_HEAP_SIZE=${TDIST_HEAP_SIZE:-4G} timeout 500 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/overlap.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/overlap.log" || rc=1
fi
if wants host; then
  TDIST_OVERLAP=pipelined timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/host_time.py 2>&1 | tee "$OUT/host_time.log" || rc=1
fi
if wants titan; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan_site .whl/*.whl || rc=1
  PYTHONPATH=/tmp/titan_site${PYTHONPATH:+:$PYTHONPATH} timeout 570 python3 benchmarks/titan.py "${TITAN_MODE:-bench}" \
    --nproc "$nproc" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/titan.log" || rc=1
fi
exit $rc
