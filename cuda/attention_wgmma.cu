// Prefill attention on Hopper tensor cores (sm_90a): wgmma from shared memory.
//
// One CTA (two warpgroups, 256 threads) takes a (work item, kv head, key
// split) of the plan, like the mma.sync kernel: a tile of up to 128 query
// vectors (query tokens x the query heads of one kv head, GQA), warpgroup g
// owning vectors 64g..64g+63. Q is copied once into shared memory; keys stream
// through in tiles of 128, gathered row by row through the block table with
// cp.async into the 128-byte swizzled layout wgmma reads (wgmma_ops.cuh).
// Per key tile t each warpgroup
//   issues S_t = Q K_t^T        (wgmma m64n128k16, A and B from shared memory),
//   issues O += P_{t-1} V_{t-1} (wgmma m64nHDk16, P from registers),
//   waits for S_t, masks it (diagonal tiles, window, tile end) and runs the
//   online softmax while the P V product is still in the tensor cores,
//   waits for P V, rescales O if the running max moved.
// Two variants: PAGEDCORE_PREFILL_KERNEL=wgmma, where all threads' cp.async
// copies bring K_{t+2} and V_{t+1} (three buffers each) and a __syncthreads
// closes each tile; =wgmma-ws, where a third warpgroup copies and mbarriers
// hand buffers between it and the two computing warpgroups (no softcap).
// Scores, softmax and O are float32; P is rounded to the query type.
#include "attention_wgmma.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_merge.cuh"
#include "attention_mma.h"
#include "pagedcore/cuda/kernels.h"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda {

namespace {

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

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

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

// Issues S = Q K^T for one warpgroup (q_wg: its 64 rows of the Q tile; kt: the K tile).
template <typename T, int HD>
__device__ __forceinline__ void issue_s(float (&s)[kKeys / 2], uint32_t q_wg, uint32_t kt) {
#pragma unroll
  for (int k = 0; k < HD / 16; ++k) {
    const uint32_t qa = q_wg + (k / 4) * (kRows * 128) + (k % 4) * 32;
    const uint32_t kb = kt + (k / 4) * (kKeys * 128) + (k % 4) * 32;
    wgmma::mma_ss_n128<T>(s, wgmma::desc(qa, 16, 1024), wgmma::desc(kb, 16, 1024), k > 0);
  }
}

// Issues O += P V (vt: the V tile, N-major: 8-key groups 1024 bytes apart,
// 64-dim panels kKeys * 128 bytes apart).
template <typename T, int HD>
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const uint32_t (&pa)[kKeys / 16][4], uint32_t vt) {
#pragma unroll
  for (int k = 0; k < kKeys / 16; ++k) wgmma::mma_rs<T, HD>(o, pa[k], wgmma::desc(vt + k * 2048, kKeys * 128, 1024));
}

// o[4n + 2r + c] (row r, head dim 8n + 2qd + c) / l -> out, or the split's
// partial output and (max, sum).
template <typename T, int HD>
__device__ __forceinline__ void store_rows(const PagedAttentionParams& p, const Item& it, const float (&o)[HD / 2],
                                           RowState& rs, int qd) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
    rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!rs.valid[r]) continue;
    const float inv = rs.l[r] > 0.f ? 1.f / rs.l[r] : 0.f;
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

