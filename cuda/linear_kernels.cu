// out = input @ weight^T (+ bias) for the few rows of a decode step (contract:
// pagedcore/cuda/layer_kernels.h, LinearParams). One row here, and 2..16 rows over
// small weights; 2..16 rows over larger weights on tensor cores in linear_mma.cu.
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


// One input row (M = 1), or up to M = 16 rows over a small weight: KW warps
// share each output feature, each reading a contiguous part of its weight row
// (split k), so that a product of few long rows still makes many small CTAs:
// with one warp per feature and 8 features per CTA the 768 CTAs of the 8B
// shape's qkv (6 on some SMs, 5 on others) read 3.0 TB/s on the H200, with 4
// warps a feature (3,072 CTAs) 3.5, gate_up's 3,584 CTAs 4.0. Each lane keeps
// two rounds of kUnroll 16-byte loads in flight (the next round is issued
// before the current one is multiplied). Partial sums meet in shared memory in
// a fixed order.
//
// M > 1 (2..16 rows, issue 11): each weight vector a lane loads is multiplied
// with every row's input (the inputs, a few KB a row, stay in L1), into one
// float32 accumulator per row. The lanes' sums meet by a transposing butterfly:
// at each xor step a lane keeps half of its rows and sends the other half, so
// that after log2(M) steps lane pairs hold one row each (16 shuffles at M = 16
// instead of 80); each row's value is added in the same pairs and order as the
// one-row kernel's butterfly, so a row's result is the same bits as a one-row
// call's, whatever other rows share the call. Over small weights (SmolLM2) the
// tensor-core kernel's longer chain (weights, inputs, mma, a shared-memory
// reduction over 8 warps) cost 4.9-5.5 us a call in the model against 2.2-3.0
// for the one-row kernel.
//
// GATED (LinearParams::silu_and_mul): the CTA's first R / 2 features are gate rows
// j.., the others the matching up rows I + j..; the gate rows' threads combine them.
template <typename T, int KW, bool GATED, int M>
__global__ void __launch_bounds__(32 * kWarps) linear_row_kernel(LinearParams p) {
  constexpr int R = kWarps / KW;  // output features per CTA
  constexpr int U = kUnroll;
  static_assert(!GATED || R % 2 == 0, "gate and up rows in pairs");
  static_assert(M >= 1 && M <= 32 && (M & (M - 1)) == 0, "rows: a power of two up to a warp");
  __shared__ float partial[kWarps][M];
  __shared__ float gated[R][M];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int part = warp % KW;
  const int half = p.out_features / 2;  // (GATED: I)
  const int rows = M == 1 ? 1 : p.num_tokens;
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
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  for (int v0 = v_begin; v0 < v_end; v0 += 32 * U) {
    if (v0 + 32 * U < v_end) load_weights(next, v0 + 32 * U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u + lane;
      if (!active || v >= v_end) break;
      float wf[8];
      widen8<T>(w[u], wf);
#pragma unroll
      for (int r = 0; r < M; ++r) {
        if (r >= rows) break;
        float xf[8];
        widen8<T>(__ldg(reinterpret_cast<const uint4*>(input + r * p.input_stride + 8 * static_cast<int64_t>(v))), xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r] = fmaf(xf[i], wf[i], acc[r]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = next[u];
  }
  // The butterfly: while a lane holds c > 1 rows, the xor step keeps rows
  // [0, c/2) or [c/2, c) by the lane's bit and adds the partner's sums of them;
  // `row` collects the kept offsets. Then plain xor steps over the other bits.
  int row = 0;
#pragma unroll
  for (int o = 16, c = M; o > 0; o /= 2) {
    if (c > 1) {
      const bool upper = (lane & o) != 0;
#pragma unroll
      for (int i = 0; i < c / 2; ++i) {
        const float send = upper ? acc[i] : acc[i + c / 2];
        const float keep = upper ? acc[i + c / 2] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      if (upper) row += c / 2;
      c /= 2;
    } else {
      acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
    }
  }
  // Lanes whose bits below the butterfly's last transposing step are 0 hold row
  // `row`'s whole sum (M = 1: lane 0, row 0).
  const bool holder = (lane & (32 / M - 1)) == 0;
  float sum = acc[0];
  if constexpr (KW > 1) {
    if (holder) partial[warp][row] = sum;
    __syncthreads();
    if (part == 0 && holder) {
      sum = 0.f;
#pragma unroll
      for (int k = 0; k < KW; ++k) sum += partial[warp + k][row];
    }
  }
  const bool owner = part == 0 && holder && active && row < rows;  // holds row `row` of feature n
  const float bias = owner && p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[n]) : 0.f;
  T* out = static_cast<T*>(p.out) + row * p.out_stride;
  if constexpr (GATED) {
    // The product rounded to the dtype (as the unfused path stores gate_up), then
    // silu_and_mul's arithmetic: silu rounded to the dtype, times up, rounded once.
    if (owner) gated[warp / KW][row] = to_float(from_float<T>(sum + bias));
    __syncthreads();
    if (!owner || warp / KW >= R / 2) return;
    const float g = gated[warp / KW][row], u = gated[warp / KW + R / 2][row];
    const float silu = to_float(from_float<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g)))));
    out[n] = from_float<T>(__fmul_rn(silu, u));
  } else {
    if (owner) out[n] = from_float<T>(sum + bias);
  }
}

