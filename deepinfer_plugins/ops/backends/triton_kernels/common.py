"""Shared pieces of the Triton kernels: output allocation, interpreter detection and bit-exact number formats.

The quantisers round in integer arithmetic on the float bits instead of relying on hardware or interpreter
casts (the interpreter's fp32 -> fp8 cast does not round to nearest even), so every backend produces the
references' bits.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.backends import backends

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# triton-ascend replaces the triton package, so its backend being installed means kernels compile for an NPU
# (or run under its interpreter): no fp8 types, and at most ASCEND_MAX_PROGRAMS programs per launch.
TRITON_ASCEND = "ascend" in backends
ASCEND_MAX_PROGRAMS = 65535  # an Ascend kernel launch's block dimension is at most 65535
# triton-ascend's documented switch for GPU-sized grids: with it, its compiler loops each physical core over the
# launch's programs, so a launch may exceed ASCEND_MAX_PROGRAMS. Every kernel here allows it: programs write
# disjoint outputs and never wait on each other (no atomics, no barriers), so their order does not matter.
BLOCKS_PARALLEL_ENV = "TRITON_ALL_BLOCKS_PARALLEL"

# Tests set POISON = True: every output buffer starts as NaN (floats) or a sentinel (integers), so an element a
# kernel forgets to write is caught.
POISON = False
POISON_INT = -7777


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        if dtype.is_floating_point:
            if dtype.itemsize == 1:
                out.view(torch.uint8).fill_(0x7F)  # NaN in e4m3
            else:
                out.fill_(float("nan"))
        elif dtype in (torch.uint8, torch.int8):
            out.fill_(0x55)
        else:
            out.fill_(POISON_INT)
    return out


def can_run(t: torch.Tensor) -> bool:
    """Triton runs CUDA tensors compiled (NPU tensors where triton-ascend is the installed triton), CPU tensors
    only in interpreter mode."""
    if t.device.type == "cpu":
        return INTERPRETED
    return t.device.type == ("npu" if TRITON_ASCEND else "cuda")


class GridTooLarge(Exception):
    """A grid that no cut of its first axis fits into launches the target takes; the op declines the call."""


def programs_capped() -> bool:
    """Whether a launch takes at most ASCEND_MAX_PROGRAMS: under triton-ascend, unless BLOCKS_PARALLEL_ENV is on
    (read per launch, parsed as triton-ascend's compiler and launcher parse it)."""
    return TRITON_ASCEND and os.environ.get(BLOCKS_PARALLEL_ENV, "0").lower() not in ("1", "true")


def launch_chunks(*dims: int) -> list[tuple[int, tuple[int, ...]]]:
    """(first program along axis 0, grid) of each launch that covers a grid of ``dims`` programs: one launch, except
    where an NPU launch's limit applies and the grid exceeds it, which cuts axis 0 into runs that fit. A grid whose
    other axes alone exceed the limit raises GridTooLarge. (On CUDA the driver checks its own limits: 2^31 - 1
    programs along x, 65535 along y and z, which our launches keep to.)"""
    if math.prod(dims) <= ASCEND_MAX_PROGRAMS or not programs_capped():
        return [(0, dims)]
    per_first = math.prod(dims[1:])
    if per_first > ASCEND_MAX_PROGRAMS:
        raise GridTooLarge(f"{per_first} programs per index of a launch's first axis; an NPU launch takes at most "
                           f"{ASCEND_MAX_PROGRAMS} unless {BLOCKS_PARALLEL_ENV}=1")
    step = ASCEND_MAX_PROGRAMS // per_first
    return [(first, (min(step, dims[0] - first), *dims[1:])) for first in range(0, dims[0], step)]


def run_kernel(kernel, dims: tuple[int, ...], *args, **kwargs) -> None:
    """Launches ``kernel`` over a grid of ``dims`` programs in the launches of ``launch_chunks``: every kernel here
    adds its ``first_program`` argument to its axis-0 program id."""
    for first, grid in launch_chunks(*dims):
        kernel[grid](*args, first_program=first, **kwargs)


# ``triton.jit`` for a kernel that ``run_kernel`` launches. Triton specialises an integer argument on its value
# (divisible by 16, equal to 1), so the launches of a cut grid would each pick a binary by where they start: on
# an NPU that is a compile per new class of start mid-serving. With ``first_program`` left unspecialised, every
# launch of a kernel's grid takes the first launch's binary.
cut_launch_jit = triton.jit(do_not_specialize=["first_program"])


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


ONE_WAVE_PROGRAMS = 132  # an H200's multiprocessors: a launch with fewer programs leaves some idle
SPLIT_TARGET_PROGRAMS = 2 * ONE_WAVE_PROGRAMS


def split_count(programs: int, blocks: int, min_blocks_per_split: int) -> int:
    """How many slices to cut a launch's reduction loop of ``blocks`` steps into (each slice its own program,
    partial results combined afterwards): none for a launch of one wave or more; otherwise enough to reach two
    waves, keeping at least ``min_blocks_per_split`` steps per slice so each still pipelines its loads."""
    if programs >= ONE_WAVE_PROGRAMS:
        return 1
    return max(1, min(-(-SPLIT_TARGET_PROGRAMS // programs), blocks // min_blocks_per_split))


TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---- bit-exact number formats ----------------------------------------------------------------------------------
@triton.jit
def pow2_ceil(x):
    """Smallest power of two >= x for normal positive fp32 x (exact, from the float bits)."""
    bits = x.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + 1) << 23
    return tl.where((bits & 0x7FFFFF) == 0, bits, up).to(tl.float32, bitcast=True)


@triton.jit
def pow2_reciprocal(p):
    """1 / p for a power of two p whose reciprocal is a normal fp32 (exact, from the bits): x * pow2_reciprocal(p)
    is then x / p correctly rounded, without a division."""
    return ((254 << 23) - p.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round(v):
    """Round fp32 v (|v| <= 448 after the caller's clamp, or larger: saturates) to E4M3, nearest-even.

    Returns (value as fp32, code as int32 0..255 with the sign in bit 7, copied from v's sign bit)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)  # keep 3 mantissa bits, RNE
    sub_units = (a * 512.0 + 8388608.0) - 8388608.0  # RNE to a multiple of 2^-9 (subnormal step)
    is_sub = a < 0.015625
    mag = tl.minimum(tl.where(is_sub, sub_units * 0.001953125, normal), 448.0)
    mb = mag.to(tl.int32, bitcast=True)
    code = tl.where(is_sub, sub_units.to(tl.int32), (((mb >> 23) - 120) << 3) | ((mb >> 20) & 7))
    neg = v.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 keeps it like torch's cast
    code = code | tl.where(neg, 128, 0)
    return tl.where(neg, -mag, mag), code


@triton.jit
def e4m3_decode(code):
    """E4M3 byte (int32 0..255) -> fp32."""
    e = (code >> 3) & 15
    m = code & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((code & 128) != 0, -mag, mag)


@triton.jit
def ue8m0_decode(code):
    """UE8M0 byte (int32 1..254) -> 2^(code - 127) as fp32."""
    return (code << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_encode(scaled, neg):
    """|scaled| clamped to [0, 6] -> E2M1 code 0..15 (bit 3 = neg), ties to the even code."""
    m = tl.abs(scaled)
    code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
            + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    return code | tl.where(neg, 8, 0)


@triton.jit
def e2m1_decode(code):
    """E2M1 code (int32 0..15) -> fp32 in {0, .5, 1, 1.5, 2, 3, 4, 6} with sign."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)
