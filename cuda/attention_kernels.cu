// Paged attention over the KV cache, for decode rows, prompt chunks with a
// cached prefix and whole prompts in one launch: the entry point, the float32
// kernels and the split merge kernel. bf16 / fp16 queries go to the
// tensor-core kernel in attention_mma.cu.
//
// float32: a work item (planned on the host, once per step) is a tile of up to
// 16 query vectors: consecutive query tokens of one row times the query heads
// that share one kv head (GQA), so each K/V row is read once for all of them.
// A CTA takes (work item, kv head, key split): it walks its key range in chunks
// staged in shared memory, with an online softmax on CUDA cores. Decode rows go
// to a kernel that streams K/V rows with 16-byte loads (a lane group per key).
// With several splits, a second kernel merges the partial results by their
// log-sum-exp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>

#include "attention_merge.cuh"
#include "attention_mma.h"
#include "pagedcore/cuda/kernels.h"
#include "pdl.cuh"

namespace pagedcore::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kVectors = 16;                             // query vectors per CTA (float32 tiles)
constexpr int kSlots = kAttentionPartialVectors;         // partial-buffer slots per split
constexpr int kThreadsPerVector = kThreads / kVectors;   // 8

template <int HD>
__host__ __device__ constexpr int keys_per_chunk() {
  return HD <= 32 ? 128 : (HD <= 64 ? 64 : (HD <= 128 ? 32 : 16));
}

template <int HD>
__host__ __device__ constexpr int smem_floats() {
  constexpr int kt = keys_per_chunk<HD>();
  return kVectors * HD + kt * (HD + 1) + kt * HD + kVectors * (kt + 1);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// 16 bytes of T as floats.
template <typename T>
__device__ __forceinline__ void load16(const T* src, float* dst) {
  constexpr int n = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[n];
  } u;
  u.raw = *reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < n; ++i) dst[i] = to_float(u.v[i]);
}

// 16 raw bytes of T as floats.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* dst) {
  constexpr int n = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[n];
  } u;
  u.raw = raw;
#pragma unroll
  for (int i = 0; i < n; ++i) dst[i] = to_float(u.v[i]);
}

