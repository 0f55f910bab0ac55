"""linear_fp8 / linear_fp4: references are x times the weight decoded from its codes and scales; DeepGEMM /
FlashInfer wrappers keep the documented call contract (checked against fake modules that do the documented math
on CPU). Expected values come from gemm_support's decoders, written from the formats' definitions."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.models.deepseek_v41.linear import Linear
from deepinfer_plugins.ops.backends import deepgemm_backend, flashinfer_backend
from deepinfer_plugins.ops.quant import quantize_fp4_weight, quantize_fp8_weight
from deepinfer_plugins.ops.registry import DEVICE_PREFERENCE, ENTRY_POINT_GROUP, OpRegistry
from integration_tests.host_reads import ModuleCalls

from .gemm_support import (ACTIVATION_FP8_REL_TOL, MOE_FP8_REL_TOL, OUTPUT_ROUNDING_REL_TOL, dense_fp4, dense_fp8,
                           e2m1_values, e4m3_activation, e4m3_values, moe_with_e4m3_activations, rel_err, routing,
                           stacked_fp4_experts)


def _fp8_weight(out_features, in_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    return quantize_fp8_weight(w)


def _fp4_weight(out_features, in_features, seed=1):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp4_weight(torch.randn(out_features, in_features, generator=g))


def _x(tokens, in_features, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*tokens, in_features, generator=g).to(dtype)


def _e8m0_decode(byte):
    return torch.pow(2.0, byte.to(torch.float32) - 127.0)


# --- references ---------------------------------------------------------------------------------------------

def test_format_decoders_give_hand_computed_values():
    """The decoders the expected values below are built from, on codes worked out by hand."""
    e4m3 = torch.tensor([0x00, 0x80, 0x01, 0x07, 0x08, 0x38, 0x3C, 0xC4, 0x7E, 0xFE], dtype=torch.uint8)
    want = [0.0, -0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 1.5, -3.0, 448.0, -448.0]
    assert e4m3_values(e4m3).tolist() == want
    assert e4m3_values(torch.tensor([0x7F, 0xFF], dtype=torch.uint8)).isnan().all()
    assert torch.equal(e2m1_values(torch.tensor([[0x2F, 0x0B]], dtype=torch.uint8).view(torch.int8)),
                       torch.tensor([[-6.0, 1.0, -1.5, 0.0]], dtype=torch.float64))  # even column = low nibble
    scale = torch.tensor([[126, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^-1, 2^2
    codes = torch.full((2, 64), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.0
    assert dense_fp8(codes, scale).unique(dim=0).tolist() == [[0.5] * 32 + [4.0] * 32]
    # amax 1.0 -> 1/448 -> scale 2^-8; 76 * 2^-8 lies halfway between E4M3 72 and 80 and goes to the even 80.
    x = torch.tensor([1.0, 76 * 2.0**-8, 0.3, -0.3] + [0.0] * 28)
    assert e4m3_activation(x)[:4].tolist() == [1.0, 80 * 2.0**-8, 80 * 2.0**-8, -80 * 2.0**-8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (80, 40), (33, 70)])
def test_linear_fp8_reference_is_x_times_the_decoded_weight(dtype, shape):
    """The decoded weight is exact in x's dtype, so the CPU path is bit for bit x @ W^T in that dtype."""
    weight, scale = _fp8_weight(*shape)
    x = _x((3, 5), shape[1], dtype)
    dense = dense_fp8(weight, scale)
    assert torch.equal(dense.to(dtype).double(), dense)
    y = ops.linear_fp8(x, weight, scale)
    assert torch.equal(y, x @ dense.to(dtype).t())
    assert rel_err(y, x.double() @ dense.t()) < OUTPUT_ROUNDING_REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (48, 32)])
def test_linear_fp4_reference_is_x_times_the_decoded_weight(dtype, shape):
    weight, scale = _fp4_weight(*shape)
    x = _x((7,), shape[1], dtype)
    dense = dense_fp4(weight, scale)
    assert torch.equal(dense.to(dtype).double(), dense)
    y = ops.linear_fp4(x, weight, scale)
    assert torch.equal(y, x @ dense.to(dtype).t())
    assert rel_err(y, x.double() @ dense.t()) < OUTPUT_ROUNDING_REL_TOL[dtype]


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_module_unchanged_with_and_without_keep_dense(fmt, dtype):
    layer = Linear(64, 48, fmt)
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(48, 64, generator=g)
    if fmt == "fp8":
        layer.weight.data, layer.scale.data = quantize_fp8_weight(dense)
        dense = dense_fp8(layer.weight, layer.scale)
    elif fmt == "fp4":
        layer.weight.data, layer.scale.data = quantize_fp4_weight(dense)
        dense = dense_fp4(layer.weight, layer.scale)
    else:
        layer.weight.data = dense
    x = _x((2, 3), 64, dtype)
    want = x @ dense.to(dtype).t()
    assert torch.equal(layer(x), want)
    layer.keep_dense(dtype)
    assert torch.equal(layer(x), want)


