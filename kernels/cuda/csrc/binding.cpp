// Torch extension entry points for kernels/cuda (built only where a CUDA toolchain and a CUDA build of torch exist).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cuda_runtime.h>

extern "C" cudaError_t deepinfer_cache_write_bf16(const void*, const int64_t*, uint8_t*, int, int, int, int,
                                                  cudaStream_t);
extern "C" cudaError_t deepinfer_cache_write_f32(const void*, const int64_t*, uint8_t*, int, int, int, int,
                                                 cudaStream_t);
extern "C" cudaError_t deepinfer_sparse_decode_bf16(const void*, const void*, const int64_t*, const float*, void*, int,
                                                    int, int, int, float, cudaStream_t);
// Tensor-core attention kernels share one interface: a split count for (rows, heads, topk), then the launch.
using AttentionSplits = cudaError_t (*)(int, int, int, int*);
using AttentionLaunch = cudaError_t (*)(const void*, const void*, const int64_t*, const float*, void*, float*, int, int,
                                        int, int, int, float, cudaStream_t);
extern "C" cudaError_t deepinfer_sparse_attention_mma_splits(int, int, int, int*);
extern "C" cudaError_t deepinfer_sparse_attention_mma_bf16(const void*, const void*, const int64_t*, const float*, void*,
                                                           float*, int, int, int, int, int, float, cudaStream_t);
extern "C" cudaError_t deepinfer_sparse_attention_wgmma_splits(int, int, int, int*);
extern "C" cudaError_t deepinfer_sparse_attention_wgmma_bf16(const void*, const void*, const int64_t*, const float*,
                                                             void*, float*, int, int, int, int, int, float, cudaStream_t);
extern "C" cudaError_t deepinfer_sparse_attention_tcgen05_splits(int, int, int, int*);
extern "C" cudaError_t deepinfer_sparse_attention_tcgen05_bf16(const void*, const void*, const int64_t*, const float*,
                                                               void*, float*, int, int, int, int, int, float,
                                                               cudaStream_t);

static void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

torch::Tensor cache_write(torch::Tensor cache, torch::Tensor slots, torch::Tensor x, int64_t fmt, int64_t record_bytes) {
  // An engine's cache row may hold more than the record: rows are cache.stride(0) bytes apart, records dense in them.
  TORCH_CHECK(cache.is_cuda() && cache.dtype() == torch::kUInt8 && cache.dim() == 2 && cache.stride(1) == 1,
              "cache: uint8 CUDA [slots, record bytes] with dense rows");
  TORCH_CHECK(cache.size(1) == record_bytes, "cache rows are ", cache.size(1), " bytes but records are ", record_bytes);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [tokens, dim] with dim a multiple of 32");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.numel() == x.size(0), "slots: int64 [tokens]");
  auto xc = x.contiguous();
  auto sc = slots.contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  if (xc.scalar_type() == torch::kBFloat16) {
    check(deepinfer_cache_write_bf16(xc.data_ptr(), sc.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(), xc.size(0),
                                     xc.size(1), static_cast<int>(cache.stride(0)), fmt, stream), "cache_write");
  } else {
    TORCH_CHECK(xc.scalar_type() == torch::kFloat32, "x must be bf16 or fp32");
    check(deepinfer_cache_write_f32(xc.data_ptr(), sc.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(), xc.size(0),
                                    xc.size(1), static_cast<int>(cache.stride(0)), fmt, stream), "cache_write");
  }
  return cache;
}

// Shape / dtype checks shared by both attention kernels: q [T, H, D], kv [P, D] bf16, indices [T, K], sink [H].
static void check_attention_inputs(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& indices,
                                   const torch::Tensor& sink) {
  TORCH_CHECK(q.is_cuda() && kv.is_cuda() && indices.is_cuda() && sink.is_cuda(), "all inputs must be CUDA tensors");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && kv.scalar_type() == torch::kBFloat16, "q and kv must be bf16");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 2 && indices.dim() == 2, "q [T, H, D], kv [P, D], indices [T, K]");
  TORCH_CHECK(indices.size(0) == q.size(0) && sink.numel() == q.size(1), "indices rows must equal T, sink size H");
  TORCH_CHECK(q.size(2) == kv.size(1) && q.size(2) <= 512, "head dim of q (", q.size(2), ") and kv (", kv.size(1),
              ") must agree and be <= 512");
}

