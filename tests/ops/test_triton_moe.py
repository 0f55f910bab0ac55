"""Grouped routed-expert Triton kernels (moe_experts) against the reference: under the Triton interpreter by
default, compiled on a GPU with ``DEEPINFER_TEST_DEVICE=cuda``.

The kernels decode each FP4 weight to the value the reference's dequantiser gives and round where the reference
rounds (projections, SwiGLU, the weighted activation, the down projection in x's dtype), and the combine adds a
token's experts in the reference's order, so only the dot products' fp32 summation order differs: fp32 outputs
agree to ~1e-6 of the output scale; bf16 ones to a few bf16 roundings (a rounding of an intermediate can land
on the other side of a bf16 step). Covered: one and several blocks per expert, experts nobody chose, every
token on one expert, reduction tails, a SwiGLU clamp that binds, top-1 and top-6, an empty batch, the decline
of float experts and dispatch through the registry.
"""

import pytest
import torch

from .kernel_compare import assert_close, gen, on_test_device, poison_outputs, to_test_device  # noqa: F401

from deepinfer_plugins import ops  # noqa: E402
from deepinfer_plugins.ops.backends.triton_kernels import moe  # noqa: E402
from deepinfer_plugins.ops.backends.triton_kernels.moe import MoeConfig  # noqa: E402
from integration_tests.host_reads import ModuleCalls  # noqa: E402

kernels = on_test_device(moe)


def stacked_experts(g, n_experts: int, dim: int, inter: int) -> ops.ExpertWeights:
    """Checkpoint-like FP4 experts (quantised from Gaussian weights), stacked."""
    def stack(out_features, in_features):
        pairs = [ops.quantize_fp4_weight(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
                 for _ in range(n_experts)]
        return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, dim), stack(inter, dim), stack(dim, inter)
    return ops.ExpertWeights(w1, s1, w3, s3, w2, s2)


def routing(g, tokens: int, n_experts: int, top_k: int, only: int | None = None):
    """Router-like outputs: distinct experts per token (``only`` puts every token's first choice on that one)."""
    scores = torch.rand(tokens, n_experts, generator=g)
    if only is not None:
        scores[:, only] = 2.0
    ids = scores.argsort(dim=1, descending=True)[:, :top_k]
    return torch.rand(tokens, top_k, generator=g) * 2, ids


def assert_matches(got, want, dtype):
    size = want.abs().max().item() if want.numel() else 0.0
    if dtype == torch.float32:
        assert_close(got, want, atol=2e-6 * size, rtol=1e-4)
    else:
        assert_close(got, want, atol=4e-2 * size, rtol=4e-2, cos=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 6), (5, 6), (37, 3)])
@pytest.mark.parametrize("dim,inter", [(64, 96), (96, 32)])
def test_moe_experts_match_the_reference(dim, inter, tokens, top_k, dtype, gen):
    experts = stacked_experts(gen, 8, dim, inter)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    route_weights, ids = routing(gen, tokens, 8, top_k)
    got = kernels.moe_experts(x, route_weights, ids, experts, 10.0)
    assert got.dtype == torch.float32
    assert_matches(got, ops.moe_experts.reference(x, route_weights, ids, experts, 10.0), dtype)


@pytest.mark.parametrize("limit", [None, 0.05])
@pytest.mark.parametrize("block_m", [16, 32])
def test_many_blocks_on_one_expert_and_experts_left_idle(block_m, limit, gen):
    """Every token's first choice is expert 3 (several row blocks of one expert, the last partial), 16 experts
    for 40 tokens at top-2 leave some unchosen; a 0.05 clamp binds on most activations."""
    experts = stacked_experts(gen, 16, 64, 64)
    x = torch.randn(40, 64, generator=gen)
    route_weights, ids = routing(gen, 40, 16, 2, only=3)
    assert (ids[:, 0] == 3).all()
    got = kernels.moe_experts(x, route_weights, ids, experts, limit, config=MoeConfig(block_m=block_m, block_n=32,
                                                                                      block_k=32))
    assert_matches(got, ops.moe_experts.reference(x, route_weights, ids, experts, limit), torch.float32)


def test_the_block_table_covers_every_assignment_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])  # expert 3: 5 rows, experts 0, 1: 2, expert 2: 1
    order, expert, row0, row_end = moe.block_table(ids, n_experts=5, block_m=2)
    assert expert.tolist()[:6] == [0, 1, 2, 3, 3, 3] and (expert[6:] == -1).all()
    assert row0.tolist()[:6] == [0, 2, 4, 5, 7, 9] and row_end.tolist()[:6] == [2, 4, 5, 10, 10, 10]
    rows = torch.cat([order[a:min(a + 2, b)] for e, a, b in zip(expert, row0, row_end, strict=True) if e >= 0])
    assert sorted(rows.tolist()) == list(range(10))
    assert (ids.flatten()[order] == torch.tensor([0, 0, 1, 1, 2, 3, 3, 3, 3, 3])).all()


def test_an_empty_batch(gen):
    experts = stacked_experts(gen, 4, 32, 32)
    got = kernels.moe_experts(torch.zeros(0, 32), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), experts,
                              None)
    assert got.shape == (0, 32) and got.dtype == torch.float32


def test_float_experts_are_declined(gen):
    dense = ops.ExpertWeights(torch.randn(4, 32, 32), None, torch.randn(4, 32, 32), None, torch.randn(4, 32, 32),
                              None)
    assert moe.moe_experts(torch.randn(3, 32), torch.rand(3, 2), torch.tensor([[0, 1]] * 3), dense, None) \
        is NotImplemented


def test_mismatched_expert_shapes_raise(gen):
    experts = stacked_experts(gen, 4, 64, 32)
    with pytest.raises(ValueError, match="do not match"):
        moe.moe_experts(torch.randn(3, 32), torch.rand(3, 2), torch.tensor([[0, 1]] * 3), experts, None)


def test_the_registry_runs_the_kernel_when_triton_is_forced(gen, monkeypatch):
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "moe_experts=triton")
    experts = stacked_experts(gen, 8, 64, 32)
    x = torch.randn(6, 64, generator=gen)
    route_weights, ids = routing(gen, 6, 8, 2)
    assert ops.registry.select("moe_experts", "cpu").__name__ == "triton_moe_experts"
    assert_matches(ops.moe_experts(x, route_weights, ids, experts, None),
                   ops.moe_experts.reference(x, route_weights, ids, experts, None), torch.float32)


def test_the_launch_reads_nothing_on_the_host_and_does_not_grow_with_the_routing(gen):
    """On a GPU a host read waits for the router: the launcher sizes everything from shapes, and the torch work
    it queues is the same whether 1 token or 40 tokens on a few experts or many are routed. The launcher is called
    directly (the watch sees only its own module's calls), so its inputs are put on the test device here."""
    experts = to_test_device(stacked_experts(gen, 16, 64, 32))
    counts = []
    for tokens, only in ((1, None), (40, None), (40, 3)):
        x = to_test_device(torch.randn(tokens, 64, generator=gen))
        route_weights, ids = to_test_device(routing(gen, tokens, 16, 2, only=only))
        watch = ModuleCalls(moe)
        with watch:
            moe.moe_experts(x, route_weights, ids, experts, 10.0)
        assert watch.host_reads == []
        counts.append(watch.calls)
    assert len(set(counts)) == 1, counts
