// The kernels' entry points on integer addresses (what the bindings call).
#include <stdexcept>
#include <string>

#include "pagedcore/cuda/device_info.h"
#include "pagedcore/cuda/kernels.h"
#include "pagedcore/cuda/layer_kernels.h"

namespace pagedcore::cuda {

namespace {

template <typename P>
P* ptr(std::uintptr_t address) {
  return reinterpret_cast<P*>(address);
}

void check(int error, const char* what) {
  if (error != 0) throw std::runtime_error(std::string(what) + ": CUDA error: " + error_string(error));
}

}  // namespace

#ifndef PAGEDCORE_WITH_WGMMA
bool wgmma_prefill_available() { return false; }  // a build without sm_90
int wgmma_selftest(float* errors) {
  for (int i = 0; i < kWgmmaSelftestErrors; ++i) errors[i] = -1.f;
  return 0;
}
#endif

std::vector<float> wgmma_selftest_at() {
  std::vector<float> errors(kWgmmaSelftestErrors);
  check(wgmma_selftest(errors.data()), "wgmma_selftest");
  return errors;
}

void reshape_and_cache_at(std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache,
                          std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                          bool slot_mapping_int64, DType dtype, int32_t num_tokens,
                          int32_t num_kv_heads, int32_t head_dim, int32_t num_blocks,
                          int32_t block_size, int64_t key_stride, int64_t value_stride,
                          DType cache_dtype, float k_scale, float v_scale, std::uintptr_t stream) {
  ReshapeAndCacheParams p{ptr<const void>(key), ptr<const void>(value), ptr<void>(key_cache),
                          ptr<void>(value_cache), ptr<const void>(slot_mapping), slot_mapping_int64,
                          num_tokens, num_kv_heads, head_dim, num_blocks, block_size, key_stride,
                          value_stride, dtype, cache_dtype, k_scale, v_scale};
  check(reshape_and_cache(p, ptr<void>(stream)), "reshape_and_cache");
}

void copy_blocks_at(std::uintptr_t cache_ptrs, std::uintptr_t block_mapping, int32_t num_caches,
                    int32_t num_pairs, int32_t num_blocks, int64_t block_bytes,
                    std::uintptr_t stream) {
  CopyBlocksParams p{ptr<const int64_t>(cache_ptrs), ptr<const int64_t>(block_mapping), num_caches,
                     num_pairs, num_blocks, block_bytes};
  check(copy_blocks(p, ptr<void>(stream)), "copy_blocks");
}

void gather_blocks_at(std::uintptr_t cache_ptrs, std::uintptr_t blocks, std::uintptr_t staging,
                      int32_t num_caches, int32_t num_blocks_moved, int32_t num_blocks,
                      int64_t block_bytes, bool to_staging, std::uintptr_t stream) {
  GatherBlocksParams p{ptr<const int64_t>(cache_ptrs), ptr<const int64_t>(blocks), ptr<void>(staging),
                       num_caches, num_blocks_moved, num_blocks, block_bytes};
  check(to_staging ? gather_blocks(p, ptr<void>(stream)) : scatter_blocks(p, ptr<void>(stream)),
        to_staging ? "gather_blocks" : "scatter_blocks");
}

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
                        int32_t decode_max_query_tokens, std::uintptr_t stream) {
  if (!head_dim_supported(head_dim)) {
    throw std::invalid_argument("unsupported head_dim: " + std::to_string(head_dim));
  }
  PagedAttentionParams p{};
  p.out = ptr<void>(out);
  p.query = ptr<const void>(query);
  p.key_cache = ptr<const void>(key_cache);
  p.value_cache = ptr<const void>(value_cache);
  p.block_tables = ptr<const int32_t>(block_tables);
  p.seq_lens = ptr<const int32_t>(seq_lens);
  p.query_start_loc = ptr<const int32_t>(query_start_loc);
  p.work_seq = ptr<const int32_t>(work_seq);
  p.work_q_start = ptr<const int32_t>(work_q_start);
  p.partial_out = ptr<float>(partial_out);
  p.partial_lse = ptr<float>(partial_lse);
  p.decode_seq = ptr<const int32_t>(decode_seq);
  p.decode_partial_out = ptr<float>(decode_partial_out);
  p.decode_partial_lse = ptr<float>(decode_partial_lse);
  p.split_counters = ptr<int32_t>(split_counters);
  p.decode_split_counters = ptr<int32_t>(decode_split_counters);
  p.num_decode = num_decode;
  p.decode_splits = decode_splits;
  p.num_work = num_work;
  p.num_splits = num_splits;
  p.tile_tokens = tile_tokens;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.num_blocks = num_blocks;
  p.query_stride = query_stride;
  p.block_tables_stride = block_tables_stride;
  p.scale = scale;
  p.softcap = softcap;
  p.sliding_window = sliding_window;
  p.dtype = dtype;
  p.kv_dtype = kv_dtype;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.decode_cluster = decode_cluster;
  p.decode_max_query_tokens = decode_max_query_tokens;
  check(paged_attention(p, ptr<void>(stream)), "paged_attention");
}

