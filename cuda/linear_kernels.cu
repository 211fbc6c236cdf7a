// out = input @ weight^T (+ bias) for the few rows of a decode step (contract:
// pagedcore/cuda/layer_kernels.h, LinearParams). One row here; 2..16 rows on
// tensor cores in linear_mma.cu.
//
// A warp computes one output feature for the row: its lanes stream the weight
// row with 16-byte loads that bypass L1 (each weight byte is read once), several
// loads in flight per lane, while the input row (a few KB, read by every warp)
// stays in L1. Products accumulate in float32 per lane, then across the warp by
// shuffles. At one row a GEMM library's tiles leave most of the GPU idle and the
// call latency-bound; this kernel is bound by the weight's bytes.
// Launched with PDL (pdl.cuh): each warp's first weight loads are in flight
// before the kernel that produced the input has finished.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "linear_mma.h"
#include "pagedcore/cuda/layer_kernels.h"
#include "pdl.cuh"

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

// M: rows the kernel is built for (p.num_tokens <= M); F: output features per
// warp, which share each load of the input rows (at one row F = 1: more warps).
template <typename T, int M, int F>
__global__ void __launch_bounds__(32 * kWarps) linear_kernel(LinearParams p) {
  constexpr int U = F >= 4 ? 1 : kUnroll;  // weight loads in flight per lane: F * U
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kWarps + threadIdx.x / 32) * F;
  if (n0 >= p.out_features) return;  // (no block-wide synchronisation below)
  const int rows = p.num_tokens;
  const int vectors = p.in_features / 8;
  const T* input = static_cast<const T*>(p.input);
  const T* wrow[F];
#pragma unroll
  for (int f = 0; f < F; ++f) {
    // (a feature past the end re-reads the first one; its sum is not written)
    const int n = n0 + f < p.out_features ? n0 + f : n0;
    wrow[f] = static_cast<const T*>(p.weight) + static_cast<int64_t>(n) * p.in_features;
  }
  float acc[F][M];
#pragma unroll
  for (int f = 0; f < F; ++f) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[f][m] = 0.f;
  }
  uint4 w[U][F];
  const auto load_weights = [&](int v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u + lane;
      if (v < vectors) {
#pragma unroll
        for (int f = 0; f < F; ++f) w[u][f] = load_streaming(wrow[f] + 8 * static_cast<int64_t>(v));
      }
    }
  };
  // The first weight loads go out before the kernel that writes the input ends (PDL).
  load_weights(0);
  pdl_wait();
  pdl_launch_dependents();
  for (int v0 = 0; v0 < vectors; v0 += 32 * U) {
    if (v0 > 0) load_weights(v0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u + lane;
      if (v >= vectors) break;
      float wf[F][8];
#pragma unroll
      for (int f = 0; f < F; ++f) widen8<T>(w[u][f], wf[f]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m >= rows) break;
        float xf[8];
        widen8<T>(__ldg(reinterpret_cast<const uint4*>(input + m * p.input_stride + 8 * static_cast<int64_t>(v))), xf);
#pragma unroll
        for (int f = 0; f < F; ++f) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[f][m] = fmaf(xf[i], wf[f][i], acc[f][m]);
        }
      }
    }
  }
#pragma unroll
  for (int f = 0; f < F; ++f) {
    const int n = n0 + f;
    const float bias = p.bias != nullptr && n < p.out_features ? to_float(static_cast<const T*>(p.bias)[n]) : 0.f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= rows) break;
      float s = acc[f][m];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0 && n < p.out_features) static_cast<T*>(p.out)[m * p.out_stride + n] = from_float<T>(s + bias);
    }
  }
}

template <typename T, int M, int F>
cudaError_t launch_rows(const LinearParams& p, cudaStream_t stream) {
  const dim3 grid((p.out_features + kWarps * F - 1) / (kWarps * F));
  return launch_pdl(linear_kernel<T, M, F>, grid, dim3(32 * kWarps), 0, stream, p);
}

// NOTE: the kernel's M > 1 instances (an FMA path for 2..16 rows, slower than
// cuBLAS there) gave way to linear_mma.cu; the template keeps M and F.
template <typename T>
int launch(const LinearParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 1) return launch_rows<T, 1, 1>(p, stream);
  return linear_mma(p, stream);
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
