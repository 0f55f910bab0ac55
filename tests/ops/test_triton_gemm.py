"""Fused dequantise + GEMM Triton kernels (linear_fp8, linear_fp4, linear_fp8_grouped) and the float-weight GEMM
with fp32 output (linear_to_fp32) against their references: under the Triton interpreter by default, compiled on a
GPU with ``DEEPINFER_TEST_DEVICE=cuda``.

Every decoded weight equals the reference dequantiser's value in x's dtype, so only the fp32 summation order
differs: fp32 outputs agree to ~1e-6 of the output scale, bf16 outputs to one bf16 rounding. Covered: tails of
every tile dimension, 1 / 5 / 64 rows, 3-D and empty inputs, K splits, fp32 scales, every E4M3 / E2M1 code
including negative zero, and E8M0 scales at both ends of their range.
"""

import pytest
import torch

from .kernel_compare import (assert_close, describe, gen, on_test_device,  # noqa: F401
                             poison_outputs)
from .gemm_support import dense_fp4, dense_fp8  # noqa: E402

from deepinfer_plugins import ops  # noqa: E402
from deepinfer_plugins.ops.backends import triton_backend  # noqa: E402
from deepinfer_plugins.ops.backends.triton_kernels import gemm  # noqa: E402
from deepinfer_plugins.ops.backends.triton_kernels.gemm import GemmConfig  # noqa: E402

gemm = on_test_device(gemm)

E4M3_NAN = (0x7F, 0xFF)  # the only E4M3 codes a checkpoint never holds


