// The decoder layer's elementwise kernels (contract: pagedcore/cuda/layer_kernels.h).
//
// NOTE: products and sums go through __fmul_rn / __fadd_rn: nvcc would otherwise
// contract a * b + c into an FMA and skip a rounding that torch performs, and float32
// results would no longer equal the unfused arithmetic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "pagedcore/cuda/layer_kernels.h"
#include "pdl.cuh"

namespace pagedcore::cuda {

namespace {

template <typename T>
struct Num;
template <>
struct Num<float> {
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float f) { return f; }
};
template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float f) { return __float2bfloat16_rn(f); }
};
template <>
struct Num<__half> {
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float f) { return __float2half_rn(f); }
};

// f rounded to T and widened again.
template <typename T>
__device__ __forceinline__ float rnd(float f) {
  return Num<T>::load(Num<T>::store(f));
}

// 16 bytes of T.
template <typename T>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  Vec<T> r;
  *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  return r;
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

int round_up32(int64_t n) { return static_cast<int>((n + 31) / 32 * 32); }

// ---- RMSNorm ---------------------------------------------------------------------------

// blockDim.x threads serve one row, blockDim.y rows per CTA. kVec: the rows start on 16
// bytes, and the first hidden_size / V elements of a row go as vectors, the rest scalar.
// K: vectors per thread held in registers between the two passes (and their weights),
// the thread's first K of the row; any further ones are read again in the second pass.
template <typename T, bool kVec, int K>
__global__ void rms_norm_kernel(RmsNormParams p, int64_t num_rows) {
  constexpr int V = Vec<T>::kSize;
  __shared__ double partial[32];
  __shared__ float row_inv[32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const int n = p.hidden_size;
  const int64_t t = active ? row / p.num_heads : 0;
  const int64_t h = active ? row % p.num_heads : 0;
  const T* in = static_cast<const T*>(p.input) + t * p.input_stride + h * n;
  T* out = static_cast<T*>(p.out) + t * p.out_stride + h * n;
  T* res = p.residual != nullptr ? static_cast<T*>(p.residual) + t * p.residual_stride : nullptr;
  const T* w = static_cast<const T*>(p.weight);
  const int vec_end = kVec ? n / V * V : 0;
  // The thread's first K vectors stay in registers between the two passes (one vector a
  // thread at the hidden sizes of the models with K = 1), and their weights are loaded
  // before the kernel before this one has ended (PDL): a decode step's row then costs one
  // memory round trip, not three.
  const int i0 = threadIdx.x * V;
  const int step = blockDim.x * V;
  Vec<T> xs[K], gs[K];
  if (kVec && active) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i0 + k * step < vec_end) gs[k] = load_vec(w + i0 + k * step);
    }
  }
  pdl_wait();
  pdl_launch_dependents();

  // NOTE: the sum of squares in double (as the CPU kernel): a float sum over rows of 8k
  // elements drifts by a few ulps from the exact one. Bandwidth-bound, so it costs nothing.
  double acc = 0.0;
  if (active) {
    if (res != nullptr) {
      // HF: hidden = residual + hidden, rounded to the dtype; the sum is normalised.
      auto add = [&](int i) {
        Vec<T> a = load_vec(in + i), b = load_vec(res + i);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float s = rnd<T>(__fadd_rn(Num<T>::load(b.v[j]), Num<T>::load(a.v[j])));
          b.v[j] = Num<T>::store(s);
          acc += static_cast<double>(s) * s;
        }
        store_vec(res + i, b);
        return b;
      };
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (i0 + k * step < vec_end) xs[k] = add(i0 + k * step);
      }
      for (int i = i0 + K * step; i < vec_end; i += step) add(i);
      for (int i = vec_end + threadIdx.x; i < n; i += blockDim.x) {
        const float s = rnd<T>(__fadd_rn(Num<T>::load(res[i]), Num<T>::load(in[i])));
        res[i] = Num<T>::store(s);
        acc += static_cast<double>(s) * s;
      }
    } else {
      auto square = [&](int i) {
        const Vec<T> a = load_vec(in + i);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const double x = Num<T>::load(a.v[j]);
          acc += x * x;
        }
        return a;
      };
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (i0 + k * step < vec_end) xs[k] = square(i0 + k * step);
      }
      for (int i = i0 + K * step; i < vec_end; i += step) square(i);
      for (int i = vec_end + threadIdx.x; i < n; i += blockDim.x) {
        const double x = Num<T>::load(in[i]);
        acc += x * x;
      }
    }
  }
  // Sum over the row's threads: within each warp, then over the row's warps.
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  const int warps_per_row = blockDim.x / 32;
  const int warp = threadIdx.y * warps_per_row + threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) partial[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int k = 0; k < warps_per_row; ++k) total += partial[threadIdx.y * warps_per_row + k];
    const float sum = static_cast<float>(total);
    // torch: x * rsqrt(mean + eps) with mean = sum / n; rsqrt as 1 / sqrt, both rounded.
    const float variance = __fdiv_rn(sum, static_cast<float>(n));
    row_inv[threadIdx.y] = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(variance, p.eps)));
  }
  __syncthreads();
  if (!active) return;
  const float inv = row_inv[threadIdx.y];
  const T* x = res != nullptr ? res : in;
  auto norm = [&](int i, const Vec<T>& a, const Vec<T>& g) {
    Vec<T> o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      o.v[j] = Num<T>::store(__fmul_rn(Num<T>::load(g.v[j]), rnd<T>(__fmul_rn(Num<T>::load(a.v[j]), inv))));
    }
    store_vec(out + i, o);
  };
  if constexpr (kVec) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i0 + k * step < vec_end) norm(i0 + k * step, xs[k], gs[k]);
    }
  }
  for (int i = i0 + K * step; i < vec_end; i += step) norm(i, load_vec(x + i), load_vec(w + i));
  for (int i = vec_end + threadIdx.x; i < n; i += blockDim.x) {
    out[i] = Num<T>::store(__fmul_rn(Num<T>::load(w[i]), rnd<T>(__fmul_rn(Num<T>::load(x[i]), inv))));
  }
}

