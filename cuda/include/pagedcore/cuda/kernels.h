// CUDA kernels over the paged KV cache: framework-free launchers.
//
// Each launcher takes a plain struct of device pointers, sizes and strides and
// the caller's stream (a cudaStream_t as void*), enqueues its work and returns
// the cudaError_t of the launch as an int (0 = success). Nothing here needs a
// CUDA header, torch, or a synchronisation. Indices produced by the engine are
// trusted; out-of-range slots and blocks are skipped, never dereferenced.
//
// KV cache layout (one tensor per layer for K, one for V):
//   [num_blocks, block_size, num_kv_heads, head_dim]
#pragma once

#include <cstdint>
#include <vector>

namespace pagedcore::cuda {

// kFloat8E4M3: KV cache only (values stored divided by a per-tensor scale).
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8E4M3 = 3 };

// Head sizes the attention kernel is compiled for.
bool head_dim_supported(int32_t head_dim);

struct ReshapeAndCacheParams {
  const void* key;          // [num_tokens, num_kv_heads, head_dim], token stride key_stride
  const void* value;        // [num_tokens, num_kv_heads, head_dim], token stride value_stride
  void* key_cache;          // [num_blocks, block_size, num_kv_heads, head_dim]
  void* value_cache;        // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* slot_mapping;     // [num_tokens] int32 or int64; < 0 or >= num_blocks * block_size: skipped
  bool slot_mapping_int64;
  int32_t num_tokens;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t num_blocks;
  int32_t block_size;
  int64_t key_stride;       // elements between tokens
  int64_t value_stride;
  DType dtype;              // key and value
  DType cache_dtype;        // dtype, or kFloat8E4M3 (bf16/fp16 input): stores value / scale, saturated
  float k_scale;
  float v_scale;
};
int reshape_and_cache(const ReshapeAndCacheParams& p, void* stream);

struct CopyBlocksParams {
  const int64_t* cache_ptrs;    // [num_caches] device addresses of every layer's K and V cache
  const int64_t* block_mapping; // [num_pairs, 2] (src, dst)
  int32_t num_caches;
  int32_t num_pairs;
  int32_t num_blocks;
  int64_t block_bytes;          // bytes of one block (a multiple of 16)
};
// Copies every pair in every cache: one launch for all layers (copy-on-write).
int copy_blocks(const CopyBlocksParams& p, void* stream);

struct GatherBlocksParams {
  const int64_t* cache_ptrs;  // [num_caches] device caches
  const int64_t* blocks;      // [num_blocks_moved] block ids, in order
  void* staging;              // [num_caches, num_blocks_moved, block_bytes] contiguous
                              // (block ids < 0: rows skipped)
  int32_t num_caches;
  int32_t num_blocks_moved;
  int32_t num_blocks;
  int64_t block_bytes;
};
// staging[c][i] = cache c, block blocks[i] (swap-out: one gather, then a DMA
// per cache and run of consecutive host blocks).
int gather_blocks(const GatherBlocksParams& p, void* stream);
// cache c, block blocks[i] = staging[c][i] (swap-in: the DMAs, then one scatter).
int scatter_blocks(const GatherBlocksParams& p, void* stream);

