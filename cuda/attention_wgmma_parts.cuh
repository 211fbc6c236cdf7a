// Internal: the pieces of the Hopper prefill kernels (attention_wgmma.cu) and
// of their building-block self-test (attention_wgmma_selftest.cu): tile
// geometry, the work item of a CTA, the Q and K/V gathers into swizzled
// shared memory, the masked online softmax on wgmma accumulators, the two
// wgmma issues (S = Q K^T, O += P V) and the output store. Device code for
// sm_90a only (wgmma_ops.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "device_ops.cuh"
#include "pagedcore/cuda/kernels.h"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda::wgmma_attention {

constexpr int kRows = kAttentionMmaTileVectors;  // query vectors per CTA
constexpr int kKeys = 128;                       // keys per shared-memory tile
constexpr int kThreads = 256;                    // two warpgroups of 64 rows
constexpr int kStages = 3;                       // K tiles (and V tiles) in shared memory
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows == 128, "two warpgroups of 64 rows");

template <int HD>
__host__ __device__ constexpr int tile_bytes(int rows) {
  return rows * HD * 2;
}
// Q, kStages K tiles, kStages V tiles, and room to align the start to 1024
// bytes (head dim 128: 225 KiB of the 227 a CTA may have).
template <int HD>
__host__ __device__ constexpr size_t smem_bytes() {
  return 1024 + tile_bytes<HD>(kRows) + 2 * kStages * tile_bytes<HD>(kKeys);
}

using dev::fast_exp2;

template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// What one CTA computes: work item `work` (query tokens t0 .. t0 + tile_tokens - 1
// of row `row`, times the `group` query heads of kv head `kv_head`) over keys
// [s_lo, s_hi) of split `split`, in n_tiles tiles of kKeys.
struct Item {
  int kv_head, work, split, splits, group, row, t0, q_begin, q_len, num_vectors, first_pos, s_lo, s_hi, n_tiles;
};

__device__ __forceinline__ Item item_of(const PagedAttentionParams& p, int kv_head, int work, int split) {
  Item it;
  it.kv_head = kv_head;
  it.work = work;
  it.split = split;
  it.splits = p.num_splits;
  it.group = p.num_heads / p.num_kv_heads;
  it.row = p.work_seq[it.work];
  it.t0 = p.work_q_start[it.work];
  it.q_begin = p.query_start_loc[it.row];
  it.q_len = p.query_start_loc[it.row + 1] - it.q_begin;
  const int tile_tokens = min(p.tile_tokens, it.q_len - it.t0);
  const int ctx = p.seq_lens[it.row];
  it.num_vectors = tile_tokens * it.group;
  it.first_pos = ctx - it.q_len + it.t0;
  const int last_pos = it.first_pos + tile_tokens - 1;
  const int k_lo = p.sliding_window > 0 ? max(0, it.first_pos - p.sliding_window + 1) : 0;
  const int k_hi = last_pos + 1;
  const int per_split = (k_hi - k_lo + it.splits - 1) / it.splits;
  it.s_lo = k_lo + it.split * per_split;
  it.s_hi = min(k_hi, it.s_lo + per_split);
  it.n_tiles = it.s_hi > it.s_lo ? (it.s_hi - it.s_lo + kKeys - 1) / kKeys : 0;
  return it;
}

// The CTA of a (kv heads, work items, splits) grid, or item `linear` in that
// grid's launch order (kv head fastest) for a persistent CTA.
__device__ __forceinline__ Item item_of(const PagedAttentionParams& p) {
  return item_of(p, blockIdx.x, blockIdx.y, blockIdx.z);
}
__device__ __forceinline__ Item item_at(const PagedAttentionParams& p, int linear) {
  const int rest = linear / p.num_kv_heads;
  return item_of(p, linear % p.num_kv_heads, rest % p.num_work, rest / p.num_work);
}

