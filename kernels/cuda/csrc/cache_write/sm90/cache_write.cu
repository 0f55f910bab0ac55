// Fused quantise + pack + paged scatter of KV-cache records (ops.cache_write), any arch >= sm_90.
// Records are written at cache + slot * row_bytes: an engine row may be wider than the record.
// One thread per channel pair; a quantisation block of B channels is B/2 consecutive lanes of one warp, so the
// block amax is a shuffle reduction. Record layouts: ops/cache.py (528 B fp8 window, 288 B nvfp4, 68 B mxfp4).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/formats.cuh"

namespace deepinfer {

// Explicit widening: torch's extension build defines __CUDA_NO_BFLOAT16_CONVERSIONS__, which removes the implicit
// __nv_bfloat16 -> float conversion.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int FMT, typename T>
__global__ void __launch_bounds__(256) cache_write_kernel(const T* __restrict__ x, const int64_t* __restrict__ slots,
                                                          uint8_t* __restrict__ cache, int tokens, int dim,
                                                          int row_bytes) {
  constexpr int kBlock = FMT == kNvfp4 ? 16 : 32;
  constexpr int kLanes = kBlock / 2;  // lanes per quantisation block
  const int pairs_per_token = dim / 2;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = static_cast<int64_t>(tokens) * pairs_per_token;
  const bool active = pair < total;
  const int token = active ? static_cast<int>(pair / pairs_per_token) : 0;
  const int p = active ? static_cast<int>(pair % pairs_per_token) : 0;
  float x0 = 0.f, x1 = 0.f;
  if (active) {
    x0 = to_float(x[static_cast<int64_t>(token) * dim + 2 * p]);
    x1 = to_float(x[static_cast<int64_t>(token) * dim + 2 * p + 1]);
  }
  float amax = fmaxf(fabsf(x0), fabsf(x1));
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  const int64_t slot = active ? slots[token] : -1;
  if (slot < 0) return;
  uint8_t* record = cache + slot * row_bytes;
  const int block = (2 * p) / kBlock;
  const bool leader = (p % kLanes) == 0;
  if constexpr (FMT == kFp8Window) {
    const float scale = pow2_ceil(__fdiv_rn(fmaxf(amax, 1e-4f), 448.0f));
    uint32_t c0, c1;
    e4m3_round(fminf(fmaxf(__fdiv_rn(x0, scale), -448.f), 448.f), &c0);
    e4m3_round(fminf(fmaxf(__fdiv_rn(x1, scale), -448.f), 448.f), &c1);
    record[2 * p] = static_cast<uint8_t>(c0);
    record[2 * p + 1] = static_cast<uint8_t>(c1);
    if (leader) record[dim + block] = static_cast<uint8_t>((float_to_bits(scale) >> 23) & 0xFFu);
  } else {
    float scale;
    uint32_t scale_byte;
    if constexpr (FMT == kNvfp4) {
      scale = e4m3_round(__fdiv_rn(fmaxf(amax, 0.01171875f), 6.0f), &scale_byte);
    } else {
      scale = pow2_ceil(__fdiv_rn(fmaxf(amax, 6.0f * 1.1754943508222875e-38f), 6.0f));
      scale_byte = (float_to_bits(scale) >> 23) & 0xFFu;
    }
    const uint32_t c0 = e2m1_encode(fminf(fmaxf(__fdiv_rn(x0, scale), -6.f), 6.f), x0 < 0.f);
    const uint32_t c1 = e2m1_encode(fminf(fmaxf(__fdiv_rn(x1, scale), -6.f), 6.f), x1 < 0.f);
    record[p] = static_cast<uint8_t>(c0 | (c1 << 4));
    if (leader) record[dim / 2 + block] = static_cast<uint8_t>(scale_byte);
  }
}

template <typename T>
static cudaError_t launch(const T* x, const int64_t* slots, uint8_t* cache, int tokens, int dim, int row_bytes,
                          int fmt, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(tokens) * dim / 2;
  if (pairs == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((pairs + 255) / 256));
  switch (fmt) {
    case kFp8Window:
      cache_write_kernel<kFp8Window, T><<<grid, 256, 0, stream>>>(x, slots, cache, tokens, dim, row_bytes);
      break;
    case kNvfp4:
      cache_write_kernel<kNvfp4, T><<<grid, 256, 0, stream>>>(x, slots, cache, tokens, dim, row_bytes);
      break;
    case kMxfp4:
      cache_write_kernel<kMxfp4, T><<<grid, 256, 0, stream>>>(x, slots, cache, tokens, dim, row_bytes);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace deepinfer

// dim must be a multiple of 32; the binding checks shapes and dtypes.
extern "C" cudaError_t deepinfer_cache_write_bf16(const void* x, const int64_t* slots, uint8_t* cache, int tokens,
                                                  int dim, int row_bytes, int fmt, cudaStream_t stream) {
  return deepinfer::launch(static_cast<const __nv_bfloat16*>(x), slots, cache, tokens, dim, row_bytes, fmt, stream);
}

extern "C" cudaError_t deepinfer_cache_write_f32(const void* x, const int64_t* slots, uint8_t* cache, int tokens,
                                                 int dim, int row_bytes, int fmt, cudaStream_t stream) {
  return deepinfer::launch(static_cast<const float*>(x), slots, cache, tokens, dim, row_bytes, fmt, stream);
}