// Work plan of one attention call, computed on the host once per step and
// reused by every layer (see plan_attention in pagedcore.ops).
// A decode row under twice this many keys runs unsplit, with no partials and
// no merge; a longer one runs at most one key split per
// kAttentionDecodeSplitChunk keys (the params' decode_split_keys): a plan's
// decode_splits is an upper bound (a CUDA graph plans for the longest row it
// may meet), and a shorter row runs fewer splits.
constexpr int32_t kAttentionDecodeSplitKeys = 256;
constexpr int32_t kAttentionDecodeSplitChunk = 64;
// Query vectors (query tokens x heads of one kv head) of a bf16/fp16 decode row.
constexpr int32_t kAttentionDecodeVectors = 16;
struct PagedAttentionParams {
  void* out;                      // [num_tokens, num_heads, head_dim], contiguous
  const void* query;              // [num_tokens, num_heads, head_dim], token stride query_stride
  const void* key_cache;          // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;        // same
  const int32_t* block_tables;    // [num_seqs, *], row stride block_tables_stride
  const int32_t* seq_lens;        // [num_seqs] tokens in the cache after this step
  const int32_t* query_start_loc; // [num_seqs + 1]
  const int32_t* work_seq;        // [num_work] row of each work item; a negative entry: a
                                  // padded plan's spare item, which no CTA computes
  const int32_t* work_q_start;    // [num_work] first query (within the row) of the item
  float* partial_out;             // [num_work, num_kv_heads, num_splits, kAttentionPartialVectors, head_dim]
  float* partial_lse;             // [num_work, num_kv_heads, num_splits, kAttentionPartialVectors, 2] (max, sum)
  // Rows with a single query (decode) may instead go to a kernel made for
  // them (all heads of a kv head in one CTA): see decode_supported(). With
  // bf16/fp16 queries a decode row may hold a few queries (speculative decoding,
  // beams): query tokens x group <= kAttentionDecodeVectors; float32: one query.
  const int32_t* decode_seq;      // [num_decode] rows run by the decode kernel; a negative
                                  // entry: a padded plan's spare item, whose CTAs return at once
  float* decode_partial_out;      // [num_decode, num_kv_heads, decode_splits, kAttentionPartialVectors, head_dim]
  float* decode_partial_lse;      // [num_decode, num_kv_heads, decode_splits, kAttentionPartialVectors, 2]
  // Optional (bf16/fp16 path): [num_work * num_kv_heads] and [num_decode *
  // num_kv_heads] zeroed int32 counters. With them, the last CTA of each (item,
  // kv head) to finish merges the splits (and zeroes its counter again) instead
  // of a second kernel.
  int32_t* split_counters;
  int32_t* decode_split_counters;
  int32_t num_decode;
  int32_t decode_splits;
  int32_t num_work;
  int32_t num_splits;             // key ranges per work item, merged by a second kernel
  int32_t tile_tokens;            // queries per work item
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
  int32_t num_blocks;
  int64_t query_stride;
  int64_t block_tables_stride;
  float scale;
  float softcap;                  // 0: off
  int32_t sliding_window;         // 0: off
  DType dtype;                    // query and output
  DType kv_dtype;                 // the cache: dtype, or kFloat8E4M3 with bf16/fp16 queries
  float k_scale;                  // fp8 cache: stored = value / scale (1 otherwise)
  float v_scale;
  // Keys per decode split at least in a row that splits (see
  // kAttentionDecodeSplitKeys); 0: always decode_splits.
  int32_t decode_split_keys = kAttentionDecodeSplitChunk;
  // CTAs a thread-block cluster of the decode launch shares a short row with (4
  // or 8; 0: none), as the plan chose (planning._planned_cluster): a launch over a
  // 16-bit cache at head dim 64 or 128 on compute capability 9.0 that fits the
  // GPU at once takes it, any other the plain kernel. PAGEDCORE_DECODE_CLUSTER,
  // where set, overrides it (attention_mma.cu).
  int32_t decode_cluster = 0;
  // Keys under which a decode row of a cluster launch runs by its cluster's first
  // CTA alone (PAGEDCORE_DECODE_CLUSTER_MIN_KEYS, set by the launch; 0: none).
  int32_t decode_cluster_min_keys = 0;
  // The most query tokens of a decode row, where the plan knows it for every launch
  // that may use it (a step's own plan; a decode graph's: 1); 0: unknown (a padded
  // plan refilled under a captured graph), up to kAttentionDecodeVectors / group.
  // fp8 decode's TMA tiles (attention_mma.cu, kLeanNarrow) take their narrow kernel
  // where this times the group is at most 8 query vectors.
  int32_t decode_max_query_tokens = 0;
};
// Query vectors (query tokens x heads of one kv head) a work item may hold:
// kAttentionMmaTileVectors on the tensor-core path (2-byte queries), 16 for
// float32.
int32_t attention_tile_vectors(int32_t element_bytes);
constexpr int32_t kAttentionMmaTileVectors = 128;
// Slots per (item, kv head, split) in the partial buffers.
constexpr int32_t kAttentionPartialVectors = kAttentionMmaTileVectors;
// Key splits a launch may ask for.
constexpr int32_t kAttentionMaxSplits = 64;
// Whether the decode kernel serves this shape (2-byte queries: up to 16 query
// heads per kv head; float32: up to 8, with a K/V row of one kv head that 1,
// 2, 4, ... or 32 lanes of 16-byte loads cover exactly).
bool decode_supported(int32_t group, int32_t head_dim, int32_t element_bytes);
int paged_attention(const PagedAttentionParams& p, void* stream);
// Whether this build holds the Hopper prefill kernel (wgmma, sm_90a) and the
// current device (compute capability 9.0) runs it. Work items (prefill tiles)
// of bf16/fp16 queries over a cache of the same dtype go to it by
// PAGEDCORE_PREFILL_KERNEL: unset or "auto" = where it measured faster (head
// dim 128: wgmma-tma-pairs up to block size 32, wgmma-tma above; over an fp8
// e4m3 cache the fp8 TMA kernel, no softcap), "wgmma", "wgmma-tma",
// "wgmma-tma-pairs" = that kernel for head dims 64 and 128 (-pairs pairs the
// halves at 128 only; fp8 caches then stay on mma.sync), "wgmma-tma-fp8" = the
// TMA kernel over an fp8 cache at head dims 64 and 128 too, "mma" = never;
// everything else stays on the mma.sync kernel.
bool wgmma_prefill_available();
// Diagnostics: the wgmma building blocks of that kernel (swizzled tiles,
// descriptors, S = Q K^T from shared memory, O = P V with P in registers) on
// one tile against float arithmetic: max abs errors of S and O for bf16 head
// dim 64, bf16 128, fp16 64, fp16 128, then bf16 128 and fp16 128 with K and V
// in the paired layout (wgmma-tma-pairs), into errors[kWgmmaSelftestErrors]
// (-1 where the kernel is not available). Synchronous (allocates, copies back).
constexpr int kWgmmaSelftestErrors = 12;
int wgmma_selftest(float* errors);

}  // namespace pagedcore::cuda

