// Sparse MQA decode / verify with a sink (ops.sparse_attention) on tensor cores: warp-level
// mma.sync.m16n8k16 bf16 -> fp32 with ldmatrix operands, FlashAttention-2 / FlashMLA-decode style. Runs on every
// arch >= sm_80, built here for sm_90a / sm_100a / sm_103a.
//
// Problem per query row t: Q [H x D] (D <= 512), keys = values = gathered latent rows K [n x D], one key set per
// row shared by all heads. So S = Q K^T is an [H x BK] GEMM per key block and O += P K an [H x D] GEMM.
//
// Tiling. One CTA = (query row, 64 heads, key split). 8 warps; warp w owns head tile g = w % 4 (16 heads: the
// m16 of the MMA) and "half" c = w / 4. The pair (g, 0), (g, 1) shares its 16 heads:
//   * S phase: warp c computes S for its 16 heads over keys [32c, 32c + 32) of the 64-key block, full D
//     contraction (32 k16 steps x 4 n8 tiles = 128 MMAs per block per warp).
//   * softmax: the pair exchanges its per-row block maxima through shared memory, so both warps hold the same
//     running max m; each writes its bf16 probabilities to a shared P tile [64 heads x 64 keys].
//   * PV phase: warp c accumulates O for its 16 heads over all 64 keys of the block and over its channels:
//     16-channel chunks 2i + c (i = 0..15), i.e. interleaved so that D = 128 still splits evenly across c
//     (4 k16 steps x 32 n8 tiles = 128 MMAs per block per warp, balanced with the S phase).
// The O accumulator of a warp is 16 heads x 256 channels fp32 = 32 n8 tiles x 4 regs = 128 registers per thread;
// everything else (S 16 regs, fragments, softmax state) fits beside it under the 255-register cap of
// __launch_bounds__(256, 1) without spilling (compile_check.sh shows the counts).
//
// Shared memory (dynamic, 210,432 B; one CTA per SM):
//   Q tile     [64][520] bf16     66,560 B  (loaded once with cp.async, rows >= H zero-filled)
//   K blocks   2 x [64][520] bf16 133,120 B (double-buffered cp.async gather; invalid keys zero-filled)
//   P tile     [64][72] bf16       9,216 B
//   key valid  2 x [64] int, pair row maxima / row sums 2 x [64] float each.
// Rows are padded by 8 bf16 (16 B): row strides of 1040 B / 144 B put the 8 row addresses of every ldmatrix
// 8x8 matrix into 8 different 16-byte bank groups, so ldmatrix and the bf16x2 fragment stores are
// conflict-free. BK = 64 (not 32) halves the barriers per key and, with D = 512, one block is 64 KB of loads
// in flight while the other is computed; 2 x 64 KB + Q still fits the 227 KB opt-in limit.
//
// Online softmax in the log2 domain: logits are scaled by softmax_scale * log2(e); the running max starts at the
// sink logit and the running sum at 1 (the sink's zero value vector adds nothing to O). -1 indices and keys past
// topk get -inf logits and zero-filled rows, so a row with no valid key returns exactly zero.
//
// Split-K. With few rows (rows * head groups < #SMs / 2) the key blocks are split over gridDim.z CTAs; each
// writes its unnormalised fp32 O, running max and sum to a workspace and a combine kernel merges them. Only
// split 0 carries the sink; the others start from m = -inf, l = 0. The split rule, workspace layout and combine
// kernel are shared with the wgmma and tcgen05 kernels (../split_combine.cuh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../split_combine.cuh"