void rms_norm_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t residual,
                 std::uintptr_t weight, DType dtype, int32_t num_tokens, int32_t num_heads,
                 int32_t hidden_size, int64_t input_stride, int64_t out_stride,
                 int64_t residual_stride, float eps, std::uintptr_t stream) {
  RmsNormParams p{ptr<void>(out), ptr<const void>(input), ptr<void>(residual), ptr<const void>(weight),
                  num_tokens, num_heads, hidden_size, input_stride, out_stride, residual_stride, eps, dtype};
  check(rms_norm(p, ptr<void>(stream)), residual != 0 ? "fused_add_rms_norm" : "rms_norm");
}

void rotary_embedding_at(std::uintptr_t positions, bool positions_int64, std::uintptr_t query,
                         std::uintptr_t key, std::uintptr_t cos_sin_cache, DType dtype,
                         int32_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
                         int32_t head_dim, int64_t query_stride, int64_t key_stride,
                         int32_t max_position, std::uintptr_t value, std::uintptr_t key_cache,
                         std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                         bool slot_mapping_int64, int32_t num_blocks, int32_t block_size,
                         int64_t value_stride, DType cache_dtype, float k_scale, float v_scale,
                         std::uintptr_t stream) {
  RotaryEmbeddingParams p{ptr<const void>(positions), positions_int64, ptr<void>(query), ptr<void>(key),
                          ptr<const float>(cos_sin_cache), num_tokens, num_heads, num_kv_heads, head_dim,
                          query_stride, key_stride, max_position, dtype, ptr<const void>(value),
                          ptr<void>(key_cache), ptr<void>(value_cache), ptr<const void>(slot_mapping),
                          slot_mapping_int64, num_blocks, block_size, value_stride, cache_dtype, k_scale,
                          v_scale};
  check(rotary_embedding(p, ptr<void>(stream)), "rotary_embedding");
}

void silu_and_mul_at(std::uintptr_t out, std::uintptr_t input, DType dtype, int32_t num_tokens,
                     int32_t intermediate_size, int64_t input_stride, int64_t out_stride,
                     std::uintptr_t stream) {
  SiluAndMulParams p{ptr<void>(out), ptr<const void>(input), num_tokens, intermediate_size, input_stride,
                     out_stride, dtype};
  check(silu_and_mul(p, ptr<void>(stream)), "silu_and_mul");
}

void linear_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t weight, std::uintptr_t bias, DType dtype,
               int32_t num_tokens, int32_t in_features, int32_t out_features, int64_t input_stride,
               int64_t out_stride, std::uintptr_t stream, bool silu_and_mul) {
  LinearParams p{ptr<void>(out),  ptr<const void>(input), ptr<const void>(weight), ptr<const void>(bias),
                 num_tokens,      in_features,            out_features,           input_stride,
                 out_stride,      dtype,                  silu_and_mul};
  check(linear(p, ptr<void>(stream)), "linear");
}

}  // namespace pagedcore::cuda