// PAGEDCORE_RMSNORM_VECS: vectors per thread held in registers (1, 2 or 4; fewer threads
// per row for more), read on every launch so that one process can compare them; unset or
// empty: by the row count where rows have 256+ vectors (hidden 2048+ in 16-bit types).
// NOTE: measured on the H200 at 141c09e (bench/rmsnorm_variants.py, bf16, hidden 4096, us;
// K = 1 / 2 / 4): add+norm 16 rows 2.1 / 2.3 / 3.4, 512 rows 5.3 / 5.3 / 4.5, 4096 rows
// 46.5 / 44.8 / 47.6; norm alone 4096 rows 38.8 / 33.0 / 35.5; every output the same bits.
// Hidden 576: no consistent winner (K = 1). The thresholds between those row counts (256,
// 2048) and float32 rows (4 floats a vector) are interpolated, not measured.
int rms_norm_vecs(int64_t units, int64_t num_rows) {
  const char* env = std::getenv("PAGEDCORE_RMSNORM_VECS");
  if (env != nullptr && env[0] != '\0') {
    const int k = std::atoi(env);
    return k == 2 || k == 4 ? k : 1;
  }
  if (units < 256) return 1;
  return num_rows >= 2048 ? 2 : num_rows >= 256 ? 4 : 1;
}

template <typename T, int K>
int launch_rms_norm_vec(const RmsNormParams& p, int64_t units, cudaStream_t s) {
  const int64_t per_thread = (units + K - 1) / K;
  const int threads = per_thread >= 1024 ? 1024 : round_up32(per_thread);
  const int rows_per_cta = threads >= 256 ? 1 : 256 / threads;
  const int64_t num_rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t blocks = (num_rows + rows_per_cta - 1) / rows_per_cta;
  return launch_pdl(rms_norm_kernel<T, true, K>, dim3(blocks), dim3(threads, rows_per_cta), 0, s, p, num_rows);
}

