#!/usr/bin/env bash
# Create (or refresh) the isolated virtualenv used by the NeMo-AutoModel differential-test oracle.
#
#   tests/oracle/setup_oracle_venv.sh            # creates <repo>/.venv-oracle
#
# Environment knobs (all optional):
#   ORACLE_PYTHON      python interpreter used to create the venv (default: python3)
#   ORACLE_VENV        venv path, relative to the repo root (default: .venv-oracle)
#   ORACLE_NEMO_WHEEL  local path to nemo_automodel-0.7.0-py3-none-any.whl (default: fetch from the index)
#   ORACLE_TORCH_INDEX extra index URL for the CPU torch wheel, e.g. https://download.pytorch.org/whl/cpu
#                      (not needed when pip's find-links/cache already holds torch 2.13.0+cpu)
#   ORACLE_FORCE=1     delete and recreate the venv
#   ORACLE_SYSTEM_SITE=1  create the venv with --system-site-packages and reuse the interpreter's own
#                      torch 2.13.0 when it has one (faster; the venv's transformers 5.18.0 still wins)
#
# The oracle is a test-only dependency: nemo-automodel is installed with --no-deps and only the
# packages its deepseek_v41 forward path really imports are added.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
cd "$REPO_ROOT"

PY="${ORACLE_PYTHON:-python3}"
VENV="${ORACLE_VENV:-.venv-oracle}"
NEMO_VERSION="0.7.0"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.oracle-ready-v1"

# Pinned minimum runtime deps (transformers must be exactly 5.18.0: nemo-automodel 0.7.0 pins it).
DEPS=(
  "transformers==5.18.0"
  "safetensors>=0.4"
  "numpy"
  "pyyaml"
  "pillow"
)

if [[ "${ORACLE_FORCE:-0}" == "1" ]]; then
  rm -rf "$VENV"
fi

if [[ -f "$STAMP" ]] && "$VENV/bin/python" - <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md
assert md.version("nemo-automodel") == "0.7.0"
assert md.version("transformers") == "5.18.0"
assert md.version("torch").split("+")[0] == "2.13.0"
PYEOF
then
  echo "[oracle] $VENV already set up (rm -rf $VENV or ORACLE_FORCE=1 to rebuild)"
  exit 0
fi

VENV_ARGS=()
SKIP_TORCH=0
if [[ "${ORACLE_SYSTEM_SITE:-0}" == "1" ]]; then
  VENV_ARGS+=(--system-site-packages)
  if "$PY" -c 'import torch,sys; sys.exit(0 if torch.__version__.split("+")[0]=="2.13.0" else 1)' 2>/dev/null; then
    SKIP_TORCH=1
  fi
fi
echo "[oracle] creating $VENV with $("$PY" --version 2>&1) ${VENV_ARGS[*]:-}"
"$PY" -m venv "${VENV_ARGS[@]}" "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --no-input)

TORCH_ARGS=()
if [[ -n "${ORACLE_TORCH_INDEX:-}" ]]; then
  TORCH_ARGS+=(--extra-index-url "$ORACLE_TORCH_INDEX")
fi
# torch first (CPU build; pip's find-links/cache supply the local +cpu wheel when present).
if [[ "$SKIP_TORCH" == "1" ]]; then
  echo "[oracle] reusing the system torch $TORCH_VERSION"
else
  "${PIP[@]}" "${TORCH_ARGS[@]}" "torch==${TORCH_VERSION}"
fi
"${PIP[@]}" "${DEPS[@]}"

if [[ -n "${ORACLE_NEMO_WHEEL:-}" ]]; then
  "${PIP[@]}" --no-deps "$ORACLE_NEMO_WHEEL"
else
  "${PIP[@]}" --no-deps "nemo-automodel==${NEMO_VERSION}"
fi

# Smoke check: the exact imports the oracle runner needs.
TORCHDYNAMO_DISABLE=1 "$VPY" - <<'PYEOF'
import importlib.metadata as md
import torch, transformers
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM  # noqa: F401
from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41StateDictAdapter  # noqa: F401
print("[oracle] torch", torch.__version__, "transformers", transformers.__version__,
      "nemo-automodel", md.version("nemo-automodel"))
assert transformers.__version__ == "5.18.0", transformers.__version__
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
PYEOF
touch "$STAMP"
echo "[oracle] ready: $VENV"
