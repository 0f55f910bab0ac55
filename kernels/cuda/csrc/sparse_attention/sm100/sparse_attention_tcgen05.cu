// Sparse MQA decode / verify with a sink (ops.sparse_attention) on the 5th-generation tensor cores of SM100 / SM103
// (B200 / B300): tcgen05.mma with fp32 accumulators in tensor memory (TMEM), the Q tile loaded by TMA, gathered key
// rows by cp.async into 128-byte-swizzled shared memory. Same math as sparse_attention_mma.cu; the split-K rule,
// workspace layout and combine kernel are shared with it (../split_combine.cuh). Not yet run on a B200: opt-in until
// verified there. The device code is compiled only for the 10.x family targets (sm_100a / sm_103a / sm_100f /
// sm_103f); elsewhere the kernel is empty and the launcher returns cudaErrorNotSupported on a device that is not
// compute capability 10.x.
//
// Problem per query row t: Q [64 heads x D] (D a multiple of 64, <= 512), keys = values = gathered latent rows
// K [n x D], one key set per row shared by all heads. S = Q K^T per 64-key block, O += P K.
//
// TMEM budget (128 lanes x 512 columns of 32 bit). Every MMA has M = 64 (one head tile; a CTA owns one query row,
// so there is nothing to fill M = 128 with: another query row has other keys). An M = 64 accumulator uses Layout F
// (PTX ISA 9.7.16.10.5): row r in lane 32 (r / 16) + r % 16 + a, i.e. 16 of the 32 lanes of each warp quarter,
// with lane offset a = 0 or 16. A plain O [64 x 512] fp32 would take all 512 columns and leave no room for S, so
// the two lane halves hold different matrices over the same columns:
//   columns   0..255  lanes +0..15: O channels [0, n_lo)      lanes +16..31: O channels [n_lo, D)
//   columns 256..287  lanes +0..15: S keys 0..31 (buffer 0)    lanes +16..31: S keys 32..63 (buffer 0)
//   columns 288..319  the same for S buffer 1 (S of block i + 1 is computed while block i's softmax runs)
// n_lo = 64 ceil(D / 128), so each O half is a whole number of 64-channel swizzle atoms and N <= 256. A warp's
// tcgen05.ld.32x32b then hands thread t < 16 row 16 w + t of the lane-0 matrix and thread t >= 16 the same row
// of the lane-16 matrix: all 32 threads do useful work and each row is owned by the lane pair (t, t ^ 16).
// 512 columns are allocated (power of two >= 320), so one CTA per SM, which shared memory forces anyway.
//
// Warp roles (288 threads, one CTA per (query row, 64 heads, key split)):
//   warps 0-3  softmax: warp w reads TMEM lanes 32w..32w+31 (the only lanes it may access), i.e. heads
//              16w..16w+15; S -> P (bf16, shared memory), running max / sum, O rescale, epilogue.
//   warp 4     allocates TMEM; lane 0 issues the Q TMA and every tcgen05.mma / tcgen05.commit.
//   warps 5-8  producers: cp.async gather of the block's key rows (16-byte chunks, swizzled by hand).
// Per key block i (stage i % 2, S buffer i % 2), with mbarriers (phase parity = use count & 1):
//   producers: wait empty[stage] -> gather -> wait own copies -> proxy fence -> arrive full[stage]
//   MMA:       S(i + 1) = Q K(i + 1)^T as two N = 32 MMAs (lanes +0 / +16), committed to s_full; then wait p_full,
//              O += P K(i) as N = n_lo (lanes +0) and N = D - n_lo (lanes +16) MMAs, committed to pv_done (and to
//              empty[stage] if the stage is refilled). Issuing S(i + 1) before PV(i) lets softmax(i + 1) overlap
//              PV(i); the price is that PV(i) also waits for key block i + 1 to land.
//   softmax:   wait s_full -> tcgen05.ld S -> arrive s_free -> masked online softmax -> wait pv_done (PV(i - 1)
//              done: O is stable and P may be overwritten) -> rescale O if needed -> write P -> arrive p_full.
//
// Shared memory (dynamic, 205,928 B including 1,024 B of alignment slack; 1024-byte aligned regions):
//   Q          D / 64 TMA boxes of [64 heads x 64 channels] bf16, 128-byte swizzle    65,536 B
//   K stages   2 x D / 64 blocks of [64 keys x 64 channels] bf16, 128-byte swizzle    131,072 B
//   P          [64 heads x 64 keys] bf16, 128-byte swizzle                             8,192 B
//   11 mbarriers and the TMEM base address.
// All three are 8-row x 128-byte swizzle atoms (row r of an atom at 128 r, 16-byte chunk c stored at c ^ (r % 8)),
// the layout TMA writes for SWIZZLE_128B and the canonical SW128 layout of the MMA descriptors. One K stage serves
// as the K-major B of S (N = keys, K = channels: SBO = 1024 between 8-key groups, k-steps advance the start by
// 32 B inside an atom) and as the MN-major B of P K (K = keys, N = channels: LBO = 8192 between 64-channel
// atoms, SBO = 1024 between 8-key groups). Q and P are K-major A operands (SBO = 1024).
//
// Online softmax in the log2 domain as in the mma kernel: logits scaled by softmax_scale * log2(e), the running max
// starts at the sink logit and the sum at 1 (zero value vector). O lives in TMEM, so rescaling it costs a
// tcgen05.ld / st round trip of 64 x D fp32; the reference max m is therefore only raised when a block's max
// exceeds it by more than 8 (then O and l are scaled by 2^(m_old - m_new)). Otherwise P = 2^(s - m) <= 2^8 and
// O, l stay consistent with the same m, so the result is exact up to rounding. -1 indices and keys past topk get
// -inf logits and zero-filled rows, so a row with no valid key returns exactly zero.
//
// Split-K as in the mma kernel: with few rows the key blocks are split over gridDim.z CTAs that write unnormalised
// fp32 O plus (m, l) to the workspace, merged by a combine kernel; only split 0 carries the sink. The stored m is
// the reference max above, which the merge accepts since O and l were scaled by it.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/device.cuh"
#include "../split_combine.cuh"

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ / 100 == 10)
#define DEEPINFER_TCGEN05_DEVICE 1
#else
#define DEEPINFER_TCGEN05_DEVICE 0
#endif

