// KV-cache operations on the CPU: reshape_and_cache, copy_blocks, swap_blocks (contract:
// pagedcore/cpu_ops.h). All three are row / block memcpys: validated in full first (so a
// call that throws has written nothing), then spread over the thread pool when large.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../check.h"
#include "pagedcore/cpu_ops.h"
#include "thread_pool.h"

namespace pagedcore::cpu {
namespace {

// Below this many bytes a copy runs on the calling thread: waking workers costs more.
constexpr int64_t kParallelBytes = int64_t{1} << 18;

int64_t dtype_size(DType dtype, const char* op) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
  }
  throw InvalidArgument(detail::concat(op, ": unsupported dtype: ", static_cast<int>(dtype)));
}

void check_index_type(IndexType type, const char* op, const char* field) {
  if (type != IndexType::kInt32 && type != IndexType::kInt64) {
    throw InvalidArgument(
        detail::concat(op, ": unsupported ", field, " index type: ", static_cast<int>(type)));
  }
}

int64_t index_at(const void* data, IndexType type, int64_t i) {
  return type == IndexType::kInt32 ? int64_t{static_cast<const int32_t*>(data)[i]}
                                   : static_cast<const int64_t*>(data)[i];
}

// Runs fn(begin, end) over [0, n) in pieces of about `grain` items: on the pool when the
// work is large, else on the calling thread.
template <typename Fn>
void for_ranges(int64_t n, int64_t grain, bool parallel, Fn&& fn) {
  if (n <= 0) return;
  if (!parallel) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t pieces = std::min<int64_t>((n + grain - 1) / grain, 16 * int64_t{pool_threads()});
  const int64_t step = (n + pieces - 1) / pieces;
  parallel_for(pieces, [&](int64_t i) {
    const int64_t begin = i * step;
    fn(begin, std::min(n, begin + step));
  });
}

// Validates a [num_pairs, 2] block mapping: ids in range, destinations distinct and, when
// the two pools are one array, no destination is also a source (the copies run in any
// order and in parallel, so such a pair would race).
void check_block_mapping(const char* op, const void* mapping, IndexType type, int64_t num_pairs,
                         int64_t num_src_blocks, int64_t num_dst_blocks, bool same_pool) {
  std::vector<int64_t> dsts(static_cast<size_t>(num_pairs));
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src = index_at(mapping, type, 2 * i), dst = index_at(mapping, type, 2 * i + 1);
    if (src < 0 || src >= num_src_blocks) {
      throw InvalidArgument(detail::concat(op, ": block_mapping[", i, "][0] = ", src,
                                           " out of range [0, ", num_src_blocks, ")"));
    }
    if (dst < 0 || dst >= num_dst_blocks) {
      throw InvalidArgument(detail::concat(op, ": block_mapping[", i, "][1] = ", dst,
                                           " out of range [0, ", num_dst_blocks, ")"));
    }
    dsts[static_cast<size_t>(i)] = dst;
  }
  std::sort(dsts.begin(), dsts.end());
  const auto dup = std::adjacent_find(dsts.begin(), dsts.end());
  if (dup != dsts.end()) {
    throw InvalidArgument(
        detail::concat(op, ": block_mapping names destination block ", *dup, " twice"));
  }
  if (!same_pool) return;
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src = index_at(mapping, type, 2 * i);
    if (std::binary_search(dsts.begin(), dsts.end(), src)) {
      throw InvalidArgument(detail::concat(op, ": block ", src,
                                           " is both a source and a destination in block_mapping"));
    }
  }
}

}  // namespace