def random_weight(fmt: str, out_features: int, in_features: int, g, scale_bytes=(118, 130), magnitudes="any"):
    """Random weight codes and E8M0 scale bytes in a range. ``magnitudes``: "any" (every E4M3 code but NaN, every
    E2M1 code including both signed zeros), "below_two" (E4M3 exponent field <= 7, E2M1 codes <= 1.5) or
    "at_least_one" (E4M3 exponent field >= 8, E2M1 codes 1, 1.5, 4, 6)."""
    if fmt == "fp8":
        codes = torch.randint(0, 256, (out_features, in_features), generator=g, dtype=torch.uint8)
        codes = {"any": codes, "below_two": codes & 0xBF, "at_least_one": codes | 0x40}[magnitudes]
        codes = torch.where((codes == E4M3_NAN[0]) | (codes == E4M3_NAN[1]), codes - 1, codes)
        weight = codes.view(torch.float8_e4m3fn)
        scale_shape = (-(-out_features // 32), -(-in_features // 32))
    else:
        weight = torch.randint(-128, 128, (out_features, in_features // 2), generator=g, dtype=torch.int8)
        signs = weight & -0x78  # 0x88: the sign bit of both nibbles
        weight = {"any": weight, "below_two": weight & 0x33 | signs, "at_least_one": weight | 0x22}[magnitudes]
        scale_shape = (out_features, in_features // 32)
    scale = torch.randint(scale_bytes[0], scale_bytes[1] + 1, scale_shape, generator=g, dtype=torch.uint8)
    return weight, scale.view(torch.float8_e8m0fnu)


def launch(fmt: str, x, weight, scale, **kwargs):
    return getattr(gemm, f"linear_{fmt}")(x, weight, scale, **kwargs)


def reference(fmt: str, x, weight, scale):
    return getattr(ops, f"linear_{fmt}").reference(x, weight, scale)


def dense(fmt: str, weight, scale) -> torch.Tensor:
    return (dense_fp8 if fmt == "fp8" else dense_fp4)(weight, scale)


def assert_matches(got, want, dtype):
    """fp32: summation order only; bf16: plus one output rounding (2^-8 relative), checked with the cosine."""
    size = want.abs().max().item() if want.numel() else 0.0
    if dtype == torch.float32:
        assert_close(got, want, atol=1e-5 * size, rtol=1e-4)
    else:
        assert_close(got, want, atol=2e-2 * size, rtol=2e-2, cos=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("out_features,in_features", [(70, 96), (64, 160)])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_linear_matches_reference(fmt, out_features, in_features, rows, dtype, gen):
    weight, scale = random_weight(fmt, out_features, in_features, gen)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    got = launch(fmt, x, weight, scale)
    assert_matches(got, reference(fmt, x, weight, scale), dtype)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_linear_at_v41_expert_shape(fmt, gen):
    """5120 -> 2304 (shared / routed expert up projection) with checkpoint-like weights, two decode tokens."""
    quantize = ops.quantize_fp8_weight if fmt == "fp8" else ops.quantize_fp4_weight
    weight, scale = quantize(torch.randn(2304, 5120, generator=gen) * 0.02)
    x = torch.randn(2, 5120, generator=gen).to(torch.bfloat16)
    assert_matches(launch(fmt, x, weight, scale), reference(fmt, x, weight, scale), torch.bfloat16)


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, split_k=3), GemmConfig(16, 64, 64, split_k=2),
                                    GemmConfig(32, 32, 64, split_k=0), GemmConfig(16, 128, 32, split_k=1)])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_tile_configs_and_k_splits(fmt, config, gen):
    """Explicit configurations: several K tiles per split, a K tail inside the last split, more splits than the
    K range allows (clamped), and an N tile wider than the weight."""
    weight, scale = random_weight(fmt, 70, 160, gen)
    x = torch.randn(21, 160, generator=gen)
    assert_matches(launch(fmt, x, weight, scale, config=config), reference(fmt, x, weight, scale), torch.float32)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_leading_dims_empty_rows_and_fp32_scales(fmt, gen):
    weight, scale = random_weight(fmt, 40, 64, gen)
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    got = launch(fmt, x, weight, scale)
    assert got.shape == (2, 3, 40)
    assert_matches(got, reference(fmt, x, weight, scale), torch.bfloat16)
    x32 = x.float()
    assert_matches(launch(fmt, x32, weight, scale.float()), reference(fmt, x32, weight, scale.float()), torch.float32)
    for shape in ((0, 64), (2, 0, 64)):
        empty = launch(fmt, torch.randn(shape), weight, scale)
        assert empty.shape == shape[:-1] + (40,) and empty.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_extreme_scales(fmt, dtype, gen):
    """E8M0 bytes 1..3 (weights down to 2^-126) against large activations, and bytes 252..254 (weights up to
    1.875 * 2^127, no overflow) against small ones. Subnormal weights are left out: the CPU reference's bf16
    matmul flushes them to zero. Each output is held to the summation-order bound of its own products,
    sum |x| |w| (plus one bf16 rounding), since neighbouring outputs differ by up to 2^250."""
    for scale_bytes, magnitudes, x_scale in (((1, 3), "at_least_one", 2.0**100), ((252, 254), "below_two", 2.0**-100)):
        weight, scale = random_weight(fmt, 64, 96, gen, scale_bytes, magnitudes)
        x = (torch.randn(5, 96, generator=gen) * x_scale).to(dtype)
        got, want = launch(fmt, x, weight, scale), reference(fmt, x, weight, scale)
        assert got.isfinite().all() and want.isfinite().all()
        bound = x.double().abs() @ dense(fmt, weight, scale).abs().t()
        rounding = 2.0**-7 if dtype == torch.bfloat16 else 0.0
        excess = (got.double() - want.double()).abs() - (1e-5 * bound + rounding * want.double().abs())
        assert (excess <= 0).all(), describe(got, want)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_negative_zero_weights_give_zero_rows(fmt, gen):
    weight, scale = random_weight(fmt, 48, 64, gen)
    if fmt == "fp8":
        weight.view(torch.uint8)[:16] = 0x80  # E4M3 -0
    else:
        weight[:16] = -0x78  # 0x88: two E2M1 -0 nibbles
    x = torch.randn(3, 64, generator=gen)
    got = launch(fmt, x, weight, scale)
    assert (got[:, :16] == 0).all()
    assert_matches(got, reference(fmt, x, weight, scale), torch.float32)


# ---- linear_fp8_grouped (wo_a: a block-diagonal product of G row blocks of one FP8 weight) ----------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("groups,out_per_group,in_features", [(2, 64, 96), (3, 40, 64), (8, 128, 512)])
def test_grouped_linear_matches_reference(groups, out_per_group, in_features, rows, dtype, gen):
    """40 rows per group: scale blocks (32 weight rows) straddle the group boundaries; 8 x 128 over 512 is wo_a's
    shape at an eighth of V4.1's width."""
    weight, scale = random_weight("fp8", groups * out_per_group, in_features, gen)
    x = torch.randn(rows, groups, in_features, generator=gen).to(dtype)
    got = gemm.linear_fp8_grouped(x, weight, scale)
    assert got.shape == (rows, groups, out_per_group)
    assert_matches(got, ops.linear_fp8_grouped.reference(x, weight, scale), dtype)


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, split_k=3), GemmConfig(16, 64, 64, split_k=0),
                                    GemmConfig(16, 128, 32, split_k=1)])