// ---- the kernel without warp specialization (PAGEDCORE_PREFILL_KERNEL=wgmma) ----
//
// All 256 threads copy; a __syncthreads closes each key tile.
// SOFTCAP: p.softcap > 0 (its tanh costs registers the common case should not pay).
template <typename T, int HD, bool SOFTCAP>
__global__ void __launch_bounds__(kThreads, 1) wgmma_prefill_kernel(const __grid_constant__ PagedAttentionParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int ON = HD / 2;          // output registers per thread
  constexpr int PK = kKeys / 16;      // k steps of O += P V
  constexpr int TB = tile_bytes<HD>(kKeys);
  static_assert(HD == 64 || HD == 128, "head dim");
  static_assert(kStages == 3, "the buffer rotation below");

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = wgmma::smem_addr(smem_raw);
  const uint32_t q_s = (raw + 1023u) & ~1023u;  // swizzle atoms sit on 1024-byte boundaries
  const uint32_t k_s = q_s + tile_bytes<HD>(kRows);
  const uint32_t v_s = k_s + kStages * TB;

  const Item it = item_of(p);
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int lane = tid % 32;
  const int qd = lane % 4;
  RowState rs(p, it, wg, (tid / 32) % 4, lane);
  const ScoreScale sc(p);
  const KvGather<T, HD> kv(p, it);
  const int n_tiles = it.n_tiles;

  // Groups of copies: {Q, K_0}, {K_1, V_0}, then one per tile t: {K_{t+2}, V_{t+1}}
  // (empty past the end); a tile's copies are waited for one tile ahead.
  load_q<T, HD>(p, it, q_s, 0, kRows, tid, kThreads);
  if (n_tiles > 0) kv.template load<kThreads, 8>(k_s, kv.key_base, it.s_lo, it.s_hi, tid);
  wgmma::cp_async_commit();
  if (n_tiles > 1) kv.template load<kThreads, 8>(k_s + TB, kv.key_base, it.s_lo + kKeys, it.s_hi, tid);
  if (n_tiles > 0) kv.template load<kThreads, 8>(v_s, kv.value_base, it.s_lo, it.s_hi, tid);
  wgmma::cp_async_commit();
  wgmma::cp_async_wait<1>();
  wgmma::fence_proxy_async();
  __syncthreads();

  float o[ON];
#pragma unroll
  for (int i = 0; i < ON; ++i) o[i] = 0.f;
  uint32_t pa[PK][4];  // P of the previous tile: A fragments of O += P V
#pragma unroll
  for (int k = 0; k < PK; ++k) pa[k][0] = pa[k][1] = pa[k][2] = pa[k][3] = 0u;
  const uint32_t q_wg = q_s + wg * 64 * 128;  // this warpgroup's 64 rows (8 atoms of 8 rows)

#pragma unroll 1
  for (int t = 0; t < n_tiles; ++t) {
    const int kbase = it.s_lo + t * kKeys;
    // Buffers of K_t, V_t (stage t % 3) and of the previous tile.
    const int st = t % kStages;
    const int st_prev = st == 0 ? kStages - 1 : st - 1;
    const int st_next = st == kStages - 1 ? 0 : st + 1;
    // K_{t+2} and V_{t+1} into the buffers that S_{t-1} and P_{t-2} V_{t-2}
    // read (stage (t + 2) % 3 = (t - 1) % 3, (t + 1) % 3 = (t - 2) % 3), both
    // retired before the barrier that closed tile t-1.
    if (t + 2 < n_tiles) kv.template load<kThreads, 8>(k_s + st_prev * TB, kv.key_base, kbase + 2 * kKeys, it.s_hi, tid);
    if (t + 1 < n_tiles) kv.template load<kThreads, 8>(v_s + st_next * TB, kv.value_base, kbase + kKeys, it.s_hi, tid);
    wgmma::cp_async_commit();

    float s[kKeys / 2];
    __syncwarp();
    wgmma::pin(o);
    wgmma::pin(pa);
    wgmma::fence();
    issue_s<T, HD>(s, q_wg, k_s + st * TB);
    wgmma::commit();
    if (t > 0) {
      issue_pv<T, HD>(o, pa, v_s + st_prev * TB);
      wgmma::commit();
      wgmma::wait<1>();
    } else {
      wgmma::wait<0>();
    }
    wgmma::pin(s);

    uint32_t pn[PK][4];
    float corr[2];
    bool grow;
    softmax_tile<T, SOFTCAP>(s, pn, rs, sc, kbase, qd, corr, grow);

    wgmma::wait<0>();  // P_{t-1} V_{t-1} has landed in O
    wgmma::pin(o);
    wgmma::pin(pa);
    if (grow) rescale(o, corr);
#pragma unroll
    for (int k = 0; k < PK; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i) pa[k][i] = pn[k][i];
    }
    wgmma::cp_async_wait<1>();  // K_{t+1}, V_t (the group of tile t-1)
    wgmma::fence_proxy_async();
    __syncthreads();
  }
  if (n_tiles > 0) {
    __syncwarp();
    wgmma::pin(o);
    wgmma::pin(pa);
    wgmma::fence();
    issue_pv<T, HD>(o, pa, v_s + ((n_tiles - 1) % kStages) * TB);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o);
  }
  wgmma::cp_async_wait<0>();  // (empty groups by now; the merge reuses the buffers)
  store_rows<T, HD>(p, it, o, rs, qd);
  if (it.splits > 1 && p.split_counters != nullptr) {
    // The last split of this (item, kv head) to finish merges them all; its
    // scratch is the K/V buffers (every wgmma and copy has retired).
    __syncthreads();
    unsigned char* const scratch = smem_raw + (k_s - raw);
    merge::count_and_merge<T, HD, kThreads, false>(p, it.work, it.kv_head, reinterpret_cast<float*>(scratch));
  }
