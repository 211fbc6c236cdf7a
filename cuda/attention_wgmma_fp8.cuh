// Internal: the fp8 (e4m3) KV cache pieces of the Hopper prefill TMA kernel
// (attention_wgmma.cu, PAGEDCORE_PREFILL_KERNEL=wgmma-tma-fp8): the tensor
// maps over the byte caches, the per-block TMA copies into a staging area,
// the widening of a staged tile into the fp16 swizzled tile that wgmma reads,
// and Q rounded to fp16 (device code for sm_90a only, wgmma_ops.cuh).
//
// NOTE: the products run in fp16 whatever the query type, as in the mma.sync
// kernel (its MT): e4m3 widens to fp16 exactly in one cvt per two values (NaN
// stays NaN, so a stray read of a NaN slot shows), Q is rounded to fp16, P is
// packed as fp16, and the per-layer scales apply in float32 — k_scale to the
// scores, v_scale to the output — exactly where the mma.sync kernel applies
// them.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "attention_wgmma_parts.cuh"
#include "attention_wgmma_tma.cuh"
#include "pagedcore/cuda/kernels.h"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda::wgmma_attention {

// fp16 K and V tiles in shared memory (each), and staging slots: with the
// fp8 staging (kFp8Slots x a K and a V tile of bytes, half an fp16 tile each)
// they take what kStages 16-bit tiles of K and V take.
constexpr int kFp8Stages = 2;
constexpr int kFp8Slots = 2;
static_assert(2 * kFp8Stages + kFp8Slots <= 2 * kStages, "the fp8 layout fits smem_bytes()");

// Staging slot layout: K bytes then V bytes, each kKeys rows of HD bytes, row j
// of the tile (key kbase + j) at j * HD (no swizzle: the widening reads it).
template <int HD>
__host__ __device__ constexpr int fp8_tile_bytes() {
  return kKeys * HD;
}

// Block `block` of both caches (its rows of kv head `kv_head`) -> rows
// lane * bs .. of the staged K tile at k8 and V tile at v8, by one warp: lane
// j copies block j of the tile (tile_block, -1: none) unless it is -1; lane 0
// first arms `bar` with the bytes of them all (its one arrival). Blocks that
// hold no key of the range are not copied: their staged rows keep stale bytes,
// which the widening zeroes for V and the mask hides for K.
template <int HD>
__device__ __forceinline__ void tma_fp8_blocks(const KvTensorMaps& maps, int kv_head, uint32_t k8, uint32_t v8,
                                               uint32_t bar, int block, int bs, int lane) {
  const unsigned mask = __ballot_sync(0xffffffffu, block >= 0);
  if (lane == 0) wgmma::mbar_arrive_expect_tx(bar, 2 * __popc(mask) * bs * HD);
  __syncwarp();
  if (block >= 0) {
    wgmma::tma_load_4d(k8 + lane * bs * HD, &maps.k, 0, kv_head, 0, block, bar);
    wgmma::tma_load_4d(v8 + lane * bs * HD, &maps.v, 0, kv_head, 0, block, bar);
  }
}

// Two e4m3 bytes (the low one first) -> an fp16 pair (exact; NaN stays NaN).
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t two) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(static_cast<uint16_t>(two & 0xffffu)));
  return h;
}

// A staged tile (src8) -> the fp16 swizzled tile at dst, by the 128 threads of
// a warpgroup (this one is `tid` of them). ZERO_OUTSIDE (V): rows whose key
// kbase + row lies outside [s_lo, s_hi) become zeros (P = 0 times NaN is NaN);
// K rows are widened whatever they hold (their scores are masked).
// NOTE: thread i widens 16 bytes (dims 16c .. 16c + 15 of a row, c = i % (HD /
// 16)) into fp16 chunks 2c and 2c + 1; the first store takes the odd one where
// c is in the second 64-dim panel, so that the 8 threads of a quarter warp
// write 8 distinct 16-byte bank groups (the swizzle spreads a row's chunks).
template <int HD, bool ZERO_OUTSIDE>
__device__ __forceinline__ void widen_fp8_tile(uint32_t src8, uint32_t dst, int kbase, int s_lo, int s_hi, int tid) {
  constexpr int CPR = HD / 16;  // 16-byte pieces per staged row
  constexpr int PASSES = kKeys * CPR / 128;
#pragma unroll 2
  for (int pass = 0; pass < PASSES; ++pass) {
    const int i = pass * 128 + tid;
    const int row = i / CPR;
    const int c = i % CPR;
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    const bool keep = !ZERO_OUTSIDE || (kbase + row >= s_lo && kbase + row < s_hi);
    if (keep) {
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                   : "r"(src8 + row * HD + c * 16));
    }
    uint32_t h[8];
    h[0] = keep ? e4m3x2_to_half2(w.x) : 0u;
    h[1] = keep ? e4m3x2_to_half2(w.x >> 16) : 0u;
    h[2] = keep ? e4m3x2_to_half2(w.y) : 0u;
    h[3] = keep ? e4m3x2_to_half2(w.y >> 16) : 0u;
    h[4] = keep ? e4m3x2_to_half2(w.z) : 0u;
    h[5] = keep ? e4m3x2_to_half2(w.z >> 16) : 0u;
    h[6] = keep ? e4m3x2_to_half2(w.w) : 0u;
    h[7] = keep ? e4m3x2_to_half2(w.w >> 16) : 0u;
    const bool odd_first = ((c >> 2) & 1) != 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const bool upper = (k == 1) != odd_first;  // fp16 chunk 2c + upper: dims 16c + 8 upper ..
      // (selects, not h[4 * upper + j]: a run-time index would put h in local memory)
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + wgmma::swizzled<kKeys>(row, 2 * c + upper)),
                   "r"(upper ? h[4] : h[0]), "r"(upper ? h[5] : h[1]), "r"(upper ? h[6] : h[2]),
                   "r"(upper ? h[7] : h[3])
                   : "memory");
    }
  }
}

