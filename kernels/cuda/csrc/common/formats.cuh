// Bit-exact number formats of DeepSeek-V4.1's caches (ops/quant.py, ops/cache.py), in integer arithmetic on the
// float bits so every arch rounds like the PyTorch reference (no reliance on cvt rounding modes).
#pragma once
#include <cstdint>

namespace deepinfer {

__device__ __forceinline__ float bits_to_float(uint32_t b) { return __uint_as_float(b); }
__device__ __forceinline__ uint32_t float_to_bits(float f) { return __float_as_uint(f); }

// Smallest power of two >= x, x normal and positive.
__device__ __forceinline__ float pow2_ceil(float x) {
  uint32_t b = float_to_bits(x);
  return (b & 0x7FFFFFu) == 0 ? x : bits_to_float(((b >> 23) + 1u) << 23);
}

// Round to E4M3 nearest-even, saturating at 448. Returns the value; *code gets the byte (sign from v's sign bit).
__device__ __forceinline__ float e4m3_round(float v, uint32_t* code) {
  float a = fabsf(v);
  uint32_t b = float_to_bits(a);
  float normal = bits_to_float((b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u);
  float units = __fadd_rn(__fmul_rn(a, 512.0f), 8388608.0f) - 8388608.0f;  // RNE to a multiple of 2^-9
  bool sub = a < 0.015625f;
  float mag = fminf(sub ? units * 0.001953125f : normal, 448.0f);
  uint32_t mb = float_to_bits(mag);
  uint32_t c = sub ? static_cast<uint32_t>(units) : ((((mb >> 23) - 120u) << 3) | ((mb >> 20) & 7u));
  bool neg = (float_to_bits(v) >> 31) != 0;
  *code = c | (neg ? 0x80u : 0u);
  return neg ? -mag : mag;
}

// |scaled| (clamped to [0, 6]) -> E2M1 code with sign bit 3 = neg, ties to even.
__device__ __forceinline__ uint32_t e2m1_encode(float scaled, bool neg) {
  float m = fabsf(scaled);
  uint32_t c = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) + (m > 5.0f);
  return c | (neg ? 8u : 0u);
}

__device__ __forceinline__ float e4m3_decode(uint32_t c) {
  uint32_t e = (c >> 3) & 15u, m = c & 7u;
  float mag = e == 0 ? static_cast<float>(m) * 0.001953125f : bits_to_float(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ float ue8m0_decode(uint32_t c) { return bits_to_float(c << 23); }

enum CacheFormat : int { kFp8Window = 0, kNvfp4 = 1, kMxfp4 = 2 };

}  // namespace deepinfer
