// Programmatic dependent launch (Hopper): a kernel launched with launch_pdl() may
// start while the kernel before it in the stream still runs, once every CTA of
// that one has called pdl_launch_dependents() (or exited). It must call
// pdl_wait() before it reads anything an earlier kernel wrote and before it
// writes anything: pdl_wait() returns when the kernel before it has completed
// and its writes are visible. What it may do before that: read data no kernel of
// the step writes (weights, block tables copied in before the step), compute
// addresses, stage constants. So a decode step's chain of small kernels
// overlaps each launch and prologue with the tail of the kernel before it.
//
// Kernels launched the ordinary way (torch's, cuBLAS's) are full dependencies in
// both directions, and pdl_wait() in a kernel launched without the attribute
// returns at once. CUDA-graph capture keeps the programmatic edges.
//
// PAGEDCORE_PDL=0 launches everything the ordinary way (read once per process);
// devices below compute capability 9.0 always do.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace pagedcore::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether launches carry the programmatic-serialization attribute (the device
// current at the first call decides the compute-capability part).
inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("PAGEDCORE_PDL");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();  // (leave no sticky error behind for the caller)
      return false;
    }
    return major >= 9;
  }();
  return enabled;
}

// kernel<<<grid, block, smem, stream>>>(args...) in thread-block clusters of
// `cluster` CTAs (more than one: compute capability 9.0 and up, the grid a
// whole number of clusters), with the programmatic attribute when
// pdl_enabled(). Returns the launch's error.
template <typename... Params, typename... Args>
cudaError_t launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block, size_t smem,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned int n = 0;
  if (pdl_enabled()) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = cluster.x;
    attribute[n].val.clusterDim.y = cluster.y;
    attribute[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// The same without clusters: kernel<<<grid, block, smem, stream>>>(args...).
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  return launch_pdl_cluster(kernel, grid, dim3(1, 1, 1), block, smem, stream, std::forward<Args>(args)...);
}

}  // namespace pagedcore::cuda
