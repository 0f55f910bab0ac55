"""One loader: vLLM's model class loads the same parameters (names, dtypes, values) as the core's
``from_pretrained`` and the SGLang adapter, for every activation dtype vLLM serves and for a checkpoint whose float
tensors are stored fp16 (which must load as fp16, not rounded to bf16). In process, without a server: the model
class is built from the parts of vLLM's config it reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from tests.models.test_loader_paths import (DTYPES, assert_same_parameters, assert_stored_dtypes, checkpoint_weights,
                                            fp16_copy, sglang_load)


def vllm_load(path, dtype: torch.dtype) -> torch.nn.Module:
    """The vLLM model class's core model, built and loaded as vLLM's loader drives it (one rank, no DSpark)."""
    from vllm.config import CompilationMode

    from deepinfer_plugins.vllm.model import DeepInferDeepseekV41ForCausalLM

    config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(path), tokenizer=str(path), dtype=dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), speculative_config=None,
        cache_config=SimpleNamespace(block_size=16),
        compilation_config=SimpleNamespace(static_forward_context={}, mode=CompilationMode.NONE, splitting_ops=[]))
    model = DeepInferDeepseekV41ForCausalLM(vllm_config=config)
    loaded = model.load_weights(checkpoint_weights(path))
    assert loaded == {f"model.{name}" for name, _ in model.model.named_parameters()}
    return model.model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    bf16 = write_random_checkpoint(tmp_path_factory.mktemp("bf16"), "tiny-vocab256", seed=0)
    return {"bf16": bf16, "fp16": fp16_copy(bf16, tmp_path_factory.mktemp("fp16") / "ckpt")}


@pytest.mark.parametrize("stored", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vllm_core_and_sglang_load_the_same_parameters(stored, dtype, checkpoints):
    path = checkpoints[stored]
    core = DeepseekV41ForCausalLM.from_pretrained(path, dtype=dtype, with_drafter=False)
    assert_stored_dtypes(core, path, "core")
    assert_same_parameters(vllm_load(path, dtype), core, "vllm")
    assert_same_parameters(sglang_load(path, dtype), core, "sglang")
