// Paged attention on the CPU (contract: pagedcore/cpu_ops.h).
//
// One launch serves a batch that mixes decode rows, prefill rows with a cached prefix
// and chunked-prefill rows. The work is cut into items, each one kv head of one row, so
// that the K/V of a kv head are read once for all the query heads that share it (GQA):
//
// * decode items (q_len * group <= kMaxDecodeQueries query vectors): vectors run along
//   head_dim; the scores of W keys come out of one transpose-sum (simd.h). A row with
//   few items for the threads is split along its keys (split-KV) and the partial
//   softmax states are merged by a second pass.
// * lane tiles (prefill): up to 4 * W query vectors (queries x heads of one kv head) are
//   laid side by side in the vector lanes, so QK^T and PV are outer products: every key
//   and value element is broadcast against all lanes and no horizontal reduction or
//   transpose of K/V is needed, only of the small Q tile and its output.
//
// Both stream the keys in chunks of kChunk with an online softmax in fp32. Items are
// sorted by estimated cost and handed out dynamically by the thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../check.h"
#include "pagedcore/cpu_ops.h"
#include "isa.h"
#include "thread_pool.h"

#if !defined(__clang__)
// Vector types never cross a call between target regions (see simd.h); the ABI notes
// GCC would print for them do not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define PAGEDCORE_INLINE inline __attribute__((always_inline))