namespace deepinfer {
namespace mma_attention {

constexpr int kMaxDim = 512;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kHeads = 64;          // heads per CTA: 4 tiles of 16 (the MMA's m)
constexpr int kBlockKeys = 64;      // keys per pipeline stage
constexpr int kRowStride = kMaxDim + 8;     // bf16 elements per Q / K / O staging row (1040 B)
constexpr int kPStride = kBlockKeys + 8;    // bf16 elements per P row (144 B)
constexpr int kChunksPerWarp = kMaxDim / 32;  // 16-channel chunks of O per warp (2 warps share 16 heads)
constexpr float kLog2e = 1.4426950408889634f;

constexpr int kQBytes = kHeads * kRowStride * 2;
constexpr int kKBufferBytes = kBlockKeys * kRowStride * 2;
constexpr int kPBytes = kHeads * kPStride * 2;
constexpr int kKOffset = kQBytes;
constexpr int kPOffset = kKOffset + 2 * kKBufferBytes;
constexpr int kValidOffset = kPOffset + kPBytes;
constexpr int kMaxOffset = kValidOffset + 2 * kBlockKeys * 4;
constexpr int kSumOffset = kMaxOffset + 2 * kHeads * 4;
constexpr int kSmemBytes = kSumOffset + 2 * kHeads * 4;
static_assert(kKOffset % 16 == 0 && kPOffset % 16 == 0 && kValidOffset % 16 == 0, "16-byte aligned regions");
static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm_90 / sm_100 opt-in shared memory per block");
static_assert(kMaxDim <= split_combine::kMaxDim, "the combine kernel covers every head dim");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 writes 16 zero bytes (the source is then not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool fill) {
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Barrier for the two warps (64 threads) sharing head tile g; id 0 is __syncthreads.
__device__ __forceinline__ void pair_barrier(int g) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(g + 1), "r"(64) : "memory");
}

// ldmatrix x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i receives matrix i with
// lane l holding row l / 4, columns 2 (l % 4), 2 (l % 4) + 1 (low half = lower column). With .trans the matrix
// is transposed on the way: lane l holds rows 2 (l % 4), 2 (l % 4) + 1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D[16x8] += A[16x16] B[16x8]; g = lane / 4, q = lane % 4:
//   A: a0 (row g, cols 2q..2q+1), a1 (row g+8, cols 2q..), a2 (row g, cols 2q+8..), a3 (row g+8, cols 2q+8..)
//   B: b0 (k rows 2q..2q+1, col g), b1 (k rows 2q+8..2q+9, col g)
//   C: c0, c1 (row g, cols 2q, 2q+1), c2, c3 (row g+8, cols 2q, 2q+1)
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Issue the cp.async gather of key block `block` into K buffer `buf` and record which of its keys are valid.
// Thread t copies key t / 4, 16-byte chunks t % 4, t % 4 + 4, ... (4 threads cover 64 contiguous bytes).
__device__ __forceinline__ void gather_keys(uint8_t* smem, int buf, int block, const __nv_bfloat16* kv,
                                            const int64_t* row_indices, int topk, int dim) {
  const int key = threadIdx.x / 4, sub = threadIdx.x % 4;
  const int slot = block * kBlockKeys + key;
  const int64_t idx = slot < topk ? row_indices[slot] : -1;
  const bool valid = idx >= 0;
  const __nv_bfloat16* src = kv + (valid ? idx : 0) * dim;
  const uint32_t dst = smem_addr(smem + kKOffset + buf * kKBufferBytes) + key * kRowStride * 2;
  for (int chunk = sub; chunk < dim / 8; chunk += 4) cp_async_16(dst + chunk * 16, src + chunk * 8, valid);
  if (sub == 0) reinterpret_cast<int*>(smem + kValidOffset)[buf * kBlockKeys + key] = valid;
}

__global__ void __launch_bounds__(kThreads, 1) sparse_attention_mma_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int64_t* __restrict__ indices,
    const float* __restrict__ sink, __nv_bfloat16* __restrict__ out, float* __restrict__ partial_o,
    float* __restrict__ partial_ml, int rows, int heads, int dim, int topk, int blocks_per_split, float scale_log2) {
  extern __shared__ __align__(16) uint8_t smem[];
  const __nv_bfloat16* q_tile = reinterpret_cast<const __nv_bfloat16*>(smem);
  const __nv_bfloat16* p_tile = reinterpret_cast<const __nv_bfloat16*>(smem + kPOffset);
  const int* key_valid = reinterpret_cast<const int*>(smem + kValidOffset);
  float* pair_max = reinterpret_cast<float*>(smem + kMaxOffset);
  float* pair_sum = reinterpret_cast<float*>(smem + kSumOffset);

  const int row = blockIdx.x, head0 = blockIdx.y * kHeads, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = warp % 4, c = warp / 4;  // head tile, half
  const int group = lane / 4, quad = lane % 4;
  const bool tile_live = head0 + 16 * g < heads;
  const int key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  const int block_begin = split * blocks_per_split;
  const int block_end = min(block_begin + blocks_per_split, key_blocks);
  const int64_t* row_indices = indices + static_cast<int64_t>(row) * topk;

  // Q tile: thread t copies head row t / 4; heads past H are zero-filled (their results are never stored).
  {
    const int r = threadIdx.x / 4, sub = threadIdx.x % 4;
    const bool live = head0 + r < heads;
    const __nv_bfloat16* src = q + (static_cast<int64_t>(row) * heads + (live ? head0 + r : 0)) * dim;
    const uint32_t dst = smem_addr(smem) + r * kRowStride * 2;
    for (int chunk = sub; chunk < dim / 8; chunk += 4) cp_async_16(dst + chunk * 16, src + chunk * 8, live);
  }
  if (block_begin < block_end) gather_keys(smem, 0, block_begin, kv, row_indices, topk, dim);
  cp_async_commit();

  // This thread's two accumulator rows: local heads r_lo = 16 g + group and r_hi = r_lo + 8.
  const int r_lo = 16 * g + group, r_hi = r_lo + 8;
  float m[2], l[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = head0 + (j ? r_hi : r_lo);
    m[j] = split == 0 ? (h < heads ? sink[h] * kLog2e : 0.f) : -INFINITY;
    l[j] = (split == 0 && c == 0 && quad == 0) ? 1.f : 0.f;  // the sink's exp(0) counted once per row
  }
  float acc[2 * kChunksPerWarp][4];
#pragma unroll
  for (int j = 0; j < 2 * kChunksPerWarp; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // ldmatrix lane addressing (see the fragment layouts at mma_bf16):
  //  A from a row-major [row][col] tile: matrices (rows 0-7, cols 0-7) (rows 8-15, cols 0-7) (rows 0-7, cols 8-15)
  //    (rows 8-15, cols 8-15) = a0..a3, so lane l points at row l % 16, column 8 (l / 16).
  //  B of S = Q K^T: B[k = d][n = key] = K[key][d]; b0 wants d 2q..2q+1 of key g, which is what plain ldmatrix of
  //    the [key][d] tile gives. Matrices (keys 0-7, d 0-7) (keys 0-7, d 8-15) (keys 8-15, d 0-7) (keys 8-15,
  //    d 8-15) = b0, b1 of n-tile keys 0-7, then b0, b1 of n-tile keys 8-15: lane l points at key
  //    l % 8 + 8 (l / 16), d 8 ((l / 8) % 2).
  //  B of O = P V: B[k = key][n = d] = K[key][d]; b0 wants keys 2q..2q+1 of channel g, i.e. the transpose of the
  //    stored [key][d] 8x8 matrix, so ldmatrix .trans. Matrices (keys 0-7, d 0-7) (keys 8-15, d 0-7) (keys 0-7,
  //    d 8-15) (keys 8-15, d 8-15) = b0, b1 of n-tile d 0-7, then b0, b1 of n-tile d 8-15: lane l points at key
  //    l % 8 + 8 ((l / 8) % 2), d 8 (l / 16).
  const uint32_t q_lane = smem_addr(q_tile) + ((16 * g + lane % 16) * kRowStride + 8 * (lane / 16)) * 2;
  const uint32_t p_lane = smem_addr(p_tile) + ((16 * g + lane % 16) * kPStride + 8 * (lane / 16)) * 2;
  const uint32_t k_lane_s = ((32 * c + lane % 8 + 8 * (lane / 16)) * kRowStride + 8 * ((lane / 8) % 2)) * 2;
  const uint32_t k_lane_v = ((lane % 8 + 8 * ((lane / 8) % 2)) * kRowStride + 8 * (lane / 16) + 16 * c) * 2;

  for (int block = block_begin; block < block_end; ++block) {
    const int buf = (block - block_begin) % 2;
    cp_async_wait_all();
    __syncthreads();  // block's keys visible to all; every warp is done with the other buffer and with P
    if (block + 1 < block_end) gather_keys(smem, buf ^ 1, block + 1, kv, row_indices, topk, dim);
    cp_async_commit();
    if (!tile_live) continue;
    const uint32_t k_buf = smem_addr(smem + kKOffset + buf * kKBufferBytes);

    // S [16 heads x 32 keys]: n-tile nt covers keys 32 c + 8 nt .. + 7 of the block.
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll 2
    for (int k16 = 0; k16 < dim / 16; ++k16) {
      uint32_t a[4], b01[4], b23[4];
      ldmatrix_x4(a, q_lane + k16 * 32);
      ldmatrix_x4(b01, k_buf + k_lane_s + k16 * 32);
      ldmatrix_x4(b23, k_buf + k_lane_s + 16 * kRowStride * 2 + k16 * 32);
      mma_bf16(s[0], a, b01[0], b01[1]);
      mma_bf16(s[1], a, b01[2], b01[3]);
      mma_bf16(s[2], a, b23[0], b23[1]);
      mma_bf16(s[3], a, b23[2], b23[3]);
    }

    // Mask, scale, and this warp's row maxima over its 32 keys (the quad's 4 lanes share a row).
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 32 * c + 8 * nt + 2 * quad + (e & 1);
        s[nt][e] = key_valid[buf * kBlockKeys + key] ? s[nt][e] * scale_log2 : -INFINITY;
        block_max[e / 2] = fmaxf(block_max[e / 2], s[nt][e]);
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      block_max[j] = fmaxf(block_max[j], __shfl_xor_sync(0xFFFFFFFFu, block_max[j], 1));
      block_max[j] = fmaxf(block_max[j], __shfl_xor_sync(0xFFFFFFFFu, block_max[j], 2));
    }
    if (quad == 0) {
      pair_max[c * kHeads + r_lo] = block_max[0];
      pair_max[c * kHeads + r_hi] = block_max[1];
    }
    pair_barrier(g);
    float alpha[2], m_base[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float partner = pair_max[(1 - c) * kHeads + (j ? r_hi : r_lo)];
      const float m_new = fmaxf(m[j], fmaxf(block_max[j], partner));  // identical in both warps of the pair
      m_base[j] = m_new == -INFINITY ? 0.f : m_new;                     // no finite logit yet: all p are 0
      alpha[j] = exp2f(m[j] - m_base[j]);
      m[j] = m_new;
      l[j] *= alpha[j];
    }
    __nv_bfloat16* p_out = reinterpret_cast<__nv_bfloat16*>(smem + kPOffset);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float p0 = exp2f(s[nt][0] - m_base[0]), p1 = exp2f(s[nt][1] - m_base[0]);
      const float p2 = exp2f(s[nt][2] - m_base[1]), p3 = exp2f(s[nt][3] - m_base[1]);
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      const int col = 32 * c + 8 * nt + 2 * quad;
      *reinterpret_cast<uint32_t*>(p_out + r_lo * kPStride + col) = pack_bf16x2(p0, p1);
      *reinterpret_cast<uint32_t*>(p_out + r_hi * kPStride + col) = pack_bf16x2(p2, p3);
    }
#pragma unroll
    for (int j = 0; j < 2 * kChunksPerWarp; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }
    pair_barrier(g);  // both halves of P written

    // O [16 heads x this warp's channels] += P [16 x 64 keys] V [64 keys x channels].
#pragma unroll
    for (int k16 = 0; k16 < kBlockKeys / 16; ++k16) {
      uint32_t a[4];
      ldmatrix_x4(a, p_lane + k16 * 32);
#pragma unroll
      for (int i = 0; i < kChunksPerWarp; ++i) {
        if (16 * (2 * i + c) >= dim) continue;
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_buf + k_lane_v + (16 * k16 * kRowStride + 32 * i) * 2);
        mma_bf16(acc[2 * i], a, b[0], b[1]);
        mma_bf16(acc[2 * i + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait_all();  // nothing may still land in shared memory (no key blocks: only the Q copy was issued)

  // Row sums: reduce over the quad, then add the partner warp's half.
  float l_total[2] = {0.f, 0.f};
  if (tile_live) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      l[j] += __shfl_xor_sync(0xFFFFFFFFu, l[j], 1);
      l[j] += __shfl_xor_sync(0xFFFFFFFFu, l[j], 2);
    }
    if (quad == 0) {
      pair_sum[c * kHeads + r_lo] = l[0];
      pair_sum[c * kHeads + r_hi] = l[1];
    }
    pair_barrier(g);
    l_total[0] = pair_sum[r_lo] + pair_sum[kHeads + r_lo];
    l_total[1] = pair_sum[r_hi] + pair_sum[kHeads + r_hi];
  }

  if (partial_o != nullptr) {
    // Split-K: unnormalised fp32 O plus (m, l) per head for the combine kernel.
    if (!tile_live) return;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = head0 + (j ? r_hi : r_lo);
      if (h >= heads) continue;
      const int64_t slot = split_combine::partial_slot(split, rows, row, heads, h);
      if (c == 0 && quad == 0) split_combine::store_stats(partial_ml, slot, m[j], l_total[j]);
      float* dst = partial_o + slot * dim;
#pragma unroll
      for (int i = 0; i < kChunksPerWarp; ++i) {
        const int ch = 16 * (2 * i + c) + 2 * quad;
        if (ch >= dim) continue;
        reinterpret_cast<float2*>(dst + ch)[0] = make_float2(acc[2 * i][2 * j], acc[2 * i][2 * j + 1]);
        reinterpret_cast<float2*>(dst + ch + 8)[0] = make_float2(acc[2 * i + 1][2 * j], acc[2 * i + 1][2 * j + 1]);
      }
    }
    return;
  }

  // Normalise, stage bf16 O in the Q tile's space, then store 16-byte rows coalesced.
  __syncthreads();  // every warp is done reading Q
  if (tile_live) {
    __nv_bfloat16* o_tile = reinterpret_cast<__nv_bfloat16*>(smem);
    const float inv_lo = 1.f / l_total[0], inv_hi = 1.f / l_total[1];  // l >= 1: the max term is exp2(0)
#pragma unroll
    for (int i = 0; i < kChunksPerWarp; ++i) {
      const int ch = 16 * (2 * i + c) + 2 * quad;
      if (ch >= dim) continue;
#pragma unroll
      for (int h8 = 0; h8 < 2; ++h8) {
        const float* a = acc[2 * i + h8];
        *reinterpret_cast<uint32_t*>(o_tile + r_lo * kRowStride + ch + 8 * h8) = pack_bf16x2(a[0] * inv_lo, a[1] * inv_lo);
        *reinterpret_cast<uint32_t*>(o_tile + r_hi * kRowStride + ch + 8 * h8) = pack_bf16x2(a[2] * inv_hi, a[3] * inv_hi);
      }
    }
  }
  __syncthreads();
  const int chunks = dim / 8;
  for (int e = threadIdx.x; e < kHeads * chunks; e += kThreads) {
    const int r = e / chunks, chunk = e % chunks;
    if (head0 + r >= heads) break;  // rows are in order: every later e is past H too
    const uint4 v = *reinterpret_cast<const uint4*>(smem + (r * kRowStride + chunk * 8) * 2);
    *reinterpret_cast<uint4*>(out + (static_cast<int64_t>(row) * heads + head0 + r) * dim + chunk * 8) = v;
  }
}

}  // namespace mma_attention
}  // namespace deepinfer

