#!/usr/bin/env bash
# The one prepared script for a lent H200 (15 minutes of device time in all, machine start included): the steps'
# limits add up to ~12 minutes (a run that passes takes ~4). Every step has its own time limit and logs to $OUT, so
# a step that fails or runs long costs only itself: every step runs even when one before it failed, and the script
# then exits 1 (summary.txt's last line names the failed steps). $OUT comes back as at most 8 files: this writes 7.
#   1. install the package offline (no index there: --no-deps --no-build-isolation; the image has torch, triton)
#   2. build the CUDA extension for sm_90a in the background while the Triton kernel tests (the grouped MoE
#      and GEMM kernels' too) run compiled on the GPU (DEEPINFER_TEST_DEVICE=cuda: the same tests CI runs under the
#      interpreter)
#   3. a smoke test of the wgmma kernel, which has never run: if it fails or hangs, the benchmark leaves it out
#   4. benchmarks/kernels.py --check --sweep: every backend and attention / GEMM / MoE variant checked and timed at
#      V4.1 shapes (moe_experts on all 384 experts against the per-expert linear_fp4 loop)
#   5. the tiny model on the GPU (CUDA + Triton kernels selected by the registry) against the CPU reference
#   6. benchmarks/gpu_diagnose.py: the same model with every op on its reference on the GPU, each backend's output
#      against the reference's at the model's inputs call by call, and one op at a time on its GPU backend
#      (-> diagnose.txt), so that a failure of step 5 names its op
#   7. the CUDA kernels against their references (kernels/cuda/tests)
# Usage (device tool): bash benchmarks/device_check.sh      (OUT defaults to ./device_out)
set -uo pipefail
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 DEEPINFER_CUDA_ARCHS=90a
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
failed=()
result() {  # <step name> <exit status> [detail]: log it, and remember a failure for the exit status
  log "$1 rc=$2${3:+ ($3)}"
  [ "$2" -eq 0 ] || failed+=("$1")
}
log "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1)"
"$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$OUT/summary.txt"
nvcc --version | tail -1 | tee -a "$OUT/summary.txt"

log "1/7 install (pip's output, quiet unless it fails, goes to this file)"
timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/summary.txt" 2>&1; result pip $?

log "2/7 CUDA extension build (background) + Triton kernel tests on the GPU"
( timeout 150 "$PY" kernels/cuda/build.py >"$OUT/build.txt" 2>&1; echo "build rc=$?" >>"$OUT/build.txt" ) &
build_pid=$!
DEEPINFER_TEST_DEVICE=cuda timeout 140 "$PY" -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_triton_kernels.py tests/ops/test_triton_moe.py \
  tests/ops/test_triton_gemm.py \
  >"$OUT/tests.txt" 2>&1; result "triton GPU tests" $? "$(tail -1 "$OUT/tests.txt")"
wait "$build_pid"
build=$(tail -1 "$OUT/build.txt"); [[ "$build" == "build rc="* ]] || build="build rc=1"
result build "${build#build rc=}"

log "3/7 smoke test of the never-run wgmma kernel (a hang or failure keeps it out of the benchmark)"
timeout 60 "$PY" -m pytest -q -x -p no:cacheprovider kernels/cuda/tests/test_cuda_kernels.py \
  -k "test_sparse_attention_matches_reference and wgmma" >"$OUT/wgmma_smoke.txt" 2>&1
smoke=$?; result "wgmma smoke" $smoke "$(tail -1 "$OUT/wgmma_smoke.txt")"
skip=(); [ "$smoke" -eq 0 ] || skip=(--skip "cuda wgmma")

log "4/7 benchmark: every backend and attention variant, checked against the reference"
timeout 170 "$PY" benchmarks/kernels.py --device cuda --check --sweep "${skip[@]}" --out "$OUT/kernels.md" \
  >"$OUT/bench.jsonl" 2>&1
result benchmark $? "$(tail -1 "$OUT/bench.jsonl")"

log "5/7 tiny model on the GPU vs the CPU reference"
DEEPINFER_TEST_DEVICE=cuda timeout 50 "$PY" -m pytest -q -s -p no:cacheprovider tests/ops/test_triton_model.py -k gpu \
  >>"$OUT/tests.txt" 2>&1; result "model GPU test" $? "$(tail -1 "$OUT/tests.txt")"

log "6/7 diagnosis of the tiny model on the GPU, op by op"
timeout 90 "$PY" benchmarks/gpu_diagnose.py --device cuda >"$OUT/diagnose.txt" 2>&1
result diagnose $? "$(grep -c -- '<-- off' "$OUT/diagnose.txt") lines off; $(tail -1 "$OUT/diagnose.txt")"

log "7/7 CUDA kernels vs references (every variant this arch runs, the records path, strided cache writes)"
timeout 110 "$PY" -m pytest -q -p no:cacheprovider kernels/cuda/tests/test_cuda_kernels.py >>"$OUT/tests.txt" 2>&1
result "cuda tests" $? "$(tail -1 "$OUT/tests.txt")"
if [ "${#failed[@]}" -eq 0 ]; then
  log "done: every step passed"
  exit 0
fi
log "done: ${#failed[@]} step(s) failed: $(IFS=,; echo "${failed[*]}")"
exit 1