namespace pagedcore::cpu {

Isa best_isa() {
#if PAGEDCORE_HAVE_X86_TARGETS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma")) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

std::atomic<Isa>& current_isa() {
  static std::atomic<Isa> isa{best_isa()};
  return isa;
}

namespace {

constexpr int kChunk = 32;             // keys per online-softmax step
constexpr int kMaxDecodeQueries = 8;   // query vectors per item up to which the decode kernel runs
constexpr int kMaxHeadDim = 256;
constexpr int kMaxLanes = 64;          // 4 vectors of 16
constexpr int kMinSplitKeys = 256;     // split-KV never makes a part shorter than this
constexpr int kPartialStride = kMaxDecodeQueries * (kMaxHeadDim + 2);

int lanes_of(Isa isa) { return isa == Isa::kAvx512 ? 16 : isa == Isa::kAvx2 ? 8 : 4; }

// ---- the plan ---------------------------------------------------------------------------------

struct WorkItem {
  int32_t row;
  int32_t kv_head;
  int32_t q_begin, q_count;        // queries of the row, 0-based within the row
  int32_t head_begin, head_count;  // query heads within the kv head's group
  int32_t key_begin, key_end;      // keys read
  int32_t split;                   // -1: writes out; else its partial-result slot
  int32_t nv;                      // 0: decode kernel; else vectors of lanes (1, 2, 4)
  int64_t cost;
};

struct Merge {  // split-KV: partial results first_slot .. first_slot + num_splits - 1
  int32_t row, kv_head, first_slot, num_splits;
};

struct Problem {
  PagedAttentionArgs a;
  int64_t group;       // query heads per kv head
  float q_scale;       // folded into q: scale, or scale / softcap
  float* partials;     // [num_slots, kPartialStride]
};

PAGEDCORE_INLINE int32_t first_visible(int32_t pos, int32_t window) {
  return window > 0 ? std::max(0, pos - window + 1) : 0;
}

void plan(const Problem& p, int lanes, int threads, std::vector<WorkItem>& items,
          std::vector<Merge>& merges, int32_t& num_slots) {
  const PagedAttentionArgs& a = p.a;
  const int32_t group = static_cast<int32_t>(p.group);
  items.clear();
  merges.clear();
  num_slots = 0;
  int64_t decode_items = 0;
  for (int32_t r = 0; r < a.num_seqs; ++r) {
    const int32_t q_len = a.query_start_loc[r + 1] - a.query_start_loc[r];
    if (q_len == 0) continue;
    const int32_t pos_first = a.seq_lens[r] - q_len;
    if (q_len * group <= kMaxDecodeQueries) {
      const int32_t kb = first_visible(pos_first, a.sliding_window), ke = a.seq_lens[r];
      for (int32_t h = 0; h < a.num_kv_heads; ++h) {
        items.push_back({r, h, 0, q_len, 0, group, kb, ke, -1, 0,
                         int64_t{q_len} * group * (ke - kb) * 4 + 64});
        ++decode_items;
      }
      continue;
    }
    // Lane tiles: heads of the group first (a token's heads are adjacent in memory),
    // then as many queries as fill the lanes; sizes balanced so no tile is a sliver.
    const int32_t head_groups = (group + lanes - 1) / lanes;
    const int32_t ng = (group + head_groups - 1) / head_groups;
    const int32_t nt_max = std::max(1, lanes / ng);
    const int32_t tiles = (q_len + nt_max - 1) / nt_max;
    const int32_t nt = (q_len + tiles - 1) / tiles;
    const int32_t w = lanes / 4;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      for (int32_t hb = 0; hb < group; hb += ng) {
        const int32_t hc = std::min(ng, group - hb);
        for (int32_t qb = 0; qb < q_len; qb += nt) {
          const int32_t qc = std::min(nt, q_len - qb);
          const int32_t kb = first_visible(pos_first + qb, a.sliding_window);
          const int32_t ke = pos_first + qb + qc;
          int32_t nv = (qc * hc + w - 1) / w;
          nv = nv > 2 ? 4 : nv;
          items.push_back({r, h, qb, qc, hb, hc, kb, ke, -1, nv, int64_t{nv} * w * (ke - kb) + 64});
        }
      }
    }
  }
  // Split-KV when there are too few items to keep the threads busy (few long decodes).
  const int64_t wanted = 3 * int64_t{threads};
  if (decode_items > 0 && threads > 1 && static_cast<int64_t>(items.size()) < wanted) {
    const int64_t factor = (wanted + static_cast<int64_t>(items.size()) - 1) /
                           static_cast<int64_t>(items.size());
    const size_t n = items.size();
    for (size_t i = 0; i < n; ++i) {
      WorkItem& it = items[i];
      const int32_t keys = it.key_end - it.key_begin;
      const int32_t splits =
          static_cast<int32_t>(std::min<int64_t>(factor, keys / kMinSplitKeys));
      if (it.nv != 0 || splits < 2) continue;
      merges.push_back({it.row, it.kv_head, num_slots, splits});
      const WorkItem whole = it;
      const int32_t step = (keys + splits - 1) / splits;
      for (int32_t s = 0; s < splits; ++s) {
        WorkItem part = whole;
        part.key_begin = whole.key_begin + s * step;
        part.key_end = std::min(whole.key_end, part.key_begin + step);
        part.split = num_slots++;
        part.cost = whole.cost / splits;
        if (s == 0) {
          items[i] = part;
        } else {
          items.push_back(part);
        }
      }
    }
  }
  std::sort(items.begin(), items.end(),
            [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
}

// ---- per-thread scratch ---------------------------------------------------------------------

struct Scratch {
  std::vector<float> storage;
  float* qt;      // lanes: [head_dim, lanes] Q tile, transposed; decode: [queries, head_dim]
  float* acc;     // lanes: [head_dim, lanes];                  decode: [queries, head_dim]
  float* scores;  // lanes: [kChunk, lanes];                    decode: [queries, kChunk]
  float* kbuf;    // [kChunk, head_dim] keys widened to fp32 (16-bit caches)
  float* vbuf;    // [kChunk, head_dim] values widened to fp32
  float* row;     // [head_dim]
  float* zero;    // [head_dim] zeros: stands in for the keys that pad a chunk
  const float* krow[kChunk];
  const float* vrow[kChunk];
};

// NOTE: noinline on purpose. Inlined, GCC re-derives the thread-local address
// (__tls_get_addr, spilling every vector register around the call) inside the kernels'
// inner loops; behind a call the scratch is a plain pointer.
__attribute__((noinline)) Scratch& thread_scratch() {
  thread_local Scratch s = [] {
    Scratch t;
    constexpr size_t sizes[] = {kMaxHeadDim * kMaxLanes, kMaxHeadDim * kMaxLanes,
                                kChunk * kMaxLanes,      kChunk * kMaxHeadDim,
                                kChunk * kMaxHeadDim,    kMaxHeadDim,
                                kMaxHeadDim};
    size_t total = 16;
    for (size_t n : sizes) total += n;
    t.storage.assign(total, 0.0f);
    float* base = t.storage.data();
    base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 16) % 16;
    float** slots[] = {&t.qt, &t.acc, &t.scores, &t.kbuf, &t.vbuf, &t.row, &t.zero};
    for (size_t i = 0; i < 7; ++i) {
      *slots[i] = base;
      base += sizes[i];
    }
    return t;
  }();
  return s;
}

// ---- the kernels, once per instruction set (per_isa.h) -------------------------------------

#define PAGEDCORE_ISA_KERNELS "attention_kernels.h"
#include "per_isa.h"

using ItemFn = void (*)(const Problem&, const WorkItem&);

template <int D>
ItemFn item_fn(Isa isa) {
#if PAGEDCORE_HAVE_X86_TARGETS
  if (isa == Isa::kAvx512) return &isa_avx512::run_item<D>;
  if (isa == Isa::kAvx2) return &isa_avx2::run_item<D>;
#endif
  return &isa_generic::run_item<D>;
}

// Split-KV: merges the partial softmax states of one (row, kv head) and writes out.
void merge_partials(const Problem& p, const Merge& mg, float* row) {
  const PagedAttentionArgs& a = p.a;
  const int32_t q_start = a.query_start_loc[mg.row];
  const int32_t q_len = a.query_start_loc[mg.row + 1] - q_start;
  const int64_t G = p.group, D = a.head_dim, M = q_len * G;
  for (int64_t i = 0; i < M; ++i) {
    float mx = isa_generic::kNegInf;
    for (int32_t s = 0; s < mg.num_splits; ++s) {
      mx = std::max(mx, p.partials[int64_t{mg.first_slot + s} * kPartialStride + i]);
    }
    std::fill(row, row + D, 0.0f);
    float denom = 0.0f;
    for (int32_t s = 0; s < mg.num_splits; ++s) {
      const float* part = p.partials + int64_t{mg.first_slot + s} * kPartialStride;
      const float weight = part[i] == isa_generic::kNegInf ? 0.0f : std::exp(part[i] - mx);
      denom += part[M + i] * weight;
      const float* acc = part + 2 * M + i * D;
      for (int64_t d = 0; d < D; ++d) row[d] += acc[d] * weight;
    }
    const float inv = 1.0f / denom;
    for (int64_t d = 0; d < D; ++d) row[d] *= inv;
    const int64_t t = i / G, g = i % G;
    const int64_t at = ((q_start + t) * a.num_heads + mg.kv_head * G + g) * D;
    switch (D) {
      case 32: isa_generic::store_row<32>(a.dtype, a.out, at, row); break;
      case 64: isa_generic::store_row<64>(a.dtype, a.out, at, row); break;
      case 80: isa_generic::store_row<80>(a.dtype, a.out, at, row); break;
      case 96: isa_generic::store_row<96>(a.dtype, a.out, at, row); break;
      case 128: isa_generic::store_row<128>(a.dtype, a.out, at, row); break;
      default: isa_generic::store_row<256>(a.dtype, a.out, at, row); break;
    }
  }
}

template <int D>
void launch(const PagedAttentionArgs& args) {
  const Isa isa = current_isa().load();
  Problem p{args, args.num_heads / args.num_kv_heads,
            args.softcap > 0.0f ? args.scale / args.softcap : args.scale, nullptr};
  // NOTE: the tasks below run on other threads, where these thread_local names denote
  // other vectors: the tasks must use the references, never the names.
  thread_local std::vector<WorkItem> items_buffer;
  thread_local std::vector<Merge> merges_buffer;
  thread_local std::vector<float> partials_buffer;
  std::vector<WorkItem>& items = items_buffer;
  std::vector<Merge>& merges = merges_buffer;
  std::vector<float>& partials = partials_buffer;
  int32_t num_slots = 0;
  plan(p, 4 * lanes_of(isa), pool_threads(), items, merges, num_slots);
  if (num_slots > 0) {
    partials.resize(static_cast<size_t>(num_slots) * kPartialStride);
    p.partials = partials.data();
  }
  const ItemFn fn = item_fn<D>(isa);
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) { fn(p, items[i]); });
  if (!merges.empty()) {
    parallel_for(static_cast<int64_t>(merges.size()),
                 [&](int64_t i) { merge_partials(p, merges[i], thread_scratch().row); });
  }
}

// ---- validation --------------------------------------------------------------------------------

void validate(const PagedAttentionArgs& a) {
  const auto fail = [](const auto&... parts) {
    throw InvalidArgument(detail::concat("paged_attention: ", parts...));
  };
  if (a.dtype != DType::kFloat32 && a.dtype != DType::kBFloat16 && a.dtype != DType::kFloat16) {
    fail("unsupported dtype: ", static_cast<int>(a.dtype));
  }
  switch (a.head_dim) {
    case 32: case 64: case 80: case 96: case 128: case 256: break;
    default: fail("unsupported head_dim: ", a.head_dim);
  }
  if (a.num_kv_heads <= 0) fail("num_kv_heads must be > 0, got ", a.num_kv_heads);
  if (a.num_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    fail("num_heads (", a.num_heads, ") must be a positive multiple of num_kv_heads (",
         a.num_kv_heads, ")");
  }
  if (a.block_size <= 0) fail("block_size must be > 0, got ", a.block_size);
  if (a.num_blocks < 0) fail("num_blocks must be >= 0, got ", a.num_blocks);
  if (a.num_tokens < 0) fail("num_tokens must be >= 0, got ", a.num_tokens);
  if (a.num_seqs < 0) fail("num_seqs must be >= 0, got ", a.num_seqs);
  if (a.max_blocks_per_seq < 0) fail("max_blocks_per_seq must be >= 0, got ", a.max_blocks_per_seq);
  if (a.query_stride < a.num_heads * a.head_dim) {
    fail("query_stride (", a.query_stride, ") must be >= num_heads * head_dim (",
         a.num_heads * a.head_dim, ")");
  }
  if (a.block_tables_stride < a.max_blocks_per_seq) {
    fail("block_tables_stride (", a.block_tables_stride, ") must be >= max_blocks_per_seq (",
         a.max_blocks_per_seq, ")");
  }
  if (!std::isfinite(a.scale)) fail("scale must be finite, got ", a.scale);
  if (!(a.softcap >= 0.0f) || !std::isfinite(a.softcap)) {
    fail("softcap must be finite and >= 0, got ", a.softcap);
  }
  if (a.sliding_window < 0) fail("sliding_window must be >= 0, got ", a.sliding_window);
  if (a.num_seqs == 0) return;
  if (a.query_start_loc[0] < 0) fail("query_start_loc[0] = ", a.query_start_loc[0], " < 0");
  const int64_t capacity = a.max_blocks_per_seq * a.block_size;
  for (int64_t r = 0; r < a.num_seqs; ++r) {
    const int32_t begin = a.query_start_loc[r], end = a.query_start_loc[r + 1];
    if (end < begin) {
      fail("query_start_loc must be non-decreasing: query_start_loc[", r + 1, "] = ", end,
           " < query_start_loc[", r, "] = ", begin);
    }
    if (end > a.num_tokens) {
      fail("query_start_loc[", r + 1, "] = ", end, " > num_tokens (", a.num_tokens, ")");
    }
    const int32_t q_len = end - begin, seq_len = a.seq_lens[r];
    if (seq_len < q_len) {
      fail("seq_lens[", r, "] = ", seq_len, " < the row's query count ", q_len);
    }
    if (seq_len > capacity) {
      fail("seq_lens[", r, "] = ", seq_len, " > max_blocks_per_seq * block_size (", capacity, ")");
    }
    if (q_len == 0) continue;
    // Exactly the blocks the kernels read: from the first query's window to the end.
    const int64_t first = first_visible(seq_len - q_len, a.sliding_window) / a.block_size;
    const int64_t last = (seq_len - 1) / a.block_size;
    const int32_t* table = a.block_tables + r * a.block_tables_stride;
    for (int64_t b = first; b <= last; ++b) {
      if (table[b] < 0 || table[b] >= a.num_blocks) {
        fail("block_tables[", r, "][", b, "] = ", table[b], " out of range [0, ", a.num_blocks,
             ")");
      }
    }
  }
}

}  // namespace

