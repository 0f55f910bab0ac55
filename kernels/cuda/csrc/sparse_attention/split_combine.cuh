// Split-K of the tensor-core sparse attention kernels (sparse_attention_mma.cu, sparse_attention_wgmma.cu,
// sparse_attention_tcgen05.cu): how many CTAs share one query row's key blocks, the workspace they write and the
// kernel that merges it. One copy, because binding.cpp allocates the workspace the same way for all three (from
// the *_splits answer), so they must not drift apart in what it holds.
//
// Contract for an attention kernel launched with gridDim.z = splits > 1:
//   * split s covers key blocks [s * blocks_per_split, min((s + 1) * blocks_per_split, key_blocks)).
//   * per (row, head) it writes its unnormalised fp32 O_s and (m_s, l_s) at partial_slot(s, ...): m_s a reference
//     max in the log2 domain (logits scaled by softmax_scale * log2(e)), l_s = sum 2^(logit - m_s) and O_s scaled
//     by the same 2^-m_s. m_s need not be the exact maximum (the tcgen05 kernel raises it lazily); the merge only
//     needs O_s and l_s to share it.
//   * the sink enters through split 0 alone, whose running max starts at the sink logit and sum at 1 (the sink's
//     value vector is zero); every other split starts from m = -inf, l = 0. So the merge adds no sink term.
// Workspace (splits * rows * heads * (dim + 2) floats): O [splits, rows, heads, dim], then (m, l) [splits, rows,
// heads, 2].
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deepinfer {
namespace split_combine {

constexpr int kMaxSplits = 16;
constexpr int kMinBlocksPerSplit = 2;
constexpr int kMaxDim = 512;                  // the merge kernel covers head dims up to this, 4 channels a thread
constexpr int kCombineThreads = kMaxDim / 4;

// Key-split count for a launch of CTAs of HeadsPerCta heads and BlockKeys-key blocks (1 = no workspace needed).
// Splits only when rows x head groups leave at least half the SMs idle, keeping >= kMinBlocksPerSplit key blocks
// per split.
template <int HeadsPerCta, int BlockKeys>
inline cudaError_t split_count(int rows, int heads, int topk, int* splits) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int ctas = rows * ((heads + HeadsPerCta - 1) / HeadsPerCta);
  const int key_blocks = (topk + BlockKeys - 1) / BlockKeys;
  int n = ctas > 0 ? sms / ctas : 1;
  n = min(n, min(kMaxSplits, key_blocks / kMinBlocksPerSplit));
  if (n > 1) {
    const int per_split = (key_blocks + n - 1) / n;
    n = (key_blocks + per_split - 1) / per_split;  // no empty splits
  }
  *splits = max(n, 1);
  return cudaSuccess;
}

inline int blocks_per_split(int key_blocks, int splits) { return (key_blocks + splits - 1) / splits; }

// The workspace's two arrays; both null without split-K, which tells the attention kernel to write bf16 O itself.
struct Partials {
  float* o;
  float* ml;
};

inline Partials partials(float* workspace, int splits, int rows, int heads, int dim) {
  if (splits == 1) return {nullptr, nullptr};
  return {workspace, workspace + static_cast<int64_t>(splits) * rows * heads * dim};
}

// Index of (split, row, head) in both arrays: O row `slot` (dim floats) and (m, l) pair `slot`.
__device__ __forceinline__ int64_t partial_slot(int split, int rows, int row, int heads, int head) {
  return (static_cast<int64_t>(split) * rows + row) * heads + head;
}

__device__ __forceinline__ void store_stats(float* ml, int64_t slot, float m, float l) {
  reinterpret_cast<float2*>(ml)[slot] = make_float2(m, l);
}

// Internal linkage: each including .cu gets its own kernel, so the launch stubs of the translation units linked
// into one extension do not collide.
namespace {

// Merge the split partials of one (row, head): O = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s.
// Thread t owns channels 4t .. 4t + 3.
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const float* __restrict__ partial_o,
                                                                  const float* __restrict__ partial_ml,
                                                                  __nv_bfloat16* __restrict__ out, int rows,
                                                                  int heads, int dim, int splits) {
  const int row = blockIdx.x, h = blockIdx.y;
  const int64_t split_stride = static_cast<int64_t>(rows) * heads;
  const int64_t slot0 = static_cast<int64_t>(row) * heads + h;
  const float2* ml = reinterpret_cast<const float2*>(partial_ml);
  float m_max = -INFINITY;
  for (int s = 0; s < splits; ++s) m_max = fmaxf(m_max, ml[s * split_stride + slot0].x);
  const float m_base = m_max == -INFINITY ? 0.f : m_max;
  float l_sum = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float2 v = ml[s * split_stride + slot0];
    l_sum += exp2f(v.x - m_base) * v.y;
  }
  const int ch = 4 * threadIdx.x;
  if (ch >= dim) return;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < splits; ++s) {
    const float w = exp2f(ml[s * split_stride + slot0].x - m_base);
    const float4 v = *reinterpret_cast<const float4*>(partial_o + (s * split_stride + slot0) * dim + ch);
    o.x += w * v.x;
    o.y += w * v.y;
    o.z += w * v.z;
    o.w += w * v.w;
  }
  const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x * inv, o.y * inv);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(o.z * inv, o.w * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(out + slot0 * dim + ch) = packed;
}

// out [rows, heads, dim] bf16 from the partials of `splits` splits (dim % 4 == 0, <= kMaxDim).
inline cudaError_t combine(const Partials& partials, __nv_bfloat16* out, int rows, int heads, int dim, int splits,
                           cudaStream_t stream) {
  combine_kernel<<<dim3(rows, heads), kCombineThreads, 0, stream>>>(partials.o, partials.ml, out, rows, heads, dim,
                                                                    splits);
  return cudaGetLastError();
}

}  // namespace
}  // namespace split_combine
}  // namespace deepinfer
