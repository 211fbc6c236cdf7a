// The wgmma building blocks of the Hopper prefill kernels on one tile, against
// float arithmetic: wgmma_selftest (kernels.h), a diagnostic for the device
// (sm_90a only, compiled with attention_wgmma.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_wgmma.h"
#include "attention_wgmma_parts.cuh"
#include "pagedcore/cuda/kernels.h"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda {

namespace {

using namespace wgmma_attention;  // NOLINT: the pieces under test

// ---- self-test of the building blocks (diagnostics) ----
//
// One warpgroup, one tile: Q (64 x HD), K and V (128 x HD) of exactly
// representable values (multiples of 1/8 in [-1, 1)) stored element by element
// at their swizzled places; S = Q K^T by issue_s, then P = S / 4 rounded to T,
// O = P V by issue_pv, each against float arithmetic on the same values.
// errors[0] = max |S - ref|, errors[1] = max |O - ref| (atomicMax on the bits of
// non-negative floats; -2 if the kernel never ran); NaN shows as a huge value.
// PAIRS: K and V in the paired layout of wgmma-tma-pairs (swizzled_paired).
__device__ __forceinline__ float selftest_value(int which, int r, int c) {
  const uint32_t h = (static_cast<uint32_t>(which) * 7919u + static_cast<uint32_t>(r) * 131u +
                      static_cast<uint32_t>(c) * 31u + 17u) * 2654435761u;
  return static_cast<float>(static_cast<int>(h >> 28) - 8) / 8.f;
}

__device__ __forceinline__ void selftest_record(float* error, float e) {
  if (!(e <= 3.0e38f)) e = 3.0e38f;  // NaN or inf
  atomicMax(reinterpret_cast<int*>(error), __float_as_int(e));
}

template <typename T, int HD, bool PAIRS>
__global__ void __launch_bounds__(128, 1) wgmma_selftest_kernel(float* errors) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = wgmma::smem_addr(smem_raw);
  const uint32_t q_s = (raw + 1023u) & ~1023u;
  const uint32_t k_s = q_s + tile_bytes<HD>(kRows);
  const uint32_t v_s = k_s + tile_bytes<HD>(kKeys);
  float* p_ref = reinterpret_cast<float*>(smem_raw + (v_s + tile_bytes<HD>(kKeys) - raw));  // [64][kKeys]
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int qd = lane % 4;
  // (kv: a K or V tile, in the paired layout under PAIRS; the query tile never is.
  // NOTE: kRows == kKeys, so the tile's row count cannot tell them apart.)
  auto put = [&](uint32_t tile, bool kv, int r, int c, float x) {
    const uint32_t off = !kv    ? wgmma::swizzled<kRows>(r, c / 8)
                         : PAIRS ? wgmma::swizzled_paired(r, c / 8)
                                 : wgmma::swizzled<kKeys>(r, c / 8);
    reinterpret_cast<T*>(smem_raw + (tile + off - raw))[c % 8] = static_cast<T>(x);
  };
  for (int i = tid; i < kRows * HD; i += 128) put(q_s, false, i / HD, i % HD, selftest_value(0, i / HD, i % HD));
  for (int i = tid; i < kKeys * HD; i += 128) {
    put(k_s, true, i / HD, i % HD, selftest_value(1, i / HD, i % HD));
    put(v_s, true, i / HD, i % HD, selftest_value(2, i / HD, i % HD));
  }
  wgmma::fence_proxy_async();
  __syncthreads();

  float s[kKeys / 2];
  wgmma::fence();
  issue_s<T, HD, PAIRS>(s, q_s, k_s);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::pin(s);
  float err_s = 0.f;
  uint32_t pa[kKeys / 16][4];
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * warp + lane / 4 + 8 * r;
      float pr[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = 8 * n + 2 * qd + c;
        float ref = 0.f;
        for (int d = 0; d < HD; ++d) ref += selftest_value(0, row, d) * selftest_value(1, key, d);
        const float x = s[4 * n + 2 * r + c];
        err_s = fmaxf(err_s, fabsf(x - ref));
        pr[c] = static_cast<float>(static_cast<T>(x * 0.25f));
        p_ref[row * kKeys + key] = pr[c];
      }
      pa[n / 2][2 * (n % 2) + r] = pack2<T>(pr[0], pr[1]);
    }
  }
  selftest_record(errors, err_s);
  __syncthreads();

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  wgmma::pin(o);
  wgmma::pin(pa);
  wgmma::fence();
  issue_pv<T, HD, PAIRS>(o, pa, v_s);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::pin(o);
  float err_o = 0.f;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int row = 16 * warp + lane / 4 + 8 * r;
        const int d = 8 * n + 2 * qd + c;
        float ref = 0.f;
        for (int key = 0; key < kKeys; ++key) ref += p_ref[row * kKeys + key] * selftest_value(2, key, d);
        err_o = fmaxf(err_o, fabsf(o[4 * n + 2 * r + c] - ref));
      }
    }
  }
  selftest_record(errors + 1, err_o);
#endif
}

template <typename T, int HD, bool PAIRS = false>
int run_selftest(float* out) {
  constexpr size_t smem = 1024 + tile_bytes<HD>(kRows) + 2 * tile_bytes<HD>(kKeys) + 64 * kKeys * 4;
  float* errors = nullptr;
  // NOTE: -2 until the kernel records (the atomicMax of any error >= 0 wins):
  // a kernel compiled empty leaves it there.
  const float start[2] = {-2.f, -2.f};
  cudaError_t e = cudaMalloc(&errors, 2 * sizeof(float));
  if (e == cudaSuccess) e = cudaMemcpy(errors, start, 2 * sizeof(float), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    e = cudaFuncSetAttribute(wgmma_selftest_kernel<T, HD, PAIRS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  }
  if (e == cudaSuccess) {
    wgmma_selftest_kernel<T, HD, PAIRS><<<1, 128, smem>>>(errors);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(out, errors, 2 * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(errors);
  return e;
}

}  // namespace

int wgmma_selftest(float* errors) {
  for (int i = 0; i < kWgmmaSelftestErrors; ++i) errors[i] = -1.f;
  if (!wgmma_prefill_available()) return cudaSuccess;
  int e = run_selftest<__nv_bfloat16, 64>(errors);
  if (e == cudaSuccess) e = run_selftest<__nv_bfloat16, 128>(errors + 2);
  if (e == cudaSuccess) e = run_selftest<__half, 64>(errors + 4);
  if (e == cudaSuccess) e = run_selftest<__half, 128>(errors + 6);
  if (e == cudaSuccess) e = run_selftest<__nv_bfloat16, 128, true>(errors + 8);
  if (e == cudaSuccess) e = run_selftest<__half, 128, true>(errors + 10);
  return e;
}

}  // namespace pagedcore::cuda