// Key-split count for a launch (1 = no workspace needed); the rule is split_combine::split_count.
extern "C" cudaError_t deepinfer_sparse_attention_mma_splits(int rows, int heads, int topk, int* splits) {
  using namespace deepinfer::mma_attention;
  return deepinfer::split_combine::split_count<kHeads, kBlockKeys>(rows, heads, topk, splits);
}

// q [rows, heads, dim] bf16, kv [pool, dim] bf16 (16-byte aligned rows: dim % 16 == 0), indices [rows, topk]
// int64 (-1 unused), sink [heads] fp32, out [rows, heads, dim] bf16. With splits > 1, workspace holds
// splits * rows * heads * (dim + 2) floats.
extern "C" cudaError_t deepinfer_sparse_attention_mma_bf16(const void* q, const void* kv, const int64_t* indices,
                                                           const float* sink, void* out, float* workspace, int rows,
                                                           int heads, int dim, int topk, int splits, float scale,
                                                           cudaStream_t stream) {
  using namespace deepinfer;
  using namespace deepinfer::mma_attention;
  if (dim > kMaxDim || dim % 16 != 0 || dim <= 0 || splits < 1 || (splits > 1 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || heads == 0) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(sparse_attention_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kSmemBytes);
  if (err != cudaSuccess) return err;
  const int key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  const split_combine::Partials partials = split_combine::partials(workspace, splits, rows, heads, dim);
  const dim3 grid(rows, (heads + kHeads - 1) / kHeads, splits);
  sparse_attention_mma_kernel<<<grid, kThreads, kSmemBytes, stream>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(kv), indices, sink,
      static_cast<__nv_bfloat16*>(out), partials.o, partials.ml, rows, heads, dim, topk,
      split_combine::blocks_per_split(key_blocks, splits), scale * kLog2e);
  err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  return split_combine::combine(partials, static_cast<__nv_bfloat16*>(out), rows, heads, dim, splits, stream);
}