void reshape_and_cache(const ReshapeAndCacheArgs& a) {
  const char* op = "reshape_and_cache";
  const int64_t elem = dtype_size(a.dtype, op);
  check_index_type(a.slot_mapping_type, op, "slot_mapping");
  if (a.num_tokens < 0) {
    throw InvalidArgument(detail::concat(op, ": num_tokens must be >= 0, got ", a.num_tokens));
  }
  if (a.num_kv_heads <= 0 || a.head_dim <= 0 || a.block_size <= 0 || a.num_blocks < 0) {
    throw InvalidArgument(detail::concat(op, ": bad cache shape [", a.num_blocks, ", ",
                                         a.block_size, ", ", a.num_kv_heads, ", ", a.head_dim,
                                         "]"));
  }
  const int64_t row = a.num_kv_heads * a.head_dim;  // elements per token
  if (a.key_stride < row || a.value_stride < row) {
    throw InvalidArgument(detail::concat(op, ": token strides (key ", a.key_stride, ", value ",
                                         a.value_stride, ") must be >= num_kv_heads * head_dim (",
                                         row, ")"));
  }
  const int64_t num_slots = a.num_blocks * a.block_size;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t slot = index_at(a.slot_mapping, a.slot_mapping_type, t);
    if (slot >= num_slots) {
      throw InvalidArgument(detail::concat(op, ": slot_mapping[", t, "] = ", slot,
                                           " out of range [0, ", num_slots,
                                           ") (negative slots are skipped)"));
    }
  }
  const auto* key = static_cast<const char*>(a.key);
  const auto* value = static_cast<const char*>(a.value);
  auto* key_cache = static_cast<char*>(a.key_cache);
  auto* value_cache = static_cast<char*>(a.value_cache);
  const int64_t row_bytes = row * elem;
  for_ranges(a.num_tokens, 64, a.num_tokens * row_bytes * 2 >= kParallelBytes,
             [&](int64_t begin, int64_t end) {
               for (int64_t t = begin; t < end; ++t) {
                 const int64_t slot = index_at(a.slot_mapping, a.slot_mapping_type, t);
                 if (slot < 0) continue;
                 std::memcpy(key_cache + slot * row_bytes, key + t * a.key_stride * elem,
                             row_bytes);
                 std::memcpy(value_cache + slot * row_bytes, value + t * a.value_stride * elem,
                             row_bytes);
               }
             });
}

void copy_blocks(const CopyBlocksArgs& a) {
  const char* op = "copy_blocks";
  const int64_t elem = dtype_size(a.dtype, op);
  check_index_type(a.block_mapping_type, op, "block_mapping");
  if (a.num_layers < 0 || a.num_pairs < 0 || a.num_blocks < 0 || a.block_numel <= 0) {
    throw InvalidArgument(detail::concat(op, ": bad sizes: num_layers ", a.num_layers,
                                         ", num_pairs ", a.num_pairs, ", num_blocks ",
                                         a.num_blocks, ", block_numel ", a.block_numel));
  }
  check_block_mapping(op, a.block_mapping, a.block_mapping_type, a.num_pairs, a.num_blocks,
                      a.num_blocks, /*same_pool=*/true);
  const int64_t block_bytes = a.block_numel * elem;
  // One item per (cache, pair); caches are the K of every layer, then the V of every layer.
  const int64_t n = 2 * a.num_layers * a.num_pairs;
  for_ranges(n, 8, n * block_bytes >= kParallelBytes, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t cache = i / a.num_pairs, pair = i % a.num_pairs;
      char* base = static_cast<char*>(cache < a.num_layers ? a.key_caches[cache]
                                                           : a.value_caches[cache - a.num_layers]);
      const int64_t src = index_at(a.block_mapping, a.block_mapping_type, 2 * pair);
      const int64_t dst = index_at(a.block_mapping, a.block_mapping_type, 2 * pair + 1);
      std::memcpy(base + dst * block_bytes, base + src * block_bytes, block_bytes);
    }
  });
}