namespace deepinfer {
namespace tcgen05_attention {

constexpr int kMaxDim = 512;
constexpr int kHeads = 64;                    // M of every MMA
constexpr int kBlockKeys = 64;                // keys per pipeline stage
constexpr int kHalfKeys = kBlockKeys / 2;     // N of each S MMA (one per TMEM lane half)
constexpr int kAtomChannels = 64;             // bf16 per 128-byte swizzle row
constexpr int kStages = 2;
constexpr int kSoftmaxWarps = 4;              // one per TMEM lane quarter
constexpr int kMmaWarp = kSoftmaxWarps;
constexpr int kFirstProducerWarp = kMmaWarp + 1;
constexpr int kProducerWarps = 4;
constexpr int kThreads = (kFirstProducerWarp + kProducerWarps) * 32;
constexpr uint32_t kTmemColumns = 512;
constexpr uint32_t kSColumn = 256;            // S buffers follow the 256 O columns
constexpr float kLog2e = 1.4426950408889634f;

constexpr int kQBytes = kHeads * kMaxDim * 2;
constexpr int kStageBytes = kBlockKeys * kMaxDim * 2;
constexpr int kPBytes = kHeads * kBlockKeys * 2;
constexpr int kKOffset = kQBytes;
constexpr int kPOffset = kKOffset + kStages * kStageBytes;
constexpr int kBarrierOffset = kPOffset + kPBytes;
enum Barrier { kFull = 0, kEmpty = kFull + kStages, kSFull = kEmpty + kStages, kSFree = kSFull + 2, kQFull = kSFree + 2,
               kPFull, kPvDone, kNumBarriers };
constexpr int kTmemSlotOffset = kBarrierOffset + kNumBarriers * 8;
constexpr int kSmemBytes = kTmemSlotOffset + 16 + 1024;  // + 1024: the dynamic base is aligned by hand
static_assert(kKOffset % 1024 == 0 && kPOffset % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms need 1024 B");
static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm_100 opt-in shared memory per block");
static_assert(kMaxDim <= split_combine::kMaxDim, "the combine kernel covers every head dim");
static_assert(kSColumn + 2 * kHalfKeys <= kTmemColumns && kMaxDim / 2 <= static_cast<int>(kSColumn), "TMEM budget");

// Instruction descriptor, .kind::f16 (PTX ISA 9.7.16.4.2, Table 42): bits 4-5 D type (1 = f32), 7-9 A type and
// 10-12 B type (1 = bf16), 15 / 16 transpose A / B (0 = K-major, 1 = MN-major), 17-22 N >> 3, 24-28 M >> 4; dense,
// no negation, no saturation.
__host__ __device__ constexpr uint32_t instr_desc(int n, bool b_mn_major) {
  return (1u << 4) | (1u << 7) | (1u << 10) | (static_cast<uint32_t>(b_mn_major) << 16) |
         (static_cast<uint32_t>(n >> 3) << 17) | (static_cast<uint32_t>(kHeads >> 4) << 24);
}
static_assert(instr_desc(32, false) == 0x04080490u, "S: M = 64, N = 32, bf16 x bf16 -> f32, both K-major");
static_assert(instr_desc(256, true) == 0x04410490u, "PV: M = 64, N = 256, B MN-major");

#if DEEPINFER_TCGEN05_DEVICE

constexpr float kRescaleThreshold = 8.f;                 // log2 of the largest unnormalised probability
constexpr int kRowBytes = 128;                           // one swizzle row
constexpr int kAtomBytes = 8 * kRowBytes;                // one swizzle atom = SBO of every operand
constexpr int kQBoxBytes = kHeads * kRowBytes;           // Q: 64 heads x 64 channels per TMA box
constexpr int kKBlockBytes = kBlockKeys * kRowBytes;     // K stage: 64 keys x 64 channels = LBO of MN-major V

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared memory descriptor (PTX ISA 9.7.16.4.1, Table 40): bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4,
// 46-48 the fixed 0b001, 49-51 base offset 0 (every atom starts on a 1024-byte boundary), 52 relative LBO,
// 61-63 swizzle mode 2 = 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t start, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 46) | (2ull << 61);
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in consecutive 128-byte-swizzled atoms: the chunk index
// is XORed with the row within its 8-row atom (address bits 4-6 ^= bits 7-9), as TMA SWIZZLE_128B and the MMA do.
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// Wait for the completion of the phase with the given parity (acquire, CTA scope).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// 16-byte async copy; src_bytes = 0 writes 16 zero bytes (the source is then not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool fill) {
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Generic-proxy shared memory writes (cp.async, st.shared) made visible to the async proxy (tcgen05.mma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// TMA: one [64 channels x 64 heads x 1 row] box of q into shared memory, completion counted on `bar` in bytes.
__device__ __forceinline__ void tma_load_q(uint32_t dst, const CUtensorMap* map, int channel, int head, int row,
                                           uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(map), "r"(channel), "r"(head), "r"(row), "r"(bar)
      : "memory");
}

// Ordering of tcgen05 operations around thread synchronisation (PTX ISA 9.7.16.6).
__device__ __forceinline__ void tmem_fence_before() {
  asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
}
__device__ __forceinline__ void tmem_fence_after() {
  asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
}

// D (TMEM) = A (smem) B (smem) [+ D]; issued by one thread, asynchronous until a tcgen05.commit fires.
__device__ __forceinline__ void mma_bf16(uint32_t d_tmem, uint64_t a_desc, uint64_t b_desc, uint32_t idesc,
                                         bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.u32 p, %4, 0;\ntcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n}\n" ::"r"(
          d_tmem),
      "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(static_cast<uint32_t>(accumulate))
      : "memory");
}
// Arrive once on `bar` when every tcgen05.mma issued so far by this thread has completed.
__device__ __forceinline__ void mma_commit(uint32_t bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar) : "memory");
}

