// Sparse MQA decode / verify with a sink (ops.sparse_attention) on Hopper warpgroup MMA: wgmma.mma_async
// m64n64k16 bf16 -> fp32. sm_90a only (wgmma does not exist elsewhere); the file still builds for sm_100a /
// sm_103a with empty kernel bodies and the launcher returns cudaErrorNotSupported off compute capability 9.0.
//
// Problem per query row t: Q [H x D] (D <= 512, D % 64 == 0), keys = values = gathered latent rows K [n x D], one
// key set per row shared by all heads: S = Q K^T per key block, O += P K. Same math as sparse_attention_mma.cu.
//
// Tiling. One CTA = (query row, 64 heads, key split), two warpgroups (256 threads), 64-key blocks.
//   * WG0 ("softmax") computes the whole S [64 heads x 64 keys] with D/16 m64n64k16 wgmma (A = Q, B = the key
//     block, both in shared memory), runs the online softmax on its accumulators and turns them into bf16 P
//     fragments in registers. Each warp owns 16 full rows of S, so row max / row sum need only quad shuffles.
//   * WG1 ("loader") issues every cp.async (Q once, then the next key block while the current one is consumed).
//   * P V is split by channels: WG c accumulates the 64-channel column blocks c, c + 2, c + 4, c + 6 (interleaved
//     so D = 128 still splits evenly) with register-A wgmma: WG0 feeds its P registers directly (the m64nNk16 f32
//     accumulator layout of S is the bf16 A fragment layout of the next wgmma, see "P fragments" in the kernel),
//     WG1 reads the same fragments from shared memory, thread t from the slot WG0's thread t wrote.
//   O is 64 heads x 256 channels fp32 per warpgroup: 4 slots of m64n64 accumulators = 128 registers per thread.
// The kernel is a template on CB = D / 64 so every wgmma is issued unconditionally (see the kernel).
// Why one S warpgroup with N = 64 and not S split by keys across both (N = 32 each): every k16 step re-reads the
// 2 KB A tile (Q) from shared memory. At the bf16 tensor-core peak (2048 FMA/clk/SM) an m64n32k16 takes 16 clk
// and reads 3 KB (192 B/clk), above the 128 B/clk shared memory delivers; m64n64k16 takes 32 clk for 4 KB
// (128 B/clk), and register-A P V reads only its 2 KB B tile per 32 clk. Assuming wgmma operand fetches share
// that bandwidth, shared memory and not the tensor core bounds this kernel, so the split that reads least wins.
//
// Shared memory (dynamic, 208,384 B with the 1 KB alignment slack; one CTA per SM):
//   Q          8 column blocks x [64 rows x 128 B]  65,536 B   (rows >= H zero-filled)
//   K          2 buffers x 8 column blocks x 8 KB  131,072 B   (invalid keys zero-filled; reused to stage O)
//   P          4 k16 steps x 128 threads x 16 B      8,192 B   (WG0's fragments for WG1)
//   alpha, row sums  2 x 128 threads x 8 B; key valid flags 2 x [64] int.
// Tile layout (Q and each K buffer): column block cb = channels [64 cb, 64 cb + 64) is a [64 rows x 128 B] tile
// at cb * 8 KB; row r starts at r * 128; its 16-byte chunk c (channels 64 cb + 8c .. + 7) is stored at chunk
// position c ^ (r % 8). That is the 128-byte swizzle (PTX ISA 9.7.15.5.1.2 "Shared Memory Matrix Layout": the
// 128B swizzle atom is 8 x 8 16-byte elements, the chunk index XORed with the row within the 1024-byte atom;
// every tile starts on a 1024-byte boundary so the pattern's base offset is 0, 9.7.15.5.1.2.2). The same bytes
// serve three operands:
//   S:   A = Q  K-major ([head][d], d contiguous), SBO = 1024 (next 8 rows), LBO unused for swizzled K-major;
//        B = K  K-major ([key][d]): B[k = d][n = key], the default (imm-trans-b = 0);
//        k16 step s reads column block s / 4 at byte offset 32 (s % 4) inside the 128-byte row: the swizzle is a
//        function of the address bits, so advancing the start address inside the atom selects the chunks.
//   P V: B = K  MN-major: B[k = key][n = d] with d contiguous (imm-trans-b = 1); the canonical MN-major 128B
//        layout is 64 channels x 8 keys per 1024-byte atom, SBO = 1024 (next 8 keys along K), LBO = 8 KB (next
//        64 channels along N, not exercised at N = 64); k16 step s starts at key row 16 s.
//
// Pipeline (named barriers, 256 threads each; iteration j, buffer j % 2):
//   WG1: wait its cp.async of block j, fence.proxy.async (cp.async writes are generic-proxy writes, wgmma reads
//        through the async proxy: 9.7.15.7.1), arrive KEYS; wait its P V of block j - 1, sync FREE, issue the
//        gather of block j + 1 into the other buffer, sync PROBS, load P and alpha, rescale, issue P V (no wait).
//   WG0: wait its P V of block j - 1, sync KEYS, arrive FREE, issue S(j) and wait for it, softmax, store P and
//        alpha, arrive PROBS, rescale, issue P V (no wait).
// So the gather of block j + 1 overlaps S(j), the softmax and P V(j), and S(j + 1) overlaps WG1's P V(j).
// Each warpgroup arrives at a barrier for phase j + 1 only after passing a barrier that the other warpgroup
// arrives at after its wait of phase j (FREE(j + 1) after KEYS(j + 1), KEYS(j + 1) after PROBS(j), PROBS(j + 1)
// after KEYS(j + 1)), so arrivals of two phases never mix. A barrier arrive makes the arriving thread's prior
// shared-memory accesses performed for the waiting side (PTX ISA "bar, barrier"), which orders P, alpha, the
// valid flags and the reuse of the P slots and of the key buffers.
//
// Online softmax in the log2 domain exactly as the mma kernel: logits scaled by softmax_scale * log2(e); running
// max starts at the sink logit, running sum at 1 (the sink's zero value vector adds nothing to O); -1 indices and
// keys past topk get -inf logits and zero rows, so a row with no valid key returns exact zeros. O is rescaled only
// when some row of the warp raised its max (alpha != 1), which stops happening after the first blocks.
//
// Split-K (few rows): the key-split rule, workspace layout and combine kernel shared with the mma and tcgen05
// kernels (../split_combine.cuh); only split 0 carries the sink.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/device.cuh"
#include "../split_combine.cuh"