template <typename T>
int launch_rms_norm(const RmsNormParams& p, cudaStream_t s) {
  constexpr int V = Vec<T>::kSize;
  const int64_t eb = sizeof(T);
  // Vectors need every row to start on 16 bytes.
  bool vec = aligned16(p.input) && aligned16(p.out) && aligned16(p.weight) &&
             (p.input_stride * eb) % 16 == 0 && (p.out_stride * eb) % 16 == 0 &&
             (p.num_heads == 1 || (p.hidden_size * eb) % 16 == 0);
  if (p.residual != nullptr) vec = vec && aligned16(p.residual) && (p.residual_stride * eb) % 16 == 0;
  if (vec) {
    const int64_t units = (p.hidden_size + V - 1) / V;
    switch (rms_norm_vecs(units, static_cast<int64_t>(p.num_tokens) * p.num_heads)) {
      case 2: return launch_rms_norm_vec<T, 2>(p, units, s);
      case 4: return launch_rms_norm_vec<T, 4>(p, units, s);
      default: return launch_rms_norm_vec<T, 1>(p, units, s);
    }
  }
  const int64_t units = p.hidden_size;
  const int threads = units >= 1024 ? 1024 : round_up32(units);
  const int rows_per_cta = threads >= 256 ? 1 : 256 / threads;
  const int64_t num_rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t blocks = (num_rows + rows_per_cta - 1) / rows_per_cta;
  return launch_pdl(rms_norm_kernel<T, false, 1>, dim3(blocks), dim3(threads, rows_per_cta), 0, s, p, num_rows);
}

// ---- rotary ----------------------------------------------------------------------------

// A value as the cache stores it: the same type, or fp8 e4m3 of value * inv_scale
// (saturated; reshape_and_cache's arithmetic).
template <typename T, typename C>
__device__ __forceinline__ C to_cache(float v, float inv_scale) {
  if constexpr (sizeof(C) == 1) {
    return static_cast<C>(__nv_cvt_float_to_fp8(v * inv_scale, __NV_SATFINITE, __NV_E4M3));
  } else {
    return Num<T>::store(v);
  }
}

// N values of C stored as one access (N * sizeof(C) of 4, 8 or 16 bytes; dst aligned to it).
template <typename C, int N>
__device__ __forceinline__ void store_n(C* dst, const C (&vals)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(C));
  static_assert(kBytes == 16 || kBytes == 8 || kBytes == 4, "one 4-, 8- or 16-byte store");
  if constexpr (kBytes == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(vals);
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(vals);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(vals);
  }
}

// HF's rotation of one pair: x * cos + rotate_half(x) * sin, each product and the sum in
// the dtype; x1 at i, x2 at i + head_dim / 2.
template <typename T>
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float sn, T& o1, T& o2) {
  o1 = Num<T>::store(__fsub_rn(rnd<T>(__fmul_rn(x1, c)), rnd<T>(__fmul_rn(x2, sn))));
  o2 = Num<T>::store(__fadd_rn(rnd<T>(__fmul_rn(x2, c)), rnd<T>(__fmul_rn(x1, sn))));
}