__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = kThreadsPerVector / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = kThreadsPerVector / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(PagedAttentionParams p) {
  constexpr int KT = keys_per_chunk<HD>();
  constexpr int EPV = 16 / sizeof(T);      // elements per 16-byte vector
  constexpr int VPR = HD / EPV;            // vectors per K/V row
  constexpr int DPT = HD / kThreadsPerVector;  // output dims per thread
  extern __shared__ float smem[];
  float* qs = smem;                        // [kVectors][HD], pre-scaled queries
  float* ks = qs + kVectors * HD;          // [KT][HD + 1] (padded: no bank conflicts)
  float* vs = ks + KT * (HD + 1);          // [KT][HD]
  float* ss = vs + KT * HD;                // [kVectors][KT + 1] scores, then probabilities

  const int work = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int row = p.work_seq[work];
  if (row < 0) return;  // a padded plan's spare item
  const int q_begin = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q_begin;
  const int ctx = p.seq_lens[row];
  const int t0 = p.work_q_start[work];
  const int group = p.num_heads / p.num_kv_heads;
  const int tile_tokens = min(p.tile_tokens, q_len - t0);
  const int num_vectors = tile_tokens * group;
  const int first_pos = ctx - q_len + t0;
  const int last_pos = first_pos + tile_tokens - 1;
  // Keys any query of the tile sees, then this split's share of them.
  const int k_lo = p.sliding_window > 0 ? max(0, first_pos - p.sliding_window + 1) : 0;
  const int k_hi = last_pos + 1;
  const int per_split = (k_hi - k_lo + p.num_splits - 1) / p.num_splits;
  const int s_lo = k_lo + split * per_split;
  const int s_hi = min(k_hi, s_lo + per_split);

  const T* query = static_cast<const T*>(p.query);
  for (int i = threadIdx.x; i < kVectors * HD; i += kThreads) {
    const int v = i / HD;
    const int d = i % HD;
    float x = 0.f;
    if (v < num_vectors) {
      const int64_t tok = q_begin + t0 + v / group;
      const int head = kv_head * group + v % group;
      x = to_float(query[tok * p.query_stride + static_cast<int64_t>(head) * HD + d]) * p.scale;
    }
    qs[i] = x;
  }

  const int my_v = threadIdx.x / kThreadsPerVector;
  const int lane = threadIdx.x % kThreadsPerVector;
  float acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.f;
  float m = -FLT_MAX;  // running max (of finite scores)
  float l = 0.f;       // running sum of exp(score - m)

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(row) * p.block_tables_stride;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * HD;

  for (int c0 = s_lo; c0 < s_hi; c0 += KT) {
    const int n = min(KT, s_hi - c0);
    __syncthreads();  // the previous chunk is consumed (and qs is written)
    for (int i = threadIdx.x; i < KT * VPR; i += kThreads) {
      const int j = i / VPR;
      const int e0 = (i % VPR) * EPV;
      float kf[EPV], vf[EPV];
      if (j < n) {
        const int tok = c0 + j;
        const int64_t block = table[tok / p.block_size];
        const int64_t base =
            ((block * p.block_size + tok % p.block_size) * p.num_kv_heads) * HD + head_offset + e0;
        load16(key_cache + base, kf);
        load16(value_cache + base, vf);
      } else {
#pragma unroll
        for (int e = 0; e < EPV; ++e) kf[e] = vf[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < EPV; ++e) {
        ks[j * (HD + 1) + e0 + e] = kf[e];
        vs[j * HD + e0 + e] = vf[e];
      }
    }
    __syncthreads();
    for (int pi = threadIdx.x; pi < kVectors * KT; pi += kThreads) {
      const int v = pi / KT;
      const int j = pi % KT;
      float s = -INFINITY;
      const int key = c0 + j;
      const int pos = first_pos + v / group;
      if (v < num_vectors && j < n && key <= pos &&
          (p.sliding_window == 0 || key > pos - p.sliding_window)) {
        float dot = 0.f;
#pragma unroll 16
        for (int d = 0; d < HD; ++d) dot += qs[v * HD + d] * ks[j * (HD + 1) + d];
        s = p.softcap > 0.f ? p.softcap * tanhf(dot / p.softcap) : dot;
      }
      ss[v * (KT + 1) + j] = s;
    }
    __syncthreads();
    // Online softmax of this chunk for my vector (its 8 threads share a warp).
    float chunk_max = -INFINITY;
    for (int j = lane; j < KT; j += kThreadsPerVector) chunk_max = fmaxf(chunk_max, ss[my_v * (KT + 1) + j]);
    chunk_max = group_max(chunk_max);
    const float new_m = fmaxf(m, chunk_max);
    const float corr = __expf(m - new_m);
    float psum = 0.f;
    for (int j = lane; j < KT; j += kThreadsPerVector) {
      const float s = ss[my_v * (KT + 1) + j];
      const float e = s == -INFINITY ? 0.f : __expf(s - new_m);
      ss[my_v * (KT + 1) + j] = e;
      psum += e;
    }
    psum = group_sum(psum);
    l = l * corr + psum;
    m = new_m;
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] *= corr;
    __syncwarp();
    for (int j = 0; j < n; ++j) {
      const float pj = ss[my_v * (KT + 1) + j];
#pragma unroll
      for (int i = 0; i < DPT; ++i) acc[i] += pj * vs[j * HD + lane + kThreadsPerVector * i];
    }
  }

  if (my_v >= num_vectors) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  if (p.num_splits == 1) {
    T* out = static_cast<T*>(p.out);
    const int64_t tok = q_begin + t0 + my_v / group;
    const int head = kv_head * group + my_v % group;
    T* dst = out + (tok * p.num_heads + head) * HD;
#pragma unroll
    for (int i = 0; i < DPT; ++i) dst[lane + kThreadsPerVector * i] = from_float<T>(acc[i] * inv);
  } else {
    const int64_t slot = ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * p.num_splits + split) * kSlots + my_v;
    float* dst = p.partial_out + slot * HD;
#pragma unroll
    for (int i = 0; i < DPT; ++i) dst[lane + kThreadsPerVector * i] = acc[i] * inv;
    if (lane == 0) {
      p.partial_lse[2 * slot] = m;
      p.partial_lse[2 * slot + 1] = l;
    }
  }
}