namespace deepinfer {
namespace wgmma_attention {

constexpr int kMaxDim = 512;
constexpr int kHeads = 64;                  // heads per CTA: the wgmma M
constexpr int kBlockKeys = 64;              // keys per pipeline stage: S's N, four k16 steps of P V
constexpr int kWarpgroup = 128;
constexpr int kThreads = 2 * kWarpgroup;
constexpr int kColBlockChannels = 64;       // bf16 channels per 128-byte swizzled row
constexpr int kMaxColBlocks = kMaxDim / kColBlockChannels;
constexpr int kTileBytes = 64 * 128;        // one column block of 64 rows
constexpr int kStageStride = kMaxDim + 8;   // bf16 per row of the output staging tile (1040 B: conflict-free)
constexpr float kLog2e = 1.4426950408889634f;

constexpr int kQOffset = 0;
constexpr int kKOffset = kQOffset + kMaxColBlocks * kTileBytes;
constexpr int kKBufferBytes = kMaxColBlocks * kTileBytes;
constexpr int kPOffset = kKOffset + 2 * kKBufferBytes;
constexpr int kAlphaOffset = kPOffset + 4 * kWarpgroup * 16;
constexpr int kSumOffset = kAlphaOffset + kWarpgroup * 8;
constexpr int kValidOffset = kSumOffset + kWarpgroup * 8;
constexpr int kLayoutBytes = kValidOffset + 2 * kBlockKeys * 4;
constexpr int kSmemBytes = kLayoutBytes + 1024;  // slack to align the base to the 1024-byte swizzle atom
static_assert(kKOffset % 1024 == 0 && kKBufferBytes % 1024 == 0, "swizzled tiles start on 1024-byte atoms");
static_assert(kHeads * kStageStride * 2 <= 2 * kKBufferBytes, "output staging fits in the key buffers");
static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm_90 opt-in shared memory per block");
static_assert(kMaxDim <= split_combine::kMaxDim, "the combine kernel covers every head dim");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Named barrier ids (0 is __syncthreads).
constexpr int kBarKeys = 1;   // WG1 -> WG0: key block (and Q) landed and fenced for the async proxy
constexpr int kBarFree = 2;   // WG0 -> WG1: WG0's P V of the previous block is done, its buffer may be refilled
constexpr int kBarProbs = 3;  // WG0 -> WG1: P fragments and alpha of this block are in shared memory

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
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The compiler sees a wgmma as a synchronous asm that has produced its accumulators; this empty asm redefines
// them after the wait so no read or write of them is scheduled before it.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Matrix descriptor (PTX ISA 9.7.15.5.1.2.2): bits 0-13 start address >> 4, 16-29 leading dimension byte offset
// >> 4, 32-45 stride dimension byte offset >> 4, 49-51 base offset (0: tiles start on 1024-byte atoms), 62-63
// swizzle mode (1 = 128-byte).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | 1ull << 62;
}

// Byte offset of 16-byte chunk `chunk` (channels 8 chunk .. + 7) of row `row` in a swizzled [64 x D] tile.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return (chunk >> 3) * kTileBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

#define DEEPINFER_ACC32(c, d)                                                                                    \
  c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), c(d[8]), c(d[9]), c(d[10]), c(d[11]),    \
      c(d[12]), c(d[13]), c(d[14]), c(d[15]), c(d[16]), c(d[17]), c(d[18]), c(d[19]), c(d[20]), c(d[21]), c(d[22]), \
      c(d[23]), c(d[24]), c(d[25]), c(d[26]), c(d[27]), c(d[28]), c(d[29]), c(d[30]), c(d[31])
