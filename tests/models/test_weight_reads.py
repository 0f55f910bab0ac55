"""A forward reads every weight as stored: model code makes no dequantised or up-cast copy of a weight matrix,
and calls no op that dequantises a whole weight (the GEMM ops take the stored tensors). A copy made once after
loading (the ratio-1 compressor's wkv in the activation dtype, ``finish_loading``) is not a per-step copy.

On a GPU such a copy is a write and a second read of (a multiple of) the weight's bytes on every step; decode is
weight-bandwidth-bound, so that is most of a step's time (the LM head's fp32 copy alone was 2.6 GB written and
read per step at V4.1 size). The op kernels read the stored bytes instead, so the model must hand them the stored
tensors. Checked on the tiny model in bf16 (the serving dtype, so that only conversions a GPU would make count)
with the reference backend, for a prefill and a decode step through Engram and compressed layers.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import deepinfer_plugins
from deepinfer_plugins import ops
from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM

from ..conftest import prompt

MODEL_CODE = Path(deepinfer_plugins.__file__).parent / "models"
OPAQUE_OPS = Path(deepinfer_plugins.__file__).parent / "ops" / "opaque.py"  # custom ops model code calls
CONVERSIONS = {"float", "to", "bfloat16", "half", "double", "type"}
WEIGHT_DEQUANTISERS = {"dequant_fp8_weight", "dequant_fp4_weight"}


class WeightCopies(TorchFunctionMode):
    """Dtype-changing conversions of weight matrices by model code: parameters larger than one [streams, d] block
    (the Engram gate's two vectors per stream, which are multiplied in fp32, are that size)."""

    def __init__(self, largest_allowed: int):
        super().__init__()
        self.largest_allowed, self.sites = largest_allowed, Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in CONVERSIONS and args and isinstance(args[0], nn.Parameter) \
                and args[0].numel() > self.largest_allowed and isinstance(result, torch.Tensor) \
                and result.dtype != args[0].dtype:
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(str(MODEL_CODE)):
                self.sites[(Path(frame.f_code.co_filename).name, frame.f_lineno, tuple(args[0].shape))] += 1
        return result


def test_forward_reads_weights_as_stored(tiny256_dir, monkeypatch):
    monkeypatch.delenv("DEEPINFER_OP_BACKEND", raising=False)
    model = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, dtype=torch.bfloat16)
    dispatched = Counter()
    candidates = ops.registry.candidates

    def counting(name, device_type):  # ops the model calls itself, directly or as custom ops (a reference's own
        caller = sys._getframe(2).f_code.co_filename  # calls do not count)
        if caller.startswith(str(MODEL_CODE)) or caller == str(OPAQUE_OPS):
            dispatched[name] += 1
        return candidates(name, device_type)

    monkeypatch.setattr(ops.registry, "candidates", counting)
    args = model.args
    watch = WeightCopies(args.hc_mult * args.hidden_size)
    ids = prompt(12, 4)
    cache = model.new_cache()
    with torch.inference_mode(), watch:
        model(ids[:11], cache)
        model(ids[11:], cache)
    assert not watch.sites, f"weight copies made by model code (file, line, shape): {dict(watch.sites)}"
    assert not WEIGHT_DEQUANTISERS & set(dispatched), {name: dispatched[name] for name in WEIGHT_DEQUANTISERS}
    assert {"linear_fp8", "linear_fp8_grouped", "linear_to_fp32", "moe_experts", "engram_gather",
            "engram_gate", "csa2_compress"} <= set(dispatched), sorted(dispatched)


def test_compressor_rounded_once_gives_the_per_call_logits(tiny256_dir):
    model = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, dtype=torch.bfloat16)
    compressors = [layer.attn.compressor for layer in model.layers if layer.attn.is_kv_source]
    assert {c.ratio for c in compressors} == {1, 2}
    for compressor in compressors:
        kept = getattr(compressor.wkv, "dense", None)
        assert (kept is not None and kept.dtype == torch.bfloat16) == (compressor.ratio == 1)
    ids = prompt(12, 5)
    with torch.inference_mode():
        rounded_once = model(ids, model.new_cache())
        for compressor in compressors:
            compressor.wkv.__dict__.pop("dense", None)
        per_call = model(ids, model.new_cache())
    assert torch.equal(rounded_once, per_call)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_copies_add_no_parameters(tiny256_dir, dtype):
    """A weight already in the kept dtype is its own copy: keeping it would register a second parameter."""
    model = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, dtype=dtype)
    names = set(model.state_dict())
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model.finish_loading(keep_dense=True)
    assert set(model.state_dict()) == names
    assert {name for name, _ in model.named_parameters(remove_duplicate=False)} == parameters
