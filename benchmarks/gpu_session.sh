#!/usr/bin/env bash
# One call on a lent GPU machine (issue 37): the CUDA tests, then the GPU benchmark, everything
# written under $OUT (at most 8 files come back). Run from the repository root:
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh            # tests + 1.3B grid
#   LARGEST="4b 6.7b" OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# The machine has no network: wheels the image lacks travel in .whl/ (pydantic and its parts, hjson;
# .whl/ds/ holds DeepSpeed 0.19.8 built as a wheel without ops: its JIT loader builds FusedAdam and
# CPUAdam here, in the background while the tests run). Variables: SKIP_TESTS=1, SKIP_BENCH=1,
# MODES (default "z2 z3 z3off"), FRAMEWORKS, LARGEST (sizes for the stage-3 offload probe),
# LARGEST_MODE (z3off|z3offp), TEST_ARGS (extra pytest arguments), BENCH_ARGS, BUDGET_S (seconds after
# which the largest-size probes are not started).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/gb-logs
BUDGET_S=${BUDGET_S:-330}
log() { echo "[$(date +%T) +${SECONDS}s] $*"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch,sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
  nproc; free -g | head -2; command -v nvcc && nvcc --version | tail -1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
DS_PATH=""
if ls .whl/ds/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site .whl/ds/*.whl && DS_PATH=/tmp/ds-site
fi
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext MAX_JOBS=${MAX_JOBS:-12}
# DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as numbers and fails on the image's arch suffixes
# ("9.0a"): build (and later load, which checks the same flags) for the GPU's plain capability
echo "TORCH_CUDA_ARCH_LIST was '${TORCH_CUDA_ARCH_LIST:-}'" >>"$OUT/env.txt"
TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") && export TORCH_CUDA_ARCH_LIST
log "wheels installed (deepspeed: ${DS_PATH:-none})"

DS_BUILD_PID=""
if [ -n "$DS_PATH" ]; then
  (PYTHONPATH="$DS_PATH:${PYTHONPATH:-}" DS_ACCELERATOR=cuda timeout 300 python3 -c "
from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
FusedAdamBuilder().load(); print('fused_adam built')
CPUAdamBuilder().load(); print('cpu_adam built')" >"$OUT/ds_build.log" 2>&1) &
  DS_BUILD_PID=$!
fi

if [ "${SMOKE:-0}" = 1 ]; then  # the examples on one GPU: every bundled config's path once
  log "examples"
  for c in ${SMOKE_CONFIGS:-zero1_fp16 zero2_bf16 zero3_offload_auto}; do
    echo "== train_gpt.py $c"
    PYTHONPATH="src:${PYTHONPATH:-}" timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
      examples/train_gpt.py --deepspeed_config examples/configs/$c.json --steps 5 2>&1 | tail -4
  done
  if [ -z "${SMOKE_CONFIGS+x}" ]; then
    echo "== train_gpt_data_efficiency.py"
    PYTHONPATH="src:${PYTHONPATH:-}" timeout 120 python3 examples/train_gpt_data_efficiency.py --steps 6 2>&1 | tail -5
  fi
  echo "== compress_gpt.py"
  PYTHONPATH="src:${PYTHONPATH:-}" timeout 120 python3 examples/compress_gpt.py --dense-steps 5 --compress-steps 5 \
    --out /tmp/compressed 2>&1 | tail -5
fi >"$OUT/gpu-tests.log" 2>&1
cat "$OUT/gpu-tests.log"

if [ "${SKIP_TESTS:-0}" != 1 ]; then  # what `make test-gpu PYTHON_GPU=python3` runs (no make needed)
  log "CUDA tests"
  OMP_NUM_THREADS=1 SHARDWISE_GPU_REPORT="$OUT/gpu-report.jsonl" PYTHONPATH="src:${PYTHONPATH:-}" \
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m cuda -p no:cacheprovider -rA tests/gpu ${TEST_ARGS:-} \
    >>"$OUT/gpu-tests.log" 2>&1
  log "CUDA tests exit $?"; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20
fi

TORCH_ADAM=""
if [ -n "$DS_BUILD_PID" ]; then
  wait "$DS_BUILD_PID"; rc=$?
  log "DeepSpeed op build exit $rc"; tail -3 "$OUT/ds_build.log"
  grep -q "cpu_adam built" "$OUT/ds_build.log" || TORCH_ADAM="--ds-torch-adam"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  log "benchmark ${MODES:-z2 z3 z3off}"
  python3 benchmarks/gpu_bench.py --modes ${MODES:-z2 z3 z3off} --frameworks ${FRAMEWORKS:-shardwise fsdp2 deepspeed} \
    --deepspeed-path "$DS_PATH" $TORCH_ADAM --log-dir /tmp/gb-logs --out "$OUT/bench.json" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log"
  if [ -n "${LARGEST:-}" ] && [ "$SECONDS" -lt "$BUDGET_S" ]; then
    log "largest-size probe ${LARGEST} (${LARGEST_MODE:-z3off})"
    python3 benchmarks/gpu_bench.py --modes --largest $LARGEST --largest-mode "${LARGEST_MODE:-z3off}" \
      --frameworks ${LARGEST_FRAMEWORKS:-shardwise deepspeed} --deepspeed-path "$DS_PATH" $TORCH_ADAM \
      --log-dir /tmp/gb-logs --out "$OUT/largest.json" --warmup 1 --steps 3 ${BENCH_ARGS:-} --case-timeout "${LARGEST_TIMEOUT:-120}" --micro-batch "${LARGEST_MICRO_BATCH:-2}" 2>&1 | tee -a "$OUT/bench.log"
  fi
fi
tar czf "$OUT/logs.tgz" -C /tmp gb-logs 2>/dev/null
log "done"