#define DEEPINFER_ACC32_LIST                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// D[64 x 64] (+)= A[64 x 16] B[16 x 64]; A and B through descriptors, both K-major (imm-trans-a = imm-trans-b =
// 0). Accumulate = false is scale-d = 0 (D = A B): the first k16 step then needs no zeroed accumulator, so no
// ordinary instruction writes these registers while a wgmma group is in flight.
// D layout (9.7.15.5.1.1.1, Figure "m64nNk16 accumulator D"): warp w of the warpgroup owns rows 16 w .. 16 w + 15;
// with g = lane / 4, q = lane % 4, d[4 j + e] is row 16 w + g + 8 (e / 2), column 8 j + 2 q + (e % 2).
template <bool Accumulate>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc) {
  if constexpr (Accumulate) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DEEPINFER_ACC32_LIST
                 ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : DEEPINFER_ACC32("+f", d)
                 : "l"(a_desc), "l"(b_desc)
                 : "memory");
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DEEPINFER_ACC32_LIST
                 ", %32, %33, 0, 1, 1, 0, 0;\n"
                 : DEEPINFER_ACC32("=f", d)
                 : "l"(a_desc), "l"(b_desc)
                 : "memory");
  }
}

// D[64 x 64] += A[64 x 16] B[16 x 64]; A from registers, B MN-major through its descriptor (imm-trans-b = 1).
// A layout (Figure "m64nNk16 register fragment for matrix A"): warp w owns rows 16 w .. + 15; a[0] = (row g,
// cols 2q, 2q + 1), a[1] = (row g + 8, cols 2q, 2q + 1), a[2] = (row g, cols 2q + 8, + 9), a[3] = (row g + 8,
// cols 2q + 8, + 9), the lower column in the low half.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DEEPINFER_ACC32_LIST
               ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
               : DEEPINFER_ACC32("+f", d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc)
               : "memory");
}

#undef DEEPINFER_ACC32_LIST
#undef DEEPINFER_ACC32

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One thread's share of a swizzled [64 x 64 CB] tile copy: 16-byte chunk `sub` (0..7) of every column block of
// `row`. Eight consecutive threads cover one 128-byte row segment, so each warp-wide cp.async moves 4 full rows.
template <int CB>
__device__ __forceinline__ void copy_row(uint32_t tile, int row, const __nv_bfloat16* src, bool fill, int sub) {
#pragma unroll
  for (int cb = 0; cb < CB; ++cb) {
    cp_async_16(tile + swizzled(row, 8 * cb + sub), src + kColBlockChannels * cb + 8 * sub, fill);
  }
}

