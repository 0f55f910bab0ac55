#!/usr/bin/env bash
# Build (or refresh) the SGLang test environment `.venv-sglang` at the repo root.
#
# Idempotent: re-running reuses the venv, skips the SGLang install when the wanted version is
# already there, and re-installs deepinfer and the recipe editable (cheap). SGLang 0.5.23 installs on a CPU box
# (~11 GB with CUDA torch + NVIDIA libs); imports and registries work, serving does not.
#
# Env knobs:
#   PYTHON          interpreter for the venv (default: python3.11, else python3)
#   SGLANG_VERSION  sglang release to install (default: 0.5.23)
#   VENV_DIR        venv location (default: <repo root>/.venv-sglang)
#   FORCE=1         delete and recreate the venv
#
# Run the tests afterwards with:  .venv-sglang/bin/python -m pytest integration_tests/sglang -q
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/../.." && pwd)"
venv_dir="${VENV_DIR:-${repo_root}/.venv-sglang}"
sglang_version="${SGLANG_VERSION:-0.5.23}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# shellcheck source=integration_tests/venv_lib.sh
source "${script_dir}/../venv_lib.sh"
venv_start setup_sglang_venv "${venv_dir}" "${python_bin}"

# 1. SGLang itself (pulls CUDA torch, flashinfer, sglang-kernel; all import fine without a GPU).
have="$("${py}" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)"
if [[ "${have}" != "${sglang_version}" ]]; then
  step "installing sglang==${sglang_version} (was: ${have:-none})"
  logged pip install "sglang==${sglang_version}"
else
  step "sglang ${have} already installed"
fi

# 2. Test tools.
step "installing pytest"
logged pip install pytest

# 3. deepinfer and the recipe it depends on (the image grid arithmetic lives there), editable,
#    without re-resolving their deps: `--no-deps` so pip never touches the
#    torch that sglang pinned (2.14.1+cu130, a local version no index here serves, so it must not
#    be named in a requirement). Our other runtime deps do not depend on torch; check it stayed.
torch_ver="$("${py}" -c 'import torch; print(torch.__version__)')"
step "installing deepinfer and deepinfer-recipe (editable, --no-deps) from ${repo_root}; torch stays ${torch_ver}"
logged pip install safetensors pydantic pluggy tqdm numpy tokenizers
logged pip install --no-deps -e "${repo_root}/recipe" -e "${repo_root}"
torch_after="$("${py}" -c 'import torch; print(torch.__version__)')"
if [[ "${torch_after}" != "${torch_ver}" ]]; then
  echo "torch changed from ${torch_ver} to ${torch_after} while installing deepinfer" >&2
  exit 1
fi

# 4. Sanity: sglang imports, our entry point is visible in the group SGLang's loader reads.
step "checking imports"
"${py}" - <<'PY'
import importlib.metadata as md
import sglang, torch
import deepinfer_plugins.models.deepseek_v41  # the core, with the recipe it imports
print(f"sglang {sglang.__version__}  torch {torch.__version__}  cuda available: {torch.cuda.is_available()}")
eps = {e.name: e.value for e in md.entry_points(group="sglang.srt.plugins")}
print("sglang.srt.plugins:", eps)
if eps.get("deepinfer") != "deepinfer_plugins:register_sglang":
    raise SystemExit("entry point sglang.srt.plugins:deepinfer missing; is deepinfer installed editable?")
PY

step "done: ${venv_dir} ($(du -sh "${venv_dir}" 2>/dev/null | cut -f1))"