void paged_attention(const PagedAttentionArgs& args) {
  validate(args);
  if (args.num_seqs == 0 || args.num_tokens == 0) return;
  switch (args.head_dim) {
    case 32: return launch<32>(args);
    case 64: return launch<64>(args);
    case 80: return launch<80>(args);
    case 96: return launch<96>(args);
    case 128: return launch<128>(args);
    case 256: return launch<256>(args);
    default: throw InvalidArgument(detail::concat("unsupported head_dim: ", args.head_dim));
  }
}

std::string cpu_isa() {
  switch (current_isa().load()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kGeneric: break;
  }
  return "generic";
}

void set_cpu_isa(const std::string& isa) {
  Isa wanted;
  if (isa == "avx512") {
    wanted = Isa::kAvx512;
  } else if (isa == "avx2") {
    wanted = Isa::kAvx2;
  } else if (isa == "generic") {
    wanted = Isa::kGeneric;
  } else {
    throw InvalidArgument(detail::concat("unknown cpu isa '", isa,
                                         "': expected avx512, avx2 or generic"));
  }
  if (static_cast<int>(wanted) > static_cast<int>(best_isa())) {
    throw InvalidArgument(detail::concat("cpu isa '", isa, "' is not supported by this CPU"));
  }
  current_isa().store(wanted);
}