// WG1 thread t gathers keys t / 8 + 16 i (i = 0..3) of key block `block` and records which are valid.
template <int CB>
__device__ __forceinline__ void gather_keys(uint32_t k_tile, int* valid, int block, const __nv_bfloat16* kv,
                                            const int64_t* row_indices, int topk, int t) {
  const int sub = t % 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = t / 8 + 16 * i;
    const int slot = block * kBlockKeys + key;
    const int64_t idx = slot < topk ? row_indices[slot] : -1;
    const bool ok = idx >= 0;
    copy_row<CB>(k_tile, key, kv + (ok ? idx : 0) * (kColBlockChannels * CB), ok, sub);
    if (sub == 0) valid[key] = ok;
  }
}

// S [64 heads x 64 keys] = Q K^T over 4 CB k16 steps; step s reads column block s / 4 at byte 32 (s % 4) of the
// 128-byte rows (descriptor units of 16 bytes).
template <int CB>
__device__ __forceinline__ void issue_s(float (&s)[32], uint64_t q_desc, uint64_t k_desc) {
  wgmma_ss<false>(s, q_desc, k_desc);
#pragma unroll
  for (int step = 1; step < 4 * CB; ++step) {
    const uint64_t offset = (step / 4) * (kTileBytes >> 4) + (step % 4) * 2;
    wgmma_ss<true>(s, q_desc + offset, k_desc + offset);
  }
}

// Column blocks of warpgroup WG in P V: WG, WG + 2, ... below CB; slot i holds block 2 i + WG.
template <int CB, int WG>
constexpr int kSlots = (CB - WG + 1) / 2;

// O (this warpgroup's column blocks) += P [64 x 64 keys] V [64 keys x channels]. The B tile of k16 step ks and
// column block cb starts at key row 16 ks of that block.
template <int CB, int WG>
__device__ __forceinline__ void issue_pv(float (&o)[(CB + 1) / 2][32], const uint32_t (&p)[16], uint32_t k_tile) {
#pragma unroll
  for (int ks = 0; ks < kBlockKeys / 16; ++ks) {
    const uint32_t a[4] = {p[4 * ks], p[4 * ks + 1], p[4 * ks + 2], p[4 * ks + 3]};
#pragma unroll
    for (int i = 0; i < kSlots<CB, WG>; ++i) {
      wgmma_rs(o[i], a, smem_desc(k_tile + (2 * i + WG) * kTileBytes + ks * 16 * 128, kTileBytes, 1024));
    }
  }
}

// O rows r_lo (registers e = 0, 1 of each quadruple) and r_hi (e = 2, 3) times alpha, skipped when no row of the
// warp changed its max.
template <int CB, int WG>
__device__ __forceinline__ void rescale(float (&o)[(CB + 1) / 2][32], float alpha_lo, float alpha_hi) {
  if (__all_sync(0xFFFFFFFFu, alpha_lo == 1.f && alpha_hi == 1.f)) return;
#pragma unroll
  for (int i = 0; i < kSlots<CB, WG>; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      o[i][4 * j] *= alpha_lo;
      o[i][4 * j + 1] *= alpha_lo;
      o[i][4 * j + 2] *= alpha_hi;
      o[i][4 * j + 3] *= alpha_hi;
    }
  }
}

