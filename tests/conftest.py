"""Shared fixtures: random official-format checkpoints written once per test session."""

from __future__ import annotations

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint


@pytest.fixture(scope="session")
def tiny256_dir(tmp_path_factory):
    """Preset tiny-vocab256 (docs/model.md#test-configurations), seed 0."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny256"), "tiny-vocab256", seed=0)


@pytest.fixture(scope="session")
def tiny256(tiny256_dir):
    return DeepseekV41ForCausalLM.from_pretrained(tiny256_dir)


def prompt(n: int, seed: int = 0, vocab: int = 250) -> torch.Tensor:
    """Token ids avoiding the special ids 0-2 and the tiny config's image token 255."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))
