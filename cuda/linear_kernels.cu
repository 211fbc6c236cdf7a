// out = input @ weight^T (+ bias) for the few rows of a decode step (contract:
// pagedcore/cuda/layer_kernels.h, LinearParams). One row here; 2..16 rows on
// tensor cores in linear_mma.cu.
//
// 1-8 warps compute one output feature for the row (see linear_row_kernel): their
// lanes stream the weight row with 16-byte loads that bypass L1 (each weight byte
// is read once), several loads in flight per lane, while the input row (a few KB,
// read by every warp) stays in L1. Products accumulate in float32 per lane, then
// across the warp by shuffles. At one row a GEMM library's tiles leave most of the
// GPU idle and the call latency-bound; this kernel is bound by the weight's bytes.
// Launched with PDL (pdl.cuh): each warp's first weight loads are in flight
// before the kernel that produced the input has finished.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "device_ops.cuh"
#include "linear_mma.h"
#include "pagedcore/cuda/layer_kernels.h"
#include "pdl.cuh"

namespace pagedcore::cuda {

namespace {

using dev::from_float;
using dev::load_streaming;
using dev::to_float;

constexpr int kWarps = 8;   // output features per CTA
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane

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


// One input row: KW warps share each output feature, each reading a contiguous
// part of its weight row (split k), so that a product of few long rows still
// makes many small CTAs: with one warp per feature and 8 features per CTA the
// 768 CTAs of the 8B shape's qkv (6 on some SMs, 5 on others) read 3.0 TB/s on
// the H200, with 4 warps a feature (3,072 CTAs) 3.5, gate_up's 3,584 CTAs 4.0. Each lane keeps
// two rounds of kUnroll 16-byte loads in flight (the next round is issued
// before the current one is multiplied). Partial sums meet in shared memory in
// a fixed order.
//
// GATED (LinearParams::silu_and_mul): the CTA's first R / 2 features are gate rows
// j.., the others the matching up rows I + j..; the gate rows' threads combine them.
template <typename T, int KW, bool GATED>
__global__ void __launch_bounds__(32 * kWarps) linear_row_kernel(LinearParams p) {
  constexpr int R = kWarps / KW;  // output features per CTA
  constexpr int U = kUnroll;
  static_assert(!GATED || R % 2 == 0, "gate and up rows in pairs");
  __shared__ float partial[kWarps];
  __shared__ float gated[R];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int part = warp % KW;
  const int half = p.out_features / 2;  // (GATED: I)
  int n;
  bool active;
  if constexpr (GATED) {
    const int r = warp / KW;
    const int j = blockIdx.x * (R / 2) + r % (R / 2);
    active = j < half;
    n = r < R / 2 ? j : half + j;
  } else {
    n = blockIdx.x * R + warp / KW;
    active = n < p.out_features;
  }
  const int vectors = p.in_features / 8;
  const int per_part = (vectors + KW - 1) / KW;
  const int v_begin = part * per_part;
  const int v_end = min(vectors, v_begin + per_part);
  const T* input = static_cast<const T*>(p.input);
  const T* wrow = static_cast<const T*>(p.weight) + static_cast<int64_t>(active ? n : 0) * p.in_features;
  uint4 w[U], next[U];
  const auto load_weights = [&](uint4 (&dst)[U], int v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u + lane;
      if (active && v < v_end) dst[u] = load_streaming(wrow + 8 * static_cast<int64_t>(v));
    }
  };
  // The first weight loads go out before the kernel that writes the input ends (PDL).
  load_weights(w, v_begin);
  pdl_wait();
  pdl_launch_dependents();
  float acc = 0.f;
  for (int v0 = v_begin; v0 < v_end; v0 += 32 * U) {
    if (v0 + 32 * U < v_end) load_weights(next, v0 + 32 * U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u + lane;
      if (!active || v >= v_end) break;
      float wf[8], xf[8];
      widen8<T>(w[u], wf);
      widen8<T>(__ldg(reinterpret_cast<const uint4*>(input + 8 * static_cast<int64_t>(v))), xf);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(xf[i], wf[i], acc);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = next[u];
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if constexpr (KW > 1) {
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (part == 0 && lane == 0) {
      acc = 0.f;
#pragma unroll
      for (int k = 0; k < KW; ++k) acc += partial[warp + k];
    }
  }
  const bool owner = part == 0 && lane == 0 && active;  // holds feature n's whole sum
  const float bias = owner && p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[n]) : 0.f;
  if constexpr (GATED) {
    // The product rounded to the dtype (as the unfused path stores gate_up), then
    // silu_and_mul's arithmetic: silu rounded to the dtype, times up, rounded once.
    if (owner) gated[warp / KW] = to_float(from_float<T>(acc + bias));
    __syncthreads();
    if (!owner || warp / KW >= R / 2) return;
    const float g = gated[warp / KW], u = gated[warp / KW + R / 2];
    const float silu = to_float(from_float<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g)))));
    static_cast<T*>(p.out)[n] = from_float<T>(__fmul_rn(silu, u));
  } else {
    if (owner) static_cast<T*>(p.out)[n] = from_float<T>(acc + bias);
  }
}