template <int CB, int WG>
__device__ __forceinline__ void pin_slots(float (&o)[(CB + 1) / 2][32]) {
#pragma unroll
  for (int i = 0; i < kSlots<CB, WG>; ++i) pin(o[i]);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// CB = head dim / 64 column blocks, a template parameter so every wgmma is issued unconditionally (a wgmma under
// a data-dependent branch leaves its accumulators defined by a join, which makes ptxas serialise the pipeline).
template <int CB>
__global__ void __launch_bounds__(kThreads, 1) sparse_attention_wgmma_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int64_t* __restrict__ indices,
    const float* __restrict__ sink, __nv_bfloat16* __restrict__ out, float* __restrict__ partial_o,
    float* __restrict__ partial_ml, int rows, int heads, int topk, int blocks_per_split, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kDim = kColBlockChannels * CB;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024;
  const uint32_t base = smem_addr(smem);
  int* valid = reinterpret_cast<int*>(smem + kValidOffset);
  uint4* p_slots = reinterpret_cast<uint4*>(smem + kPOffset);
  float2* alpha_slots = reinterpret_cast<float2*>(smem + kAlphaOffset);
  float2* sum_slots = reinterpret_cast<float2*>(smem + kSumOffset);

  const int row = blockIdx.x, head0 = blockIdx.y * kHeads, split = blockIdx.z;
  const int wg = threadIdx.x / kWarpgroup, t = threadIdx.x % kWarpgroup;
  const int lane = t % 32, quad = lane % 4;
  const int r_lo = 16 * (t / 32) + lane / 4, r_hi = r_lo + 8;  // this thread's accumulator rows (local heads)
  const int key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  const int block_begin = split * blocks_per_split;
  const int block_end = min(block_begin + blocks_per_split, key_blocks);
  const int64_t* row_indices = indices + static_cast<int64_t>(row) * topk;

  float o[(CB + 1) / 2][32];
#pragma unroll
  for (int i = 0; i < (CB + 1) / 2; ++i) {
#pragma unroll
    for (int j = 0; j < 32; ++j) o[i][j] = 0.f;
  }
  float m[2], l[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = head0 + (j ? r_hi : r_lo);
    m[j] = split == 0 ? (h < heads ? sink[h] * kLog2e : 0.f) : -INFINITY;
    l[j] = (split == 0 && quad == 0) ? 1.f : 0.f;  // the sink's exp(0), counted once per row
  }

  if (wg == 0) {
    const uint64_t q_desc = smem_desc(base + kQOffset, 16, 1024);
    for (int block = block_begin; block < block_end; ++block) {
      const int buf = (block - block_begin) % 2;
      const uint32_t k_tile = base + kKOffset + buf * kKBufferBytes;
      // P V of the previous block. Waited for here, before S is issued, and not with wait_group 1 after S: ptxas
      // serialises every wgmma of the kernel when a wait_group N > 0 leaves a group in flight across this loop.
      // WG1's P V keeps the tensor cores busy meanwhile. FREE is arrived at after KEYS is passed, so WG0 cannot
      // arrive at FREE twice before WG1 has waited on it once.
      wgmma_wait<0>();
      pin_slots<CB, 0>(o);
      bar_sync(kBarKeys);
      bar_arrive(kBarFree);
      float s[32];
      wgmma_fence();
      issue_s<CB>(s, q_desc, smem_desc(k_tile, 16, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      pin(s);

      // Mask, scale, row maxima over the quad (its 4 lanes hold the 64 columns of rows r_lo / r_hi).
      const int* block_valid = valid + buf * kBlockKeys;
      float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int2 ok = *reinterpret_cast<const int2*>(block_valid + 8 * j + 2 * quad);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[4 * j + e] = ((e % 2) ? ok.y : ok.x) ? s[4 * j + e] * scale_log2 : -INFINITY;
          block_max[e / 2] = fmaxf(block_max[e / 2], s[4 * j + e]);
        }
      }
      float alpha[2], m_base[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        block_max[j] = fmaxf(block_max[j], __shfl_xor_sync(0xFFFFFFFFu, block_max[j], 1));
        block_max[j] = fmaxf(block_max[j], __shfl_xor_sync(0xFFFFFFFFu, block_max[j], 2));
        const float m_new = fmaxf(m[j], block_max[j]);
        m_base[j] = m_new == -INFINITY ? 0.f : m_new;  // no finite logit yet: every p is 0
        alpha[j] = exp2f(m[j] - m_base[j]);
        m[j] = m_new;
        l[j] *= alpha[j];
      }
      // P fragments: p[4 ks + r] is register r of the A fragment of k16 step ks. Register 0 (row g, keys
      // 16 ks + 2q, + 1) is d[8 ks], d[8 ks + 1] (column chunk j = 2 ks, row g); register 1 (row g + 8) is
      // d[8 ks + 2], d[8 ks + 3]; registers 2, 3 (keys + 8) are the same from chunk 2 ks + 1: d[8 ks + 4 .. 7].
      uint32_t p[16];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(s[4 * j] - m_base[0]), p1 = exp2f(s[4 * j + 1] - m_base[0]);
        const float p2 = exp2f(s[4 * j + 2] - m_base[1]), p3 = exp2f(s[4 * j + 3] - m_base[1]);
        l[0] += p0 + p1;
        l[1] += p2 + p3;
        p[2 * j] = pack_bf16x2(p0, p1);
        p[2 * j + 1] = pack_bf16x2(p2, p3);
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        p_slots[ks * kWarpgroup + t] = make_uint4(p[4 * ks], p[4 * ks + 1], p[4 * ks + 2], p[4 * ks + 3]);
      }
      alpha_slots[t] = make_float2(alpha[0], alpha[1]);
      bar_arrive(kBarProbs);
      rescale<CB, 0>(o, alpha[0], alpha[1]);
      wgmma_fence();
      issue_pv<CB, 0>(o, p, k_tile);
      wgmma_commit();
    }
    wgmma_wait<0>();
    pin_slots<CB, 0>(o);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      l[j] += __shfl_xor_sync(0xFFFFFFFFu, l[j], 1);
      l[j] += __shfl_xor_sync(0xFFFFFFFFu, l[j], 2);
    }
    sum_slots[t] = make_float2(l[0], l[1]);
  } else {
    // Q: thread t copies head rows t / 8 + 16 i; heads past H are zero-filled (their results are never stored).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = t / 8 + 16 * i;
      const bool live = head0 + r < heads;
      const __nv_bfloat16* src = q + (static_cast<int64_t>(row) * heads + (live ? head0 + r : 0)) * kDim;
      copy_row<CB>(base + kQOffset, r, src, live, t % 8);
    }
    if (block_begin < block_end) gather_keys<CB>(base + kKOffset, valid, block_begin, kv, row_indices, topk, t);
    cp_async_commit();
    for (int block = block_begin; block < block_end; ++block) {
      const int buf = (block - block_begin) % 2;
      cp_async_wait_all();
      fence_proxy_async();
      bar_arrive(kBarKeys);
      wgmma_wait<0>();  // this warpgroup's P V of the previous block: registers and key buffer released
      bar_sync(kBarFree);
      if (block + 1 < block_end) {
        gather_keys<CB>(base + kKOffset + (buf ^ 1) * kKBufferBytes, valid + (buf ^ 1) * kBlockKeys, block + 1, kv,
                        row_indices, topk, t);
      }
      cp_async_commit();
      bar_sync(kBarProbs);
      pin_slots<CB, 1>(o);
      uint32_t p[16];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint4 v = p_slots[ks * kWarpgroup + t];
        p[4 * ks] = v.x;
        p[4 * ks + 1] = v.y;
        p[4 * ks + 2] = v.z;
        p[4 * ks + 3] = v.w;
      }
      const float2 alpha = alpha_slots[t];
      rescale<CB, 1>(o, alpha.x, alpha.y);
      wgmma_fence();
      issue_pv<CB, 1>(o, p, base + kKOffset + buf * kKBufferBytes);
      wgmma_commit();
    }
    wgmma_wait<0>();
    pin_slots<CB, 1>(o);
    cp_async_wait_all();  // with no key block only the Q copy was issued; it must land before smem is reused
  }
  __syncthreads();  // row sums published; every wgmma and cp.async of the CTA is complete
  const float2 l_total = sum_slots[t];

  if (partial_o != nullptr) {
    // Split-K: unnormalised fp32 O plus (max, sum) per head for the combine kernel.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = head0 + (j ? r_hi : r_lo);
      if (h >= heads) continue;
      const int64_t slot = split_combine::partial_slot(split, rows, row, heads, h);
      if (wg == 0 && quad == 0) split_combine::store_stats(partial_ml, slot, m[j], j ? l_total.y : l_total.x);
      float* dst = partial_o + slot * kDim;
#pragma unroll
      for (int i = 0; i < (CB + 1) / 2; ++i) {
        const int cb = 2 * i + wg;
        if (cb >= CB) continue;
#pragma unroll
        for (int c8 = 0; c8 < 8; ++c8) {
          const int ch = kColBlockChannels * cb + 8 * c8 + 2 * quad;
          *reinterpret_cast<float2*>(dst + ch) = make_float2(o[i][4 * c8 + 2 * j], o[i][4 * c8 + 2 * j + 1]);
        }
      }
    }
    return;
  }

  // Normalise, stage bf16 O in the key buffers, then store 16-byte row chunks coalesced.
  __nv_bfloat16* o_tile = reinterpret_cast<__nv_bfloat16*>(smem + kKOffset);
  const float inv_lo = 1.f / l_total.x, inv_hi = 1.f / l_total.y;  // l >= 1: the max term is exp2(0)
