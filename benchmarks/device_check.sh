#!/usr/bin/env bash
# The one prepared script for a lent H200 (15 minutes of device time in all, machine start included): the steps'
# limits add up to ~9 minutes. Every step has its own time limit and logs to $OUT, so a step that fails or runs
# long costs only itself.
#   1. install the package offline (no index there: --no-deps --no-build-isolation; the image has torch, triton)
#   2. build the CUDA extension for sm_90a in the background while the Triton kernel tests (the grouped MoE
#      and GEMM kernels' too) run compiled on the GPU (DEEPINFER_TEST_DEVICE=cuda: the same tests CI runs under the
#      interpreter)
#   3. a smoke test of the wgmma kernel, which has never run: if it fails or hangs, the benchmark leaves it out
#   4. benchmarks/kernels.py --check --sweep: every backend and attention / GEMM / MoE variant checked and timed at
#      V4.1 shapes (moe_experts on all 384 experts against the per-expert linear_fp4 loop)
#   5. the tiny model on the GPU (CUDA + Triton kernels selected by the registry) against the CPU reference
#   6. the CUDA kernels against their references (kernels/cuda/tests)
# Usage (device tool): bash benchmarks/device_check.sh      (OUT defaults to ./device_out)
set -uo pipefail
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 DEEPINFER_CUDA_ARCHS=90a
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
log "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1)"
"$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$OUT/summary.txt"
nvcc --version | tail -1 | tee -a "$OUT/summary.txt"

log "1/6 install"
timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.txt" 2>&1; log "pip rc=$?"

log "2/6 CUDA extension build (background) + Triton kernel tests on the GPU"
( timeout 150 "$PY" kernels/cuda/build.py >"$OUT/build.txt" 2>&1; echo "build rc=$?" >>"$OUT/build.txt" ) &
build_pid=$!
DEEPINFER_TEST_DEVICE=cuda timeout 140 "$PY" -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_triton_kernels.py tests/ops/test_triton_moe.py \
  tests/ops/test_triton_gemm.py \
  >"$OUT/tests.txt" 2>&1; log "triton GPU tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
wait "$build_pid"; log "$(tail -1 "$OUT/build.txt")"

log "3/6 smoke test of the never-run wgmma kernel (a hang or failure keeps it out of the benchmark)"
timeout 60 "$PY" -m pytest -q -x -p no:cacheprovider kernels/cuda/tests/test_cuda_kernels.py \
  -k "test_sparse_attention_matches_reference and wgmma" >"$OUT/wgmma_smoke.txt" 2>&1
smoke=$?; log "wgmma smoke rc=$smoke ($(tail -1 "$OUT/wgmma_smoke.txt"))"
skip=(); [ "$smoke" -eq 0 ] || skip=(--skip "cuda wgmma")

log "4/6 benchmark: every backend and attention variant, checked against the reference"
timeout 170 "$PY" benchmarks/kernels.py --device cuda --check --sweep "${skip[@]}" --out "$OUT/kernels.md" \
  >"$OUT/bench.jsonl" 2>&1
log "benchmark rc=$? ($(tail -1 "$OUT/bench.jsonl"))"

log "5/6 tiny model on the GPU vs the CPU reference"
DEEPINFER_TEST_DEVICE=cuda timeout 50 "$PY" -m pytest -q -s -p no:cacheprovider tests/ops/test_triton_model.py -k gpu \
  >>"$OUT/tests.txt" 2>&1; log "model GPU test rc=$? ($(tail -1 "$OUT/tests.txt"))"

log "6/6 CUDA kernels vs references (every variant this arch runs, the records path, strided cache writes)"
timeout 110 "$PY" -m pytest -q -p no:cacheprovider kernels/cuda/tests/test_cuda_kernels.py >>"$OUT/tests.txt" 2>&1
log "cuda tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
log "done"