// Merges the key splits of each (work item or decode row, kv head, vector):
// grid (kv head, item).
template <typename T, int HD, bool DECODE>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(PagedAttentionParams p) {
  __shared__ float s_w[merge::kScratchFloats];
  pdl_wait();
  pdl_launch_dependents();
  merge::merge_splits<T, HD, kThreads, DECODE>(p, blockIdx.y, blockIdx.x, s_w);
}

template <typename T, int HD>
int launch_merge(const PagedAttentionParams& p, bool decode, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads, decode ? p.num_decode : p.num_work);
  return decode ? launch_pdl(merge_splits_kernel<T, HD, true>, grid, dim3(kThreads), 0, stream, p)
                : launch_pdl(merge_splits_kernel<T, HD, false>, grid, dim3(kThreads), 0, stream, p);
}

template <typename T>
int merge_head_dim(const PagedAttentionParams& p, bool decode, cudaStream_t s) {
  switch (p.head_dim) {
    case 32: return launch_merge<T, 32>(p, decode, s);
    case 64: return launch_merge<T, 64>(p, decode, s);
    case 80: return launch_merge<T, 80>(p, decode, s);
    case 96: return launch_merge<T, 96>(p, decode, s);
    case 128: return launch_merge<T, 128>(p, decode, s);
    case 256: return launch_merge<T, 256>(p, decode, s);
    default: return cudaErrorInvalidValue;
  }
}

