"""Every Triton kernel compiles for sm_90 (H100/H200) and sm_100 (B200) at the tests' and the benchmark's shapes,
sm_90 also with the benchmark's candidate tilings, without a GPU: tests/ops/triton_aot.py runs the launchers under
a compile-only driver (PTX and cubin from the wheel's ptxas, Triton's shared-memory limit enforced) and prints
registers / shared memory / local (spill) bytes per specialisation. Where triton-ascend is the installed triton,
tests/ops/triton_ascend_lowering.py lowers the same launches for Ascend NPUs instead (its adapter stage; CANN's
binary stage cannot run here).

It runs in a subprocess with TRITON_INTERPRET removed from the environment: the interpreter tests set it before
importing the kernels, and the kernels pick their block sizes from it at import.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIPPED = 3  # triton_aot's exit status when the NVIDIA toolchain is unusable, triton_ascend_lowering's without it


# Extra arguments per target. sm_90 also compiles the candidate tilings that only benchmarks/kernels.py --sweep
# launches, as benchmarks/device_check.sh does on a lent H200; sm_100 compiles what the ops launch.
TARGETS = {90: [], 100: ["--no-sweep"]}
ARCHS = tuple(TARGETS)
# With a warm Triton cache (~/.triton/cache) both targets take under a minute. With a cold one (a fresh machine),
# on 2 idle cores: sm_90 608 s (397 specialisations), sm_100 155 s (195; 743 s with the sweep). CI runs them
# beside its background jobs.
COMPILE_TIMEOUT_S = 1800


def test_every_kernel_compiles_for_the_gpu():
    """Both targets compile at once, in two processes (ptxas is single-threaded)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default, stated to silence 3.9's warning
    runs = {arch: subprocess.Popen([sys.executable, "-m", "tests.ops.triton_aot", "--arch", str(arch), *extra],
                                   cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for arch, extra in TARGETS.items()}
    try:
        results = {arch: (run.communicate(timeout=COMPILE_TIMEOUT_S), run.returncode) for arch, run in runs.items()}
    except subprocess.TimeoutExpired:
        for run in runs.values():
            run.kill()
            run.communicate()
        pytest.fail(f"compiling took over {COMPILE_TIMEOUT_S} s; with a cold Triton cache (~/.triton/cache) sm_90 "
                    "takes about 10 minutes on an idle core, and the compiled kernels are cached as they finish")
    for (stdout, _), _ in results.values():
        print(stdout)
    if all(code == SKIPPED for _, code in results.values()):
        pytest.skip(results[ARCHS[0]][0][0].strip().splitlines()[-1])
    failed = {arch: f"{out[-20000:]}\n{err[-3000:]}" for arch, ((out, err), code) in results.items() if code != 0}
    assert not failed, "kernels fail to compile:\n" + "\n".join(f"--- sm_{a}:\n{text}" for a, text in failed.items())


def test_every_kernel_lowers_for_ascend_npus():
    """Where triton-ascend is the installed triton (CI's .venv-triton-ascend): every kernel through its adapter
    for Atlas A2/A3 and the 910_95 (Ascend 950) path, within an NPU launch's program limit."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.ops.triton_ascend_lowering"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1200)
    report = "\n".join(line for line in run.stdout.splitlines() if "Please DO NOT tune" not in line)
    print(report)
    if run.returncode == SKIPPED:
        pytest.skip(report.strip().splitlines()[-1])
    assert run.returncode == 0, f"kernels fail to lower for the NPU:\n{report[-20000:]}\n{run.stderr[-3000:]}"