#endif
}

// ---- the warp-specialized kernel (PAGEDCORE_PREFILL_KERNEL=wgmma-ws) ----
//
// Warpgroup 0 copies (cp.async, 40 registers), warpgroups 1 and 2 compute
// (232 registers) — as FlashAttention-3 does for paged KV without TMA. K and V
// tiles have their own rings of kStages buffers, each buffer a "full" mbarrier
// (the 128 copying threads arrive when their copies land) and an "empty" one
// (each of the 8 computing warps arrives once its warpgroup's wgmma that read
// the buffer retired). The two computing warpgroups never wait for each other.
constexpr int kWsThreads = 384;
constexpr int kWsCopyRegs = 40;
constexpr int kWsMathRegs = 232;
constexpr int kWsJoinRegs = 168;  // everyone's share again (65536 / 384), for the split merge

template <typename T, int HD, bool PINGPONG>
__global__ void __launch_bounds__(kWsThreads, 1) wgmma_ws_prefill_kernel(const __grid_constant__ PagedAttentionParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int ON = HD / 2;
  constexpr int PK = kKeys / 16;
  constexpr int TB = tile_bytes<HD>(kKeys);
  static_assert(HD == 64 || HD == 128, "head dim");

  extern __shared__ unsigned char smem_raw[];
  // full K, full V, empty K, empty V: kStages each.
  __shared__ __align__(8) uint64_t bars[4 * kStages];
  const uint32_t raw = wgmma::smem_addr(smem_raw);
  const uint32_t q_s = (raw + 1023u) & ~1023u;
  const uint32_t k_s = q_s + tile_bytes<HD>(kRows);
  const uint32_t v_s = k_s + kStages * TB;
  const uint32_t bar0 = wgmma::smem_addr(bars);
  auto full_k = [&](int st) { return bar0 + 8 * st; };
  auto full_v = [&](int st) { return bar0 + 8 * (kStages + st); };
  auto empty_k = [&](int st) { return bar0 + 8 * (2 * kStages + st); };
  auto empty_v = [&](int st) { return bar0 + 8 * (3 * kStages + st); };

  const int tid = threadIdx.x;
  const int wg = tid / 128;  // 0: copies; 1, 2: compute
  const int total = p.num_kv_heads * p.num_work * p.num_splits;
  // NOTE: with key splits each CTA takes one item (the last split to finish
  // merges them, with a CTA barrier); without, CTAs are persistent and take
  // items blockIdx.x, + gridDim.x, ... while the buffers keep rotating, so the
  // next item's first tiles load during this one's last tiles and its output.
  const bool merge = p.num_splits > 1 && p.split_counters != nullptr;
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      wgmma::mbar_init(full_k(st), 128);
      wgmma::mbar_init(full_v(st), 128);
      wgmma::mbar_init(empty_k(st), 8);
      wgmma::mbar_init(empty_v(st), 8);
    }
    wgmma::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    wgmma::reg_dealloc<kWsCopyRegs>();
    // Tile g of this CTA (over all its items) uses stage g % kStages for the
    // (g / kStages)-th time: its full barrier completes phase g / kStages;
    // before the copy, the empty barrier must have completed the previous
    // use's phase.
    int g = 0;
#pragma unroll 1
    for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
      const Item it = item_at(p, linear);
      const KvGather<T, HD> kv(p, it);
