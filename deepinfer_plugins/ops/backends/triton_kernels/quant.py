"""Quantisers, cache-record writers and dequantising readers (bit-exact with ops/quant.py and ops/cache.py).

Two kernels serve every op here: ``_quantize_kernel`` (fake-quant, FP8 block quant, record packing and the
paged cache write, by a constexpr MODE) and ``_dequant_kernel`` (record unpacking, cache gather, checkpoint
weight dequantisation and the Engram table lookup).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache import CACHE_FORMATS, record_bytes
from .common import (INTERPRETED, cut_launch_jit, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_round, empty, next_pow2,
                     pow2_ceil, pow2_reciprocal, run_kernel, ue8m0_decode)

FP8, NVFP4, MXFP4 = 0, 1, 2
FMT_ID = {"fp8_window": FP8, "nvfp4": NVFP4, "mxfp4": MXFP4}
FAKE, RECORDS, BLOCK_QUANT = 0, 1, 2


@triton.jit
def _quant_block(x, mask, FMT: tl.constexpr):
    """x [NB, BLK_P]: NB blocks, columns past the block masked -> (codes int32, dequantised values, scale [NB],
    scale byte [NB]). Power-of-two scales (FP8, MXFP4) divide by multiplying with their exact reciprocal."""
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    if FMT == 1:
        scale, scale_byte = e4m3_round(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0))  # 6 * 2^-9
        scaled = tl.math.div_rn(x, scale[:, None])
    else:
        if FMT == 0:
            scale = pow2_ceil(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        else:
            scale = pow2_ceil(tl.math.div_rn(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 6.0))
        scale_byte = (scale.to(tl.int32, bitcast=True) >> 23) & 255
        scaled = x * pow2_reciprocal(scale)[:, None]
    if FMT == 0:
        values, codes = e4m3_round(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
    else:
        codes = e2m1_encode(tl.minimum(tl.maximum(scaled, -6.0), 6.0), x < 0)
        values = e2m1_decode(codes)
    return codes, values * scale[:, None], scale, scale_byte


@cut_launch_jit
def _quantize_kernel(x_ptr, out_ptr, scales_ptr, rec_ptr, slots_ptr, n_blocks, D, R,
                     first_program, BLK: tl.constexpr, BLK_P: tl.constexpr, NB: tl.constexpr, FMT: tl.constexpr,
                     MODE: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """NB consecutive blocks per program, read as one contiguous tile (vector loads); FP4 codes are paired into
    bytes in registers."""
    blocks = (tl.program_id(0) + first_program) * NB + tl.arange(0, NB)  # [NB] global block ids
    c = tl.arange(0, BLK_P)  # column inside the block
    bmask = blocks < n_blocks
    mask = bmask[:, None] & (c[None, :] < BLK)
    offsets = blocks[:, None] * BLK + c[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    codes, values, scale, scale_byte = _quant_block(x, mask, FMT)
    if MODE == 0:  # fake quant: dequantised values in the output dtype
        tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)
    elif MODE == 2:  # FP8 block quant: E4M3 bytes + fp32 scales
        tl.store(out_ptr + offsets, codes.to(tl.uint8), mask=mask)
        tl.store(scales_ptr + blocks, scale, mask=bmask)
    else:  # records [slots, R]: data bytes then scale bytes
        bpr = D // BLK
        row = blocks // bpr
        j = blocks % bpr
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + row, mask=bmask, other=-1).to(tl.int64)
        else:
            slot = row.to(tl.int64)
        bmask = bmask & (slot >= 0)
        base = rec_ptr + slot * R  # [NB] record starts
        if FMT == 0:
            tl.store(base[:, None] + j[:, None] * BLK + c[None, :], codes.to(tl.uint8),
                     mask=mask & (slot >= 0)[:, None])
            tl.store(base + D + j, scale_byte.to(tl.uint8), mask=bmask)
        else:
            even, odd = tl.split(tl.reshape(codes, [NB, BLK_P // 2, 2]))
            i = tl.arange(0, BLK_P // 2)
            pair_mask = bmask[:, None] & (i[None, :] < BLK // 2)
            tl.store(base[:, None] + j[:, None] * (BLK // 2) + i[None, :], (even | (odd << 4)).to(tl.uint8),
                     mask=pair_mask)
            tl.store(base + D // 2 + j, scale_byte.to(tl.uint8), mask=bmask)


@cut_launch_jit
def _dequant_kernel(data_ptr, scale_ptr, ids_ptr, out_ptr, n_rows, D, data_stride, scale_stride, scale_off,
                    SROW, first_program, BLK: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr, FP4: tl.constexpr,
                    SCALE_KIND: tl.constexpr, HAS_IDS: tl.constexpr):
    """out[r, c] = value(data[src, c]) * scale[src // SROW, c // BLK]; src = ids[r] (or r); src < 0 -> 0."""
    rows = (tl.program_id(0) + first_program) * RB + tl.arange(0, RB)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < D)
    if HAS_IDS:
        src = tl.load(ids_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    valid = mask & (src >= 0)[:, None]
    srcc = tl.maximum(src, 0)
    if FP4:
        byte = tl.load(data_ptr + srcc[:, None] * data_stride + cols[None, :] // 2, mask=valid, other=0).to(tl.int32)
        values = e2m1_decode((byte >> ((cols[None, :] % 2) * 4)) & 15)
    else:
        byte = tl.load(data_ptr + srcc[:, None] * data_stride + cols[None, :], mask=valid, other=0).to(tl.int32)
        values = e4m3_decode(byte)
    sptr = scale_ptr + (srcc // SROW)[:, None] * scale_stride + scale_off + cols[None, :] // BLK
    if SCALE_KIND == 0:
        scale = ue8m0_decode(tl.load(sptr, mask=valid, other=127).to(tl.int32))
    elif SCALE_KIND == 1:
        scale = e4m3_decode(tl.load(sptr, mask=valid, other=56).to(tl.int32))
    else:
        scale = tl.load(sptr, mask=valid, other=1.0)
    out = tl.where(valid, values * scale, 0.0)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers ---------------------------------------------------------------------------------------------------
def _launch_quantize(x: torch.Tensor, block: int, fmt: int, mode: int, out=None, scales=None, records=None,
                     slots=None, record_len: int = 0) -> None:
    d = x.shape[-1]
    block = min(block, d)
    if d % block:
        raise ValueError(f"last dimension {d} is not a multiple of the quantisation block {block}")
    x = x.contiguous()
    n_blocks = x.numel() // block
    if n_blocks == 0:
        return
    blk_p = max(2, next_pow2(block))
    nb = min(next_pow2(n_blocks), max(1, (16384 if INTERPRETED else 2048) // blk_p))
    dummy = x
    run_kernel(_quantize_kernel, (triton.cdiv(n_blocks, nb),), x, out if out is not None else dummy,
               scales if scales is not None else dummy, records if records is not None else dummy,
               slots if slots is not None else dummy, n_blocks, d, record_len, BLK=block, BLK_P=blk_p, NB=nb, FMT=fmt,
               MODE=mode, HAS_SLOTS=slots is not None)


def _fake(x: torch.Tensor, block: int, fmt: int) -> torch.Tensor:
    if min(block, x.shape[-1]) % 2:
        raise ValueError(f"odd quantisation block {block} is not supported by the Triton quantiser")
    out = empty(x.shape, x.dtype, x.device)
    _launch_quantize(x, block, fmt, FAKE, out=out)
    return out


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _fake(x, block, FP8)


def nvfp4_fake_quant(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    return _fake(x, block, NVFP4)


def mxfp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _fake(x, block, MXFP4)


def fp8_block_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    blk = min(block, x.shape[-1])
    codes = empty(x.shape, torch.uint8, x.device)
    scales = empty((*x.shape[:-1], x.shape[-1] // blk), torch.float32, x.device)
    _launch_quantize(x, block, FP8, BLOCK_QUANT, out=codes, scales=scales)
    return codes.view(torch.float8_e4m3fn), scales


def pack_cache_records(x: torch.Tensor, fmt: str) -> torch.Tensor:
    block, _, _ = CACHE_FORMATS[fmt]
    rlen = record_bytes(fmt, x.shape[-1])
    records = empty((x.shape[0], rlen), torch.uint8, x.device)
    _launch_quantize(x, block, FMT_ID[fmt], RECORDS, records=records, record_len=rlen)
    return records


def cache_write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    block, _, _ = CACHE_FORMATS[fmt]
    rlen = record_bytes(fmt, x.shape[-1])
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != rlen or cache.stride(1) != 1:
        raise ValueError(f"cache must be a uint8 [slots, {rlen}] tensor (rows may be strided) for {fmt!r} records "
                         f"of width {x.shape[-1]}; got {cache.dtype} {tuple(cache.shape)}")
    _launch_quantize(x, block, FMT_ID[fmt], RECORDS, records=cache, slots=slots.contiguous(),
                     record_len=cache.stride(0))
    return cache


def _scale_arg(scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8), 0
    if scale.dtype == torch.float8_e4m3fn:
        return scale.view(torch.uint8), 1
    return scale.float(), 2


def _launch_dequant(data, scale, scale_kind, ids, n_rows, d, data_stride, scale_stride, scale_off, srow, block,
                    fp4, dtype, device) -> torch.Tensor:
    out = empty((n_rows, d), dtype, device)
    if n_rows == 0 or d == 0:
        return out
    bd = min(next_pow2(d), 1024)
    rb = max(1, min(next_pow2(n_rows), (16384 if INTERPRETED else 4096) // bd))
    run_kernel(_dequant_kernel, (triton.cdiv(n_rows, rb), triton.cdiv(d, bd)), data, scale,
               ids if ids is not None else data, out, n_rows, d, data_stride, scale_stride, scale_off, srow, BLK=block,
               RB=rb, BD=bd, FP4=fp4, SCALE_KIND=scale_kind, HAS_IDS=ids is not None)
    return out


def unpack_cache_records(records: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return cache_gather(records, None, fmt, dim, dtype)


def cache_gather(cache: torch.Tensor, slots, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    block, bits, kind = CACHE_FORMATS[fmt]
    block = min(block, dim)
    if cache.stride(-1) != 1:
        cache = cache.contiguous()
    ids = None if slots is None else slots.reshape(-1).contiguous()
    n = cache.shape[0] if ids is None else ids.numel()
    out = _launch_dequant(cache, cache, 0 if kind == "ue8m0" else 1, ids, n, dim, cache.stride(0), cache.stride(0),
                          dim * bits // 8, 1, block, bits == 4, dtype, cache.device)
    return out if slots is None else out.reshape(*slots.shape, dim)


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32):
    scale, kind = _scale_arg(scale.contiguous())
    weight = weight.contiguous().view(torch.uint8)
    return _launch_dequant(weight, scale, kind, None, weight.shape[0], weight.shape[1], weight.shape[1],
                           scale.shape[1], 0, block, block, False, dtype, weight.device)


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32):
    scale, kind = _scale_arg(scale.contiguous())
    packed = packed.contiguous().view(torch.uint8)
    return _launch_dequant(packed, scale, kind, None, packed.shape[0], packed.shape[1] * 2, packed.shape[1],
                           scale.shape[1], 0, 1, block, True, dtype, packed.device)


def engram_gather(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype):
    w = weight.shape[-1]
    scale2, kind = _scale_arg(scale.contiguous())
    flat = ids.reshape(-1).contiguous()
    out = _launch_dequant(weight.contiguous().view(torch.uint8), scale2, kind, flat, flat.numel(), w, w,
                          scale2.shape[1], 0, 1, 32, False, dtype, weight.device)
    return out.reshape(*ids.shape, w)
