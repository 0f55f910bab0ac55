"""One loader: the core's ``from_pretrained`` and the engine adapters' ``load_weights`` give the same parameters
(names, dtypes, values) for the same checkpoint, whatever the activation dtype. Float tensors keep the dtype they
are stored in, so a checkpoint whose float tensors are stored fp16 loads as fp16 (not rounded to bf16).

The SGLang adapter's loading needs no SGLang; the vLLM adapter's runs in integration_tests/vllm/
test_weight_loading.py, which reuses these helpers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.loader import INDEX_FILE

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fp16_copy(source: Path, target: Path) -> Path:
    """``source`` with every bf16 tensor stored fp16 instead (a float checkpoint converted for fp16 serving)."""
    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        tensors = {n: t.half() if t.dtype == torch.bfloat16 else t for n, t in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    return target


def checkpoint_weights(path: Path):
    """(name, tensor) of every stored tensor, as an engine's weight iterator yields them."""
    for file in sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def sglang_load(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The SGLang adapter's core model, built and loaded as SGLang's loader drives it."""
    from deepinfer_plugins.sglang.model import DeepInferDeepseekV41ForCausalLM

    class Config:
        _name_or_path = str(path)

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # SGLang builds the model under the served dtype
    try:
        adapter = DeepInferDeepseekV41ForCausalLM(Config())
    finally:
        torch.set_default_dtype(default)
    adapter.load_weights(checkpoint_weights(path))
    return adapter.model


def assert_same_parameters(ours: torch.nn.Module, ref: torch.nn.Module, label: str) -> None:
    ours, ref = ours.state_dict(), ref.state_dict()
    assert ours.keys() == ref.keys(), label
    for name in ref:
        assert ours[name].dtype == ref[name].dtype, (label, name, ours[name].dtype, ref[name].dtype)
        assert torch.equal(ours[name].view(torch.uint8), ref[name].view(torch.uint8)), (label, name)


def assert_stored_dtypes(model: torch.nn.Module, path: Path, label: str) -> None:
    state = model.state_dict()
    for name, tensor in checkpoint_weights(path):
        if name in state:
            assert state[name].dtype == tensor.dtype, (label, name, state[name].dtype, tensor.dtype)


@pytest.fixture(scope="module")
def fp16_dir(tiny256_dir, tmp_path_factory):
    return fp16_copy(tiny256_dir, tmp_path_factory.mktemp("fp16") / "ckpt")


@pytest.mark.parametrize("stored", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_core_and_sglang_load_the_same_parameters(stored, dtype, tiny256_dir, fp16_dir):
    path = tiny256_dir if stored == "bf16" else fp16_dir
    core = DeepseekV41ForCausalLM.from_pretrained(path, dtype=dtype, with_drafter=False)
    assert_stored_dtypes(core, path, "core")
    assert_same_parameters(sglang_load(path, dtype), core, "sglang")


def test_fp16_checkpoint_is_not_rounded(fp16_dir):
    core = DeepseekV41ForCausalLM.from_pretrained(fp16_dir, dtype=torch.float16, with_drafter=False)
    assert core.embed.weight.dtype == torch.float16 and core.head.weight.dtype == torch.float16