void paged_attention_at(std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
                        std::uintptr_t value_cache, std::uintptr_t block_tables,
                        std::uintptr_t seq_lens, std::uintptr_t query_start_loc, DType dtype,
                        int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t num_blocks, int64_t block_size,
                        int64_t num_seqs, int64_t max_blocks_per_seq, int64_t query_stride,
                        int64_t block_tables_stride, float scale, int32_t sliding_window,
                        float softcap) {
  PagedAttentionArgs a;
  a.out = reinterpret_cast<void*>(out);
  a.query = reinterpret_cast<const void*>(query);
  a.key_cache = reinterpret_cast<const void*>(key_cache);
  a.value_cache = reinterpret_cast<const void*>(value_cache);
  a.block_tables = reinterpret_cast<const int32_t*>(block_tables);
  a.seq_lens = reinterpret_cast<const int32_t*>(seq_lens);
  a.query_start_loc = reinterpret_cast<const int32_t*>(query_start_loc);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.num_blocks = num_blocks;
  a.block_size = block_size;
  a.num_seqs = num_seqs;
  a.max_blocks_per_seq = max_blocks_per_seq;
  a.query_stride = query_stride;
  a.block_tables_stride = block_tables_stride;
  a.scale = scale;
  a.sliding_window = sliding_window;
  a.softcap = softcap;
  paged_attention(a);
}

}  // namespace pagedcore::cpu