// grid (tokens, chunks): unit j of the token's units (blockIdx.y * blockDim.x +
// threadIdx.x, striding over the chunks) rotates pair (i, i + head_dim / 2) of one head
// (kVec: V consecutive pairs, as 16-byte loads and stores), consecutive threads on
// consecutive i (coalesced). Several CTAs per token so that a decode step's few tokens
// still spread over SMs. C: the cache's element type (void: no cache write); a thread
// writes the key elements it rotated, so no barrier is needed.
// NOTE: the kernel took 101 us a layer on the 8B shape's 4096-token prefill with one pair
// (2-byte accesses) a thread, 4x its bytes' time at the H200's bandwidth (profile at 73b39de):
// hence kVec wherever the rows and the cache allow 16-byte accesses.
template <typename T, typename Index, typename C, bool kVec>
__global__ void rotary_kernel(RotaryEmbeddingParams p) {
  constexpr bool kCache = !std::is_void_v<C>;
  constexpr int V = kVec ? Vec<T>::kSize : 1;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int first = blockIdx.y * blockDim.x + threadIdx.x;
  const int stride = gridDim.y * blockDim.x;
  const int64_t pos = static_cast<int64_t>(static_cast<const Index*>(p.positions)[t]);
  const bool rotate = pos >= 0 && pos < p.max_position;
  const int half = p.head_dim / 2;
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  int64_t slot = -1;
  if constexpr (kCache) {
    // (its own index type: positions and slots need not share one)
    slot = p.slot_mapping_int64 ? static_cast<const int64_t*>(p.slot_mapping)[t]
                                : static_cast<int64_t>(static_cast<const int32_t*>(p.slot_mapping)[t]);
    if (slot >= static_cast<int64_t>(p.num_blocks) * p.block_size) slot = -1;
  }
  if (!rotate && slot < 0) return;
  const float* cos_sin = p.cos_sin_cache + (rotate ? pos : 0) * p.head_dim;
  T* q = static_cast<T*>(p.query) + t * p.query_stride;
  T* k = static_cast<T*>(p.key) + t * p.key_stride;
  const int per_head = half / V;
  const int units = (p.num_heads + p.num_kv_heads) * per_head;
  for (int j = first; j < units; j += stride) {
    const int head = j / per_head, i = j % per_head * V;
    const bool is_key = head >= p.num_heads;
    T* x = is_key ? k + (head - p.num_heads) * p.head_dim : q + head * p.head_dim;
    if constexpr (kVec) {
      Vec<T> a = load_vec(x + i), b = load_vec(x + half + i);
      if (rotate) {
        float c[V], sn[V];
#pragma unroll
        for (int e = 0; e < V; e += 4) {
          const float4 cv = *reinterpret_cast<const float4*>(cos_sin + i + e);
          const float4 sv = *reinterpret_cast<const float4*>(cos_sin + half + i + e);
          c[e] = cv.x, c[e + 1] = cv.y, c[e + 2] = cv.z, c[e + 3] = cv.w;
          sn[e] = sv.x, sn[e + 1] = sv.y, sn[e + 2] = sv.z, sn[e + 3] = sv.w;
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          rotate_pair<T>(Num<T>::load(a.v[e]), Num<T>::load(b.v[e]), rnd<T>(c[e]), rnd<T>(sn[e]), a.v[e], b.v[e]);
        }
        store_vec(x + i, a);
        store_vec(x + half + i, b);
      }
      if constexpr (kCache) {
        if (is_key && slot >= 0) {
          const float inv = 1.f / p.k_scale;
          C* kc = static_cast<C*>(p.key_cache) + slot * kv_row + (head - p.num_heads) * p.head_dim;
          alignas(16) C ca[V];
          alignas(16) C cb[V];
#pragma unroll
          for (int e = 0; e < V; ++e) {
            ca[e] = to_cache<T, C>(Num<T>::load(a.v[e]), inv);
            cb[e] = to_cache<T, C>(Num<T>::load(b.v[e]), inv);
          }
          store_n(kc + i, ca);
          store_n(kc + half + i, cb);
        }
      }
    } else {
      if (rotate) {
        rotate_pair<T>(Num<T>::load(x[i]), Num<T>::load(x[half + i]), rnd<T>(cos_sin[i]), rnd<T>(cos_sin[half + i]),
                       x[i], x[half + i]);
      }
      if constexpr (kCache) {
        if (is_key && slot >= 0) {
          const float inv = 1.f / p.k_scale;
          C* kc = static_cast<C*>(p.key_cache) + slot * kv_row + (head - p.num_heads) * p.head_dim;
          kc[i] = to_cache<T, C>(Num<T>::load(x[i]), inv);
          kc[half + i] = to_cache<T, C>(Num<T>::load(x[half + i]), inv);
        }
      }
    }
  }
  if constexpr (kCache) {
    if (slot < 0) return;
    const T* v = static_cast<const T*>(p.value) + t * p.value_stride;
    C* vc = static_cast<C*>(p.value_cache) + slot * kv_row;
    const float inv = 1.f / p.v_scale;
    for (int64_t e = static_cast<int64_t>(first) * V; e < kv_row; e += static_cast<int64_t>(stride) * V) {
      if constexpr (kVec) {
        const Vec<T> a = load_vec(v + e);
        alignas(16) C out[V];
#pragma unroll
        for (int u = 0; u < V; ++u) out[u] = to_cache<T, C>(Num<T>::load(a.v[u]), inv);
        store_n(vc + e, out);
      } else {
        vc[e] = to_cache<T, C>(Num<T>::load(v[e]), inv);
      }
    }
  }
}

