"""Every Triton kernel compiles for sm_90 (H100/H200) and sm_100 (B200) without a GPU: tests/ops/triton_aot.py runs
the launchers under a compile-only driver (PTX and cubin from the wheel's ptxas, Triton's shared-memory limit
enforced) and prints registers / shared memory / local (spill) bytes per specialisation. CI compiles each code path
of each kernel once (a kernel's formats, modes and dtypes; ``--one-per-path``), at the latest launch that reaches it,
which is V4.1's shape where there is one: a third of the 220 launches at the tests' and the benchmark's shapes, the
rest being other tilings of the same code. ``python -m tests.ops.triton_aot --no-sweep`` compiles all of them,
``python -m tests.ops.triton_aot`` adds the benchmark's candidate tilings, and on a GPU benchmarks/kernels.py
--sweep compiles and times those (benchmarks/device_check.sh). Where triton-ascend is the installed triton,
tests/ops/triton_ascend_lowering.py lowers the same code paths for Ascend NPUs instead (its adapter stage; CANN's
binary stage cannot run here), and every launch of a V4.1 prefill chunk.

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


# Extra arguments per target: each code path once (see above).
TARGETS = {90: ["--no-sweep", "--one-per-path"], 100: ["--no-sweep", "--one-per-path"]}
ARCHS = tuple(TARGETS)
# Cold Triton cache (a fresh machine), 75 launches per target: sm_100 alone on a busy 2-core box took 59 s (49 s of
# CPU). A warm cache (~/.triton/cache): seconds. The limit leaves several times a cold run on a slower or busier
# machine.
COMPILE_TIMEOUT_S = 600


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
        pytest.fail(f"compiling took over {COMPILE_TIMEOUT_S} s; with a cold Triton cache (~/.triton/cache) each "
                    "target takes about a minute on a busy core, and the compiled kernels are cached as they finish")
    for (stdout, _), _ in results.values():
        print(stdout)
    if all(code == SKIPPED for _, code in results.values()):
        pytest.skip(results[ARCHS[0]][0][0].strip().splitlines()[-1])
    failed = {arch: f"{out[-20000:]}\n{err[-3000:]}" for arch, ((out, err), code) in results.items() if code != 0}
    assert not failed, "kernels fail to compile:\n" + "\n".join(f"--- sm_{a}:\n{text}" for a, text in failed.items())


def test_every_kernel_lowers_for_ascend_npus():
    """Where triton-ascend is the installed triton (CI's .venv-triton-ascend): every code path of every kernel
    through its adapter for Atlas A2/A3 and the 910_95 (Ascend 950) path, within an NPU launch's program limit."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.ops.triton_ascend_lowering", "--one-per-path"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1200)
    report = "\n".join(line for line in run.stdout.splitlines() if "Please DO NOT tune" not in line)
    print(report)
    if run.returncode == SKIPPED:
        pytest.skip(report.strip().splitlines()[-1])
    assert run.returncode == 0, f"kernels fail to lower for the NPU:\n{report[-20000:]}\n{run.stderr[-3000:]}"