# --- registry wiring ----------------------------------------------------------------------------------------

def test_gemm_backends_are_entry_points_and_preferred_on_cuda():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert {"deepgemm", "flashinfer"} <= names
    assert DEVICE_PREFERENCE["cuda"][:2] == ("deepgemm", "flashinfer")
    assert ops.registry.select("linear_fp8", "cpu") is ops.linear_fp8.reference
    assert "reference" in ops.registry.backends_of("linear_fp4")


def test_select_prefers_deepgemm_then_flashinfer_on_cuda(monkeypatch):
    ops.registry.discover()
    backends = ops.registry.ops["linear_fp8"].backends
    deepgemm_fn, flashinfer_fn, cuda_fn = object(), object(), object()
    monkeypatch.setitem(backends, "cuda", cuda_fn)
    monkeypatch.setitem(backends, "flashinfer", flashinfer_fn)
    assert ops.registry.select("linear_fp8", "cuda") is flashinfer_fn
    monkeypatch.setitem(backends, "deepgemm", deepgemm_fn)
    assert ops.registry.select("linear_fp8", "cuda") is deepgemm_fn
    assert ops.registry.select("linear_fp8", "cpu") is ops.linear_fp8.reference
    assert ops.registry.backends_of("linear_fp8")[0] == "reference"


class _RecordingRegistry(OpRegistry):
    """The real registry's checks (``cuda_major``), with registrations and refusals recorded instead of applied."""

    def __init__(self):
        super().__init__()
        self.registered, self.unavailable = {}, {}

    def register_backend(self, op_name, backend, fn, automatic=True):
        self.registered[(op_name, backend)] = fn

    def mark_unavailable(self, backend, reason):
        self.unavailable[backend] = reason


def _pretend_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


@pytest.mark.parametrize("capability, ops_registered", [
    ((9, 0), {"linear_fp8", "linear_fp8_grouped"}),
    ((10, 0), {"linear_fp8", "linear_fp4", "moe_experts", "linear_fp8_grouped"}),
    ((8, 0), set())])
@pytest.mark.parametrize("has_einsum", [True, False])
def test_deepgemm_registers_per_architecture(monkeypatch, capability, ops_registered, has_einsum):
    fake = FakeDeepGemm(capability[0])
    if not has_einsum:  # a DeepGEMM from before fp8_einsum
        monkeypatch.delattr(FakeDeepGemm, "fp8_einsum")
        ops_registered = ops_registered - {"linear_fp8_grouped"}
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    _pretend_cuda(monkeypatch, capability)
    recorder = _RecordingRegistry()
    deepgemm_backend.deepinfer_register_ops(recorder)
    assert {name for name, _ in recorder.registered} == ops_registered
    assert bool(recorder.unavailable) == (not ops_registered)


@pytest.mark.parametrize("capability, registered", [((10, 0), True), ((9, 0), False)])
def test_flashinfer_registers_on_sm100_only(monkeypatch, capability, registered):
    _install_fake_flashinfer(monkeypatch)
    _pretend_cuda(monkeypatch, capability)
    recorder = _RecordingRegistry()
    flashinfer_backend.deepinfer_register_ops(recorder)
    assert bool(recorder.registered) == registered
    if registered:
        assert set(recorder.registered) == {("linear_fp8", "flashinfer"), ("linear_fp4", "flashinfer")}


def test_backends_stay_unregistered_without_their_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # makes ``import deep_gemm`` raise ImportError
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.gemm", None)
    _pretend_cuda(monkeypatch, (10, 0))
    recorder = _RecordingRegistry()
    deepgemm_backend.deepinfer_register_ops(recorder)
    flashinfer_backend.deepinfer_register_ops(recorder)
    assert not recorder.registered
    assert set(recorder.unavailable) == {"deepgemm", "flashinfer"}


# --- fake DeepGEMM ------------------------------------------------------------------------------------------