template <typename T, typename C, bool kVec>
cudaError_t launch_rotary_cache(const RotaryEmbeddingParams& p, int threads, cudaStream_t s) {
  // 128 threads per CTA, one unit each, up to 32 CTAs per token (a decode token of the
  // 8B shape: 20 CTAs of single pairs on the scalar path, 3 of 8 pairs a thread on the
  // vector path; one CTA of single pairs per token took 3.9 us there).
  constexpr int V = kVec ? Vec<T>::kSize : 1;
  const int64_t units = std::max<int64_t>((p.num_heads + p.num_kv_heads) * (p.head_dim / 2) / V,
                                          static_cast<int64_t>(p.num_kv_heads) * p.head_dim / V);
  const int block = units >= threads ? threads : round_up32(units);
  const dim3 grid(p.num_tokens, static_cast<unsigned>(std::min<int64_t>(32, (units + block - 1) / block)));
  return p.positions_int64 ? launch_pdl(rotary_kernel<T, int64_t, C, kVec>, grid, dim3(block), 0, s, p)
                           : launch_pdl(rotary_kernel<T, int32_t, C, kVec>, grid, dim3(block), 0, s, p);
}

template <typename T, typename C>
cudaError_t launch_rotary_vec_or_not(const RotaryEmbeddingParams& p, cudaStream_t s) {
  constexpr int kThreads = 128;
  constexpr int V = Vec<T>::kSize;
  const int64_t eb = sizeof(T);
  // 16-byte accesses: the rows and each half-head on 16 bytes, the table's rows too; the
  // cache's rows on V elements of C (a key's half-head and each value vector).
  bool vec = p.head_dim % (2 * V) == 0 && aligned16(p.query) && aligned16(p.key) && aligned16(p.cos_sin_cache) &&
             (p.query_stride * eb) % 16 == 0 && (p.key_stride * eb) % 16 == 0;
  if constexpr (!std::is_void_v<C>) {
    vec = vec && aligned16(p.value) && (p.value_stride * eb) % 16 == 0 && aligned16(p.key_cache) &&
          aligned16(p.value_cache);
  }
  return vec ? launch_rotary_cache<T, C, true>(p, kThreads, s) : launch_rotary_cache<T, C, false>(p, kThreads, s);
}

template <typename T>
int launch_rotary(const RotaryEmbeddingParams& p, cudaStream_t s) {
  if (p.key_cache == nullptr) return launch_rotary_vec_or_not<T, void>(p, s);
  if (p.cache_dtype == p.dtype) return launch_rotary_vec_or_not<T, T>(p, s);
  if (p.cache_dtype == DType::kFloat8E4M3 && sizeof(T) == 2) {
    if (!(p.k_scale > 0.f) || !(p.v_scale > 0.f)) return cudaErrorInvalidValue;
    return launch_rotary_vec_or_not<T, uint8_t>(p, s);
  }
  return cudaErrorInvalidValue;
}

