// KV-cache kernels: cache write, block copy (copy-on-write), block gather /
// scatter for swapping. All move 16-byte vectors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device_ops.cuh"
#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda {

namespace {

inline int element_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// One CTA per token; the token's K and V rows (num_kv_heads x head_dim) are
// contiguous in the step's tensors and in the cache slot.
template <typename Index>
__global__ void reshape_and_cache_kernel(const char* __restrict__ key, const char* __restrict__ value,
                                         char* __restrict__ key_cache, char* __restrict__ value_cache,
                                         const Index* __restrict__ slot_mapping, int64_t num_slots,
                                         int64_t row_bytes, int64_t key_stride_bytes,
                                         int64_t value_stride_bytes) {
  const int64_t token = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(slot_mapping[token]);
  if (slot < 0 || slot >= num_slots) return;  // padding
  const int64_t vecs = row_bytes / 16;
  const uint4* k = reinterpret_cast<const uint4*>(key + token * key_stride_bytes);
  const uint4* v = reinterpret_cast<const uint4*>(value + token * value_stride_bytes);
  uint4* kc = reinterpret_cast<uint4*>(key_cache + slot * row_bytes);
  uint4* vc = reinterpret_cast<uint4*>(value_cache + slot * row_bytes);
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
    kc[i] = k[i];
    vc[i] = v[i];
  }
}

using dev::to_float2;

// 8 elements (16 bytes) -> 8 e4m3 bytes of x * inv_scale, saturated to +-448.
template <typename Pair>
__device__ __forceinline__ uint2 quantize8(const uint4& raw, float inv_scale) {
  const Pair* v = reinterpret_cast<const Pair*>(&raw);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = to_float2(v[i]);
    f.x *= inv_scale;
    f.y *= inv_scale;
    w[i] = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// Like reshape_and_cache_kernel, quantizing to fp8: row_elems per token.
template <typename Pair, typename Index>
__global__ void reshape_and_cache_fp8_kernel(const char* __restrict__ key, const char* __restrict__ value,
                                             uint8_t* __restrict__ key_cache, uint8_t* __restrict__ value_cache,
                                             const Index* __restrict__ slot_mapping, int64_t num_slots,
                                             int64_t row_elems, int64_t key_stride_bytes,
                                             int64_t value_stride_bytes, float k_inv, float v_inv) {
  const int64_t token = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(slot_mapping[token]);
  if (slot < 0 || slot >= num_slots) return;  // padding
  const int64_t vecs = row_elems / 8;
  const uint4* k = reinterpret_cast<const uint4*>(key + token * key_stride_bytes);
  const uint4* v = reinterpret_cast<const uint4*>(value + token * value_stride_bytes);
  uint2* kc = reinterpret_cast<uint2*>(key_cache + slot * row_elems);
  uint2* vc = reinterpret_cast<uint2*>(value_cache + slot * row_elems);
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
    kc[i] = quantize8<Pair>(k[i], k_inv);
    vc[i] = quantize8<Pair>(v[i], v_inv);
  }
}

template <typename Pair>
void launch_fp8_write(const ReshapeAndCacheParams& p, int64_t num_slots, int64_t row_elems, int threads,
                      cudaStream_t s) {
  const char* k = static_cast<const char*>(p.key);
  const char* v = static_cast<const char*>(p.value);
  auto* kc = static_cast<uint8_t*>(p.key_cache);
  auto* vc = static_cast<uint8_t*>(p.value_cache);
  if (p.slot_mapping_int64) {
    reshape_and_cache_fp8_kernel<Pair, int64_t><<<p.num_tokens, threads, 0, s>>>(
        k, v, kc, vc, static_cast<const int64_t*>(p.slot_mapping), num_slots, row_elems, p.key_stride * 2,
        p.value_stride * 2, 1.f / p.k_scale, 1.f / p.v_scale);
  } else {
    reshape_and_cache_fp8_kernel<Pair, int32_t><<<p.num_tokens, threads, 0, s>>>(
        k, v, kc, vc, static_cast<const int32_t*>(p.slot_mapping), num_slots, row_elems, p.key_stride * 2,
        p.value_stride * 2, 1.f / p.k_scale, 1.f / p.v_scale);
  }
}

// grid (pairs, caches): one block of one cache per CTA.
__global__ void copy_blocks_kernel(const int64_t* __restrict__ cache_ptrs,
                                   const int64_t* __restrict__ mapping, int32_t num_blocks,
                                   int64_t block_bytes) {
  const int64_t src = mapping[2 * blockIdx.x];
  const int64_t dst = mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  char* base = reinterpret_cast<char*>(cache_ptrs[blockIdx.y]);
  const uint4* from = reinterpret_cast<const uint4*>(base + src * block_bytes);
  uint4* to = reinterpret_cast<uint4*>(base + dst * block_bytes);
  for (int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) to[i] = from[i];
}