// Q rows [first, first + count) of the item -> the swizzled Q tile (zeros for
// padding vectors), by `nthreads` threads (this one is `tid` of them).
template <typename T, int HD>
__device__ __forceinline__ void load_q(const PagedAttentionParams& p, const Item& it, uint32_t q_s, int first, int count,
                                       int tid, int nthreads) {
  constexpr int CH = HD / 8;
  const T* query = static_cast<const T*>(p.query);
  for (int i = tid; i < count * CH; i += nthreads) {
    const int v = first + i / CH;
    const int c = i % CH;
    const bool valid = v < it.num_vectors;
    const T* src = query;
    if (valid) {
      src = query + static_cast<int64_t>(it.q_begin + it.t0 + v / it.group) * p.query_stride +
            static_cast<int64_t>(it.kv_head * it.group + v % it.group) * HD + c * 8;
    }
    wgmma::cp_async16(q_s + wgmma::swizzled<kRows>(v, c), src, valid);
  }
}

// Gathers key rows kbase .. kbase + kKeys - 1 of one kv head (K or V) through
// the row's block table into a swizzled tile, by `nthreads` threads. NOTE:
// HD / 8 consecutive threads copy one key row (whole 128-byte lines per warp
// instruction); keys at or past s_hi are zero-filled, never read, so their V
// rows add 0 * 0 to O.
template <typename T, int HD>
struct KvGather {
  const T* key_base;    // the kv head's first element in block 0, slot 0
  const T* value_base;
  const int32_t* table;
  int64_t block_elems;  // elements per block (all kv heads)
  int slot_elems;       // elements per token (all kv heads)
  int bs, bs_shift;     // block size; log2 of it, or -1

  __device__ __forceinline__ KvGather(const PagedAttentionParams& p, const Item& it) {
    key_base = static_cast<const T*>(p.key_cache) + it.kv_head * HD;
    value_base = static_cast<const T*>(p.value_cache) + it.kv_head * HD;
    table = p.block_tables + static_cast<int64_t>(it.row) * p.block_tables_stride;
    bs = p.block_size;
    bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
    slot_elems = p.num_kv_heads * HD;
    block_elems = static_cast<int64_t>(bs) * slot_elems;
  }

  template <int NTHREADS, int UNROLL>
  __device__ __forceinline__ void load(uint32_t dst, const T* base, int kbase, int s_hi, int tid) const {
    constexpr int CH = HD / 8;
    constexpr int PASS_ROWS = NTHREADS / CH;
    static_assert(NTHREADS % CH == 0 && kKeys % PASS_ROWS == 0, "copy shape");
    const int chunk = tid % CH;
#pragma unroll UNROLL
    for (int pass = 0; pass < kKeys / PASS_ROWS; ++pass) {
      const int j = pass * PASS_ROWS + tid / CH;
      const int key = kbase + j;
      const bool valid = key < s_hi;
      const T* src = base;
      if (valid) {
        const int b = bs_shift >= 0 ? key >> bs_shift : key / bs;
        src = base + static_cast<int64_t>(table[b]) * block_elems + static_cast<int64_t>(key - b * bs) * slot_elems +
              chunk * 8;
      }
      wgmma::cp_async16(dst + wgmma::swizzled<kKeys>(j, chunk), src, valid);
    }
  }

  // Rows `row` of a tile (keys kbase + row) for row in [0, lo) and [hi, kKeys):
  // keys in [s_lo, s_hi) copied, others zero-filled; by `nthreads` threads.
  // PAIRS: into the paired layout (wgmma::swizzled_paired, head dim 128).
  template <bool PAIRS = false>
  __device__ __forceinline__ void load_edge_rows(uint32_t dst, const T* base, int kbase, int lo, int hi, int s_lo,
                                                 int s_hi, int tid, int nthreads) const {
    constexpr int CH = HD / 8;
    const int count = (lo + kKeys - hi) * CH;
#pragma unroll 1
    for (int i = tid; i < count; i += nthreads) {
      const int e = i / CH;
      const int chunk = i % CH;
      const int row = e < lo ? e : hi + (e - lo);
      const int key = kbase + row;
      const bool valid = key >= s_lo && key < s_hi;
      const T* src = base;
      if (valid) {
        const int b = key >> bs_shift;
        src = base + static_cast<int64_t>(table[b]) * block_elems + static_cast<int64_t>(key - b * bs) * slot_elems +
              chunk * 8;
      }
      wgmma::cp_async16(dst + (PAIRS ? wgmma::swizzled_paired(row, chunk) : wgmma::swizzled<kKeys>(row, chunk)), src,
                        valid);
    }
  }
};

