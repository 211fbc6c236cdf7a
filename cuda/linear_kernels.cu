// out = input @ weight^T (+ bias) for the few rows of a decode step (contract:
// pagedcore/cuda/layer_kernels.h, LinearParams).
//
// A warp computes one output feature for every input row: its lanes stream the
// weight row with 16-byte loads that bypass L1 (each weight byte is read once),
// several loads in flight per lane, while the input rows (a few KB, read by every
// warp) stay in L1. Products accumulate in float32 per lane, then across the warp
// by shuffles. At one to eight rows a GEMM library's tiles leave most of the GPU
// idle and the call latency-bound; this kernel is bound by the weight's bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "pagedcore/cuda/layer_kernels.h"

namespace pagedcore::cuda {

namespace {

constexpr int kWarps = 8;   // output features per CTA
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Eight T (16 bytes) as floats.
template <typename T>
__device__ __forceinline__ void widen8(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 two;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      two = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    } else {
      two = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    }
    f[2 * i] = two.x;
    f[2 * i + 1] = two.y;
  }
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

// M: rows the kernel is built for (p.num_tokens <= M).
template <typename T, int M>
__global__ void __launch_bounds__(32 * kWarps) linear_kernel(LinearParams p) {
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * kWarps + threadIdx.x / 32;
  if (n >= p.out_features) return;  // (no block-wide synchronisation below)
  const int rows = p.num_tokens;
  const int vectors = p.in_features / 8;
  const T* weight = static_cast<const T*>(p.weight) + static_cast<int64_t>(n) * p.in_features;
  const T* input = static_cast<const T*>(p.input);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int v0 = 0; v0 < vectors; v0 += 32 * kUnroll) {
    uint4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + 32 * u + lane;
      if (v < vectors) w[u] = load_streaming(weight + 8 * static_cast<int64_t>(v));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + 32 * u + lane;
      if (v >= vectors) break;
      float wf[8];
      widen8<T>(w[u], wf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m >= rows) break;
        float xf[8];
        widen8<T>(__ldg(reinterpret_cast<const uint4*>(input + m * p.input_stride + 8 * static_cast<int64_t>(v))), xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[m] = fmaf(xf[i], wf[i], acc[m]);
      }
    }
  }
  const float bias = p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[n]) : 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m >= rows) break;
    float s = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == m % 32) static_cast<T*>(p.out)[m * p.out_stride + n] = from_float<T>(s + bias);
  }
}

template <typename T>
int launch(const LinearParams& p, cudaStream_t stream) {
  const dim3 grid((p.out_features + kWarps - 1) / kWarps);
  const dim3 block(32 * kWarps);
  if (p.num_tokens <= 1) {
    linear_kernel<T, 1><<<grid, block, 0, stream>>>(p);
  } else if (p.num_tokens <= 2) {
    linear_kernel<T, 2><<<grid, block, 0, stream>>>(p);
  } else if (p.num_tokens <= 4) {
    linear_kernel<T, 4><<<grid, block, 0, stream>>>(p);
  } else {
    linear_kernel<T, 8><<<grid, block, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

}  // namespace

int linear(const LinearParams& p, void* stream) {
  if (p.num_tokens == 0 || p.out_features == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_tokens > kLinearMaxRows || p.in_features <= 0 || p.in_features % 8 != 0 ||
      p.out_features < 0 || p.input_stride % 8 != 0 || p.out_stride < p.out_features || !aligned16(p.input) ||
      !aligned16(p.weight) || (p.num_tokens > 1 && p.input_stride < p.in_features)) {
    return cudaErrorInvalidValue;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16>(p, s);
    case DType::kFloat16: return launch<__half>(p, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore::cuda
