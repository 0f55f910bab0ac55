# Shared start of the engine test-environment scripts (setup_vllm_venv.sh, sglang/setup_sglang_venv.sh), sourced:
#   venv_start <log name> <venv dir> <python>
# prints timed steps through step(), honours FORCE=1 (delete and recreate), creates the venv when missing and
# upgrades its pip; afterwards $py is the venv's interpreter, pip() its pip, and logged() runs a command with its
# output appended to build/install-logs/<log name>.log (the last lines are printed if it fails).

venv_start() {
  venv_log_name="$1"
  venv_start_s=$(date +%s)
  local venv_dir="$2" python_bin="$3"
  venv_log="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/install-logs/${venv_log_name}.log"
  mkdir -p "$(dirname "${venv_log}")"
  : >"${venv_log}"
  step "log: ${venv_log}"
  if [[ "${FORCE:-0}" == "1" && -d "${venv_dir}" ]]; then
    step "FORCE=1: removing ${venv_dir}"
    rm -rf "${venv_dir}"
  fi
  if [[ ! -x "${venv_dir}/bin/python" ]]; then
    step "creating venv ${venv_dir} with ${python_bin}"
    logged "${python_bin}" -m venv "${venv_dir}"
  fi
  py="${venv_dir}/bin/python"
  step "upgrading pip"
  logged pip install --upgrade pip
}

step() { echo "[${venv_log_name} +$(( $(date +%s) - venv_start_s ))s] $*"; }
pip() { "${py}" -m pip "$@"; }

logged() {
  echo "\$ $*" >>"${venv_log}"
  if ! "$@" >>"${venv_log}" 2>&1; then
    echo "[${venv_log_name}] failed: $* (last lines of ${venv_log}):" >&2
    tail -n 30 "${venv_log}" >&2
    return 1
  fi
}