// Warps per output feature: the fewest that make >= 15 CTAs per SM, keeping
// >= min_vectors weight vectors (64: 1 KB) per warp. PAGEDCORE_LINEAR_ROW_SPLIT
// caps it (1: one warp per feature, for comparisons; read once).
int row_split(const LinearParams& p, int min_vectors) {
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
  while (2 * kw <= cap && vectors / (2 * kw) >= min_vectors &&
         static_cast<int64_t>(p.out_features + kWarps / kw - 1) / (kWarps / kw) < 15 * sms) {
    kw *= 2;
  }
  return kw;
}

template <typename T, bool GATED, int M>
cudaError_t launch_rows(const LinearParams& p, cudaStream_t stream) {
  // Several rows multiply each weight vector several times: their k may be cut finer
  // (PAGEDCORE_LINEAR_ROWS_MIN_VECTORS, read at each launch; 64 as one row by default,
  // which keeps a row's bits equal to a one-row call's).
  int min_vectors = 64;
  if (const char* env = M > 1 ? std::getenv("PAGEDCORE_LINEAR_ROWS_MIN_VECTORS") : nullptr) {
    min_vectors = std::max(1, std::atoi(env));
  }
  const int split = row_split(p, min_vectors);
  const int kw = GATED ? std::min(split, kWarps / 2) : split;
  // GATED: a CTA's R features are R / 2 gate-up pairs.
  const int per_cta = GATED ? kWarps / kw / 2 : kWarps / kw;
  const int features = GATED ? p.out_features / 2 : p.out_features;
  const dim3 grid((features + per_cta - 1) / per_cta);
  const dim3 block(32 * kWarps);
  switch (kw) {
    case 1: return launch_pdl(linear_row_kernel<T, 1, GATED, M>, grid, block, 0, stream, p);
    case 2: return launch_pdl(linear_row_kernel<T, 2, GATED, M>, grid, block, 0, stream, p);
    case 4: return launch_pdl(linear_row_kernel<T, 4, GATED, M>, grid, block, 0, stream, p);
    default:
      if constexpr (GATED) {
        return cudaErrorInvalidValue;  // (unreachable: kw <= 4)
      } else {
        return launch_pdl(linear_row_kernel<T, 8, false, M>, grid, block, 0, stream, p);
      }
  }
}

// Weights of up to this many elements take the CUDA-core kernel at 2..16 rows,
// larger ones the tensor-core kernel (linear_mma.cu). PAGEDCORE_LINEAR_ROWS_MAX_WEIGHT
// (read at each launch, i.e. at a graph's capture) overrides it: 0 sends every
// 2..16-row product to the tensor cores.
int64_t rows_kernel_max_weight() {
  constexpr int64_t kDefault = int64_t{4} << 20;
  const char* env = std::getenv("PAGEDCORE_LINEAR_ROWS_MAX_WEIGHT");
  return env != nullptr ? std::atoll(env) : kDefault;
}

template <typename T>
int launch(const LinearParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 1) {
    return p.silu_and_mul ? launch_rows<T, true, 1>(p, stream) : launch_rows<T, false, 1>(p, stream);
  }
  if (static_cast<int64_t>(p.in_features) * p.out_features <= rows_kernel_max_weight()) {
    return p.silu_and_mul ? launch_rows<T, true, kLinearMaxRows>(p, stream)
                          : launch_rows<T, false, kLinearMaxRows>(p, stream);
  }
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