#pragma unroll 1
      for (int t = 0; t < it.n_tiles; ++t, ++g) {
        const int st = g % kStages;
        const uint32_t use = g / kStages;
        const int kbase = it.s_lo + t * kKeys;
        if (use > 0) wgmma::mbar_wait(empty_k(st), (use - 1) & 1);
        kv.template load<128, 4>(k_s + st * TB, kv.key_base, kbase, it.s_hi, tid);
        wgmma::cp_async_arrive(full_k(st));
        if (use > 0) wgmma::mbar_wait(empty_v(st), (use - 1) & 1);
        kv.template load<128, 4>(v_s + st * TB, kv.value_base, kbase, it.s_hi, tid);
        wgmma::cp_async_arrive(full_v(st));
      }
    }
    wgmma::cp_async_wait<0>();
    if (merge) wgmma::reg_alloc<kWsJoinRegs>();
  } else {
    wgmma::reg_alloc<kWsMathRegs>();
    const int mwg = wg - 1;  // computing warpgroup: rows 64 mwg .. 64 mwg + 63
    // PINGPONG: the two warpgroups take turns issuing their wgmma (named
    // barriers 3 and 4, 256 threads: one warpgroup syncs on its own, the other
    // arrives), so one's softmax runs while the other's GEMMs do. Both issue the
    // same number of times; warpgroup 0 gives itself the first turn (which
    // leaves one unmatched arrival on barrier 3 at exit, as FlashAttention-3 does).
    if (PINGPONG && mwg == 0) wgmma::named_arrive(3, 256);
    const int mtid = tid - 128 * wg;
    const int lane = tid % 32;
    const int qd = lane % 4;
    const ScoreScale sc(p);
    const uint32_t q_wg = q_s + mwg * 64 * 128;
    int g = 0;  // the copier's tile counter, followed
    // This warpgroup's Q rows, copied by itself: the first item's now, each
    // next item's as soon as the last S = Q K^T of the current one retired
    // (hidden behind its last softmax, P V and output).
    auto prefetch_q = [&](int linear) {
      if (linear >= total) return;
      wgmma::named_sync(1 + mwg, 128);  // every warp's wgmma reading Q has retired
      load_q<T, HD>(p, item_at(p, linear), q_s, 64 * mwg, 64, mtid, 128);
      wgmma::cp_async_commit();
    };
    prefetch_q(blockIdx.x);
#pragma unroll 1
    for (int linear = blockIdx.x; linear < total; linear += gridDim.x) {
      const Item it = item_at(p, linear);
      RowState rs(p, it, mwg, (tid / 32) % 4, lane);
      wgmma::cp_async_wait<0>();
      wgmma::fence_proxy_async();
      wgmma::named_sync(1 + mwg, 128);

      float o[ON];
#pragma unroll
      for (int i = 0; i < ON; ++i) o[i] = 0.f;
      uint32_t pa[PK][4];
#pragma unroll
      for (int k = 0; k < PK; ++k) pa[k][0] = pa[k][1] = pa[k][2] = pa[k][3] = 0u;

#pragma unroll 1
      for (int t = 0; t < it.n_tiles; ++t, ++g) {
        const int kbase = it.s_lo + t * kKeys;
        const int st = g % kStages;
        const uint32_t use = g / kStages;
        const int pg = g - 1;  // the tile whose P V runs now (t > 0: same item)
        const int pst = (g + kStages - 1) % kStages;
        float s[kKeys / 2];
        wgmma::mbar_wait(full_k(st), use & 1);
        if (t > 0) wgmma::mbar_wait(full_v(pst), (pg / kStages) & 1);
        wgmma::fence_proxy_async();
        if constexpr (PINGPONG) wgmma::named_sync(3 + mwg, 256);  // this warpgroup's turn
        __syncwarp();
        wgmma::pin(o);
        wgmma::pin(pa);
        wgmma::fence();
        issue_s<T, HD>(s, q_wg, k_s + st * TB);
        wgmma::commit();
        if (t > 0) {
          issue_pv<T, HD>(o, pa, v_s + pst * TB);
          wgmma::commit();
        }
        if constexpr (PINGPONG) wgmma::named_arrive(3 + (1 - mwg), 256);  // the other's turn
        if (t > 0) {
          wgmma::wait<1>();
        } else {
          wgmma::wait<0>();
        }
        wgmma::pin(s);
        __syncwarp();
        if (lane == 0) wgmma::mbar_arrive(empty_k(st));  // S retired: the K buffer is free
        if (t == it.n_tiles - 1) prefetch_q(linear + gridDim.x);

        uint32_t pn[PK][4];
        float corr[2];
        bool grow;
        softmax_tile<T, false>(s, pn, rs, sc, kbase, qd, corr, grow);

        wgmma::wait<0>();
        wgmma::pin(o);
        wgmma::pin(pa);
        if (t > 0) {
          __syncwarp();
          if (lane == 0) wgmma::mbar_arrive(empty_v(pst));  // P V retired: the V buffer is free
        }
        if (grow) rescale(o, corr);
#pragma unroll
        for (int k = 0; k < PK; ++k) {
#pragma unroll
          for (int i = 0; i < 4; ++i) pa[k][i] = pn[k][i];
        }
      }
      if (it.n_tiles > 0) {
        const int pg = g - 1;
        const int pst = pg % kStages;
        wgmma::mbar_wait(full_v(pst), (pg / kStages) & 1);
        wgmma::fence_proxy_async();
        if constexpr (PINGPONG) wgmma::named_sync(3 + mwg, 256);
        __syncwarp();
        wgmma::pin(o);
        wgmma::pin(pa);
        wgmma::fence();
        issue_pv<T, HD>(o, pa, v_s + pst * TB);
        wgmma::commit();
        if constexpr (PINGPONG) wgmma::named_arrive(3 + (1 - mwg), 256);
        wgmma::wait<0>();
        wgmma::pin(o);
        __syncwarp();
        if (lane == 0) wgmma::mbar_arrive(empty_v(pst));
      } else {
        prefetch_q(linear + gridDim.x);
      }
      store_rows<T, HD>(p, it, o, rs, qd);
    }
    if (merge) wgmma::reg_dealloc<kWsJoinRegs>();
  }
  if (merge) {
    // NOTE: both branches left their register counts at kWsJoinRegs: the merge
    // below is one piece of code for all 384 threads. One item per CTA here.
    __syncthreads();  // every copy and wgmma has retired: the buffers are scratch
    const Item it = item_at(p, blockIdx.x);
    unsigned char* const scratch = smem_raw + (k_s - raw);
    merge::count_and_merge<T, HD, kWsThreads, false>(p, it.work, it.kv_head, reinterpret_cast<float*>(scratch));
  }
