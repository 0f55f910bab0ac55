"""benchmarks/kernels.py --check judges the routed experts per row, within two bf16 roundings of the reference
(``agrees_by_row``): a path that only sums its dot products in another order passes, and the bugs a grouped
kernel can have (a wrong expert, a dropped assignment, swapped nibbles, scales off by a binade) fail. Checked
here with the references on the CPU at a narrower width than V4.1's (same weight statistics), so that the unit
suite can afford it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.ops.moe import experts_one_by_one
from deepinfer_plugins.ops.quant import dequant_fp4_weight

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "kernels.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("kernel_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_benchmark()


@pytest.fixture(scope="module")
def routed(bench):
    """(case arguments, reference output, reference on float64 inputs) for 4 tokens on 6 of 8 experts."""
    experts = bench.v41_experts(8, "cpu", dim=512, inter=256)
    case = bench.moe_experts_case(4, experts, torch.Generator().manual_seed(0))
    assert case.rounding == torch.bfloat16
    args = case.args_list[0]
    return args, ops.moe_experts.reference(*args), ops.moe_experts.reference(*bench.in_float64(args))


def reordered_fp4_linear(rows, weight, scale, block=64):
    """linear_fp4 with fp32 accumulation over blocks of 64 input features, last block first, rounded once to the
    activations' dtype: a correct GEMM that sums in another order than torch's."""
    dense = dequant_fp4_weight(weight, scale, torch.float32)
    total = torch.zeros(rows.shape[0], dense.shape[0])
    for k0 in reversed(range(0, dense.shape[1], block)):
        total += rows[:, k0:k0 + block].float() @ dense[:, k0:k0 + block].t()
    return total.to(rows.dtype)


def test_a_path_that_sums_in_another_order_passes(bench, routed):
    (x, weights, ids, experts, limit), want, want64 = routed
    got = experts_one_by_one(x, weights, ids, experts, limit, reordered_fp4_linear)
    ok, verdict = bench.agrees_by_row(got, want, want64, torch.bfloat16)
    assert ok, verdict
    assert bench.row_errors(want, want64).max() < torch.finfo(torch.bfloat16).eps, "the reference is ~u from fp64"


def wrong_expert(x, weights, ids, experts, limit):
    ids = ids.clone()
    ids[0, 0] = next(e for e in range(experts.w1.shape[0]) if e not in ids[0].tolist())
    return ops.moe_experts.reference(x, weights, ids, experts, limit)


def dropped_assignment(x, weights, ids, experts, limit):
    weights = weights.clone()
    weights[1, 2] = 0.0
    return ops.moe_experts.reference(x, weights, ids, experts, limit)


def swapped_nibbles(x, weights, ids, experts, limit):
    w2 = experts.w2.view(torch.uint8).clone()
    e = int(ids[2, 1])
    w2[e] = (w2[e] >> 4) | (w2[e] << 4)
    return ops.moe_experts.reference(x, weights, ids, experts._replace(w2=w2.view(torch.int8)), limit)


def scales_off_by_a_binade(x, weights, ids, experts, limit):
    scale = experts.w1_scale.view(torch.uint8).clone()
    scale[int(ids[3, 4])] += 1
    return ops.moe_experts.reference(x, weights, ids, experts._replace(w1_scale=scale.view(torch.float8_e8m0fnu)),
                                     limit)


@pytest.mark.parametrize("bug", [wrong_expert, dropped_assignment, swapped_nibbles, scales_off_by_a_binade])
def test_a_real_bug_fails(bench, routed, bug):
    args, want, want64 = routed
    ok, verdict = bench.agrees_by_row(bug(*args), want, want64, torch.bfloat16)
    assert not ok, verdict