// One warpgroup thread's share of the online softmax: its two accumulator
// rows (vectors vr[r] = 64 * warpgroup + 16 * warp + lane / 4 + 8 r), the
// keys each sees, the running max (log2 units) and its share of the sum.
struct RowState {
  int vr[2];
  bool valid[2];
  int key_from[2], key_to[2];  // keys row r sees: [key_from, key_to] (empty for padding rows)
  float m[2], l[2];

  __device__ __forceinline__ RowState(const PagedAttentionParams& p, const Item& it, int wg, int warp, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      vr[r] = 64 * wg + 16 * warp + lane / 4 + 8 * r;
      valid[r] = vr[r] < it.num_vectors;
      const int pos = it.first_pos + vr[r] / it.group;
      key_from[r] = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
      key_to[r] = valid[r] ? min(pos, it.s_hi - 1) : -1;
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
  }
};

struct ScoreScale {
  float score_log2;    // scale * log2(e)
  float softcap_log2;  // softcap * log2(e)
  float cap_scale;     // scale / softcap
  __device__ __forceinline__ explicit ScoreScale(const PagedAttentionParams& p) {
    score_log2 = p.scale * kLog2e;
    softcap_log2 = p.softcap * kLog2e;
    cap_scale = p.softcap > 0.f ? p.scale / p.softcap : 0.f;
  }
};

// S (s[4n + 2r + c]: row r, key kbase + 8n + 2qd + c) -> P as the A fragments
// of O += P V (pn), updating the running max and sum; corr[r] is the factor O's
// row r must be scaled by (grow: some factor is not 1).
template <typename T, bool SOFTCAP>
__device__ __forceinline__ void softmax_tile(float (&s)[kKeys / 2], uint32_t (&pn)[kKeys / 16][4], RowState& rs,
                                             const ScoreScale& sc, int kbase, int qd, float (&corr)[2], bool& grow) {
  constexpr int SN = kKeys / 2;
  const bool whole = rs.valid[0] && rs.valid[1] && kbase + kKeys - 1 <= rs.key_to[0] && kbase >= rs.key_from[1];
  // NOTE: without softcap the scores stay unscaled until the exponent, where
  // one FFMA applies scale * log2(e) and subtracts the max (scale > 0, so the
  // max of the raw scores is the max of the scaled ones).
  float mult = sc.score_log2;
  if constexpr (SOFTCAP) {
#pragma unroll
    for (int i = 0; i < SN; ++i) s[i] = sc.softcap_log2 * tanhf(s[i] * sc.cap_scale);
    mult = 1.f;
  }
  if (!whole) {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = kbase + 8 * n + 2 * qd + c;
          const bool seen = key >= rs.key_from[r] && key <= rs.key_to[r];
          s[4 * n + 2 * r + c] = seen ? s[4 * n + 2 * r + c] : -INFINITY;
        }
      }
    }
  }
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) tile_max[r] = fmaxf(tile_max[r], fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) tile_max[r] *= mult;  // log2 units (-inf stays -inf)
  // NOTE: the running max moves only when a row's max grew by more than
  // kSlack (log2 units) — exponentials stay <= 2^kSlack — so most tiles skip
  // rescaling O.
  constexpr float kSlack = 8.f;
  grow = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    corr[r] = 1.f;
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    if (tile_max[r] > rs.m[r] + kSlack) {
      corr[r] = fast_exp2(rs.m[r] - tile_max[r]);  // m = -inf: 0 (O and l are still 0)
      rs.m[r] = tile_max[r];
      rs.l[r] *= corr[r];
      grow = true;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float base = rs.m[r] == -INFINITY ? 0.f : rs.m[r];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
      const float e0 = fast_exp2(fmaf(s[4 * n + 2 * r], mult, -base));
      const float e1 = fast_exp2(fmaf(s[4 * n + 2 * r + 1], mult, -base));
      rs.l[r] += e0 + e1;
      // A fragment of k step n / 2: registers 0/1 (rows g / g+8) hold keys
      // 2qd, 2qd+1 of its first 8, registers 2/3 the same of its second 8.
      pn[n / 2][2 * (n % 2) + r] = pack2<T>(e0, e1);
    }
  }
}

