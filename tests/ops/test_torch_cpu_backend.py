"""``moe_experts`` through PyTorch's grouped GEMM (the ``torch`` CPU backend) against the reference.

On the CPU ``torch._grouped_mm`` multiplies each expert's rows with the GEMM the reference calls, and the
backend rounds and adds where the reference does, so the outputs are equal bit for bit, not close. Covered: every
float dtype, one to many tokens, top-1 to top-6, experts nobody chose, every token on one expert, a clamp that
binds, an empty batch, the declines (FP4 stacks, mixed dtypes, out-of-range ids) and selection by the registry.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from deepinfer_plugins import ops
from deepinfer_plugins.ops.backends import torch_cpu_backend
from deepinfer_plugins.ops.backends.torch_cpu_backend import grouped_moe_experts
from deepinfer_plugins.ops.registry import OpRegistry

N_EXPERTS = 8


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def dense_experts(g, dim: int, inter: int, dtype: torch.dtype) -> ops.ExpertWeights:
    def stack(out_features, in_features):
        return (torch.randn(N_EXPERTS, out_features, in_features, generator=g) / in_features ** 0.5).to(dtype)

    return ops.ExpertWeights(stack(inter, dim), None, stack(inter, dim), None, stack(dim, inter), None)


def routing(g, tokens: int, top_k: int, only: int | None = None):
    scores = torch.rand(tokens, N_EXPERTS, generator=g)
    if only is not None:
        scores[:, only] = 2.0
    return torch.rand(tokens, top_k, generator=g) * 2, scores.argsort(dim=1, descending=True)[:, :top_k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 6), (5, 2), (37, 3), (130, 6)])
@pytest.mark.parametrize("limit", [None, 0.3])
def test_equals_the_reference_bit_for_bit(dtype, tokens, top_k, limit, gen):
    experts = dense_experts(gen, 64, 96, dtype)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    route_weights, ids = routing(gen, tokens, top_k)
    want = ops.moe_experts.reference(x, route_weights, ids, experts, limit)
    got = grouped_moe_experts(x, route_weights, ids, experts, limit)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_idle_experts_one_busy_expert_and_an_empty_batch(gen):
    experts = dense_experts(gen, 32, 64, torch.float32)
    x = torch.randn(9, 32, generator=gen)
    route_weights, ids = routing(gen, 9, 1, only=5)  # every token on expert 5, the other seven idle
    assert torch.equal(grouped_moe_experts(x, route_weights, ids, experts, None),
                       ops.moe_experts.reference(x, route_weights, ids, experts, None))
    empty = grouped_moe_experts(x[:0], route_weights[:0], ids[:0], experts, None)
    assert empty.shape == (0, 32) and empty.dtype == torch.float32


def test_declines_what_the_reference_must_take(gen):
    experts = dense_experts(gen, 32, 64, torch.float32)
    x = torch.randn(3, 32, generator=gen)
    route_weights, ids = routing(gen, 3, 2)
    fp4 = ops.ExpertWeights(*(t for w in (experts.w1, experts.w3, experts.w2) for t in ops.quantize_fp4_weight(
        w.flatten(0, 1))))
    assert grouped_moe_experts(x, route_weights, ids, fp4, None) is NotImplemented
    assert grouped_moe_experts(x.bfloat16(), route_weights, ids, experts, None) is NotImplemented
    out_of_range = ids.clone()
    out_of_range[1, 0] = N_EXPERTS
    assert grouped_moe_experts(x, route_weights, out_of_range, experts, None) is NotImplemented
    with pytest.raises(IndexError):  # through the registry the reference names it
        ops.moe_experts(x, route_weights, out_of_range, experts, None)


def test_the_call_count_does_not_grow_with_the_experts_a_step_touches(gen):
    experts = dense_experts(gen, 32, 64, torch.float32)
    x = torch.randn(8, 32, generator=gen)

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def calls(ids):
        Count.calls = 0
        with Count():
            grouped_moe_experts(x, torch.ones(8, 2), ids, experts, None)
        return Count.calls

    assert calls(torch.tensor([[0, 1]] * 8)) == calls(torch.arange(16).view(8, 2) % N_EXPERTS)


def test_the_registry_runs_it_first_on_the_cpu_for_dense_stacks(gen, monkeypatch):
    monkeypatch.delenv("DEEPINFER_OP_BACKEND", raising=False)
    registry = OpRegistry()
    registry.reference("moe_experts")(ops.moe_experts.reference)
    torch_cpu_backend.deepinfer_register_ops(registry)
    assert registry.select("moe_experts", "cpu") is grouped_moe_experts
    assert registry.select("moe_experts", "cuda") is not grouped_moe_experts
    assert "torch" in ops.registry.backends_of("moe_experts")  # the installed entry point