#endif
}

int current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return dev;
}

// Multiprocessors of the current device, asked once per device.
int sm_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  const int dev = current_device();
  if (dev < 0 || dev >= kMaxDevices) return 132;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 132;
    }
    cached[dev] = n;
  }
  return cached[dev];
}


// ---- self-test of the building blocks (diagnostics) ----
//
// One warpgroup, one tile: Q (64 x HD), K and V (128 x HD) of exactly
// representable values (multiples of 1/8 in [-1, 1)) stored element by element
// at their swizzled places; S = Q K^T by issue_s, then P = S / 4 rounded to T,
// O = P V by issue_pv, each against float arithmetic on the same values.
// errors[0] = max |S - ref|, errors[1] = max |O - ref| (atomicMax on the bits of
// non-negative floats; -2 if the kernel never ran); NaN shows as a huge value.
__device__ __forceinline__ float selftest_value(int which, int r, int c) {
  const uint32_t h = (static_cast<uint32_t>(which) * 7919u + static_cast<uint32_t>(r) * 131u +
                      static_cast<uint32_t>(c) * 31u + 17u) * 2654435761u;
  return static_cast<float>(static_cast<int>(h >> 28) - 8) / 8.f;
}

__device__ __forceinline__ void selftest_record(float* error, float e) {
  if (!(e <= 3.0e38f)) e = 3.0e38f;  // NaN or inf
  atomicMax(reinterpret_cast<int*>(error), __float_as_int(e));
}