// A bf16 pair -> an fp16 pair (round to nearest; a bf16 is the top half of a float).
__device__ __forceinline__ uint32_t bf16x2_to_half2(uint32_t two) {
  return pack2<__half>(__uint_as_float(two << 16), __uint_as_float(two & 0xffff0000u));
}

// Q rows [first, first + count) of the item -> the swizzled Q tile in fp16 (zeros
// for padding vectors), by `nthreads` threads: bf16 queries are loaded, rounded
// and stored (synchronous: the caller's proxy fence and barrier follow), fp16
// ones copied by cp.async (load_q).
template <typename T, int HD>
__device__ __forceinline__ void load_q_half(const PagedAttentionParams& p, const Item& it, uint32_t q_s, int first,
                                            int count, int tid, int nthreads) {
  if constexpr (std::is_same_v<T, __half>) {
    load_q<T, HD>(p, it, q_s, first, count, tid, nthreads);
  } else {
    constexpr int CH = HD / 8;
    const T* query = static_cast<const T*>(p.query);
    for (int i = tid; i < count * CH; i += nthreads) {
      const int v = first + i / CH;
      const int c = i % CH;
      uint32_t h[4] = {0u, 0u, 0u, 0u};
      if (v < it.num_vectors) {
        const T* src = query + static_cast<int64_t>(it.q_begin + it.t0 + v / it.group) * p.query_stride +
                       static_cast<int64_t>(it.kv_head * it.group + v % it.group) * HD + c * 8;
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
        h[0] = bf16x2_to_half2(raw.x);
        h[1] = bf16x2_to_half2(raw.y);
        h[2] = bf16x2_to_half2(raw.z);
        h[3] = bf16x2_to_half2(raw.w);
      }
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_s + wgmma::swizzled<kRows>(v, c)), "r"(h[0]),
                   "r"(h[1]), "r"(h[2]), "r"(h[3])
                   : "memory");
    }
  }
}

// Encodes byte tensor maps over `p`'s fp8 K and V caches: dims (HD, kv heads,
// block_size, num_blocks), box (HD, 1, block_size, 1) — one block's rows of one
// kv head, HD bytes each — no swizzle. False if it cannot (said once on stderr).
template <int HD>
bool encode_fp8_kv_maps(const PagedAttentionParams& p, KvTensorMaps& maps) {
  const EncodeTiledFn encode = tensor_map_encoder();
  if (encode == nullptr || p.num_blocks <= 0 || !tma_block_size(p.block_size)) return false;
  const cuuint64_t row = HD;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(HD), static_cast<cuuint64_t>(p.num_kv_heads),
                              static_cast<cuuint64_t>(p.block_size), static_cast<cuuint64_t>(p.num_blocks)};
  const cuuint64_t strides[3] = {row, row * p.num_kv_heads, row * p.num_kv_heads * p.block_size};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(HD), 1, static_cast<cuuint32_t>(p.block_size), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  auto one = [&](CUtensorMap* map, const void* cache) {
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(cache), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  if (one(&maps.k, p.key_cache) && one(&maps.v, p.value_cache)) return true;
  static bool told = false;
  if (!told) {
    told = true;
    std::fprintf(stderr, "pagedcore: cuTensorMapEncodeTiled refused the fp8 KV cache's tensor map; its prefill "
                         "runs on the mma.sync kernel\n");
  }
  return false;
}

}  // namespace pagedcore::cuda::wgmma_attention
