// Internal: the TMA pieces of the Hopper prefill kernel (attention_wgmma.cu,
// PAGEDCORE_PREFILL_KERNEL=wgmma-tma and wgmma-tma-pairs): the
// tensor maps over the paged cache (encoded on the host), the block-aligned
// key tiles, and the per-block TMA copies of K and V tiles (device code for
// sm_90a only, wgmma_ops.cuh).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes through the runtime, no libcuda link
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "attention_wgmma_parts.cuh"
#include "pagedcore/cuda/kernels.h"
#include "tensor_map.cuh"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda::wgmma_attention {

// Tensor maps over the key and value caches for the TMA kernel (encoded on
// the host per launch, passed by value: CUDA graphs capture them with the
// launch): a box per block.
struct KvTensorMaps {
  CUtensorMap k;
  CUtensorMap v;
};

// ---- TMA (PAGEDCORE_PREFILL_KERNEL=wgmma-tma*): one copy per cache block ----
//
// A tensor map over the cache [num_blocks, block_size, num_kv_heads, HD]
// (dims HD, kv heads, block_size, num_blocks; box 64 x 1 x block_size x 1,
// 128-byte swizzle) brings one block's rows of one kv head's 64-dim half per
// copy, straight into the swizzled tile layout (a box of block_size rows lands
// at row offset j * block_size, a multiple of 8: the swizzle phase matches).
// NOTE: a box is a whole block, so key tiles start at s_lo rounded down to a
// block (block sizes: powers of two 8..128, dividing kKeys). Rows of a tile
// outside [s_lo, s_hi): K rows may hold anything (stale or NaN; their scores
// are masked to -inf by select); V rows must be finite, since P = 0 times NaN
// is NaN: V blocks wholly inside [s_lo, s_hi) come by TMA, the rows of the
// others by cp.async, zero-filled outside the range.
struct TileSpan {
  int k0;  // first key of tile 0 (a block boundary)
  int n;   // tiles
};
__device__ __forceinline__ TileSpan block_aligned_tiles(const Item& it, int bs) {
  TileSpan ts;
  ts.k0 = it.s_lo & ~(bs - 1);
  ts.n = it.s_hi > it.s_lo ? (it.s_hi - ts.k0 + kKeys - 1) / kKeys : 0;
  return ts;
}

// The cache block that lane `lane` of a warp copies by TMA for the tile at
// kbase (block lane of the tile), or -1 if that block holds no key in
// [s_lo, s_hi) (or lies past the tile).
template <typename T, int HD>
__device__ __forceinline__ int tile_block(const KvGather<T, HD>& kv, int kbase, int s_lo, int s_hi, int lane) {
  const int kb = kbase + lane * kv.bs;
  const bool any = lane * kv.bs < kKeys && kb < s_hi && kb + kv.bs > s_lo;
  return any ? kv.table[kb >> kv.bs_shift] : -1;
}

// Rows [lo, hi) of the tile at kbase: the whole blocks inside [s_lo, s_hi)
// (V rows by TMA); the others are edge rows (KvGather::load_edge_rows).
__device__ __forceinline__ void full_block_rows(int kbase, int s_lo, int s_hi, int bs, int& lo, int& hi) {
  lo = min(kKeys, (max(0, s_lo - kbase) + bs - 1) & ~(bs - 1));
  hi = max(lo, min(kKeys, (s_hi - kbase) & ~(bs - 1)));
}

// Block `block` of the cache (its rows of kv head `kv_head`) -> tile rows
// lane * bs .. of dst, completing on `bar`: one copy per 64-dim half; PAIRS
// (head dim 128, the paired tile layout, encode_kv_maps' 5-d map): one copy.
template <int HD, bool PAIRS>
__device__ __forceinline__ void tma_block(const void* map, int kv_head, uint32_t dst, uint32_t bar, int block, int bs,
                                          int lane) {
  if constexpr (PAIRS) {
    static_assert(HD == 128, "two 64-dim panels");
    wgmma::tma_load_5d(dst + lane * bs * 256, map, 0, 0, 2 * kv_head, 0, block, bar);
  } else {
#pragma unroll
    for (int h = 0; h < HD / 64; ++h) {
      wgmma::tma_load_4d(dst + h * kKeys * 128 + lane * bs * 128, map, h * 64, kv_head, 0, block, bar);
    }
  }
}

// K tile -> dst, by one warp: lane j copies block j of the tile (its
// tile_block, all 64-dim halves) unless it is -1; lane 0 first arms `bar`
// with the bytes of them all (its one arrival).
template <int HD, bool PAIRS = false>
__device__ __forceinline__ void tma_k_blocks(const void* map, int kv_head, uint32_t dst, uint32_t bar, int block, int bs,
                                             int lane) {
  const unsigned mask = __ballot_sync(0xffffffffu, block >= 0);
  if (lane == 0) wgmma::mbar_arrive_expect_tx(bar, __popc(mask) * bs * HD * 2);
  __syncwarp();
  if (block >= 0) tma_block<HD, PAIRS>(map, kv_head, dst, bar, block, bs, lane);
}

