#include <cuda_runtime.h>

#include <vector>

#include "pagedcore/cuda/device_info.h"

namespace pagedcore::cuda {

namespace {

__global__ void add_scalar_kernel(const int32_t* __restrict__ in, int32_t* __restrict__ out,
                                  int64_t n, int32_t value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    out[i] = in[i] + value;
  }
}

}  // namespace

DeviceInfo query_devices() {
  DeviceInfo info;
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  if (cudaGetDeviceCount(&info.device_count) != cudaSuccess) {
    info.device_count = 0;
    cudaGetLastError();  // clear the sticky "no driver" error
  }
  return info;
}

int launch_add_scalar(const AddScalarParams& p, void* stream) {
  if (p.n <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (p.n + threads - 1) / threads;
  add_scalar_kernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), threads, 0,
                      static_cast<cudaStream_t>(stream)>>>(p.in, p.out, p.n, p.value);
  return cudaGetLastError();
}

std::string smoke_test() {
  if (query_devices().device_count == 0) return "no CUDA device";
  const int64_t n = 5000;
  std::vector<int32_t> host(n);
  for (int64_t i = 0; i < n; ++i) host[i] = static_cast<int32_t>(i * 7 - 1000);
  int32_t* in = nullptr;
  int32_t* out = nullptr;
  std::string error;
  auto fail = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && error.empty()) error = std::string(what) + ": " + cudaGetErrorString(e);
    return e != cudaSuccess;
  };
  if (!fail(cudaMalloc(&in, n * sizeof(int32_t)), "cudaMalloc") &&
      !fail(cudaMalloc(&out, n * sizeof(int32_t)), "cudaMalloc") &&
      !fail(cudaMemcpy(in, host.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice), "copy in") &&
      !fail(static_cast<cudaError_t>(launch_add_scalar({in, out, n, 42}, nullptr)), "launch") &&
      !fail(cudaMemcpy(host.data(), out, n * sizeof(int32_t), cudaMemcpyDeviceToHost), "copy out")) {
    for (int64_t i = 0; i < n; ++i) {
      if (host[i] != static_cast<int32_t>(i * 7 - 1000 + 42)) {
        error = "wrong result at index " + std::to_string(i);
        break;
      }
    }
  }
  cudaFree(in);
  cudaFree(out);
  return error;
}

const char* error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace pagedcore::cuda