// ---- decode rows: stream K/V rows from memory -------------------------------------
//
// One CTA per (row, kv head, key split), 4 warps. A K/V row of one kv head is
// LPK lanes x 16 bytes; a warp takes 32 / LPK keys at a time, each lane
// loading 16 bytes of K and V (several keys in flight per warp), the dot
// products of the G query heads reduced across the key's lanes by shuffles,
// with a running softmax per lane group. The groups' partial results are
// merged through shared memory at the end.
template <typename T, int HD, int G>
__global__ void __launch_bounds__(kThreads) decode_kernel(PagedAttentionParams p) {
  constexpr int EPL = 16 / sizeof(T);  // elements per lane
  constexpr int LPK = HD / EPL;        // lanes per key row
  constexpr int KPW = 32 / LPK;        // keys per warp per pass
  constexpr int WARPS = kThreads / 32;
  constexpr int GROUPS = WARPS * KPW;  // independent lane groups in the CTA
  constexpr int UNROLL = 2;            // keys per lane group in flight (4 costs occupancy)
  constexpr int CHUNK = 1024;          // keys whose block ids are staged at once
  static_assert(LPK <= 32 && 32 % LPK == 0, "a key row must fit one warp");
  __shared__ float s_acc[GROUPS][G][HD];
  __shared__ float s_m[GROUPS][G];
  __shared__ float s_l[GROUPS][G];
  __shared__ int32_t s_table[CHUNK / 8 + 2];  // block_size >= 8

  const int work = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int row = p.decode_seq[work];
  if (row < 0) return;  // a padded plan's spare item
  const int q_token = p.query_start_loc[row];
  const int ctx = p.seq_lens[row];
  const int pos = ctx - 1;
  const int group = p.num_heads / p.num_kv_heads;
  const int k_lo = p.sliding_window > 0 ? max(0, pos - p.sliding_window + 1) : 0;
  const int splits = merge::decode_active_splits(p, ctx - k_lo);
  if (split >= splits) return;  // a short row: fewer splits than planned
  const int per_split = (ctx - k_lo + splits - 1) / splits;
  const int s_lo = k_lo + split * per_split;
  const int s_hi = min(ctx, s_lo + per_split);

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int sub = lane / LPK;          // which key of the pass
  const int chunk = lane % LPK;        // which 16 bytes of the row
  const int grp = warp * KPW + sub;

  const T* query = static_cast<const T*>(p.query);
  float q[G][EPL];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h < group) {
      load16(query + static_cast<int64_t>(q_token) * p.query_stride +
                 static_cast<int64_t>(kv_head * group + h) * HD + chunk * EPL,
             q[h]);
#pragma unroll
      for (int e = 0; e < EPL; ++e) q[h][e] *= p.scale;
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e) q[h][e] = 0.f;
    }
  }
  float m[G], l[G], acc[G][EPL];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[h][e] = 0.f;
  }

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(row) * p.block_tables_stride;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * HD + chunk * EPL;
  constexpr int STEP = GROUPS * UNROLL;

  // NOTE: the block ids of a chunk of keys are staged in shared memory first,
  // so that each K/V load depends on a shared-memory read, not on a second
  // round trip to global memory.
  for (int c0 = s_lo; c0 < s_hi; c0 += CHUNK) {
  const int c1 = min(s_hi, c0 + CHUNK);
  const int b0 = c0 / p.block_size;
  __syncthreads();
  for (int i = threadIdx.x; i <= (c1 - 1) / p.block_size - b0; i += kThreads) s_table[i] = table[b0 + i];
  __syncthreads();
  // NOTE: every lane runs the same number of iterations (keys past the range
  // are masked), so the shuffles below always see the whole warp.
  for (int base = c0; base < c1; base += STEP) {
    uint4 kraw[UNROLL], vraw[UNROLL];  // raw 16-byte loads, converted when used
    bool valid[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int key = base + u * GROUPS + grp;
      valid[u] = key < c1;
      if (valid[u]) {
        const int64_t block = s_table[key / p.block_size - b0];
        const int64_t off = ((block * p.block_size + key % p.block_size) * p.num_kv_heads) * HD + head_offset;
        kraw[u] = *reinterpret_cast<const uint4*>(key_cache + off);
        vraw[u] = *reinterpret_cast<const uint4*>(value_cache + off);
      } else {
        kraw[u] = vraw[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[EPL], vf[EPL];
      unpack16<T>(kraw[u], kf);
      unpack16<T>(vraw[u], vf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) d += q[h][e] * kf[e];
#pragma unroll
        for (int o = LPK / 2; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (!valid[u] || h >= group) continue;
        if (p.softcap > 0.f) d = p.softcap * tanhf(d / p.softcap);
        const float new_m = fmaxf(m[h], d);
        const float corr = __expf(m[h] - new_m);
        const float w = __expf(d - new_m);
        l[h] = l[h] * corr + w;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[h][e] = acc[h][e] * corr + w * vf[e];
        m[h] = new_m;
      }
    }
  }
  }

#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) s_acc[grp][h][chunk * EPL + e] = acc[h][e];
    if (chunk == 0) {
      s_m[grp][h] = m[h];
      s_l[grp][h] = l[h];
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < group * HD; i += kThreads) {
    const int h = i / HD;
    const int d = i % HD;
    float gmax = -FLT_MAX;
    for (int g = 0; g < GROUPS; ++g) {
      if (s_l[g][h] > 0.f) gmax = fmaxf(gmax, s_m[g][h]);
    }
    float num = 0.f, den = 0.f;
    for (int g = 0; g < GROUPS; ++g) {
      if (s_l[g][h] <= 0.f) continue;
      const float w = __expf(s_m[g][h] - gmax);
      num += w * s_acc[g][h][d];
      den += w * s_l[g][h];
    }
    if (splits == 1) {
      out[(static_cast<int64_t>(q_token) * p.num_heads + kv_head * group + h) * HD + d] =
          from_float<T>(den > 0.f ? num / den : 0.f);
    } else {
      const int64_t slot =
          ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * p.decode_splits + split) * kSlots + h;
      p.decode_partial_out[slot * HD + d] = den > 0.f ? num / den : 0.f;
      if (d == 0) {
        p.decode_partial_lse[2 * slot] = gmax;
        p.decode_partial_lse[2 * slot + 1] = den;
      }
    }
  }
}

template <typename T, int HD, int G>
int launch_decode(const PagedAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_decode, p.num_kv_heads, p.decode_splits);
  decode_kernel<T, HD, G><<<grid, kThreads, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || p.decode_splits == 1) return e;
  return launch_merge<T, HD>(p, true, stream);
}