// 32 lanes x 32 columns: thread t gets lane (taddr lane + t), register j = column (taddr column + j). The wait is in
// the same statement so that no use of the registers can be scheduled before the data has arrived.
__device__ __forceinline__ void tmem_load32(uint32_t taddr, uint32_t (&r)[32]) {
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%32];\n"
      "tcgen05.wait::ld.sync.aligned;\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]), "=r"(r[8]),
        "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15]), "=r"(r[16]),
        "=r"(r[17]), "=r"(r[18]), "=r"(r[19]), "=r"(r[20]), "=r"(r[21]), "=r"(r[22]), "=r"(r[23]), "=r"(r[24]),
        "=r"(r[25]), "=r"(r[26]), "=r"(r[27]), "=r"(r[28]), "=r"(r[29]), "=r"(r[30]), "=r"(r[31])
      : "r"(taddr)
      : "memory");
}
__device__ __forceinline__ void tmem_store32(uint32_t taddr, const uint32_t (&r)[32]) {
  asm volatile(
      "tcgen05.st.sync.aligned.32x32b.x32.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32};\n"
      "tcgen05.wait::st.sync.aligned;\n" ::"r"(taddr),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]), "r"(r[9]),
      "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15]), "r"(r[16]), "r"(r[17]), "r"(r[18]),
      "r"(r[19]), "r"(r[20]), "r"(r[21]), "r"(r[22]), "r"(r[23]), "r"(r[24]), "r"(r[25]), "r"(r[26]), "r"(r[27]),
      "r"(r[28]), "r"(r[29]), "r"(r[30]), "r"(r[31])
      : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

