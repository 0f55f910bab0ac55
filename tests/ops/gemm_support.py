"""Tolerances, inputs and expected values for the GEMM backends that quantise their activation to FP8 on the way
in (DeepGEMM, FlashInfer, the Ascend MX GEMMs), shared by their tests.

The expected values are computed here from the formats' definitions (bit fields, scale bytes, round to nearest
even) in float64, without the dequantisers, quantisers or expert loop of deepinfer_plugins.ops: the backends
under test reuse those, so an expectation built from them would share any mistake in them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_plugins import ops
from deepinfer_plugins.ops.quant import quantize_fp4_weight

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 is the sign
E4M3_MAX = 448.0
E4M3_AMAX_FLOOR = 1e-4  # a block's |x| max is raised to this before its scale is taken

# The backends quantise activations to E4M3 (3 mantissa bits, round to nearest: relative error <= 2^-4 per
# element); over a dot product of independent errors the output error is well under this relative norm.
ACTIVATION_FP8_REL_TOL = 0.04
# Against the same quantised activation, the only difference left is the output rounding of bf16 (2^-8) plus
# fp32 summation order.
OUTPUT_ROUNDING_REL_TOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}
# Routed experts round activations to E4M3 twice (before gate / up and before down).
MOE_FP8_REL_TOL = 0.08


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()



def stacked_fp4_experts(n_experts, dim, inter, seed=3):
    g = torch.Generator().manual_seed(seed)

    def stack(out_features, in_features):
        pairs = [quantize_fp4_weight(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
                 for _ in range(n_experts)]
        return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, dim), stack(inter, dim), stack(dim, inter)
    return ops.ExpertWeights(w1, s1, w3, s3, w2, s2)


def routing(tokens, n_experts, top_k, seed=4, only=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)
    for t in range(tokens):
        ids[t] = torch.randperm(n_experts, generator=g)[:top_k]
    if only is not None:  # every token's first choice is one expert
        ids[:, 0] = only
        for t in range(tokens):
            rest = [e for e in torch.randperm(n_experts, generator=g).tolist() if e != only]
            ids[t, 1:] = torch.tensor(rest[: top_k - 1])
    return torch.rand(tokens, top_k, generator=g), ids


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its bytes) -> float64: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m / 8 * 2^-6) and S.1111.111 is NaN."""
    byte = codes.view(torch.uint8).long()
    exponent, mantissa = (byte >> 3) & 0xF, (byte & 0x7).double()
    magnitude = torch.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    magnitude = torch.where((byte & 0x7F) == 0x7F, torch.nan, magnitude)
    return torch.where(byte >= 0x80, -magnitude, magnitude)


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes -> float64 2^(byte - 127); scales already widened to a float type pass through."""
    if scale.dtype == torch.float8_e8m0fnu:
        return torch.pow(2.0, scale.view(torch.uint8).double() - 127.0)
    return scale.double()


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes packed two per byte [rows, n / 2], the even column in the low nibble -> float64 [rows, n]."""
    byte = packed.view(torch.uint8).long()
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[codes & 0x7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def dense_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """An FP8 weight [out, in] with one E8M0 scale per ``block`` x ``block`` tile -> float64."""
    out_features, in_features = weight.shape
    tiles = e8m0_values(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return e4m3_values(weight) * tiles[:out_features, :in_features]


def dense_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """An FP4 weight [out, in / 2] with one E8M0 scale per row per ``block`` columns -> float64."""
    return e2m1_values(packed) * e8m0_values(scale).repeat_interleave(block, -1)


_E4M3_GRID = e4m3_values(torch.arange(0x7F, dtype=torch.uint8))  # every finite non-negative value, ascending


def e4m3_activation(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., n] as an FP8 GEMM reads it, in float64: per ``block`` columns a power-of-two scale, the smallest
    with |x| max / scale <= 448, and each x / scale rounded to the nearest E4M3 value (ties to the even code)."""
    blocks = x.double().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=E4M3_AMAX_FLOOR)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / E4M3_MAX)))
    magnitude = (blocks / scale).abs().clamp(max=E4M3_MAX)
    above = torch.searchsorted(_E4M3_GRID, magnitude).clamp(max=_E4M3_GRID.numel() - 1)
    below = (above - 1).clamp(min=0)
    up = _E4M3_GRID[above] - magnitude
    down = magnitude - _E4M3_GRID[below]
    code = torch.where((up < down) | ((up == down) & (above % 2 == 0)), above, below)
    return (torch.sign(blocks) * _E4M3_GRID[code] * scale).flatten(-2)


def fp8_activation_linear(rows, weight, scale):
    """A projection as the grouped GEMM computes it: E4M3 activation rows times the FP4 weight, exact, rounded to
    the rows' dtype."""
    return (e4m3_activation(rows, 32) @ dense_fp4(weight, scale).t()).to(rows.dtype)


def moe_with_e4m3_activations(x, route_weights, expert_ids, experts, swiglu_limit):
    """The routed experts as a grouped FP8 x FP4 GEMM computes them, token by token: per selected expert the gate
    and up projections (E4M3 rows, exact products, rounded to x's dtype), silu(min(gate, L)) * clamp(up, -L, L) in
    fp32 rounded to x's dtype, times the router weight in fp32 rounded again, the down projection likewise; the
    fp32 sum adds a token's experts in ascending expert id. -> fp32 [T, d]."""
    def project(rows, weight, scale):
        return (e4m3_activation(rows, 32) @ dense_fp4(weight, scale).t()).to(x.dtype)

    out = torch.zeros(x.shape, dtype=torch.float32)
    for token in range(x.shape[0]):
        for slot in expert_ids[token].argsort(stable=True).tolist():
            expert = int(expert_ids[token, slot])
            row = x[token: token + 1]
            gate = project(row, experts.w1[expert], experts.w1_scale[expert]).float()
            up = project(row, experts.w3[expert], experts.w3_scale[expert]).float()
            if swiglu_limit is not None:
                gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
            hidden = (F.silu(gate) * up).to(x.dtype)
            hidden = (hidden.float() * route_weights[token, slot]).to(x.dtype)
            out[token] += project(hidden, experts.w2[expert], experts.w2_scale[expert]).float()[0]
    return out