// NOTE (issue 11): this kernel generalized to 2-16 rows (16 float32 accumulators a
// lane, each weight vector multiplied with every row's input from L1) was measured
// on the H200 on 2026-12-02 (bench/RESULTS.md, eleventh session) and lost to the
// tensor-core kernel at every size, 2 rows included (SmolLM2 qkv 3.1 / 6.6 / 11.2 us
// at 2 / 8 / 16 rows against 2.1 / 2.2 / 2.9): its time grows with the rows. Do not
// retry it without a new idea for the per-row instruction cost.

// Warps per output feature for one row: the fewest that make >= 15 CTAs per SM,
// keeping >= 64 weight vectors (1 KB) per warp. PAGEDCORE_LINEAR_ROW_SPLIT caps it
// (1: one warp per feature, for comparisons; read once).
int row_split(const LinearParams& p) {
  static const int cap = [] {
    const char* env = std::getenv("PAGEDCORE_LINEAR_ROW_SPLIT");
    const int v = env != nullptr ? std::atoi(env) : kWarps;
    return v >= 1 && v <= kWarps ? v : kWarps;
  }();
  static const int sms = [] {
    int device = 0, count = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return 132;
    }
    return count;
  }();
  const int vectors = p.in_features / 8;
  int kw = 1;
  while (2 * kw <= cap && vectors / (2 * kw) >= 64 &&
         static_cast<int64_t>(p.out_features + kWarps / kw - 1) / (kWarps / kw) < 15 * sms) {
    kw *= 2;
  }
  return kw;
}

template <typename T, bool GATED>
cudaError_t launch_one_row(const LinearParams& p, cudaStream_t stream) {
  const int kw = GATED ? std::min(row_split(p), kWarps / 2) : row_split(p);
  // GATED: a CTA's R features are R / 2 gate-up pairs.
  const int per_cta = GATED ? kWarps / kw / 2 : kWarps / kw;
  const int features = GATED ? p.out_features / 2 : p.out_features;
  const dim3 grid((features + per_cta - 1) / per_cta);
  const dim3 block(32 * kWarps);
  switch (kw) {
    case 1: return launch_pdl(linear_row_kernel<T, 1, GATED>, grid, block, 0, stream, p);
    case 2: return launch_pdl(linear_row_kernel<T, 2, GATED>, grid, block, 0, stream, p);
    case 4: return launch_pdl(linear_row_kernel<T, 4, GATED>, grid, block, 0, stream, p);
    default:
      if constexpr (GATED) {
        return cudaErrorInvalidValue;  // (unreachable: kw <= 4)
      } else {
        return launch_pdl(linear_row_kernel<T, 8, false>, grid, block, 0, stream, p);
      }
  }
}

template <typename T>
int launch(const LinearParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 1) return p.silu_and_mul ? launch_one_row<T, true>(p, stream) : launch_one_row<T, false>(p, stream);
  return linear_mma(p, stream);
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

}  // namespace

int linear(const LinearParams& p, void* stream) {
  if (p.num_tokens == 0 || p.out_features == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_tokens > kLinearMaxRows || p.in_features <= 0 || p.in_features % 8 != 0 ||
      p.out_features < 0 || p.input_stride % 8 != 0 ||
      p.out_stride < (p.silu_and_mul ? p.out_features / 2 : p.out_features) || !aligned16(p.input) ||
      !aligned16(p.weight) || (p.num_tokens > 1 && p.input_stride < p.in_features) ||
      (p.silu_and_mul && p.out_features % 2 != 0)) {
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