#endif  // DEEPINFER_TCGEN05_DEVICE

__global__ void __launch_bounds__(kThreads, 1) sparse_attention_tcgen05_kernel(
    const __grid_constant__ CUtensorMap q_map, const __nv_bfloat16* __restrict__ kv,
    const int64_t* __restrict__ indices, const float* __restrict__ sink, __nv_bfloat16* __restrict__ out,
    float* __restrict__ partial_o, float* __restrict__ partial_ml, int rows, int heads, int dim, int topk,
    int blocks_per_split, float scale_log2) {
#if DEEPINFER_TCGEN05_DEVICE
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_base = smem_addr(smem_raw);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_base);
  const uint32_t q_smem = base, k_smem = base + kKOffset, p_smem = base + kPOffset;
  const uint32_t bars = base + kBarrierOffset;

  const int row = blockIdx.x, head0 = blockIdx.y * kHeads, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  const int block_begin = split * blocks_per_split;
  const int nblocks = max(0, min(block_begin + blocks_per_split, key_blocks) - block_begin);
  const int64_t* row_indices = indices + static_cast<int64_t>(row) * topk;
  // O channel halves: whole 64-channel atoms, lane half 0 takes the first ceil(D / 128) of them.
  const int atoms = dim / kAtomChannels, atoms_lo = (atoms + 1) / 2;
  const int n_lo = atoms_lo * kAtomChannels, n_hi = dim - n_lo;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bars + 8 * (kFull + s), kProducerWarps * 32);
      mbar_init(bars + 8 * (kEmpty + s), 1);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(bars + 8 * (kSFull + b), 1);
      mbar_init(bars + 8 * (kSFree + b), kSoftmaxWarps * 32);
    }
    mbar_init(bars + 8 * kQFull, 1);
    mbar_init(bars + 8 * kPFull, kSoftmaxWarps * 32);
    mbar_init(bars + 8 * kPvDone, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (warp == kMmaWarp) {
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(base + kTmemSlotOffset),
                 "r"(kTmemColumns)
                 : "memory");
    asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
  }
  tmem_fence_before();
  __syncthreads();
  tmem_fence_after();
  const uint32_t tmem = *reinterpret_cast<volatile const uint32_t*>(smem + kTmemSlotOffset);

  if (warp >= kFirstProducerWarp) {
    // Warp p gathers key groups p and p + 4 (8 keys each); lane l copies key l % 8 of the group, 16-byte chunks
    // l / 8, l / 8 + 4, ... (4 lanes read 64 contiguous bytes of a key; a warp fills whole swizzle rows).
    const int producer = warp - kFirstProducerWarp;
    for (int n = 0; n < nblocks; ++n) {
      const int stage = n % kStages;
      if (n >= kStages) mbar_wait(bars + 8 * (kEmpty + stage), (n / kStages - 1) & 1);
      const uint32_t dst = k_smem + stage * kStageBytes;
      for (int group = producer; group < kBlockKeys / 8; group += kProducerWarps) {
        const int key = 8 * group + lane % 8;
        const int slot = (block_begin + n) * kBlockKeys + key;
        const int64_t idx = slot < topk ? row_indices[slot] : -1;
        const bool valid = idx >= 0;
        const __nv_bfloat16* src = kv + (valid ? idx : 0) * dim;
        for (int chunk = lane / 8; chunk < dim / 8; chunk += 4) {
          cp_async_16(dst + (chunk / 8) * kKBlockBytes + sw128_offset(key, chunk % 8), src + chunk * 8, valid);
        }
      }
      cp_async_commit();
      cp_async_wait_all();
      fence_proxy_async();
      mbar_arrive(bars + 8 * (kFull + stage));
    }
  } else if (warp == kMmaWarp) {
    if (lane == 0 && nblocks > 0) {
      mbar_arrive_expect_tx(bars + 8 * kQFull, atoms * kQBoxBytes);
      for (int a = 0; a < atoms; ++a) {
        tma_load_q(q_smem + a * kQBoxBytes, &q_map, a * kAtomChannels, head0, row, bars + 8 * kQFull);
      }
      mbar_wait(bars + 8 * kQFull, 0);

      const uint32_t idesc_s = instr_desc(kHalfKeys, false);
      const uint32_t idesc_lo = instr_desc(n_lo, true), idesc_hi = instr_desc(n_hi, true);
      // S(i) = Q K(i)^T: lane half h (TMEM lanes +16 h) gets keys 32 h .. 32 h + 31; k-step j covers channels
      // 16 j .. 16 j + 15, i.e. atom j / 4 at byte 32 (j % 4) of each swizzle row.
      auto issue_s = [&](int i) {
        const int stage = i % kStages, buf = i % 2;
        mbar_wait(bars + 8 * (kFull + stage), (i / kStages) & 1);
        if (i >= 2) mbar_wait(bars + 8 * (kSFree + buf), (i / 2 - 1) & 1);
        tmem_fence_after();
        const uint32_t keys = k_smem + stage * kStageBytes;
        for (int h = 0; h < 2; ++h) {
          const uint32_t d = tmem + (static_cast<uint32_t>(16 * h) << 16) + kSColumn + kHalfKeys * buf;
          for (int j = 0; j < dim / 16; ++j) {
            const uint32_t k_off = (j / 4) * kQBoxBytes + (j % 4) * 32;
            const uint64_t a = sw128_desc(q_smem + k_off, 16, kAtomBytes);
            const uint64_t b = sw128_desc(keys + (j / 4) * kKBlockBytes + h * kHalfKeys * kRowBytes + (j % 4) * 32,
                                          16, kAtomBytes);
            mma_bf16(d, a, b, idesc_s, j > 0);
          }
        }
        mma_commit(bars + 8 * (kSFull + buf));
      };

      issue_s(0);
      for (int n = 0; n < nblocks; ++n) {
        if (n + 1 < nblocks) issue_s(n + 1);
        mbar_wait(bars + 8 * kPFull, n & 1);
        tmem_fence_after();
        // O += P V: k-step j covers keys 16 j .. 16 j + 15 (two 8-key groups, SBO apart); V is MN-major with its
        // 64-channel atoms kKBlockBytes (LBO) apart.
        const uint32_t values = k_smem + (n % kStages) * kStageBytes;
        for (int j = 0; j < kBlockKeys / 16; ++j) {
          const uint64_t a = sw128_desc(p_smem + j * 32, 16, kAtomBytes);
          const uint32_t v = values + j * 16 * kRowBytes;
          const bool accumulate = n > 0 || j > 0;
          mma_bf16(tmem, a, sw128_desc(v, kKBlockBytes, kAtomBytes), idesc_lo, accumulate);
          if (n_hi > 0) {
            mma_bf16(tmem + (16u << 16), a, sw128_desc(v + atoms_lo * kKBlockBytes, kKBlockBytes, kAtomBytes),
                     idesc_hi, accumulate);
          }
        }
        mma_commit(bars + 8 * kPvDone);
        // Only stages that will be refilled get an arrival, so none is left in flight when the CTA exits.
        if (n + kStages < nblocks) mma_commit(bars + 8 * (kEmpty + n % kStages));
      }
    }
  } else {
    // Softmax: thread (w, t) owns local head h = 16 w + t % 16 and key / channel half t / 16.
    const int h = 16 * warp + lane % 16, half = lane / 16;
    const int head = head0 + h;
    const bool live = head < heads;
    const uint32_t tmem_rows = tmem + (static_cast<uint32_t>(32 * warp) << 16);
    float m = split == 0 ? (live ? sink[head] * kLog2e : 0.f) : -INFINITY;
    float l = (split == 0 && half == 0) ? 1.f : 0.f;  // the sink's exp(0), counted once per head

    for (int n = 0; n < nblocks; ++n) {
      const int buf = n % 2;
      const int slot = (block_begin + n) * kBlockKeys + lane;
      const bool valid_lo = slot < topk && row_indices[slot] >= 0;
      const bool valid_hi = slot + kHalfKeys < topk && row_indices[slot + kHalfKeys] >= 0;
      const uint32_t mask_lo = __ballot_sync(0xFFFFFFFFu, valid_lo), mask_hi = __ballot_sync(0xFFFFFFFFu, valid_hi);
      const uint32_t valid = half ? mask_hi : mask_lo;

      mbar_wait(bars + 8 * (kSFull + buf), (n / 2) & 1);
      __syncwarp();  // tcgen05.ld / st are .sync.aligned: the warp leaves the spin loop together
      tmem_fence_after();
      uint32_t raw[32];
      tmem_load32(tmem_rows + kSColumn + kHalfKeys * buf, raw);
      tmem_fence_before();
      mbar_arrive(bars + 8 * (kSFree + buf));

      float s[32];
      float block_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        s[j] = (valid >> j) & 1 ? __uint_as_float(raw[j]) * scale_log2 : -INFINITY;
        block_max = fmaxf(block_max, s[j]);
      }
      block_max = fmaxf(block_max, __shfl_xor_sync(0xFFFFFFFFu, block_max, 16));  // same in both lanes of a head
      const float m_new = fmaxf(m, block_max);
      const bool rescale = m_new > m + kRescaleThreshold;  // false while both are -inf
      float alpha = 1.f;
      if (rescale) {
        alpha = exp2f(m - m_new);
        m = m_new;
        l *= alpha;
      }
      const float m_base = m == -INFINITY ? 0.f : m;  // no finite logit yet: every p is 0
      uint32_t p[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float p0 = exp2f(s[2 * j] - m_base), p1 = exp2f(s[2 * j + 1] - m_base);
        l += p0 + p1;
        p[j] = pack_bf16x2(p0, p1);
      }

      if (n > 0) {
        mbar_wait(bars + 8 * kPvDone, (n - 1) & 1);  // PV(n - 1) done: O is stable and P is free
        __syncwarp();
        tmem_fence_after();
        // Before the first PV, O holds nothing (that MMA overwrites it), so it is only rescaled from n = 1 on.
        if (__any_sync(0xFFFFFFFFu, rescale)) {
          for (int c = 0; c < n_lo; c += 32) {
            uint32_t o[32];
            tmem_load32(tmem_rows + c, o);
#pragma unroll
            for (int j = 0; j < 32; ++j) o[j] = __float_as_uint(__uint_as_float(o[j]) * alpha);
            tmem_store32(tmem_rows + c, o);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        *reinterpret_cast<uint4*>(smem + kPOffset + sw128_offset(h, 4 * half + i)) =
            make_uint4(p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]);
      }
      fence_proxy_async();
      tmem_fence_before();
      mbar_arrive(bars + 8 * kPFull);
    }

    // Epilogue: thread half 0 holds channels [0, n_lo) of its head, half 1 channels [n_lo, D), same TMEM columns.
    if (nblocks > 0) {
      mbar_wait(bars + 8 * kPvDone, (nblocks - 1) & 1);
      __syncwarp();
      tmem_fence_after();
    }
    const float l_total = l + __shfl_xor_sync(0xFFFFFFFFu, l, 16);
    const int columns = half ? n_hi : n_lo, channel0 = half ? n_lo : 0;
    // With split-K the slot of split_combine::partial_slot, without it the index of (row, head) in out.
    const int64_t out_slot = (partial_o != nullptr ? static_cast<int64_t>(split) * rows + row : row) * heads + head;
    const float inv = 1.f / l_total;  // without split-K this is split 0: l >= the sink's or the max key's term
    for (int c = 0; c < n_lo; c += 32) {
      uint32_t o[32];
      if (nblocks > 0) {
        tmem_load32(tmem_rows + c, o);
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) o[j] = 0u;
      }
      if (!live || c >= columns) continue;
      if (partial_o != nullptr) {
        float4* dst = reinterpret_cast<float4*>(partial_o + out_slot * dim + channel0 + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dst[i] = make_float4(__uint_as_float(o[4 * i]), __uint_as_float(o[4 * i + 1]), __uint_as_float(o[4 * i + 2]),
                               __uint_as_float(o[4 * i + 3]));
        }
      } else {
        uint4* dst = reinterpret_cast<uint4*>(out + out_slot * dim + channel0 + c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            w[k] = pack_bf16x2(__uint_as_float(o[8 * i + 2 * k]) * inv, __uint_as_float(o[8 * i + 2 * k + 1]) * inv);
          }
          dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
    if (partial_o != nullptr && live && half == 0) {
      split_combine::store_stats(partial_ml, out_slot, m, l_total);
    }
    tmem_fence_before();
  }

  __syncthreads();  // every TMEM read is done and every MMA completed (the epilogue waited on the last PV)
  if (warp == kMmaWarp) {
    __syncwarp();  // lane 0 comes back from issuing MMAs; dealloc is .sync.aligned
    tmem_fence_after();
    asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(tmem), "r"(kTmemColumns)
                 : "memory");
  }
