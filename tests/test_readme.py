"""The README's counts and bounds are the code's: each claim below is read from the README and compared with
the number the code or the asserting test holds, so a change on either side fails here until both agree."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_triton_op_count_is_the_backends():
    from deepinfer_plugins.ops.backends.triton_backend import OPS

    claimed = re.search(r"Triton kernels \((\d+) ops\)", README)
    assert claimed and int(claimed.group(1)) == len(OPS)


def test_the_nemo_parity_bounds_are_the_tests():
    from tests.oracle import test_nemo_parity

    claimed = re.search(r"top-1 (\d+)% and RMS relative error <= ([0-9.e-]+)", README)
    assert claimed, "the README states the NeMo parity bounds"
    assert int(claimed.group(1)) == 100 and float(claimed.group(2)) == test_nemo_parity.RMS_BOUND
    source = Path(test_nemo_parity.__file__).read_text()
    assert source.count("top1 == 1.0 and rel <= RMS_BOUND") == 2, "the seeds and the oracle-written checkpoint"
    real = re.search(r"real 129280-token vocabulary .*? top-1 (\d+)% and RMS relative error <= ([0-9.e-]+)", README)
    assert real and int(real.group(1)) == 100
    assert float(real.group(2)) == test_nemo_parity.REAL_VOCABULARY_RMS_BOUND
    assert source.count("top1 == 1.0 and rel <= REAL_VOCABULARY_RMS_BOUND") == 1
