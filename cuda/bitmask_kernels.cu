// Structured outputs' kernels (contract: pagedcore/cuda/bitmask_kernels.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "pagedcore/cuda/bitmask_kernels.h"
#include "pagedcore/cuda/device_info.h"

namespace pagedcore::cuda {

namespace {

template <typename T>
struct Fill;
template <>
struct Fill<float> {
  static __device__ __forceinline__ float value(float f) { return f; }
};
template <>
struct Fill<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 value(float f) { return __float2bfloat16(f); }
};
template <>
struct Fill<__half> {
  static __device__ __forceinline__ __half value(float f) { return __float2half(f); }
};

constexpr int kThreads = 256;

// One thread per token of one mask's row (grid: tokens x masks). A warp's 32 tokens
// share one word of the mask; only blocked tokens are written.
template <typename T>
__global__ void apply_token_bitmask_kernel(TokenBitmaskParams p) {
  const int32_t mask = blockIdx.y;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= p.vocab) return;
  int64_t row = mask;
  if (p.rows != nullptr) {
    row = p.rows_int64 ? static_cast<const int64_t*>(p.rows)[mask] : static_cast<const int32_t*>(p.rows)[mask];
  }
  if (row < 0 || row >= p.num_rows) return;
  T* logit = static_cast<T*>(p.logits) + row * p.logits_stride + t;
  if (p.status != nullptr && *p.status != 0) {
    *logit = Fill<T>::value(__int_as_float(0x7fc00000));  // NaN: the row cannot be sampled
    return;
  }
  const int64_t word = t >> 5;
  const bool allowed =
      word < p.num_words &&
      ((static_cast<uint32_t>(p.bitmask[static_cast<int64_t>(mask) * p.num_words + word]) >> (t & 31)) & 1u);
  if (!allowed) *logit = Fill<T>::value(__int_as_float(0xff800000));  // -inf
}

template <typename T>
int launch_apply(const TokenBitmaskParams& p, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((p.vocab + kThreads - 1) / kThreads), static_cast<unsigned>(p.num_masks));
  apply_token_bitmask_kernel<T><<<grid, kThreads, 0, s>>>(p);
  return cudaGetLastError();
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread: polls the host's flag (each read crosses the bus: volatile, never cached).
__global__ void wait_host_flag_kernel(const volatile uint32_t* flag, uint32_t ticket, uint64_t timeout_ns,
                                      int32_t* status) {
  const uint64_t start = globaltimer_ns();
  int32_t timed_out = 0;
  while (static_cast<int32_t>(*flag - ticket) < 0) {
    if (globaltimer_ns() - start > timeout_ns) {
      timed_out = 1;
      break;
    }
    __nanosleep(1000);
  }
  *status = timed_out;
}

void check(int error, const char* what) {
  if (error != 0) throw std::runtime_error(std::string(what) + ": CUDA error: " + error_string(error));
}

}  // namespace

int apply_token_bitmask(const TokenBitmaskParams& p, void* stream) {
  if (p.num_masks == 0 || p.vocab == 0) return cudaSuccess;
  if (p.num_masks < 0 || p.num_masks > 65535 || p.vocab < 0 || p.num_words < 0 || p.num_rows < 0) {
    return cudaErrorInvalidValue;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return launch_apply<float>(p, s);
    case DType::kBFloat16: return launch_apply<__nv_bfloat16>(p, s);
    case DType::kFloat16: return launch_apply<__half>(p, s);
    default: return cudaErrorInvalidValue;
  }
}

int wait_host_flag(const WaitHostFlagParams& p, void* stream) {
  // NOTE: the device reaches pinned host memory at the address the runtime maps it to
  // (the host's own on unified-addressing systems); anything else is refused.
  cudaPointerAttributes attributes{};
  const cudaError_t error = cudaPointerGetAttributes(&attributes, p.flag);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return error;
  }
  if (attributes.type != cudaMemoryTypeHost || attributes.devicePointer == nullptr ||
      reinterpret_cast<std::uintptr_t>(p.flag) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  wait_host_flag_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const volatile uint32_t*>(attributes.devicePointer), p.ticket, p.timeout_ns, p.status);
  return cudaGetLastError();
}

void apply_token_bitmask_at(std::uintptr_t logits, std::uintptr_t bitmask, std::uintptr_t rows,
                            bool rows_int64, std::uintptr_t status, int32_t num_masks,
                            int32_t num_rows, int32_t vocab, int32_t num_words,
                            int64_t logits_stride, DType dtype, std::uintptr_t stream) {
  TokenBitmaskParams p{reinterpret_cast<void*>(logits), reinterpret_cast<const int32_t*>(bitmask),
                       reinterpret_cast<const void*>(rows), rows_int64,
                       reinterpret_cast<const int32_t*>(status), num_masks, num_rows, vocab, num_words,
                       logits_stride, dtype};
  check(apply_token_bitmask(p, reinterpret_cast<void*>(stream)), "apply_token_bitmask");
}

void wait_host_flag_at(std::uintptr_t flag, uint32_t ticket, uint64_t timeout_ns,
                       std::uintptr_t status, std::uintptr_t stream) {
  WaitHostFlagParams p{reinterpret_cast<const uint32_t*>(flag), ticket, timeout_ns,
                       reinterpret_cast<int32_t*>(status)};
  check(wait_host_flag(p, reinterpret_cast<void*>(stream)), "wait_host_flag");
}

}  // namespace pagedcore::cuda
