#!/usr/bin/env bash
# Build (or refresh) `.venv-triton-ascend` at the repo root: the Triton kernels' tests under triton-ascend, the
# Triton that Ascend NPUs compile with, on a machine without an NPU or CANN.
#
# triton-ascend 3.2.0 replaces the `triton` package (it must never share a venv with upstream triton), so it gets
# its own venv with the CPU torch. Its interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU, and its
# compiler's adapter stage runs without CANN (tests/ops/triton_ascend_lowering.py). Measured here: `import triton`
# needs pybind11 (its backend imports it), and its interpreter fails on numpy 2 ("only 0-dimensional arrays can be
# converted to Python scalars"), hence numpy 1.26.4, the version triton-ascend's CANN install guide names.
# Idempotent; FORCE=1 recreates the venv.
#
# Run the tests afterwards with:  TRITON_INTERPRET=1 .venv-triton-ascend/bin/python -m pytest tests/ops/test_triton_*.py
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/../.." && pwd)"
venv_dir="${VENV_DIR:-${repo_root}/.venv-triton-ascend}"
triton_ascend_version="${TRITON_ASCEND_VERSION:-3.2.0}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# shellcheck source=integration_tests/venv_lib.sh
source "${repo_root}/integration_tests/venv_lib.sh"
venv_start setup_triton_ascend_venv "${venv_dir}" "${python_bin}"

step "installing torch 2.13.0 (CPU), triton-ascend ${triton_ascend_version}, pybind11, numpy 1.26.4, pytest"
pip install --quiet "torch==2.13.0"
pip install --quiet "triton-ascend==${triton_ascend_version}" pybind11 "numpy==1.26.4" pytest

step "installing deepinfer (editable) from ${repo_root}"
pip install --quiet -e "${repo_root}/recipe" -e "${repo_root}"  # the plugin depends on the recipe

step "checking that triton is triton-ascend"
"${py}" - <<'PY'
from importlib.metadata import distributions

import numpy
import triton
from triton.backends import backends

upstream = [d.version for d in distributions() if d.metadata["Name"] == "triton"]
if "ascend" not in backends or upstream:
    raise SystemExit(f"triton {triton.__version__} has backends {sorted(backends)}; upstream triton {upstream} "
                     "must not be installed beside triton-ascend")
print(f"triton {triton.__version__}, backends {sorted(backends)}, numpy {numpy.__version__}")
PY

step "done: ${venv_dir} ($(du -sh "${venv_dir}" 2>/dev/null | cut -f1))"