#pragma unroll
  for (int i = 0; i < (CB + 1) / 2; ++i) {
    const int cb = 2 * i + wg;
    if (cb >= CB) continue;
#pragma unroll
    for (int c8 = 0; c8 < 8; ++c8) {
      const int ch = kColBlockChannels * cb + 8 * c8 + 2 * quad;
      const float* a = o[i] + 4 * c8;
      *reinterpret_cast<uint32_t*>(o_tile + r_lo * kStageStride + ch) = pack_bf16x2(a[0] * inv_lo, a[1] * inv_lo);
      *reinterpret_cast<uint32_t*>(o_tile + r_hi * kStageStride + ch) = pack_bf16x2(a[2] * inv_hi, a[3] * inv_hi);
    }
  }
  __syncthreads();
  constexpr int kChunks = kDim / 8;
  for (int e = threadIdx.x; e < kHeads * kChunks; e += kThreads) {
    const int r = e / kChunks, chunk = e % kChunks;
    if (head0 + r >= heads) break;  // rows are in order: every later e is past H too
    const uint4 v = *reinterpret_cast<const uint4*>(o_tile + r * kStageStride + chunk * 8);
    *reinterpret_cast<uint4*>(out + (static_cast<int64_t>(row) * heads + head0 + r) * kDim + chunk * 8) = v;
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// One kernel instance per head dim D = 64 CB, indexed by CB - 1.
using KernelFn = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const int64_t*, const float*, __nv_bfloat16*,
                          float*, float*, int, int, int, int, float);