void swap_blocks(const SwapBlocksArgs& a) {
  const char* op = "swap_blocks";
  const int64_t elem = dtype_size(a.dtype, op);
  check_index_type(a.block_mapping_type, op, "block_mapping");
  if (a.num_pairs < 0 || a.num_src_blocks < 0 || a.num_dst_blocks < 0 || a.block_numel <= 0) {
    throw InvalidArgument(detail::concat(op, ": bad sizes: num_pairs ", a.num_pairs,
                                         ", num_src_blocks ", a.num_src_blocks,
                                         ", num_dst_blocks ", a.num_dst_blocks, ", block_numel ",
                                         a.block_numel));
  }
  check_block_mapping(op, a.block_mapping, a.block_mapping_type, a.num_pairs, a.num_src_blocks,
                      a.num_dst_blocks, /*same_pool=*/a.src == a.dst);
  const int64_t block_bytes = a.block_numel * elem;
  const auto* src = static_cast<const char*>(a.src);
  auto* dst = static_cast<char*>(a.dst);
  for_ranges(a.num_pairs, 8, a.num_pairs * block_bytes >= kParallelBytes,
             [&](int64_t begin, int64_t end) {
               for (int64_t i = begin; i < end; ++i) {
                 const int64_t s = index_at(a.block_mapping, a.block_mapping_type, 2 * i);
                 const int64_t d = index_at(a.block_mapping, a.block_mapping_type, 2 * i + 1);
                 std::memcpy(dst + d * block_bytes, src + s * block_bytes, block_bytes);
               }
             });
}

void reshape_and_cache_at(std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache,
                          std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                          IndexType slot_mapping_type, DType dtype, int64_t num_tokens,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                          int64_t block_size, int64_t key_stride, int64_t value_stride) {
  ReshapeAndCacheArgs a;
  a.key = reinterpret_cast<const void*>(key);
  a.value = reinterpret_cast<const void*>(value);
  a.key_cache = reinterpret_cast<void*>(key_cache);
  a.value_cache = reinterpret_cast<void*>(value_cache);
  a.slot_mapping = reinterpret_cast<const void*>(slot_mapping);
  a.slot_mapping_type = slot_mapping_type;
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.num_blocks = num_blocks;
  a.block_size = block_size;
  a.key_stride = key_stride;
  a.value_stride = value_stride;
  reshape_and_cache(a);
}

void copy_blocks_at(const std::vector<std::uintptr_t>& key_caches,
                    const std::vector<std::uintptr_t>& value_caches,
                    std::uintptr_t block_mapping, IndexType block_mapping_type, DType dtype,
                    int64_t num_pairs, int64_t num_blocks, int64_t block_numel) {
  if (key_caches.size() != value_caches.size()) {
    throw InvalidArgument(detail::concat("copy_blocks: ", key_caches.size(), " key caches but ",
                                         value_caches.size(), " value caches"));
  }
  std::vector<void*> keys(key_caches.size()), values(value_caches.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = reinterpret_cast<void*>(key_caches[i]);
    values[i] = reinterpret_cast<void*>(value_caches[i]);
  }
  CopyBlocksArgs a;
  a.key_caches = keys.data();
  a.value_caches = values.data();
  a.block_mapping = reinterpret_cast<const void*>(block_mapping);
  a.block_mapping_type = block_mapping_type;
  a.dtype = dtype;
  a.num_layers = static_cast<int64_t>(keys.size());
  a.num_pairs = num_pairs;
  a.num_blocks = num_blocks;
  a.block_numel = block_numel;
  copy_blocks(a);
}

void swap_blocks_at(std::uintptr_t src, std::uintptr_t dst, std::uintptr_t block_mapping,
                    IndexType block_mapping_type, DType dtype, int64_t num_pairs,
                    int64_t num_src_blocks, int64_t num_dst_blocks, int64_t block_numel) {
  SwapBlocksArgs a;
  a.src = reinterpret_cast<const void*>(src);
  a.dst = reinterpret_cast<void*>(dst);
  a.block_mapping = reinterpret_cast<const void*>(block_mapping);
  a.block_mapping_type = block_mapping_type;
  a.dtype = dtype;
  a.num_pairs = num_pairs;
  a.num_src_blocks = num_src_blocks;
  a.num_dst_blocks = num_dst_blocks;
  a.block_numel = block_numel;
  swap_blocks(a);
}

}  // namespace pagedcore::cpu
