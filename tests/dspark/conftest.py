"""The tiny model (preset tiny-vocab256, seed 0) with its DSpark drafter, in float64 activations.

Exactness tests (rollback, greedy speculative == generate) run in float64: in fp32 the same math batched into
differently sized matmuls rounds differently in the last bit, and the indexer's relu scores and the routers
have exact ties that such noise can flip, after which two correct runs diverge. In float64 that noise is
~1e-16 and the comparisons are exact in practice.
"""

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM


@pytest.fixture(scope="session")
def tiny256_f64(tiny256_dir):
    return DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, dtype=torch.float64)


@pytest.fixture
def single_thread():
    """Tiny-model tests gain nothing from intra-op threads, and on a shared 2-core machine two torch threads
    contending with other processes made them ~100x slower; run them on one thread, then restore."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