template <typename T, int HD>
int dispatch_decode(const PagedAttentionParams& p, cudaStream_t s) {
  if constexpr (HD * sizeof(T) <= 512 && 32 % (HD * sizeof(T) / 16) == 0) {
    return p.num_heads / p.num_kv_heads <= 4 ? launch_decode<T, HD, 4>(p, s) : launch_decode<T, HD, 8>(p, s);
  } else {
    return cudaErrorInvalidValue;
  }
}

template <typename T, int HD>
int launch(const PagedAttentionParams& p, cudaStream_t stream) {
  constexpr size_t smem = smem_floats<HD>() * sizeof(float);
  static bool configured = false;  // NOTE: per instantiation; raising the limit is idempotent
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(paged_attention_kernel<T, HD>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    configured = true;
  }
  if (p.num_decode > 0) {
    const int e = dispatch_decode<T, HD>(p, stream);
    if (e != cudaSuccess) return e;
  }
  if (p.num_work == 0) return cudaSuccess;
  const dim3 grid(p.num_work, p.num_kv_heads, p.num_splits);
  paged_attention_kernel<T, HD><<<grid, kThreads, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || p.num_splits == 1) return e;
  return launch_merge<T, HD>(p, false, stream);
}

template <typename T>
int dispatch_head_dim(const PagedAttentionParams& p, cudaStream_t s) {
  switch (p.head_dim) {
    case 32: return launch<T, 32>(p, s);
    case 64: return launch<T, 64>(p, s);
    case 80: return launch<T, 80>(p, s);
    case 96: return launch<T, 96>(p, s);
    case 128: return launch<T, 128>(p, s);
    case 256: return launch<T, 256>(p, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int merge_attention_splits(const PagedAttentionParams& p, bool decode, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return merge_head_dim<float>(p, decode, stream);
    case DType::kBFloat16: return merge_head_dim<__nv_bfloat16>(p, decode, stream);
    case DType::kFloat16: return merge_head_dim<__half>(p, decode, stream);
    default: return cudaErrorInvalidValue;
  }
}

int32_t attention_tile_vectors(int32_t element_bytes) { return element_bytes == 2 ? kAttentionMmaTileVectors : kVectors; }

bool decode_supported(int32_t group, int32_t head_dim, int32_t element_bytes) {
  if (!head_dim_supported(head_dim)) return false;
  if (element_bytes == 2) return group >= 1 && group <= 16;
  const int row_bytes = head_dim * element_bytes;
  // A row must be 1, 2, 4, ... or 32 lanes of 16 bytes.
  return group <= 8 && row_bytes <= 512 && row_bytes % 16 == 0 && 32 % (row_bytes / 16) == 0;
}

bool head_dim_supported(int32_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 ||
         head_dim == 256;
}

int paged_attention(const PagedAttentionParams& params, void* stream) {
  if (params.num_work == 0 && params.num_decode == 0) return cudaSuccess;
  // PAGEDCORE_DECODE_SPLIT_KEYS (benchmarks; read per launch, so that they can
  // alternate): another minimum of keys per split of a decode row that splits.
  PagedAttentionParams p = params;
  if (const char* v = std::getenv("PAGEDCORE_DECODE_SPLIT_KEYS"); v != nullptr && *v != '\0') {
    p.decode_split_keys = std::atoi(v);
  }
  const int group = p.num_heads % p.num_kv_heads == 0 ? p.num_heads / p.num_kv_heads : 0;
  const int element_bytes = p.dtype == DType::kFloat32 ? 4 : 2;
  if (group == 0 || p.dtype == DType::kFloat8E4M3 || group > attention_tile_vectors(element_bytes) ||
      p.tile_tokens * group > attention_tile_vectors(element_bytes) || p.num_splits < 1 ||
      p.num_splits > kAttentionMaxSplits || p.decode_splits > kAttentionMaxSplits ||
      p.num_work > 65535 || p.num_decode > 65535 ||
      (p.num_decode > 0 && (p.decode_splits < 1 || !decode_supported(group, p.head_dim, element_bytes)))) {
    return cudaErrorInvalidValue;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  if (element_bytes == 2) return paged_attention_mma(p, s);
  if (p.kv_dtype != p.dtype) return cudaErrorInvalidValue;
  return dispatch_head_dim<float>(p, s);
}

}  // namespace pagedcore::cuda