class FakeDeepGemm(types.ModuleType):
    """``fp8_gemm_nt((a, sfa), (b, sfb), d, recipe=...)`` as DeepGEMM documents it, in float64 on CPU."""

    def __init__(self, arch):
        super().__init__("deep_gemm")
        self.arch, self.calls, self.transforms, self.grouped_calls = arch, [], [], 0

    def fp8_gemm_nt(self, a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                    disable_ue8m0_cast=False, alpha=None):
        (a_data, sfa), (b_data, sfb) = a, b
        assert c is None and recipe is not None and recipe_a is None and recipe_b is None
        gran_m, gran_n, gran_k = recipe
        assert gran_m == 1
        if self.arch == 9:
            assert recipe == (1, 128, 128), "SM90 takes FP32 scales at granularity 128 only"
        else:
            assert gran_k in (32, 128)
        m, k = a_data.shape
        assert a_data.dtype == torch.float8_e4m3fn and a_data.stride(-1) == 1  # K-major
        if b_data.dtype == torch.int8:
            assert self.arch == 10, "packed FP4 operands are SM100 only"
            n, k_b = b_data.shape[0], b_data.shape[1] * 2
            b_values = e2m1_values(b_data)
        else:
            assert b_data.dtype == torch.float8_e4m3fn
            n, k_b = b_data.shape
            b_values = b_data.double()
        assert b_data.stride(-1) == 1 and k_b == k
        for sf, rows, gran_rows in ((sfa, m, gran_m), (sfb, n, gran_n)):
            assert sf.dtype == torch.float32
            assert sf.shape == (-(-rows // gran_rows), -(-k // gran_k))
            mantissa, _ = torch.frexp(sf)
            assert torch.all(mantissa == 0.5), "UE8M0 needs power-of-two scales"
        assert d.shape == (m, n) and d.dtype in (torch.bfloat16, torch.float32) and d.stride(-1) == 1
        a_deq = a_data.double() * _expand(sfa, gran_m, gran_k, m, k)
        b_deq = b_values * _expand(sfb, gran_n, gran_k, n, k)
        self.calls.append({"recipe": recipe, "a": a_deq, "b": b_deq, "b_data": b_data, "sfb": sfb})
        d.copy_((a_deq @ b_deq.t()).to(d.dtype))

    def fp8_einsum(self, expr, a, b, d, c=None, recipe=(1, 128, 128)):
        """``bhr,hdr->bhd``: per group h, d[:, h] = a[:, h] @ b[h]^T, a [B, H, R] and b [H, D, R] K-major E4M3 with
        FP32 power-of-two scales [B, H, R / gran_k] and [H, ceil(D / gran_n), R / gran_k]."""
        (a_data, sfa), (b_data, sfb) = a, b
        assert expr == "bhr,hdr->bhd" and c is None
        gran_m, gran_n, gran_k = recipe
        assert gran_m == 1 and (recipe == (1, 128, 128) if self.arch == 9 else gran_k in (32, 128))
        batch, heads, k = a_data.shape
        heads_b, n, k_b = b_data.shape
        assert heads_b == heads and k_b == k
        assert a_data.dtype == b_data.dtype == torch.float8_e4m3fn and a_data.stride(-1) == b_data.stride(-1) == 1
        for sf, shape in ((sfa, (batch, heads, -(-k // gran_k))), (sfb, (heads, -(-n // gran_n), -(-k // gran_k)))):
            assert sf.dtype == torch.float32 and sf.shape == shape
            mantissa, _ = torch.frexp(sf)
            assert torch.all(mantissa == 0.5), "UE8M0 needs power-of-two scales"
        assert d.shape == (batch, heads, n) and d.dtype in (torch.bfloat16, torch.float32) and d.stride(-1) == 1
        a_deq = a_data.double() * sfa.double().repeat_interleave(gran_k, -1)[..., :k]
        b_deq = b_data.double() * sfb.double().repeat_interleave(gran_n, 1).repeat_interleave(gran_k, 2)[:, :n, :k]
        self.calls.append({"recipe": recipe, "a": a_deq, "b": b_deq, "b_data": b_data, "sfb": sfb})
        d.copy_(torch.einsum("bhr,hdr->bhd", a_deq, b_deq).to(d.dtype))

    # grouped GEMMs: contiguous layout with PSUM offsets, weight scales pre-packed by the library
    alignment = 128

    def get_mk_alignment_for_contiguous_layout(self):
        return self.alignment

    def transform_sf_into_required_layout(self, sf, mn, k, recipe, num_groups=None, is_sfa=None,
                                          disable_ue8m0_cast=False, psum_layout=None):
        """Weight scales to an opaque int32 tensor (here: one exponent byte per int; the real layout packs four,
        TMA-aligned, MN-major), remembered so the GEMM can check it got the library's own tensor."""
        assert self.arch == 10 and recipe == (1, 1, 32) and is_sfa is False and not disable_ue8m0_cast
        assert sf.dtype == torch.float32 and sf.shape == (num_groups, mn, k // 32)
        mantissa, _ = torch.frexp(sf)
        assert torch.all(mantissa == 0.5), "UE8M0 needs power-of-two scales"
        packed = (sf.view(torch.int32) >> 23).contiguous()
        self.transforms.append(packed)
        return packed

    def m_grouped_fp8_fp4_gemm_nt_contiguous(self, a, b, d, grouped_layout, recipe=None, recipe_a=None,
                                             recipe_b=None, compiled_dims="nk", disable_ue8m0_cast=False,
                                             use_psum_layout=False, ensure_zero_padding=True,
                                             expected_m_for_psum_layout=None):
        """Group g owns rows [align(end[g-1]), end[g]) of a and d; rows outside every group are left unwritten
        (NaN here), as the kernel leaves them."""
        assert expected_m_for_psum_layout is None or expected_m_for_psum_layout >= 1
        (a_data, sfa), (b_data, sfb) = a, b
        assert self.arch == 10 and use_psum_layout and recipe == (1, 1, 32)
        assert a_data.dtype == torch.float8_e4m3fn and a_data.stride(-1) == 1
        m, k = a_data.shape
        groups, n = b_data.shape[:2]
        assert b_data.dtype == torch.int8 and b_data.shape[2] * 2 == k and b_data.is_contiguous()
        assert sfa.dtype == torch.float32 and sfa.shape == (m, k // 32)
        assert any(sfb is t for t in self.transforms), "weight scales must be the library's packed tensor"
        assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (groups,)
        assert d.dtype == torch.bfloat16 and d.shape == (m, n)
        ends = grouped_layout.tolist()
        assert ends == sorted(ends) and ends[-1] <= m
        d.fill_(float("nan"))
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                a_deq = a_data[start:end].double() * _expand(sfa[start:end], 1, 32, end - start, k)
                b_deq = e2m1_values(b_data[g]) * _expand(2.0 ** (sfb[g].double() - 127), 1, 32, n, k)
                d[start:end] = (a_deq @ b_deq.t()).to(d.dtype)
            start = -(-end // self.alignment) * self.alignment
        self.grouped_calls += 1


def _expand(sf, gran_rows, gran_k, rows, k):
    return sf.double().repeat_interleave(gran_rows, 0).repeat_interleave(gran_k, 1)[:rows, :k]


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    def install(arch):
        fake = FakeDeepGemm(arch)
        monkeypatch.setitem(sys.modules, "deep_gemm", fake)
        return fake

    return install


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_features", [256, 80])
def test_deepgemm_sm100_fp8_passes_checkpoint_scales_at_block_32(fake_deep_gemm, dtype, out_features):
    fake = fake_deep_gemm(10)
    weight, scale = _fp8_weight(out_features, 256)
    x = _x((2, 3), 256, dtype)
    y = deepgemm_backend.linear_fp8(x, weight, scale, arch=10)
    (call,) = fake.calls
    assert call["recipe"] == (1, 32, 32)
    assert call["b_data"] is weight
    assert torch.equal(call["sfb"], scale.float())
    assert torch.equal(call["b"], dense_fp8(weight, scale))  # weight side exact
    assert torch.equal(call["a"], e4m3_activation(x, 32).reshape(-1, 256))
    assert y.shape == (2, 3, out_features) and y.dtype == dtype
    expected = e4m3_activation(x, 32) @ dense_fp8(weight, scale).t()
    assert rel_err(y, expected) < OUTPUT_ROUNDING_REL_TOL[dtype]
    assert rel_err(y, ops.linear_fp8.reference(x, weight, scale)) < ACTIVATION_FP8_REL_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepgemm_sm100_fp4_passes_packed_weight_unchanged(fake_deep_gemm, dtype):
    fake = fake_deep_gemm(10)
    weight, scale = _fp4_weight(192, 256)
    x = _x((5,), 256, dtype)
    y = deepgemm_backend.linear_fp4(x, weight, scale, arch=10)
    (call,) = fake.calls
    assert call["recipe"] == (1, 1, 32)
    assert call["b_data"].dtype == torch.int8 and torch.equal(call["b_data"], weight)
    assert torch.equal(call["b"], dense_fp4(weight, scale))
    assert y.shape == (5, 192) and y.dtype == dtype
    expected = e4m3_activation(x, 32) @ dense_fp4(weight, scale).t()
    assert rel_err(y, expected) < OUTPUT_ROUNDING_REL_TOL[dtype]
    assert rel_err(y, ops.linear_fp4.reference(x, weight, scale)) < ACTIVATION_FP8_REL_TOL


def test_deepgemm_sm90_fp8_requantises_to_128_blocks_exactly(fake_deep_gemm):
    fake = fake_deep_gemm(9)
    weight, scale = _fp8_weight(160, 256)
    scale = torch.full_like(scale.float(), 2.0**-8)  # one scale per 128x128 tile: the fold is exact
    scale[4:, 4:] = 2.0**-6
    scale = scale.to(torch.float8_e8m0fnu)
    x = _x((4,), 256, torch.bfloat16)
    y = deepgemm_backend.linear_fp8(x, weight, scale, arch=9)
    (call,) = fake.calls
    assert call["recipe"] == (1, 128, 128)
    assert call["sfb"].shape == (2, 2)
    assert torch.equal(call["b"], dense_fp8(weight, scale))
    assert torch.equal(call["a"], e4m3_activation(x, 128))
    expected = e4m3_activation(x, 128) @ dense_fp8(weight, scale).t()
    assert rel_err(y, expected) < OUTPUT_ROUNDING_REL_TOL[torch.bfloat16]


def test_requantize_to_128_blocks_is_exact_or_declines():
    weight, _ = _fp8_weight(256, 256)
    byte = torch.full((8, 8), 120, dtype=torch.uint8)
    byte[::2, ::2] = 119  # blocks one power of two below their tile's largest scale
    values = weight.float()
    values[values.abs() < 2.0**-3] = 0.0  # halving keeps 3 mantissa bits above E4M3's 2^-9 step
    weight_shifted = values.to(torch.float8_e4m3fn)
    exact_scale = byte.view(torch.float8_e8m0fnu)
    converted = deepgemm_backend.requantize_to_128_blocks(weight_shifted, exact_scale)
    assert converted is not None
    values, tile_scale = converted
    assert values.dtype == torch.float8_e4m3fn and tile_scale.shape == (2, 2) and tile_scale.dtype == torch.float32
    refolded = values.float() * tile_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(refolded.double(), dense_fp8(weight_shifted, exact_scale))

    byte[0, 0] -= 12  # one block 2^13 below its tile's largest scale: its values underflow E4M3
    assert deepgemm_backend.requantize_to_128_blocks(weight_shifted, byte.view(torch.float8_e8m0fnu)) is None


def test_deepgemm_sm90_inexact_weight_is_declined(fake_deep_gemm):
    fake = fake_deep_gemm(9)
    weight, scale = _fp8_weight(128, 256)
    byte = scale.view(torch.uint8).clone()
    byte[0, 0] -= 12
    scale = byte.view(torch.float8_e8m0fnu)
    x = _x((3,), 256, torch.bfloat16)
    assert deepgemm_backend.linear_fp8(x, weight, scale, arch=9) is NotImplemented
    assert not fake.calls


@pytest.mark.parametrize("arch, fmt, in_features", [(10, "fp8", 96), (10, "fp4", 96), (9, "fp4", 256)])
def test_deepgemm_declines_what_it_cannot_take_exactly(fake_deep_gemm, arch, fmt, in_features):
    fake = fake_deep_gemm(arch)
    weight, scale = (_fp8_weight if fmt == "fp8" else _fp4_weight)(128, in_features)
    x = _x((3,), in_features, torch.bfloat16)
    wrapper = deepgemm_backend.linear_fp8 if fmt == "fp8" else deepgemm_backend.linear_fp4
    assert wrapper(x, weight, scale, arch=arch) is NotImplemented
    assert not fake.calls


def _grouped_case(groups, rows, in_features, tokens, dtype, seed=5):
    weight, scale = _fp8_weight(groups * rows, in_features, seed=seed)
    return _x((tokens, groups), in_features, dtype, seed=seed + 1), weight, scale


def _grouped_expected(x, weight, scale, block):
    dense = dense_fp8(weight, scale).unflatten(0, (x.shape[1], -1))
    return torch.einsum("ngi,goi->ngo", e4m3_activation(x, block), dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups, rows, tokens", [(8, 64, 3), (3, 32, 1), (2, 96, 17)])
def test_deepgemm_sm100_grouped_fp8_is_one_einsum_over_the_stored_weight(fake_deep_gemm, dtype, groups, rows, tokens):
    fake = fake_deep_gemm(10)
    x, weight, scale = _grouped_case(groups, rows, 256, tokens, dtype)
    y = deepgemm_backend.linear_fp8_grouped(x, weight, scale, arch=10)
    (call,) = fake.calls
    assert call["recipe"] == (1, 32, 32)
    assert call["b_data"].data_ptr() == weight.data_ptr() and call["b_data"].shape == (groups, rows, 256)
    assert torch.equal(call["sfb"], scale.float().view(groups, rows // 32, 8))
    assert torch.equal(call["a"], e4m3_activation(x, 32))
    assert y.shape == (tokens, groups, rows) and y.dtype == dtype
    assert rel_err(y, _grouped_expected(x, weight, scale, 32)) < OUTPUT_ROUNDING_REL_TOL[dtype]
    assert rel_err(y, ops.linear_fp8_grouped.reference(x, weight, scale)) < ACTIVATION_FP8_REL_TOL


def test_deepgemm_sm90_grouped_fp8_folds_scales_per_group(fake_deep_gemm):
    fake = fake_deep_gemm(9)
    x, weight, scale = _grouped_case(2, 128, 256, 4, torch.bfloat16)
    tile = torch.full((8, 8), 2.0**-8)  # one scale per 128x128 tile, a different one per group: the fold is exact
    tile[4:] = 2.0**-6
    scale = tile.to(torch.float8_e8m0fnu)
    y = deepgemm_backend.linear_fp8_grouped(x, weight, scale, arch=9)
    (call,) = fake.calls
    assert call["recipe"] == (1, 128, 128)
    assert torch.equal(call["sfb"], torch.tensor([2.0**-8, 2.0**-6]).view(2, 1, 1).expand(2, 1, 2))
    assert torch.equal(call["b"].flatten(0, 1), dense_fp8(weight, scale))
    assert rel_err(y, _grouped_expected(x, weight, scale, 128)) < OUTPUT_ROUNDING_REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("arch, groups, rows, in_features, tokens", [
    (10, 2, 40, 256, 3),  # a 32-row scale block straddles the two groups
    (9, 2, 64, 256, 3),  # SM90 needs whole 128-row tiles per group
    (10, 2, 64, 96, 3),  # in_features not a multiple of 128
    (10, 2, 64, 256, 0),  # no tokens
])
def test_deepgemm_grouped_declines_what_it_cannot_take_exactly(fake_deep_gemm, arch, groups, rows, in_features,
                                                              tokens):
    fake = fake_deep_gemm(arch)
    x, weight, scale = _grouped_case(groups, rows, in_features, tokens, torch.bfloat16)
    assert deepgemm_backend.linear_fp8_grouped(x, weight, scale, arch=arch) is NotImplemented
    assert deepgemm_backend.linear_fp8_grouped(x[:, 0], weight, scale, arch=arch) is NotImplemented  # not [n, G, in]
    assert not fake.calls


# --- DeepGEMM grouped routed experts -----------------------------------------------------------------------

# Two E4M3 activations in series (x before gate / up, the weighted SwiGLU output before down): about sqrt(2) times
# one projection's error (2.7% at these shapes), more where SwiGLU's slope exceeds 1; 5.2% measured.
@pytest.mark.parametrize("tokens, top_k, only", [(7, 3, None), (1, 6, None), (40, 2, 1), (130, 2, 0)])
def test_deepgemm_moe_is_the_reference_with_e4m3_activations(fake_deep_gemm, tokens, top_k, only):
    """Tokens on a few experts, on every expert, 130 rows on one expert (two aligned blocks), idle experts."""
    fake = fake_deep_gemm(10)
    experts = stacked_fp4_experts(8, 256, 128)
    x = _x((tokens,), 256, torch.bfloat16)
    route_weights, ids = routing(tokens, 8, top_k, only=only)
    y = deepgemm_backend.moe_experts(x, route_weights, ids, experts, 4.0, arch=10)
    assert fake.grouped_calls == 3 and y.dtype == torch.float32 and y.shape == (tokens, 256)
    emulated = moe_with_e4m3_activations(x, route_weights, ids, experts, 4.0)
    torch.testing.assert_close(y, emulated, rtol=0, atol=1e-6 * emulated.abs().max().item())
    assert rel_err(y, ops.moe_experts.reference(x, route_weights, ids, experts, 4.0)) < MOE_FP8_REL_TOL


def test_deepgemm_moe_layout_fits_every_routing():
    """Each expert's rows are exactly [align(end of the previous expert), its grouped_layout end), inside the
    buffer sized from the shapes alone."""
    for tokens, top_k, only in ((1, 6, None), (9, 4, None), (50, 3, 5), (200, 1, 2)):
        _, ids = routing(tokens, 16, top_k, only=only)
        order, rows, ends, capacity = deepgemm_backend.contiguous_layout(ids, 16, 8)
        flat = ids.reshape(-1)
        assert torch.equal(flat[order], flat[order].sort().values)
        assert rows.unique().numel() == rows.numel() and int(rows.max()) < capacity
        assert capacity == flat.numel() + min(flat.numel(), 16) * 7
        starts = torch.cat((torch.zeros(1, dtype=torch.int32), (ends[:-1] + 7) // 8 * 8))  # align(previous end)
        for expert in range(16):
            mine = rows[flat[order] == expert]
            assert int(ends[expert]) - int(starts[expert]) == mine.numel()
            assert torch.equal(mine, torch.arange(int(starts[expert]), int(ends[expert])))


def test_deepgemm_moe_packs_each_weight_scale_once_per_version(fake_deep_gemm):
    fake = fake_deep_gemm(10)
    experts = stacked_fp4_experts(4, 128, 128)
    x = _x((5,), 128, torch.bfloat16)
    route_weights, ids = routing(5, 4, 2)
    first = deepgemm_backend.moe_experts(x, route_weights, ids, experts, None, arch=10)
    assert len(fake.transforms) == 3
    deepgemm_backend.moe_experts(x, route_weights, ids, experts, None, arch=10)
    assert len(fake.transforms) == 3  # cached: the library is not asked to convert again
    experts.w1_scale.view(torch.uint8).add_(1)  # an in-place reload doubles w1's scales
    doubled = deepgemm_backend.moe_experts(x, route_weights, ids, experts, None, arch=10)
    assert len(fake.transforms) == 4
    assert not torch.equal(first, doubled)
    cached = len(deepgemm_backend._packed_scales)
    del experts, first, doubled
    assert len(deepgemm_backend._packed_scales) == cached - 3


def test_deepgemm_moe_reads_nothing_on_the_host_whatever_the_routing(fake_deep_gemm):
    """A host read would wait for the router on a GPU: the torch work queued is the same for 1 token, 40 tokens
    spread out, or 40 tokens sharing an expert (the weight scales packed beforehand, as by the first call)."""
    fake_deep_gemm(10)
    experts = stacked_fp4_experts(8, 128, 128)
    deepgemm_backend.moe_experts(_x((2,), 128, torch.bfloat16), *routing(2, 8, 2), experts, None, arch=10)
    counts = []
    for tokens, only in ((1, None), (40, None), (40, 3)):
        route_weights, ids = routing(tokens, 8, 2, only=only)
        watch = ModuleCalls(deepgemm_backend)
        with watch:
            deepgemm_backend.moe_experts(_x((tokens,), 128, torch.bfloat16), route_weights, ids, experts, None,
                                         arch=10)
        assert watch.host_reads == []
        counts.append(watch.calls)
    assert len(set(counts)) == 1, counts


@pytest.mark.parametrize("case", ["fp32 activations", "float experts", "intermediate not a multiple of 128",
                                  "no tokens", "sm90"])
def test_deepgemm_moe_declines_what_it_cannot_take(fake_deep_gemm, case):
    fake = fake_deep_gemm(10)
    experts = stacked_fp4_experts(4, 128, 96 if case == "intermediate not a multiple of 128" else 128)
    x = _x((0 if case == "no tokens" else 3,), 128, torch.float32 if case == "fp32 activations" else torch.bfloat16)
    if case == "float experts":
        experts = ops.ExpertWeights(*(torch.randn(4, 128, 128) if i % 2 == 0 else None for i in range(6)))
    route_weights, ids = routing(x.shape[0], 4, 2)
    arch = 9 if case == "sm90" else 10
    assert deepgemm_backend.moe_experts(x, route_weights, ids, experts, None, arch=arch) is NotImplemented
    assert fake.grouped_calls == 0 and not fake.transforms


# --- fake FlashInfer ----------------------------------------------------------------------------------------

def _unswizzle_128x4(flat, rows, cols):
    """FlashInfer's 128x4 scale layout back to a [rows, cols] grid (written from its documented tiling)."""
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    grid = torch.empty(padded_rows, padded_cols, dtype=flat.dtype)
    index = 0
    for row_tile in range(padded_rows // 128):
        for col_tile in range(padded_cols // 4):
            for r32 in range(32):
                for r4 in range(4):
                    for c4 in range(4):
                        grid[row_tile * 128 + r4 * 32 + r32, col_tile * 4 + c4] = flat[index]
                        index += 1
    return grid[:rows, :cols]


class FakeFlashinferGemm(types.ModuleType):
    """``mm_mxfp8`` as flashinfer 0.7.2 documents it, in float64 on CPU."""

    def __init__(self):
        super().__init__("flashinfer.gemm")
        self.calls = []

    def mm_mxfp8(self, a, b, a_descale, b_descale, out=None, out_dtype=torch.bfloat16, use_8x4_sf_layout=False,
                 backend="auto"):
        assert out is None and not use_8x4_sf_layout and backend == "auto"
        m, k = a.shape
        k_b, n = b.shape
        assert k_b == k and n >= 128 and k >= 128 and k % 32 == 0
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.stride(-1) == 1 and b.stride(0) == 1, "a row-major, b column-major"
        for descale, rows in ((a_descale, m), (b_descale, n)):
            assert descale.dtype == torch.uint8 and descale.ndim == 1, "2-D linear scales raise in 0.7.2"
            assert descale.numel() == -(-rows // 128) * 128 * -(-(k // 32) // 4) * 4
        assert out_dtype in (torch.bfloat16, torch.float16)
        a_scale = _e8m0_decode(_unswizzle_128x4(a_descale, m, k // 32)).double().repeat_interleave(32, 1)
        b_scale = _e8m0_decode(_unswizzle_128x4(b_descale, n, k // 32)).double().repeat_interleave(32, 1)
        a_deq, b_deq = a.double() * a_scale, b.t().double() * b_scale
        self.calls.append({"a": a_deq, "b": b_deq, "b_data": b})
        return (a_deq @ b_deq.t()).to(out_dtype)


def _install_fake_flashinfer(monkeypatch):
    gemm_module = FakeFlashinferGemm()
    package = types.ModuleType("flashinfer")
    package.gemm = gemm_module
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.gemm", gemm_module)
    return gemm_module


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return _install_fake_flashinfer(monkeypatch)


def test_swizzle_128x4_matches_the_documented_tiling():
    grid = torch.arange(200 * 12, dtype=torch.int64).reshape(200, 12).to(torch.uint8)
    flat = flashinfer_backend.swizzle_128x4(grid)
    assert flat.shape == (256 * 12,)
    assert torch.equal(_unswizzle_128x4(flat, 200, 12), grid)


def test_e2m1_to_e4m3_is_exact():
    weight, _ = _fp4_weight(16, 64)
    assert torch.equal(flashinfer_backend.e2m1_to_e4m3(weight).double(), e2m1_values(weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features", [256, 144])
def test_flashinfer_fp8_expands_block_scales_to_rows_exactly(fake_flashinfer, dtype, out_features):
    weight, scale = _fp8_weight(out_features, 256)
    x = _x((2, 3), 256, dtype)
    y = flashinfer_backend.linear_fp8(x, weight, scale)
    (call,) = fake_flashinfer.calls
    assert call["b_data"].shape == (256, out_features)
    assert torch.equal(call["b"], dense_fp8(weight, scale))
    assert torch.equal(call["a"], e4m3_activation(x, 32).reshape(-1, 256))
    assert y.shape == (2, 3, out_features) and y.dtype == dtype
    expected = e4m3_activation(x, 32) @ dense_fp8(weight, scale).t()
    assert rel_err(y, expected) < OUTPUT_ROUNDING_REL_TOL[dtype]
    assert rel_err(y, ops.linear_fp8.reference(x, weight, scale)) < ACTIVATION_FP8_REL_TOL


def test_flashinfer_fp4_reencodes_to_e4m3_exactly(fake_flashinfer):
    weight, scale = _fp4_weight(128, 384)
    x = _x((9,), 384, torch.bfloat16)
    y = flashinfer_backend.linear_fp4(x, weight, scale)
    (call,) = fake_flashinfer.calls
    assert torch.equal(call["b"], dense_fp4(weight, scale))
    expected = e4m3_activation(x, 32) @ dense_fp4(weight, scale).t()
    assert y.shape == (9, 128) and y.dtype == torch.bfloat16
    assert rel_err(y, expected) < OUTPUT_ROUNDING_REL_TOL[torch.bfloat16]
    assert rel_err(y, ops.linear_fp4.reference(x, weight, scale)) < ACTIVATION_FP8_REL_TOL


@pytest.mark.parametrize("fmt, out_features, in_features, dtype", [
    ("fp8", 128, 256, torch.float32),  # mm_mxfp8 writes bf16 / fp16 only
    ("fp8", 64, 256, torch.bfloat16),  # below mm_mxfp8's minimum n
    ("fp8", 128, 96, torch.bfloat16),  # k not a multiple of 128
    ("fp4", 128, 96, torch.bfloat16),
])
def test_flashinfer_declines_what_it_cannot_take_exactly(fake_flashinfer, fmt, out_features, in_features, dtype):
    weight, scale = (_fp8_weight if fmt == "fp8" else _fp4_weight)(out_features, in_features)
    x = _x((3,), in_features, dtype)
    wrapper = flashinfer_backend.linear_fp8 if fmt == "fp8" else flashinfer_backend.linear_fp4
    assert wrapper(x, weight, scale) is NotImplemented
    assert not fake_flashinfer.calls