#endif  // DEEPINFER_TCGEN05_DEVICE
}

// cuTensorMapEncodeTiled from the driver the runtime already loaded (no link against libcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

}  // namespace tcgen05_attention
}  // namespace deepinfer

// Key-split count for a launch (1 = no workspace needed); the rule is split_combine::split_count.
extern "C" cudaError_t deepinfer_sparse_attention_tcgen05_splits(int rows, int heads, int topk, int* splits) {
  using namespace deepinfer::tcgen05_attention;
  return deepinfer::split_combine::split_count<kHeads, kBlockKeys>(rows, heads, topk, splits);
}

// q [rows, heads, dim] bf16 (dim a multiple of 64, <= 512; 16-byte aligned), kv [pool, dim] bf16 (16-byte aligned),
// indices [rows, topk] int64 (-1 unused), sink [heads] fp32, out [rows, heads, dim] bf16. With splits > 1, workspace
// holds splits * rows * heads * (dim + 2) floats. cudaErrorNotSupported unless the device is compute capability 10.x.
extern "C" cudaError_t deepinfer_sparse_attention_tcgen05_bf16(const void* q, const void* kv, const int64_t* indices,
                                                               const float* sink, void* out, float* workspace,
                                                               int rows, int heads, int dim, int topk, int splits,
                                                               float scale, cudaStream_t stream) {
  using namespace deepinfer;
  using namespace deepinfer::tcgen05_attention;
  if (dim > kMaxDim || dim <= 0 || dim % kAtomChannels != 0 || splits < 1 || (splits > 1 && workspace == nullptr) ||
      reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(kv) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  int major = 0, minor = 0;
  cudaError_t err = current_compute_capability(&major, &minor);
  if (err != cudaSuccess) return err;
  if (major != 10) return cudaErrorNotSupported;
  if (rows == 0 || heads == 0) return cudaSuccess;

  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  // q as a 3-D tensor (channel, head, row); a box is 64 channels x 64 heads of one row, heads past H read as zero.
  CUtensorMap q_map;
  const cuuint64_t global_dim[3] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                                    static_cast<cuuint64_t>(rows)};
  const cuuint64_t global_stride[2] = {static_cast<cuuint64_t>(dim) * 2, static_cast<cuuint64_t>(heads) * dim * 2};
  const cuuint32_t box[3] = {kAtomChannels, kHeads, 1};
  const cuuint32_t element_stride[3] = {1, 1, 1};
  if (encode(&q_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(q), global_dim, global_stride, box,
             element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return cudaErrorInvalidValue;
  }

  err = cudaFuncSetAttribute(sparse_attention_tcgen05_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kSmemBytes);
  if (err != cudaSuccess) return err;
  const int key_blocks = (topk + kBlockKeys - 1) / kBlockKeys;
  const split_combine::Partials partials = split_combine::partials(workspace, splits, rows, heads, dim);
  const dim3 grid(rows, (heads + kHeads - 1) / kHeads, splits);
  sparse_attention_tcgen05_kernel<<<grid, kThreads, kSmemBytes, stream>>>(
      q_map, static_cast<const __nv_bfloat16*>(kv), indices, sink, static_cast<__nv_bfloat16*>(out), partials.o,
      partials.ml, rows, heads, dim, topk, split_combine::blocks_per_split(key_blocks, splits), scale * kLog2e);
  err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  return split_combine::combine(partials, static_cast<__nv_bfloat16*>(out), rows, heads, dim, splits, stream);
}