// ---- entry points on integer addresses, for bindings ---------------------------------------
// The same launchers with every pointer (and the stream) passed as an integer;
// they throw std::runtime_error naming the CUDA error instead of returning it.
namespace pagedcore::cuda {

void reshape_and_cache_at(std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache,
                          std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                          bool slot_mapping_int64, DType dtype, int32_t num_tokens,
                          int32_t num_kv_heads, int32_t head_dim, int32_t num_blocks,
                          int32_t block_size, int64_t key_stride, int64_t value_stride,
                          DType cache_dtype, float k_scale, float v_scale, std::uintptr_t stream);
void copy_blocks_at(std::uintptr_t cache_ptrs, std::uintptr_t block_mapping, int32_t num_caches,
                    int32_t num_pairs, int32_t num_blocks, int64_t block_bytes,
                    std::uintptr_t stream);
void gather_blocks_at(std::uintptr_t cache_ptrs, std::uintptr_t blocks, std::uintptr_t staging,
                      int32_t num_caches, int32_t num_blocks_moved, int32_t num_blocks,
                      int64_t block_bytes, bool to_staging, std::uintptr_t stream);
// wgmma_selftest's kWgmmaSelftestErrors errors; throws std::runtime_error on a CUDA error.
std::vector<float> wgmma_selftest_at();
void paged_attention_at(std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
                        std::uintptr_t value_cache, std::uintptr_t block_tables,
                        std::uintptr_t seq_lens, std::uintptr_t query_start_loc,
                        std::uintptr_t work_seq, std::uintptr_t work_q_start,
                        std::uintptr_t partial_out, std::uintptr_t partial_lse,
                        std::uintptr_t decode_seq, std::uintptr_t decode_partial_out,
                        std::uintptr_t decode_partial_lse, std::uintptr_t split_counters,
                        std::uintptr_t decode_split_counters, int32_t num_decode,
                        int32_t decode_splits, int32_t num_work,
                        int32_t num_splits, int32_t tile_tokens, int32_t num_heads,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                        int32_t num_blocks, int64_t query_stride, int64_t block_tables_stride,
                        float scale, float softcap, int32_t sliding_window, DType dtype,
                        DType kv_dtype, float k_scale, float v_scale, int32_t decode_cluster,
                        int32_t decode_max_query_tokens, std::uintptr_t stream);

}  // namespace pagedcore::cuda