template <int ON>
__device__ __forceinline__ void rescale(float (&o)[ON], const float (&corr)[2]) {
#pragma unroll
  for (int n = 0; n < ON / 4; ++n) {
    o[4 * n] *= corr[0];
    o[4 * n + 1] *= corr[0];
    o[4 * n + 2] *= corr[1];
    o[4 * n + 3] *= corr[1];
  }
}

// Issues S = Q K^T for one warpgroup (q_wg: its 64 rows of the Q tile; kt: the K tile,
// PAIRS: in the paired layout, 8-key atoms 2048 bytes apart, the second 64-dim panel's
// 1024 bytes after the first's).
template <typename T, int HD, bool PAIRS = false>
__device__ __forceinline__ void issue_s(float (&s)[kKeys / 2], uint32_t q_wg, uint32_t kt) {
#pragma unroll
  for (int k = 0; k < HD / 16; ++k) {
    const uint32_t qa = q_wg + (k / 4) * (kRows * 128) + (k % 4) * 32;
    const uint32_t kb = kt + (k / 4) * (PAIRS ? 1024 : kKeys * 128) + (k % 4) * 32;
    wgmma::mma_ss_n128<T>(s, wgmma::desc(qa, 16, 1024), wgmma::desc(kb, 16, PAIRS ? 2048 : 1024), k > 0);
  }
}

// Issues O += P V (vt: the V tile, N-major: 8-key groups 1024 bytes apart,
// 64-dim panels kKeys * 128 bytes apart; PAIRS: the paired layout, 8-key groups
// 2048 bytes apart, panels 1024).
template <typename T, int HD, bool PAIRS = false>
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const uint32_t (&pa)[kKeys / 16][4], uint32_t vt) {
  constexpr uint32_t kGroup = PAIRS ? 2048 : 1024;
  constexpr uint32_t kPanel = PAIRS ? 1024 : kKeys * 128;
#pragma unroll
  for (int k = 0; k < kKeys / 16; ++k) wgmma::mma_rs<T, HD>(o, pa[k], wgmma::desc(vt + k * 2 * kGroup, kPanel, kGroup));
}

// o[4n + 2r + c] (row r, head dim 8n + 2qd + c) * out_scale / l -> out, or the
// split's partial output and (max, sum). out_scale: an fp8 cache's v_scale.
template <typename T, int HD>
__device__ __forceinline__ void store_rows(const PagedAttentionParams& p, const Item& it, const float (&o)[HD / 2],
                                           RowState& rs, int qd, float out_scale = 1.f) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
    rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!rs.valid[r]) continue;
    const float inv = rs.l[r] > 0.f ? out_scale / rs.l[r] : 0.f;
    const int v = rs.vr[r];
    if (it.splits == 1) {
      const int64_t tok = it.q_begin + it.t0 + v / it.group;
      const int head = it.kv_head * it.group + v % it.group;
      T* dst = static_cast<T*>(p.out) + (tok * p.num_heads + head) * HD + 2 * qd;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        *reinterpret_cast<uint32_t*>(dst + 8 * n) = pack2<T>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
    } else {
      const int64_t slot =
          ((static_cast<int64_t>(it.work) * p.num_kv_heads + it.kv_head) * it.splits + it.split) *
              kAttentionPartialVectors + v;
      float* dst = p.partial_out + slot * HD + 2 * qd;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
      if (qd == 0) {
        p.partial_lse[2 * slot] = rs.m[r] == -INFINITY ? -FLT_MAX : rs.m[r] * kLn2;
        p.partial_lse[2 * slot + 1] = rs.l[r];
      }
    }
  }
}

}  // namespace pagedcore::cuda::wgmma_attention
