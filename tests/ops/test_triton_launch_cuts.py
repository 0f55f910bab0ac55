"""Every Triton kernel gives the same bits when its launch is cut into runs of its first grid axis, as it is under
triton-ascend for a grid of more programs than an NPU launch takes (``common.launch_chunks``; each kernel adds its
``first_program`` argument to its axis-0 program id).

Each case runs a launcher once as is, then again with every launch cut into launches of one first-axis index
each. Outputs start poisoned, so a program that a cut skips or misplaces shows. Together the cases cut every
kernel. (Where the cuts fall is ``launch_chunks``'s business, tested in test_triton_model.py.)
"""

import math
from functools import partial

import pytest
import torch

from .kernel_compare import TEST_DEVICE, assert_bits_equal, gen, poison_outputs, triton, triton_kernels  # noqa: F401

from deepinfer_plugins import ops  # noqa: E402
from deepinfer_plugins.ops.backends.triton_kernels import (attention, common, gemm, indexer, mhc, misc,  # noqa: E402
                                                           moe, quant)

from .test_triton_moe import stacked_experts  # noqa: E402

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="interpreter only: the cuts do not depend on the device")


def _cases(g):
    """name -> one launcher with its inputs, at shapes that give its kernels several first-axis programs under the
    interpreter's tilings."""
    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    bf16 = torch.bfloat16
    w8, s8 = ops.quantize_fp8_weight(randn(64, 96))
    w4, s4 = ops.quantize_fp4_weight(randn(64, 96))
    table, table_scale = ops.quantize_fp8_rows(randn(50, 64))
    records = ops.pack_cache_records(randn(40, 64), "fp8_window")
    window = ops.pack_cache_records(randn(30, 64), "fp8_window")
    window_slots = torch.randint(-1, 30, (5, 9), generator=g)
    compressed = ops.pack_cache_records(randn(20, 64), "nvfp4")
    compressed_slots = torch.randint(-1, 20, (5, 7), generator=g)
    keys = ops.pack_cache_records(randn(70, 128), "mxfp4")
    key_slots = torch.randint(-1, 70, (3, 40), generator=g)
    scores = randn(4, 70)
    experts = stacked_experts(g, 3, 64, 96)
    streams = randn(5, 4, 96)
    split_config = attention.AttentionConfig(head_block=16, key_block=16, splits=3)
    return {
        "fp8_fake_quant": partial(quant.fp8_fake_quant, randn(1100, 32)),
        "cache_gather": partial(quant.cache_gather, records, torch.randint(-1, 40, (300, 2), generator=g), "fp8_window",
                                64, torch.float32),
        "engram_gather": partial(quant.engram_gather, table, table_scale, torch.randint(0, 50, (300, 2), generator=g),
                                 torch.float32),
        "sparse_attention split": partial(attention.sparse_attention, randn(3, 40, 64), randn(50, 64),
                                          torch.randint(-1, 50, (3, 75), generator=g), randn(40), 0.125,
                                          config=split_config),
        "sparse_attention_records": partial(attention.sparse_attention_records, randn(5, 20, 64), window, window_slots,
                                            compressed, compressed_slots, randn(20), 0.125),
        "linear_fp8 split-K": partial(gemm.linear_fp8, randn(70, 96), w8, s8,
                                      config=gemm.GemmConfig(16, 16, 32, 4, 2, split_k=3)),
        "linear_fp4": partial(gemm.linear_fp4, randn(70, 96), w4, s4, config=gemm.GemmConfig(16, 16, 32, 4, 2)),
        "indexer_scores_records": partial(indexer.indexer_scores_records, randn(6, 32, 128), randn(6, 32), keys,
                                          key_slots, [1, 3, 2]),
        "topk_indices": partial(indexer.topk_indices, scores, 5),
        "candidate_mask": partial(indexer.candidate_mask, scores, torch.tensor([70, 33, 64, 1]), 8, 3),
        "sinkhorn": partial(mhc.sinkhorn, randn(5, 4, 4), 20, 1e-6),
        "hc_coefficients": partial(mhc.hc_coefficients, streams, randn(24, 4 * 96), randn(24), randn(3), 20, 1e-6, 1e-6,
                                   splits=2),
        "hc_collapse": partial(mhc.hc_collapse, streams, randn(5, 4)),
        "hc_collapse_norm": partial(mhc.hc_collapse_norm, streams, randn(5, 4), randn(96), 1e-6),
        "hc_expand": partial(mhc.hc_expand, streams, randn(5, 96), randn(5, 4), randn(5, 4, 4)),
        "rms_norm": partial(misc.rms_norm, randn(5, 80), randn(80), 1e-6),
        "rope": partial(misc.rope, randn(5, 3, 80), torch.arange(5), torch.rand(8, generator=g)),
        "swiglu": partial(misc.swiglu, randn(3, 50000), randn(3, 50000), 10.0),
        "sqrtsoftplus_route": partial(misc.sqrtsoftplus_route, randn(9, 64), randn(64), 6, 1.5),
        "engram_hash": partial(misc.engram_hash, torch.randint(0, 99092, (2100, 4), generator=g),
                               torch.randint(1, 2 ** 40, (4,), generator=g),
                               torch.randint(2 ** 20, 2 ** 24, (3, 8), generator=g),
                               torch.randint(0, 2 ** 30, (3, 8), generator=g)),
        "engram_gate": partial(misc.engram_gate, randn(3, 4, 64, dtype=bf16), randn(3, 4, 64), randn(3, 64),
                               randn(4, 64), 1e-6),
        "csa2_compress": partial(misc.csa2_compress, randn(8, 48), randn(8, 48), 2, randn(48), 1e-6, torch.float32),
        "moe_experts": partial(moe.moe_experts, randn(7, 64), torch.rand(7, 2, generator=g),
                               torch.randint(0, 3, (7, 2), generator=g), experts, 10.0,
                               config=moe.MoeConfig(16, 32, 32)),
    }


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def _one_index_per_launch(*dims):
    return [(first, (1, *dims[1:])) for first in range(dims[0])]


def test_every_kernel_gives_the_same_bits_with_its_launches_cut(gen, monkeypatch):
    launches = []
    jit_type = type(misc._rms_norm_kernel)
    launch = jit_type.__getitem__

    def recording(kernel, grid):
        launches.append((kernel.fn.__name__, grid))
        return launch(kernel, grid)

    monkeypatch.setattr(jit_type, "__getitem__", recording)
    whole_launches = common.launch_chunks
    cut = set()
    for name, call in _cases(gen).items():
        monkeypatch.setattr(common, "launch_chunks", whole_launches)
        launches.clear()
        want = _outputs(call())
        whole = list(launches)
        monkeypatch.setattr(common, "launch_chunks", _one_index_per_launch)
        launches.clear()
        got = _outputs(call())
        for g, w in zip(got, want, strict=True):
            assert_bits_equal(g, w)
        for kernel in {k for k, grid in whole if grid[0] > 1}:
            assert sum(k == kernel for k, _ in launches) > sum(k == kernel for k, _ in whole), f"{name}: {kernel}"
            cut.add(kernel)
    kernels = set(triton_kernels())
    assert len(kernels) >= 27 and kernels == cut