template <typename T, int HD>
__global__ void __launch_bounds__(128, 1) wgmma_selftest_kernel(float* errors) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = wgmma::smem_addr(smem_raw);
  const uint32_t q_s = (raw + 1023u) & ~1023u;
  const uint32_t k_s = q_s + tile_bytes<HD>(kRows);
  const uint32_t v_s = k_s + tile_bytes<HD>(kKeys);
  float* p_ref = reinterpret_cast<float*>(smem_raw + (v_s + tile_bytes<HD>(kKeys) - raw));  // [64][kKeys]
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int qd = lane % 4;
  auto put = [&](uint32_t tile, int rows, int r, int c, float x) {
    const uint32_t off = rows == kRows ? wgmma::swizzled<kRows>(r, c / 8) : wgmma::swizzled<kKeys>(r, c / 8);
    reinterpret_cast<T*>(smem_raw + (tile + off - raw))[c % 8] = static_cast<T>(x);
  };
  for (int i = tid; i < kRows * HD; i += 128) put(q_s, kRows, i / HD, i % HD, selftest_value(0, i / HD, i % HD));
  for (int i = tid; i < kKeys * HD; i += 128) {
    put(k_s, kKeys, i / HD, i % HD, selftest_value(1, i / HD, i % HD));
    put(v_s, kKeys, i / HD, i % HD, selftest_value(2, i / HD, i % HD));
  }
  wgmma::fence_proxy_async();
  __syncthreads();

  float s[kKeys / 2];
  wgmma::fence();
  issue_s<T, HD>(s, q_s, k_s);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::pin(s);
  float err_s = 0.f;
  uint32_t pa[kKeys / 16][4];
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * warp + lane / 4 + 8 * r;
      float pr[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = 8 * n + 2 * qd + c;
        float ref = 0.f;
        for (int d = 0; d < HD; ++d) ref += selftest_value(0, row, d) * selftest_value(1, key, d);
        const float x = s[4 * n + 2 * r + c];
        err_s = fmaxf(err_s, fabsf(x - ref));
        pr[c] = static_cast<float>(static_cast<T>(x * 0.25f));
        p_ref[row * kKeys + key] = pr[c];
      }
      pa[n / 2][2 * (n % 2) + r] = pack2<T>(pr[0], pr[1]);
    }
  }
  selftest_record(errors, err_s);
  __syncthreads();

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  wgmma::pin(o);
  wgmma::pin(pa);
  wgmma::fence();
  issue_pv<T, HD>(o, pa, v_s);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::pin(o);
  float err_o = 0.f;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int row = 16 * warp + lane / 4 + 8 * r;
        const int d = 8 * n + 2 * qd + c;
        float ref = 0.f;
        for (int key = 0; key < kKeys; ++key) ref += p_ref[row * kKeys + key] * selftest_value(2, key, d);
        err_o = fmaxf(err_o, fabsf(o[4 * n + 2 * r + c] - ref));
      }
    }
  }
  selftest_record(errors + 1, err_o);
#endif
}