torch::Tensor sparse_attention_simt(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, torch::Tensor sink,
                                    double scale) {
  check_attention_inputs(q, kv, indices, sink);
  const c10::cuda::CUDAGuard device_guard(q.device());
  auto qc = q.contiguous();
  auto kc = kv.contiguous();
  auto ic = indices.to(torch::kInt64).contiguous();
  auto sk = sink.to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(qc);
  check(deepinfer_sparse_decode_bf16(qc.data_ptr(), kc.data_ptr(), ic.data_ptr<int64_t>(), sk.data_ptr<float>(),
                                     out.data_ptr(), qc.size(0), qc.size(1), qc.size(2), ic.size(1),
                                     static_cast<float>(scale), at::cuda::getCurrentCUDAStream()),
        "sparse_attention_simt");
  return out;
}

// 16-byte aligned copy of t (cp.async reads 16-byte chunks; a sliced tensor may start mid-chunk).
static torch::Tensor aligned_contiguous(const torch::Tensor& t) {
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// The tensor-core kernels (mma, wgmma, tcgen05): head dim a multiple of ``dim_multiple``, split-K workspace.
static torch::Tensor tensor_core_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& indices,
                                           const torch::Tensor& sink, double scale, int64_t dim_multiple,
                                           AttentionSplits splits_for, AttentionLaunch launch, const char* name) {
  check_attention_inputs(q, kv, indices, sink);
  TORCH_CHECK(q.size(2) % dim_multiple == 0 && q.size(2) > 0, name, " needs a head dim multiple of ", dim_multiple,
              ", got ", q.size(2));
  const c10::cuda::CUDAGuard device_guard(q.device());
  auto qc = aligned_contiguous(q);
  auto kc = aligned_contiguous(kv);
  auto ic = indices.to(torch::kInt64).contiguous();
  auto sk = sink.to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(qc);
  const int rows = qc.size(0), heads = qc.size(1), dim = qc.size(2), topk = ic.size(1);
  int splits = 1;
  check(splits_for(rows, heads, topk, &splits), name);
  torch::Tensor workspace;  // split partials: fp32 O [splits, T, H, D] then (max, sum) [splits, T, H, 2]
  if (splits > 1) workspace = torch::empty({static_cast<int64_t>(splits) * rows * heads * (dim + 2)},
                                           qc.options().dtype(torch::kFloat32));
  check(launch(qc.data_ptr(), kc.data_ptr(), ic.data_ptr<int64_t>(), sk.data_ptr<float>(), out.data_ptr(),
               splits > 1 ? workspace.data_ptr<float>() : nullptr, rows, heads, dim, topk, splits,
               static_cast<float>(scale), at::cuda::getCurrentCUDAStream()),
        name);
  return out;
}

torch::Tensor sparse_attention_mma(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, torch::Tensor sink,
                                   double scale) {
  return tensor_core_attention(q, kv, indices, sink, scale, 16, deepinfer_sparse_attention_mma_splits,
                               deepinfer_sparse_attention_mma_bf16, "sparse_attention_mma");
}

torch::Tensor sparse_attention_wgmma(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, torch::Tensor sink,
                                     double scale) {
  return tensor_core_attention(q, kv, indices, sink, scale, 64, deepinfer_sparse_attention_wgmma_splits,
                               deepinfer_sparse_attention_wgmma_bf16, "sparse_attention_wgmma");
}

torch::Tensor sparse_attention_tcgen05(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, torch::Tensor sink,
                                       double scale) {
  return tensor_core_attention(q, kv, indices, sink, scale, 64, deepinfer_sparse_attention_tcgen05_splits,
                               deepinfer_sparse_attention_tcgen05_bf16, "sparse_attention_tcgen05");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cache_write", &cache_write, "quantise + pack + scatter KV records");
  m.def("sparse_attention_simt", &sparse_attention_simt, "sparse MQA with sink (decode / verify rows), CUDA cores");
  m.def("sparse_attention_mma", &sparse_attention_mma, "sparse MQA with sink (decode / verify rows), tensor cores");
  m.def("sparse_attention_wgmma", &sparse_attention_wgmma,
        "sparse MQA with sink (decode / verify rows), Hopper wgmma; sm_90a only, opt-in until verified on an H200");
  m.def("sparse_attention_tcgen05", &sparse_attention_tcgen05,
        "sparse MQA with sink (decode / verify rows), SM100 tcgen05 + TMA; opt-in until verified on a B200");
}