constexpr KernelFn kKernels[kMaxColBlocks] = {
    sparse_attention_wgmma_kernel<1>, sparse_attention_wgmma_kernel<2>, sparse_attention_wgmma_kernel<3>,
    sparse_attention_wgmma_kernel<4>, sparse_attention_wgmma_kernel<5>, sparse_attention_wgmma_kernel<6>,
    sparse_attention_wgmma_kernel<7>, sparse_attention_wgmma_kernel<8>};

}  // namespace wgmma_attention
}  // namespace deepinfer

// Key-split count for a launch (1 = no workspace needed); the rule is split_combine::split_count.
extern "C" cudaError_t deepinfer_sparse_attention_wgmma_splits(int rows, int heads, int topk, int* splits) {
  using namespace deepinfer::wgmma_attention;
  return deepinfer::split_combine::split_count<kHeads, kBlockKeys>(rows, heads, topk, splits);
}

// q [rows, heads, dim] bf16, kv [pool, dim] bf16 (16-byte aligned base pointers; dim a multiple of 64, <= 512),
// indices [rows, topk] int64 (-1 unused), sink [heads] fp32, out [rows, heads, dim] bf16. With splits > 1,
// workspace holds splits * rows * heads * (dim + 2) floats. Returns cudaErrorNotSupported unless the current
// device is compute capability 9.0 (the wgmma kernel body exists only in the sm_90a image).
extern "C" cudaError_t deepinfer_sparse_attention_wgmma_bf16(const void* q, const void* kv, const int64_t* indices,
                                                             const float* sink, void* out, float* workspace,
                                                             int rows, int heads, int dim, int topk, int splits,
                                                             float scale, cudaStream_t stream) {
  using namespace deepinfer;
  using namespace deepinfer::wgmma_attention;
  if (dim > kMaxDim || dim <= 0 || dim % kColBlockChannels != 0 || splits < 1 ||
      (splits > 1 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  int major = 0, minor = 0;
  cudaError_t err = current_compute_capability(&major, &minor);
  if (err != cudaSuccess) return err;
  if (major != 9 || minor != 0) return cudaErrorNotSupported;
  if (rows == 0 || heads == 0) return cudaSuccess;
  const int key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  const split_combine::Partials partials = split_combine::partials(workspace, splits, rows, heads, dim);
  const dim3 grid(rows, (heads + kHeads - 1) / kHeads, splits);
  const KernelFn kernel = kKernels[dim / kColBlockChannels - 1];
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(static_cast<const __nv_bfloat16*>(q),
                                                 static_cast<const __nv_bfloat16*>(kv), indices, sink,
                                                 static_cast<__nv_bfloat16*>(out), partials.o, partials.ml, rows,
                                                 heads, topk, split_combine::blocks_per_split(key_blocks, splits),
                                                 scale * kLog2e);
  err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  return split_combine::combine(partials, static_cast<__nv_bfloat16*>(out), rows, heads, dim, splits, stream);
}
