// Device helpers shared by the product, attention and cache kernels: the 16-bit
// float conversions (one value, or a pair), the weight-streaming load, the
// m16n8k16 tensor-core product, the transposing ldmatrix and 2^x.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>  // INFINITY
#include <cstdint>
#include <type_traits>

namespace pagedcore::cuda::dev {

// T (bf16 / fp16) to float and back (round to nearest even).
template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// Two T side by side (4 bytes), to float2, and two floats stored as two T (one
// 4-byte store, round to nearest even).
template <typename T>
using Pair = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }

template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
  } else {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(x, y);
  }
}

// 2^x on the special-function unit (flush-to-zero; the attention kernels' inputs are <= 8).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax: the running max m (log2 units) raised to cover tmax, the
// running sum l rescaled to it; returns the factor for what else was summed
// under the old max (1 when it stays; an all -inf max stays finite).
__device__ __forceinline__ float raise_max(float& m, float& l, float tmax) {
  const float new_m = fmaxf(m, tmax);
  const float corr = fast_exp2(m - (new_m == -INFINITY ? 0.f : new_m));
  m = new_m;
  l *= corr;
  return corr;
}

// 16 bytes read once: non-coherent, not kept in L1 (a weight byte is read by one warp).
__device__ __forceinline__ uint4 load_streaming(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

// c += a * b on a 16x8x16 tile, float32 accumulators; T: bf16 or fp16 operands.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 matrices of 16-bit elements from shared memory, transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace pagedcore::cuda::dev
