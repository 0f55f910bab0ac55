// Host helper shared by the launchers of arch-specific kernels.
#pragma once

#include <cuda_runtime.h>

namespace deepinfer {

// Compute capability of the current device. The wgmma (9.0) and tcgen05 (10.x) launchers check it because their
// kernel bodies exist only in that architecture's image: elsewhere the kernel would launch as an empty stub.
inline cudaError_t current_compute_capability(int* major, int* minor) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device);
  return err;
}

}  // namespace deepinfer
