// Sparse MQA decode / verify with a sink over gathered keys (ops.sparse_attention), CUDA cores, any arch >= sm_90.
// Grid: (query rows, heads / kHeads). Each CTA stages one chunk of kChunk gathered keys (K = V, D <= 512 bf16) in
// shared memory; warp w owns heads 2w and 2w+1, lane l owns channels l, l+32, ... (D/32 per lane) of their
// accumulators. Online softmax starts from the sink logit (zero value vector). This is the correctness baseline
// for the tensor-core (wgmma / tcgen05) versions; it does not reach the matrix roofline.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deepinfer {

constexpr int kMaxDim = 512;
constexpr int kWarps = 8;
constexpr int kHeads = 2 * kWarps;  // heads per CTA
constexpr int kChunk = 16;          // keys staged per step
constexpr int kPerLane = kMaxDim / 32;

__global__ void __launch_bounds__(kWarps * 32) sparse_decode_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int64_t* __restrict__ indices,
    const float* __restrict__ sink, __nv_bfloat16* __restrict__ out, int heads, int dim, int topk, float scale) {
  __shared__ __nv_bfloat16 keys[kChunk][kMaxDim];
  __shared__ bool valid[kChunk];
  const int row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float qv[2][kPerLane], acc[2][kPerLane], m[2], l[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = blockIdx.y * kHeads + 2 * warp + j;
    const bool live = h < heads;
    m[j] = live ? sink[h] : 0.f;
    l[j] = 1.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      qv[j][i] = (live && d < dim) ? __bfloat162float(q[(static_cast<int64_t>(row) * heads + h) * dim + d]) : 0.f;
      acc[j][i] = 0.f;
    }
  }
  for (int k0 = 0; k0 < topk; k0 += kChunk) {
    __syncthreads();
    for (int e = threadIdx.x; e < kChunk * kMaxDim; e += blockDim.x) {
      const int k = e / kMaxDim, d = e % kMaxDim;
      const int64_t idx = k0 + k < topk ? indices[static_cast<int64_t>(row) * topk + k0 + k] : -1;
      keys[k][d] = (idx >= 0 && d < dim) ? kv[idx * dim + d] : __float2bfloat16(0.f);
      if (d == 0) valid[k] = idx >= 0;
    }
    __syncthreads();
#pragma unroll 1
    for (int k = 0; k < kChunk; ++k) {
      if (!valid[k]) continue;
      float kd[kPerLane];
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) kd[i] = __bfloat162float(keys[k][lane + 32 * i]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) s = fmaf(qv[j][i], kd[i], s);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
        s *= scale;
        const float m_new = fmaxf(m[j], s);
        const float alpha = __expf(m[j] - m_new), p = __expf(s - m_new);
        l[j] = l[j] * alpha + p;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[j][i] = acc[j][i] * alpha + p * kd[i];
        m[j] = m_new;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = blockIdx.y * kHeads + 2 * warp + j;
    if (h >= heads) continue;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < dim) out[(static_cast<int64_t>(row) * heads + h) * dim + d] = __float2bfloat16(acc[j][i] / l[j]);
    }
  }
}

}  // namespace deepinfer

// q [rows, heads, dim] bf16, kv [pool, dim] bf16, indices [rows, topk] int64 (-1 unused), sink [heads] fp32.
extern "C" cudaError_t deepinfer_sparse_decode_bf16(const void* q, const void* kv, const int64_t* indices,
                                                    const float* sink, void* out, int rows, int heads, int dim,
                                                    int topk, float scale, cudaStream_t stream) {
  if (dim > deepinfer::kMaxDim) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const dim3 grid(rows, (heads + deepinfer::kHeads - 1) / deepinfer::kHeads);
  deepinfer::sparse_decode_kernel<<<grid, deepinfer::kWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(kv), indices, sink,
      static_cast<__nv_bfloat16*>(out), heads, dim, topk, scale);
  return cudaGetLastError();
}