// grid (moved blocks, caches). to_staging: cache -> staging, else staging -> cache.
template <bool to_staging>
__global__ void move_blocks_kernel(const int64_t* __restrict__ cache_ptrs,
                                   const int64_t* __restrict__ blocks, char* __restrict__ staging,
                                   int32_t num_blocks, int64_t block_bytes) {
  const int64_t block = blocks[blockIdx.x];
  if (block < 0 || block >= num_blocks) return;
  char* cache = reinterpret_cast<char*>(cache_ptrs[blockIdx.y]) + block * block_bytes;
  // staging is cache-major: each cache's blocks are contiguous (one DMA per run).
  char* stage = staging + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * block_bytes;
  const uint4* from = reinterpret_cast<const uint4*>(to_staging ? cache : stage);
  uint4* to = reinterpret_cast<uint4*>(to_staging ? stage : cache);
  for (int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) to[i] = from[i];
}

int threads_for(int64_t vecs) { return vecs >= 256 ? 256 : (vecs >= 128 ? 128 : 64); }

}  // namespace

int reshape_and_cache(const ReshapeAndCacheParams& p, void* stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int eb = element_bytes(p.dtype);
  const int64_t row_bytes = static_cast<int64_t>(p.num_kv_heads) * p.head_dim * eb;
  if (row_bytes % 16 != 0) return cudaErrorInvalidValue;
  const int64_t num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.cache_dtype == DType::kFloat8E4M3) {
    if (!(p.k_scale > 0.f) || !(p.v_scale > 0.f)) return cudaErrorInvalidValue;
    const int64_t row_elems = row_bytes / 2;
    if (p.dtype == DType::kBFloat16) {
      launch_fp8_write<__nv_bfloat162>(p, num_slots, row_elems, threads_for(row_elems / 8), s);
    } else if (p.dtype == DType::kFloat16) {
      launch_fp8_write<__half2>(p, num_slots, row_elems, threads_for(row_elems / 8), s);
    } else {
      return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  if (p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
  const int threads = threads_for(row_bytes / 16);
  const char* k = static_cast<const char*>(p.key);
  const char* v = static_cast<const char*>(p.value);
  char* kc = static_cast<char*>(p.key_cache);
  char* vc = static_cast<char*>(p.value_cache);
  if (p.slot_mapping_int64) {
    reshape_and_cache_kernel<int64_t><<<p.num_tokens, threads, 0, s>>>(
        k, v, kc, vc, static_cast<const int64_t*>(p.slot_mapping), num_slots, row_bytes,
        p.key_stride * eb, p.value_stride * eb);
  } else {
    reshape_and_cache_kernel<int32_t><<<p.num_tokens, threads, 0, s>>>(
        k, v, kc, vc, static_cast<const int32_t*>(p.slot_mapping), num_slots, row_bytes,
        p.key_stride * eb, p.value_stride * eb);
  }
  return cudaGetLastError();
}

int copy_blocks(const CopyBlocksParams& p, void* stream) {
  if (p.num_pairs == 0 || p.num_caches == 0) return cudaSuccess;
  if (p.block_bytes % 16 != 0 || p.num_caches > 65535) return cudaErrorInvalidValue;
  const dim3 grid(p.num_pairs, p.num_caches);
  copy_blocks_kernel<<<grid, threads_for(p.block_bytes / 16), 0, static_cast<cudaStream_t>(stream)>>>(
      p.cache_ptrs, p.block_mapping, p.num_blocks, p.block_bytes);
  return cudaGetLastError();
}

namespace {

template <bool to_staging>
int move_blocks(const GatherBlocksParams& p, void* stream) {
  if (p.num_blocks_moved == 0 || p.num_caches == 0) return cudaSuccess;
  if (p.block_bytes % 16 != 0 || p.num_caches > 65535) return cudaErrorInvalidValue;
  const dim3 grid(p.num_blocks_moved, p.num_caches);
  move_blocks_kernel<to_staging><<<grid, threads_for(p.block_bytes / 16), 0, static_cast<cudaStream_t>(stream)>>>(
      p.cache_ptrs, p.blocks, static_cast<char*>(p.staging), p.num_blocks, p.block_bytes);
  return cudaGetLastError();
}

}  // namespace

int gather_blocks(const GatherBlocksParams& p, void* stream) { return move_blocks<true>(p, stream); }

int scatter_blocks(const GatherBlocksParams& p, void* stream) { return move_blocks<false>(p, stream); }

}  // namespace pagedcore::cuda
