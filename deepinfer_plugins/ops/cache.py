"""Quantised KV-cache records: pack / unpack references and the paged cache write / gather ops.

Every record is the byte image of one token (window) or one compressed entry, so a paged cache is a uint8
tensor [slots, record_bytes] (pages are runs of slots; the caller maps positions to slots through its block
table and, for the window ring, position % window). Unpacking a record gives exactly the matching fake-quant
op of quant.py, bit for bit (tests/ops/test_cache_ops.py checks this), so a cache written by these ops and
read back is the model's cache precision.

Formats (docs/model.md#cache-records), D = width of the vector:
  * ``fp8_window``  (window KV, D = 512): D bytes E4M3 codes, then D/32 UE8M0 scale bytes  -> 528 B.
  * ``nvfp4``       (compressed KV, D = 512): D/2 bytes E2M1 pairs (even channel = low nibble), then D/16
                    E4M3 scale bytes -> 288 B.
  * ``mxfp4``       (indexer keys, D = 128): D/2 bytes E2M1 pairs, then D/32 UE8M0 scale bytes -> 68 B.
Sign of an E2M1 code is bit 3 and is set for every negative input, including ones that round to zero (the
checkpoint writer's rule, ``quantize_fp4_weight``).
"""

from __future__ import annotations

import torch

from .quant import FP4_MAX, FP8_AMAX_FLOOR, FP8_MAX, _blocks, e2m1_code, e2m1_value, pow2_ceil
from .registry import registry

# format -> (quantisation block, element bits, scale kind)
CACHE_FORMATS = {"fp8_window": (32, 8, "ue8m0"), "nvfp4": (16, 4, "e4m3"), "mxfp4": (32, 4, "ue8m0")}


def _check_format(fmt: str) -> tuple[int, int, str]:
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}; expected one of {sorted(CACHE_FORMATS)}")
    return CACHE_FORMATS[fmt]


def record_bytes(fmt: str, dim: int) -> int:
    """Bytes of one record of a ``dim``-wide vector: 528 (fp8_window, 512), 288 (nvfp4, 512), 68 (mxfp4, 128)."""
    block, bits, _ = _check_format(fmt)
    block = min(block, dim)
    return dim * bits // 8 + dim // block


def _byte_values() -> tuple[torch.Tensor, torch.Tensor]:
    """The value every stored byte decodes to: as one E4M3 code (fp32 [256]), and as a packed E2M1 pair (even
    channel = low nibble, sign bit 3) whose two fp32 values are held as the bits of one int64 ([256]). Decoding a
    record is then one ``index_select`` per byte (with int32 indices: on a CPU about twice as fast as ``take``,
    which needs int64 ones); a pair read as one int64 is about 5x faster on a CPU than indexing a [256, 2] table,
    and viewing the result as fp32 restores the pairs."""
    byte = torch.arange(256)
    e4m3 = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = torch.stack((byte & 0x0F, byte >> 4), dim=-1)  # [256, 2]
    magnitude = e2m1_value(codes & 0x7)
    pairs = torch.where((codes & 0x8).bool(), -magnitude, magnitude).float().contiguous()
    return e4m3, pairs.view(torch.int64).reshape(256)


_E4M3_BYTE_VALUES, _E2M1_PAIR_BITS = _byte_values()


def _fp4_codes(xb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """xb [..., nb, block] fp32, scale [..., nb, 1] -> E2M1 codes with sign bit 3, uint8 [..., nb, block]."""
    scaled = (xb / scale).clamp(-FP4_MAX, FP4_MAX)
    return (e2m1_code(scaled.abs()) | ((xb < 0).to(torch.int64) << 3)).to(torch.uint8)


@registry.reference("pack_cache_records")
def pack_cache_records(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [T, D] (any float dtype) -> uint8 records [T, record_bytes(fmt, D)]."""
    block, _, _ = _check_format(fmt)
    xb = _blocks(x, block)  # [T, nb, block] fp32
    if fmt == "fp8_window":
        amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
        scale = pow2_ceil(amax / FP8_MAX)  # [T, nb, 1]
        codes = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        scale_bytes = scale.squeeze(-1).to(torch.float8_e8m0fnu).view(torch.uint8)  # [T, nb]
        return torch.cat((codes.flatten(1), scale_bytes), dim=1)
    if fmt == "nvfp4":
        amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-9)
        scale_e4m3 = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)  # saturating, as in quant.py
        scale = scale_e4m3.float()
        scale_bytes = scale_e4m3.view(torch.uint8).squeeze(-1)
    else:  # mxfp4
        amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
        scale = pow2_ceil(amax / FP4_MAX)
        scale_bytes = scale.squeeze(-1).to(torch.float8_e8m0fnu).view(torch.uint8)
    codes = _fp4_codes(xb, scale).flatten(1)  # [T, D]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [T, D/2], even channel in the low nibble
    return torch.cat((packed, scale_bytes), dim=1)


@registry.reference("unpack_cache_records")
def unpack_cache_records(records: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 records [T, R] -> dequantised [T, dim] in ``dtype`` (equal to the fake-quant op's output)."""
    block, bits, _ = _check_format(fmt)
    block = min(block, dim)
    t, nb = records.shape[0], dim // block
    data, scale_bytes = records[:, : dim * bits // 8], records[:, dim * bits // 8: dim * bits // 8 + nb]
    table = _E4M3_BYTE_VALUES if fmt == "fp8_window" else _E2M1_PAIR_BITS
    values = table.to(records.device).index_select(0, data.reshape(-1).int()).view(data.shape)  # fp8: [T, D]
    if fmt != "fp8_window":
        values = values.view(torch.float32)  # [T, D/2] pairs -> [T, D]
    if fmt == "nvfp4":
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()  # [T, nb]
    else:
        scale = scale_bytes.contiguous().view(torch.float8_e8m0fnu).float()
    return (values.view(t, nb, block) * scale[:, :, None]).reshape(t, dim).to(dtype)


@registry.reference("cache_write")
def cache_write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise x [T, D] and store record t at cache[slots[t]] (uint8 cache [S, R]); slot -1 = skip.

    Returns ``cache`` (written in place)."""
    records = pack_cache_records.reference(x, fmt)  # [T, R]
    keep = slots >= 0
    cache[slots[keep]] = records[keep]
    return cache


@registry.reference("cache_gather")
def cache_gather(cache: torch.Tensor, slots: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised rows of cache [S, R] at slots [...] -> [..., dim] in ``dtype``; slot -1 gives zeros."""
    flat = slots.reshape(-1)
    if cache.shape[0] == 0:  # nothing stored yet (a sequence's first tokens): every slot is -1
        return torch.zeros(*slots.shape, dim, dtype=dtype, device=slots.device)
    # an all-zero record decodes to +0.0 in every format, so unused slots are zeroed as bytes, a quarter of the
    # memory traffic of zeroing the decoded floats
    records = torch.where((flat >= 0)[:, None], cache[flat.clamp(min=0)], 0)
    return unpack_cache_records.reference(records, fmt, dim, dtype).reshape(*slots.shape, dim)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host-built index tensor on ``device``, copied from pinned memory so that the host does not wait (a plain
    copy to a GPU waits for the device to finish its queue)."""
    return host if torch.device(device).type == "cpu" else host.pin_memory().to(device, non_blocking=True)