template <typename T, int HD>
int run_selftest(float* out) {
  constexpr size_t smem = 1024 + tile_bytes<HD>(kRows) + 2 * tile_bytes<HD>(kKeys) + 64 * kKeys * 4;
  float* errors = nullptr;
  // NOTE: -2 until the kernel records (the atomicMax of any error >= 0 wins):
  // a kernel compiled empty leaves it there.
  const float start[2] = {-2.f, -2.f};
  cudaError_t e = cudaMalloc(&errors, 2 * sizeof(float));
  if (e == cudaSuccess) e = cudaMemcpy(errors, start, 2 * sizeof(float), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    e = cudaFuncSetAttribute(wgmma_selftest_kernel<T, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  }
  if (e == cudaSuccess) {
    wgmma_selftest_kernel<T, HD><<<1, 128, smem>>>(errors);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(out, errors, 2 * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(errors);
  return e;
}

// Launches `kernel` (threads per CTA: `threads`) over work items x kv heads x
// key splits — `persistent`: one CTA per multiprocessor, each walking the
// items of that grid in launch order, blockIdx.x + k gridDim.x (without key
// splits only); merges the splits with the merge kernel when there are no
// counters.
template <int HD>
int launch(void (*kernel)(PagedAttentionParams), bool& configured, int threads, const PagedAttentionParams& p,
           cudaStream_t stream, bool persistent = false) {
  constexpr size_t smem = smem_bytes<HD>();
  static_assert(smem - 1024 - tile_bytes<HD>(kRows) >= merge::kScratchFloats * 4, "split merge space");
  if (!configured) {  // NOTE: per kernel; raising the limit is idempotent
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    configured = true;
  }
  if (p.num_work > 65535) return cudaErrorInvalidConfiguration;
  if (persistent) {
    const int64_t total = static_cast<int64_t>(p.num_kv_heads) * p.num_work * p.num_splits;
    const int grid = static_cast<int>(p.num_splits > 1 ? total : std::min<int64_t>(total, sm_count()));
    kernel<<<grid, threads, smem, stream>>>(p);
  } else {
    kernel<<<dim3(p.num_kv_heads, p.num_work, p.num_splits), threads, smem, stream>>>(p);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || p.num_splits == 1 || p.split_counters != nullptr) return e;
  return merge_attention_splits(p, false, stream);
}

template <typename T, int HD>
int launch_head_dim(const PagedAttentionParams& p, int choice, cudaStream_t stream) {
  // NOTE: the warp-specialized kernel's computing warpgroups have 232
  // registers; softcap's tanh needs more, so softcap stays on the plain one.
  if (choice == 2 && p.softcap == 0.f) {
    static bool configured = false;
    return launch<HD>(wgmma_ws_prefill_kernel<T, HD, false>, configured, kWsThreads, p, stream, true);
  }
  if (choice == 3 && p.softcap == 0.f) {
    static bool configured = false;
    return launch<HD>(wgmma_ws_prefill_kernel<T, HD, true>, configured, kWsThreads, p, stream, true);
  }
  if (p.softcap > 0.f) {
    static bool configured = false;
    return launch<HD>(wgmma_prefill_kernel<T, HD, true>, configured, kThreads, p, stream);
  }
  static bool configured = false;
  return launch<HD>(wgmma_prefill_kernel<T, HD, false>, configured, kThreads, p, stream);
}

template <typename T>
int dispatch_head_dim(const PagedAttentionParams& p, int choice, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_head_dim<T, 64>(p, choice, stream);
    case 128: return launch_head_dim<T, 128>(p, choice, stream);
    default: return cudaErrorInvalidValue;
  }
}

// PAGEDCORE_PREFILL_KERNEL: 1 = "wgmma", 2 = "wgmma-ws", 3 = "wgmma-pp" (wgmma-ws
// with the warpgroups taking turns at the tensor cores), 0 = anything else.
// Unset (or empty): kDefaultChoice — 0 (mma.sync) until the wgmma kernels have
// been measured on the H200; then the fastest correct variant.
constexpr int kDefaultChoice = 0;
int kernel_choice() {
  // NOTE: read on every call (a getenv per layer is noise) so that a process
  // can switch kernels, as the tests and benchmarks do.
  const char* choice = std::getenv("PAGEDCORE_PREFILL_KERNEL");
  if (choice == nullptr || choice[0] == '\0') return kDefaultChoice;
  if (std::strcmp(choice, "wgmma") == 0) return 1;
  if (std::strcmp(choice, "wgmma-ws") == 0) return 2;
  if (std::strcmp(choice, "wgmma-pp") == 0) return 3;
  return 0;  // "mma", or anything else
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Compute capability 9.0 (what sm_90a code runs on), per device, asked once.
bool device_is_sm90() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return false;
  }
  if (cached[dev] == 0) {
    int major = 0, minor = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    if (!ok) cudaGetLastError();
    cached[dev] = ok && major == 9 && minor == 0 ? 1 : 2;
  }
  return cached[dev] == 1;
}

}  // namespace

bool wgmma_prefill_available() { return device_is_sm90(); }

int wgmma_selftest(float* errors) {
  for (int i = 0; i < 8; ++i) errors[i] = -1.f;
  if (!device_is_sm90()) return cudaSuccess;
  int e = run_selftest<__nv_bfloat16, 64>(errors);
  if (e == cudaSuccess) e = run_selftest<__nv_bfloat16, 128>(errors + 2);
  if (e == cudaSuccess) e = run_selftest<__half, 64>(errors + 4);
  if (e == cudaSuccess) e = run_selftest<__half, 128>(errors + 6);
  return e;
}

bool wgmma_prefill_serves(const PagedAttentionParams& p) {
  if (kernel_choice() == 0) return false;
  if (!(p.scale > 0.f)) return false;  // the softmax takes the max of unscaled scores
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (p.kv_dtype != p.dtype || (p.head_dim != 64 && p.head_dim != 128)) return false;
  if (p.tile_tokens * (p.num_heads / p.num_kv_heads) > kRows) return false;
  if (!aligned16(p.query) || !aligned16(p.key_cache) || !aligned16(p.value_cache) || !aligned16(p.out) ||
      p.query_stride % 8 != 0) {
    return false;
  }
  return device_is_sm90();
}

int paged_attention_wgmma(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_work == 0) return cudaSuccess;
  const int choice = kernel_choice();
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, choice, stream);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, choice, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore::cuda
