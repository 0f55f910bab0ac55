// Torch extension entry points for kernels/cuda (built only where a CUDA toolchain and a CUDA build of torch exist).
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include <cuda_runtime.h>

extern "C" cudaError_t deepinfer_cache_write_bf16(const void*, const int64_t*, uint8_t*, int, int, int, int,
                                                  cudaStream_t);
extern "C" cudaError_t deepinfer_cache_write_f32(const void*, const int64_t*, uint8_t*, int, int, int, int,
                                                 cudaStream_t);
extern "C" cudaError_t deepinfer_sparse_decode_bf16(const void*, const void*, const int64_t*, const float*, void*, int,
                                                    int, int, int, float, cudaStream_t);

static void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

torch::Tensor cache_write(torch::Tensor cache, torch::Tensor slots, torch::Tensor x, int64_t fmt, int64_t record_bytes) {
  TORCH_CHECK(cache.is_cuda() && cache.dtype() == torch::kUInt8 && cache.is_contiguous(), "cache: contiguous uint8 CUDA");
  TORCH_CHECK(cache.size(1) == record_bytes, "cache rows are ", cache.size(1), " bytes but records are ", record_bytes);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [tokens, dim] with dim a multiple of 32");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.numel() == x.size(0), "slots: int64 [tokens]");
  auto xc = x.contiguous();
  auto sc = slots.contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  if (xc.scalar_type() == torch::kBFloat16) {
    check(deepinfer_cache_write_bf16(xc.data_ptr(), sc.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(), xc.size(0),
                                     xc.size(1), record_bytes, fmt, stream), "cache_write");
  } else {
    TORCH_CHECK(xc.scalar_type() == torch::kFloat32, "x must be bf16 or fp32");
    check(deepinfer_cache_write_f32(xc.data_ptr(), sc.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(), xc.size(0),
                                    xc.size(1), record_bytes, fmt, stream), "cache_write");
  }
  return cache;
}

torch::Tensor sparse_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor indices, torch::Tensor sink,
                               double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && kv.scalar_type() == torch::kBFloat16, "q and kv must be bf16");
  TORCH_CHECK(q.size(2) == kv.size(1) && q.size(2) <= 512, "head dim of q (", q.size(2), ") and kv (", kv.size(1),
              ") must agree and be <= 512");
  auto qc = q.contiguous();
  auto kc = kv.contiguous();
  auto ic = indices.to(torch::kInt64).contiguous();
  auto sk = sink.to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(qc);
  check(deepinfer_sparse_decode_bf16(qc.data_ptr(), kc.data_ptr(), ic.data_ptr<int64_t>(), sk.data_ptr<float>(),
                                     out.data_ptr(), qc.size(0), qc.size(1), qc.size(2), ic.size(1),
                                     static_cast<float>(scale), at::cuda::getCurrentCUDAStream()),
        "sparse_attention");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cache_write", &cache_write, "quantise + pack + scatter KV records");
  m.def("sparse_attention", &sparse_attention, "sparse MQA with sink (decode / verify rows)");
}