def test_grouped_linear_tiles_and_k_splits(config, gen):
    """K splits (partials indexed by group), an N tile wider than a group's rows, several N tiles per group."""
    weight, scale = random_weight("fp8", 3 * 70, 160, gen)
    x = torch.randn(9, 3, 160, generator=gen)
    assert_matches(gemm.linear_fp8_grouped(x, weight, scale, config=config),
                   ops.linear_fp8_grouped.reference(x, weight, scale), torch.float32)


def test_grouped_linear_equals_one_linear_per_group(gen):
    """Each group's output is the plain linear of its input against its row block (bf16: the same kernel tiles)."""
    weight, scale = random_weight("fp8", 4 * 64, 96, gen)
    x = torch.randn(6, 4, 96, generator=gen).to(torch.bfloat16)
    got = gemm.linear_fp8_grouped(x, weight, scale, config=GemmConfig(16, 64, 32, split_k=1))
    for g in range(4):
        block = gemm.linear_fp8(x[:, g], weight[64 * g: 64 * (g + 1)], scale[2 * g: 2 * (g + 1)],
                                config=GemmConfig(16, 64, 32, split_k=1))
        assert torch.equal(got[:, g], block)


def test_grouped_linear_rejects_shapes_like_the_reference(gen):
    weight, scale = random_weight("fp8", 96, 64, gen)
    for x in (torch.randn(2, 5, 64), torch.randn(2, 64), torch.randn(2, 0, 64)):
        with pytest.raises(ValueError, match="grouped x"):
            gemm.linear_fp8_grouped(x, weight, scale)
        with pytest.raises(ValueError, match="grouped x"):
            ops.linear_fp8_grouped.reference(x, weight, scale)
    empty = gemm.linear_fp8_grouped(torch.randn(0, 3, 64), weight, scale)
    assert empty.shape == (0, 3, 32)


# ---- linear_to_fp32 (the router and the LM head: float weights as stored, fp32 out) ------------------------------
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("out_features,in_features", [(384, 160), (1000, 96)])
def test_linear_to_fp32_matches_reference(out_features, in_features, rows, x_dtype, w_dtype, gen):
    """bf16 products are exact in fp32, so every pairing differs from the reference in summation order only."""
    weight = torch.randn(out_features, in_features, generator=gen).to(w_dtype)
    x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
    got = gemm.linear_to_fp32(x, weight)
    assert got.dtype == torch.float32
    assert_matches(got, ops.linear_to_fp32.reference(x, weight), torch.float32)


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, split_k=3), GemmConfig(16, 128, 64, split_k=0)])
def test_linear_to_fp32_leading_dims_splits_and_bad_dtypes(config, gen):
    """The drafter's [R, B, d] rows; K splits; FP8 codes or integer inputs are refused, not misread."""
    weight = torch.randn(70, 160, generator=gen).bfloat16()
    x = torch.randn(2, 3, 160, generator=gen).bfloat16()
    got = gemm.linear_to_fp32(x, weight, config=config)
    assert got.shape == (2, 3, 70)
    assert_matches(got, ops.linear_to_fp32.reference(x, weight), torch.float32)
    assert gemm.linear_to_fp32(torch.randn(0, 160).bfloat16(), weight).shape == (0, 70)
    for bad_x, bad_w in ((x, weight.to(torch.float8_e4m3fn)), (x.long(), weight)):
        with pytest.raises(ValueError, match="float x and W"):
            gemm.linear_to_fp32(bad_x, bad_w)


def test_triton_backend_maps_the_gemm_ops_to_these_launchers():
    for name in ("linear_fp8", "linear_fp4", "linear_fp8_grouped", "linear_to_fp32"):
        assert triton_backend.OPS[name] == "gemm" and callable(getattr(gemm, name))