// ---- SiLU and multiply -------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float silu_mul(T gate, T up) {
  const float g = Num<T>::load(gate);
  // HF: act_fn(gate) * up: silu rounded to the dtype, then the product.
  const float silu = rnd<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))));
  return __fmul_rn(silu, Num<T>::load(up));
}

// grid (tokens, chunks of the row); each thread one vector (kVec) or one element.
template <typename T, bool kVec>
__global__ void silu_and_mul_kernel(SiluAndMulParams p) {
  constexpr int V = kVec ? Vec<T>::kSize : 1;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int64_t i = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (i >= p.intermediate_size) return;
  const T* gate = static_cast<const T*>(p.input) + t * p.input_stride;
  const T* up = gate + p.intermediate_size;
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  if constexpr (kVec) {
    const Vec<T> g = load_vec(gate + i), u = load_vec(up + i);
    Vec<T> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = Num<T>::store(silu_mul(g.v[j], u.v[j]));
    store_vec(out + i, o);
  } else {
    out[i] = Num<T>::store(silu_mul(gate[i], up[i]));
  }
}

template <typename T>
int launch_silu_and_mul(const SiluAndMulParams& p, cudaStream_t s) {
  constexpr int V = Vec<T>::kSize;
  const int64_t eb = sizeof(T);
  const bool vec = aligned16(p.input) && aligned16(p.out) && p.intermediate_size % V == 0 &&
                   (p.input_stride * eb) % 16 == 0 && (p.out_stride * eb) % 16 == 0;
  const int64_t units = vec ? p.intermediate_size / V : p.intermediate_size;
  const int threads = units >= 256 ? 256 : round_up32(units);
  const int64_t chunks = (units + threads - 1) / threads;
  if (chunks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(p.num_tokens, static_cast<unsigned>(chunks));
  return vec ? launch_pdl(silu_and_mul_kernel<T, true>, grid, dim3(threads), 0, s, p)
             : launch_pdl(silu_and_mul_kernel<T, false>, grid, dim3(threads), 0, s, p);
}

// Calls launch<T>() with the activation type of dtype; fp8 is a cache type only.
template <template <typename> class L, typename P>
int dispatch(const P& p, cudaStream_t s) {
  switch (p.dtype) {
    case DType::kFloat32: return L<float>::run(p, s);
    case DType::kBFloat16: return L<__nv_bfloat16>::run(p, s);
    case DType::kFloat16: return L<__half>::run(p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
struct RmsNormLaunch {
  static int run(const RmsNormParams& p, cudaStream_t s) { return launch_rms_norm<T>(p, s); }
};
template <typename T>
struct RotaryLaunch {
  static int run(const RotaryEmbeddingParams& p, cudaStream_t s) { return launch_rotary<T>(p, s); }
};
template <typename T>
struct SiluAndMulLaunch {
  static int run(const SiluAndMulParams& p, cudaStream_t s) { return launch_silu_and_mul<T>(p, s); }
};

}  // namespace

int rms_norm(const RmsNormParams& p, void* stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_heads <= 0 || p.hidden_size <= 0) return cudaErrorInvalidValue;
  if (p.residual != nullptr && p.num_heads != 1) return cudaErrorInvalidValue;
  return dispatch<RmsNormLaunch>(p, static_cast<cudaStream_t>(stream));
}

int rotary_embedding(const RotaryEmbeddingParams& p, void* stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_heads <= 0 || p.num_kv_heads < 0 || p.head_dim <= 0 || p.head_dim % 2 != 0) {
    return cudaErrorInvalidValue;
  }
  return dispatch<RotaryLaunch>(p, static_cast<cudaStream_t>(stream));
}

int silu_and_mul(const SiluAndMulParams& p, void* stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.intermediate_size <= 0) return cudaErrorInvalidValue;
  return dispatch<SiluAndMulLaunch>(p, static_cast<cudaStream_t>(stream));
}

}  // namespace pagedcore::cuda