// V tile -> dst, by one warp: the blocks of rows [lo, hi) (full_block_rows;
// lane j: block j, its tile_block), lane 0 arming `bar` with their bytes (its
// one arrival). The edge rows are the caller's (cp.async, zero-filled).
template <int HD, bool PAIRS = false>
__device__ __forceinline__ void tma_v_blocks(const void* map, int kv_head, uint32_t dst, uint32_t bar, int block, int bs,
                                             int lo, int hi, int lane) {
  const bool load = lane * bs >= lo && lane * bs < hi;
  if (lane == 0) wgmma::mbar_arrive_expect_tx(bar, (hi - lo) * HD * 2);
  __syncwarp();
  if (load) tma_block<HD, PAIRS>(map, kv_head, dst, bar, block, bs, lane);
}

// (tensor_map_encoder: tensor_map.cuh, in the enclosing namespace)

// The TMA variants serve block sizes 8..128 that are powers of two (a box is
// one block; kKeys / block_size boxes per tile half, at most 16 = the lanes
// that issue them).
inline bool tma_block_size(int bs) { return bs >= 8 && bs <= kKeys && (bs & (bs - 1)) == 0; }

// Encodes the K and V tensor maps of `p`'s cache (see tma_block): dims (HD,
// kv heads, block_size, num_blocks), box (64, 1, block_size, 1), 128-byte
// swizzle; PAIRS (head dim 128): dims (64, 8 rows, 2 * kv heads 64-dim
// halves, block_size / 8 row groups, num_blocks), box (64, 8, 2, block_size /
// 8, 1) — a block's rows of both halves of one kv head, landing as 8-row atoms
// of the two panels side by side (wgmma::swizzled_paired). False if it cannot.
template <typename T, int HD, bool PAIRS = false>
bool encode_kv_maps(const PagedAttentionParams& p, KvTensorMaps& maps) {
  static_assert(!PAIRS || HD == 128, "pairs: two 64-dim panels, block by block");
  const EncodeTiledFn encode = tensor_map_encoder();
  if (p.num_blocks <= 0 || !tma_block_size(p.block_size)) return false;
  if (encode == nullptr) {
    static bool told = false;
    if (!told) {
      told = true;
      std::fprintf(stderr, "pagedcore: no cuTensorMapEncodeTiled in the driver; the wgmma-tma* variants run the plain "
                           "wgmma kernel\n");
    }
    return false;
  }
  const CUtensorMapDataType type =
      std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint64_t row = static_cast<cuuint64_t>(HD) * sizeof(T);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(HD), static_cast<cuuint64_t>(p.num_kv_heads),
                              static_cast<cuuint64_t>(p.block_size), static_cast<cuuint64_t>(p.num_blocks)};
  const cuuint64_t strides[3] = {row, row * p.num_kv_heads, row * p.num_kv_heads * p.block_size};  // bytes, dims 1..3
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(p.block_size), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const cuuint64_t pair_dims[5] = {64, 8, 2 * static_cast<cuuint64_t>(p.num_kv_heads),
                                   static_cast<cuuint64_t>(p.block_size / 8), static_cast<cuuint64_t>(p.num_blocks)};
  const cuuint64_t pair_strides[4] = {row * p.num_kv_heads, 128, 8 * row * p.num_kv_heads, strides[2]};
  const cuuint32_t pair_box[5] = {64, 8, 2, static_cast<cuuint32_t>(p.block_size / 8), 1};
  const cuuint32_t pair_elem_strides[5] = {1, 1, 1, 1, 1};
  auto one = [&](CUtensorMap* map, const void* cache) {
    if constexpr (PAIRS) {
      return encode(map, type, 5, const_cast<void*>(cache), pair_dims, pair_strides, pair_box, pair_elem_strides,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    }
    return encode(map, type, 4, const_cast<void*>(cache), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  if (one(&maps.k, p.key_cache) && one(&maps.v, p.value_cache)) return true;
  // NOTE: the caller then runs the plain kernel; said once (per dtype and head
  // dim), so that a measurement of an opt-in TMA variant does not pass the
  // plain one off as it.
  static bool told = false;
  if (!told) {
    told = true;
    std::fprintf(stderr, "pagedcore: cuTensorMapEncodeTiled refused the KV cache's tensor map; the wgmma-tma* "
                         "variants run the plain wgmma kernel\n");
  }
  return false;
}

}  // namespace pagedcore::cuda::wgmma_attention
