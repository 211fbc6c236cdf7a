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
// Kernels (PAGEDCORE_PREFILL_KERNEL): =wgmma, where all threads' cp.async
// copies bring K_{t+2} and V_{t+1} (three buffers each) and a __syncthreads
// closes each tile (also what serves softcap); =wgmma-tma (the default at head
// dim 128 above block size 32), where a third warpgroup copies K and V by TMA,
// one copy per cache block and 64-dim half (attention_wgmma_tma.cuh), mbarriers
// hand the buffers between it and the two computing warpgroups, and CTAs are
// persistent; =wgmma-tma-pairs (the default at head dim 128 up to block size
// 32), one copy per block for both halves; =wgmma-tma-fp8 (the default over fp8 caches at
// head dim 128), the TMA
// kernel over an fp8 e4m3 cache: bytes by TMA, widened to fp16 in shared
// memory by the copying warpgroup (attention_wgmma_fp8.cuh).
// Scores, softmax and O are float32; P is rounded to the query type (fp8
// caches: to fp16, as Q).
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
#include "attention_wgmma_fp8.cuh"
#include "attention_wgmma_parts.cuh"
#include "attention_wgmma_tma.cuh"
#include "pagedcore/cuda/kernels.h"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda {

namespace {

using namespace wgmma_attention;  // NOLINT: the kernels are made of these parts

// ---- the kernel without warp specialization (PAGEDCORE_PREFILL_KERNEL=wgmma) ----
//
// All 256 threads copy; a __syncthreads closes each key tile.
// The reference for the faster wgmma-tma, and what serves softcap and block
// sizes that are not powers of two in 8..128.
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

  if (p.work_seq[blockIdx.y] < 0) return;  // a padded plan's spare item
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
    if (t + 2 < n_tiles) {
      kv.template load<kThreads, 8>(k_s + st_prev * TB, kv.key_base, kbase + 2 * kKeys, it.s_hi, tid);
    }
    if (t + 1 < n_tiles) {
      kv.template load<kThreads, 8>(v_s + st_next * TB, kv.value_base, kbase + kKeys, it.s_hi, tid);
    }
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

// ---- the TMA kernel (PAGEDCORE_PREFILL_KERNEL=wgmma-tma, -pairs; the default at head dim 128) ----
//
// Warpgroup 0 copies (40 registers), warpgroups 1 and 2 compute (232
// registers), as FlashAttention-3 does. K and V tiles have their own rings of
// kStages buffers, each buffer a "full" mbarrier and an "empty" one (each of
// the 8 computing warps arrives once its warpgroup's wgmma that read the
// buffer retired). The copying warpgroup's first warp issues the TMA copies,
// lane j those of the tile's block j (tma_k_blocks / tma_v_blocks in
// attention_wgmma_tma.cuh), one per cache block and 64-dim half; key tiles
// start on a block boundary; the full K barrier counts lane 0's arrival plus
// the bytes, the full V barrier that and the 128 threads' cp.async arrivals
// (edge rows of V, zero-filled). The two computing warpgroups never wait for
// each other.
// MODE kPairs (=wgmma-tma-pairs, head dim 128; the default up to block size
// 32, where a K or V tile is 16 copies at block size 16 against 2 at 128):
// one copy per block for both 64-dim halves, K and V tiles in the paired
// layout (the halves' 8-row atoms side by side, wgmma::swizzled_paired; the
// wgmma descriptors' strides follow): 8 copies per K or V tile at block size
// 16, not 16.
// MODE kFp8 (=wgmma-tma-fp8, an fp8 e4m3 cache): warp 0 copies each
// tile's blocks of both byte caches by TMA into a staging slot (two slots,
// one mbarrier each, bytes counted), and the whole copying warpgroup widens
// the staged tile one step later (the next tile's copies in flight meanwhile)
// into fp16 K and V tiles (kFp8Stages each; full barriers count its 128
// threads' arrivals, each after its writes and a proxy fence), V rows outside
// the key range as zeros; a named barrier of the warpgroup frees the slot for
// the next copy. The computing warpgroups run as for 16-bit caches but in
// fp16 (Q rounded to it), k_scale in the score scale and v_scale in the
// output (attention_wgmma_fp8.cuh).
constexpr int kTmaThreads = 384;
constexpr int kPairs = 4;
constexpr int kFp8 = 8;

// How a persistent CTA walks the launch's items (the `walk` of persistent_item).
constexpr int kWalkPlain = 0;     // blockIdx.x, + gridDim.x, ...
constexpr int kWalkFromEnd = 1;   // snake order from the last item
constexpr int kWalkFromStart = 2; // snake order from the first item

// The r-th item (linear index of the launch's grid) of this persistent CTA, or
// -1 when it has no more: blockIdx.x + r * gridDim.x (kWalkPlain); in snake
// order, the items dealt out forwards in even rounds and backwards in odd ones,
// which evens out the CTAs' sums on ramps of lengths such as a causal
// prefill's, from the first item (kWalkFromStart) or the last (kWalkFromEnd).
// NOTE: the plan (planning._plan_lists) lists the tiles longest first, so
// kWalkFromStart takes the long items first and leaves the short ones for the
// tail. kWalkFromEnd, the walk since a218601, was written for a plan in
// ascending order and so takes the shortest first: a model of the walk (132
// CTAs, an item's cost its 128-key tiles + 1) puts the 8k causal prefill's
// busiest CTA 6.2% above the mean that way, 0.05% from the start (the default
// since 068f05e's measurement: prefill_walk()). One item per CTA
// (key splits merged in the kernel) must walk plainly: the merge finds its item
// by blockIdx.x.
__device__ __forceinline__ int persistent_item(int r, int total, int walk) {
  const int g = gridDim.x;
  if (walk == kWalkPlain) {
    const int linear = blockIdx.x + r * g;
    return linear < total ? linear : -1;
  }
  const int pos = r * g + ((r & 1) != 0 ? g - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x));
  if (pos >= total) return -1;
  return walk == kWalkFromStart ? pos : total - 1 - pos;
}

// persistent_item from the r-th on, past a padded plan's spare work items (a
// negative row in work_seq: no tiles, no output); r is left at the one returned.
// NOTE: the copying and the computing warpgroups walk the same items, so that
// their tile counts (the stages' phases) agree.
__device__ __forceinline__ int next_item(const PagedAttentionParams& p, int& r, int total, int walk) {
  int linear = persistent_item(r, total, walk);
  while (linear >= 0 && p.work_seq[linear / p.num_kv_heads % p.num_work] < 0) {
    linear = persistent_item(++r, total, walk);
  }
  return linear;
}
constexpr int kCopyRegs = 40;
constexpr int kMathRegs = 232;
constexpr int kJoinRegs = 168;  // everyone's share again (65536 / 384), for the split merge

template <typename T, int HD, int MODE>
__global__ void __launch_bounds__(kTmaThreads, 1)
    wgmma_tma_prefill_kernel(const __grid_constant__ PagedAttentionParams p,
                             const __grid_constant__ KvTensorMaps maps, int walk_from) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int ON = HD / 2;
  constexpr int PK = kKeys / 16;
  constexpr int TB = tile_bytes<HD>(kKeys);
  constexpr bool FP8 = (MODE & kFp8) != 0;
  constexpr bool PAIRS = (MODE & kPairs) != 0 && HD == 128 && !FP8;
  // The wgmma type: an fp8 cache is widened to fp16, as in the mma.sync kernel.
  using MT = std::conditional_t<FP8, __half, T>;
  constexpr int NST = FP8 ? kFp8Stages : kStages;  // K (and V) tiles in shared memory
  constexpr int F8B = fp8_tile_bytes<HD>();
  static_assert(HD == 64 || HD == 128, "head dim");

  extern __shared__ unsigned char smem_raw[];
  // full K, full V, empty K, empty V: NST each; FP8: a full barrier per staging slot.
  __shared__ __align__(8) uint64_t bars[4 * NST + (FP8 ? kFp8Slots : 0)];
  const uint32_t raw = wgmma::smem_addr(smem_raw);
  const uint32_t q_s = (raw + 1023u) & ~1023u;
  const uint32_t k_s = q_s + tile_bytes<HD>(kRows);
  const uint32_t v_s = k_s + NST * TB;
  const uint32_t staged_s = v_s + NST * TB;  // FP8: slot i's K bytes at + 2 i F8B, its V bytes F8B after
  const uint32_t bar0 = wgmma::smem_addr(bars);
  auto full_k = [&](int st) { return bar0 + 8 * st; };
  auto full_v = [&](int st) { return bar0 + 8 * (NST + st); };
  auto empty_k = [&](int st) { return bar0 + 8 * (2 * NST + st); };
  auto empty_v = [&](int st) { return bar0 + 8 * (3 * NST + st); };
  auto staged = [&](int slot) { return bar0 + 8 * (4 * NST + slot); };

  const int tid = threadIdx.x;
  const int wg = tid / 128;  // 0: copies; 1, 2: compute
  // NOTE: FP8: each branch below computes the item count again after its
  // setmaxnreg (one computed before was kept across it in local memory there).
  const int items = p.num_kv_heads * p.num_work * p.num_splits;
  auto items_total = [&] { return FP8 ? p.num_kv_heads * p.num_work * p.num_splits : items; };
  // NOTE: with key splits each CTA takes one item (the last split to finish
  // merges them, with a CTA barrier); without, CTAs are persistent and take
  // items blockIdx.x, + gridDim.x, ... while the buffers keep rotating, so the
  // next item's first tiles load during this one's last tiles and its output.
  // They walk the items in snake order (persistent_item; a static round-robin
  // left the 8k causal prefill's CTAs 6% apart in work), from the start or the
  // end as `walk_from` says (PAGEDCORE_PREFILL_WALK, prefill_walk()).
  const bool merge = p.num_splits > 1 && p.split_counters != nullptr;
  const int walk = merge ? kWalkPlain : walk_from;
  // (merging: this CTA's one item; a spare one has nothing to compute or merge)
  if (merge && p.work_seq[blockIdx.x / p.num_kv_heads % p.num_work] < 0) return;
  if (tid == 0) {
    for (int st = 0; st < NST; ++st) {
      wgmma::mbar_init(full_k(st), FP8 ? 128 : 1);
      wgmma::mbar_init(full_v(st), FP8 ? 128 : 1 + 128);
      wgmma::mbar_init(empty_k(st), 8);
      wgmma::mbar_init(empty_v(st), 8);
    }
    for (int slot = 0; slot < (FP8 ? kFp8Slots : 0); ++slot) wgmma::mbar_init(staged(slot), 1);
    wgmma::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    wgmma::reg_dealloc<kCopyRegs>();
    const int total = items_total();
    if (tid == 0) {
      wgmma::tma_prefetch_map(&maps.k);
      wgmma::tma_prefetch_map(&maps.v);
    }
    if constexpr (FP8) {
      // Step g copies tile g into staging slot g % kFp8Slots, then widens tile
      // g - 1 (`prev`) into fp16 stage (g - 1) % NST; the slot of tile g is
      // free since the barrier that closed step g - 1's widening (of tile g - 2).
      struct Pending {
        int g, kbase, s_lo, s_hi;
      };
      auto widen = [&](const Pending& w) {
        const int slot = w.g % kFp8Slots;
        const int st = w.g % NST;
        const uint32_t use = w.g / NST;
        const uint32_t k8 = staged_s + 2 * slot * F8B;
        wgmma::mbar_wait(staged(slot), (w.g / kFp8Slots) & 1);
        if (use > 0) wgmma::mbar_wait(empty_k(st), (use - 1) & 1);
        widen_fp8_tile<HD, false>(k8, k_s + st * TB, w.kbase, w.s_lo, w.s_hi, tid);
        wgmma::fence_proxy_async();
        wgmma::mbar_arrive(full_k(st));
        if (use > 0) wgmma::mbar_wait(empty_v(st), (use - 1) & 1);
        widen_fp8_tile<HD, true>(k8 + F8B, v_s + st * TB, w.kbase, w.s_lo, w.s_hi, tid);
        wgmma::fence_proxy_async();
        wgmma::mbar_arrive(full_v(st));
        wgmma::named_sync(3, 128);  // every thread's reads of the slot are done
      };
      Pending prev{-1, 0, 0, 0};
      int g = 0;
#pragma unroll 1
      for (int r = 0, linear = next_item(p, r, total, walk); linear >= 0;
           ++r, linear = next_item(p, r, total, walk)) {
        const Item it = item_at(p, linear);
        const KvGather<uint8_t, HD> kv(p, it);
        const TileSpan span = block_aligned_tiles(it, p.block_size);
#pragma unroll 1
        for (int t = 0; t < span.n; ++t, ++g) {
          const int kbase = span.k0 + t * kKeys;
          if (tid < 32) {
            const int slot = g % kFp8Slots;
            const int block = tile_block(kv, kbase, it.s_lo, it.s_hi, tid);
            tma_fp8_blocks<HD>(maps, it.kv_head, staged_s + 2 * slot * F8B, staged_s + (2 * slot + 1) * F8B,
                               staged(slot), block, p.block_size, tid);
          }
          if (prev.g >= 0) widen(prev);
          prev = Pending{g, kbase, it.s_lo, it.s_hi};
        }
      }
      if (prev.g >= 0) widen(prev);
    } else {
      // Tile g of this CTA (over all its items) uses stage g % kStages for the
      // (g / kStages)-th time: its full barrier completes phase g / kStages;
      // before the copy, the empty barrier must have completed the previous
      // use's phase.
      int g = 0;
#pragma unroll 1
      for (int r = 0, linear = next_item(p, r, total, walk); linear >= 0;
           ++r, linear = next_item(p, r, total, walk)) {
        const Item it = item_at(p, linear);
        const KvGather<T, HD> kv(p, it);
        const TileSpan span = block_aligned_tiles(it, p.block_size);
#pragma unroll 1
        for (int t = 0; t < span.n; ++t, ++g) {
          const int st = g % kStages;
          const uint32_t use = g / kStages;
          const int kbase = span.k0 + t * kKeys;
          // Warp 0's lanes look up the tile's blocks once, for K and V.
          if (use > 0) wgmma::mbar_wait(empty_k(st), (use - 1) & 1);
          const int block = tid < 32 ? tile_block(kv, kbase, it.s_lo, it.s_hi, tid) : -1;
          if (tid < 32) {
            tma_k_blocks<HD, PAIRS>(&maps.k, it.kv_head, k_s + st * TB, full_k(st), block, p.block_size, tid);
          }
          if (use > 0) wgmma::mbar_wait(empty_v(st), (use - 1) & 1);
          int lo, hi;
          full_block_rows(kbase, it.s_lo, it.s_hi, p.block_size, lo, hi);
          if (tid < 32) {
            tma_v_blocks<HD, PAIRS>(&maps.v, it.kv_head, v_s + st * TB, full_v(st), block, p.block_size, lo, hi, tid);
          }
          kv.template load_edge_rows<PAIRS>(v_s + st * TB, kv.value_base, kbase, lo, hi, it.s_lo, it.s_hi, tid, 128);
          wgmma::cp_async_arrive(full_v(st));
        }
      }
    }
    wgmma::cp_async_wait<0>();
    if (merge) wgmma::reg_alloc<kJoinRegs>();
  } else {
    wgmma::reg_alloc<kMathRegs>();
    const int total = items_total();
    const int mwg = wg - 1;  // computing warpgroup: rows 64 mwg .. 64 mwg + 63
    const int mtid = tid - 128 * wg;
    const int lane = tid % 32;
    const int qd = lane % 4;
    ScoreScale sc(p);
    if constexpr (FP8) sc.score_log2 *= p.k_scale;  // (no softcap here)
    const float out_scale = FP8 ? p.v_scale : 1.f;
    const uint32_t q_wg = q_s + mwg * 64 * 128;
    int g = 0;  // the copier's tile counter, followed
    // This warpgroup's Q rows, copied by itself: the first item's now, each
    // next item's as soon as the last S = Q K^T of the current one retired
    // (hidden behind its last softmax, P V and output).
    auto prefetch_q = [&](int linear) {
      if (linear < 0) return;
      wgmma::named_sync(1 + mwg, 128);  // every warp's wgmma reading Q has retired
      if constexpr (FP8) {
        load_q_half<T, HD>(p, item_at(p, linear), q_s, 64 * mwg, 64, mtid, 128);
      } else {
        load_q<T, HD>(p, item_at(p, linear), q_s, 64 * mwg, 64, mtid, 128);
      }
      wgmma::cp_async_commit();
    };
    // (the item after the r-th)
    auto following = [&](int r) { return next_item(p, ++r, total, walk); };
    prefetch_q(following(-1));
#pragma unroll 1
    for (int r = 0, linear = next_item(p, r, total, walk); linear >= 0;
         ++r, linear = next_item(p, r, total, walk)) {
      const Item it = item_at(p, linear);
      RowState rs(p, it, mwg, (tid / 32) % 4, lane);
      const TileSpan span = block_aligned_tiles(it, p.block_size);
      // Tiles start on a block boundary: keys before s_lo (another split's, or
      // outside the window) are masked like keys past s_hi.
      rs.key_from[0] = max(rs.key_from[0], it.s_lo);
      rs.key_from[1] = max(rs.key_from[1], it.s_lo);
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
      for (int t = 0; t < span.n; ++t, ++g) {
        const int kbase = span.k0 + t * kKeys;
        const int st = g % NST;
        const uint32_t use = g / NST;
        const int pg = g - 1;  // the tile whose P V runs now (t > 0: same item)
        const int pst = (g + NST - 1) % NST;
        float s[kKeys / 2];
        wgmma::mbar_wait(full_k(st), use & 1);
        if (t > 0) wgmma::mbar_wait(full_v(pst), (pg / NST) & 1);
        wgmma::fence_proxy_async();
        __syncwarp();
        wgmma::pin(o);
        wgmma::pin(pa);
        wgmma::fence();
        issue_s<MT, HD, PAIRS>(s, q_wg, k_s + st * TB);
        wgmma::commit();
        // NOTE: issue and wait in one branch each: ptxas serializes wgmma whose
        // accumulators are in flight across a join of branches.
        if (t > 0) {
          issue_pv<MT, HD, PAIRS>(o, pa, v_s + pst * TB);
          wgmma::commit();
          wgmma::wait<1>();
        } else {
          wgmma::wait<0>();
        }
        wgmma::pin(s);
        __syncwarp();
        if (lane == 0) wgmma::mbar_arrive(empty_k(st));  // S retired: the K buffer is free
        if (t == span.n - 1) prefetch_q(following(r));

        uint32_t pn[PK][4];
        float corr[2];
        bool grow;
        softmax_tile<MT, false>(s, pn, rs, sc, kbase, qd, corr, grow);

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
      if (span.n > 0) {
        const int pg = g - 1;
        const int pst = pg % NST;
        wgmma::mbar_wait(full_v(pst), (pg / NST) & 1);
        wgmma::fence_proxy_async();
        __syncwarp();
        wgmma::pin(o);
        wgmma::pin(pa);
        wgmma::fence();
        issue_pv<MT, HD, PAIRS>(o, pa, v_s + pst * TB);
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::pin(o);
        __syncwarp();
        if (lane == 0) wgmma::mbar_arrive(empty_v(pst));
      } else {
        prefetch_q(following(r));
      }
      store_rows<T, HD>(p, it, o, rs, qd, out_scale);
    }
    if (merge) wgmma::reg_dealloc<kJoinRegs>();
  }
  if (merge) {
    // NOTE: both branches left their register counts at kJoinRegs: the merge
    // below is one piece of code for all 384 threads. One item per CTA here.
    __syncthreads();  // every copy and wgmma has retired: the buffers are scratch
    const Item it = item_at(p, blockIdx.x);
    unsigned char* const scratch = smem_raw + (k_s - raw);
    merge::count_and_merge<T, HD, kTmaThreads, false>(p, it.work, it.kv_head, reinterpret_cast<float*>(scratch));
  }
#endif
}

// Launches `kernel` (threads per CTA: `threads`) over work items x kv heads x
// key splits — `persistent`: one CTA per multiprocessor, each walking the
// items of that grid in launch order, blockIdx.x + k gridDim.x (without key
// splits only); merges the splits with the merge kernel when there are no
// counters.
template <int HD, typename... Args>
int launch(void (*kernel)(PagedAttentionParams, Args...), bool& configured, int threads, const PagedAttentionParams& p,
           cudaStream_t stream, bool persistent, const Args&... args) {
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
    const int grid = static_cast<int>(p.num_splits > 1 ? total : std::min<int64_t>(total, multiprocessor_count()));
    kernel<<<grid, threads, smem, stream>>>(p, args...);
  } else {
    kernel<<<dim3(p.num_kv_heads, p.num_work, p.num_splits), threads, smem, stream>>>(p, args...);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || p.num_splits == 1 || p.split_counters != nullptr) return e;
  return merge_attention_splits(p, false, stream);
}

// kernel_choice(): 1 the plain kernel, kTmaChoice + MODE the TMA kernel.
constexpr int kTmaChoice = 2;
constexpr int kFp8Choice = kTmaChoice + kFp8;

// The persistent TMA kernel's walk (persistent_item). PAGEDCORE_PREFILL_WALK
// (read per launch; a measurement switch): "end" from the plan's last item (its
// shortest, the walk until 068f05e), anything else from its first (its longest).
// NOTE: measured on the H200 at 068f05e (bench/prefill_walk.py, us, end -> start):
// 8k causal bs16 1089 -> 1035, bs128 1089 -> 1037, its fp8 cache 1939 -> 1833,
// 2048 new over 6144 cached 470 -> 459, 16 x 512 over 1-4k cached 801 -> 800.
int prefill_walk() {
  const char* env = std::getenv("PAGEDCORE_PREFILL_WALK");
  return env != nullptr && std::strcmp(env, "end") == 0 ? kWalkFromEnd : kWalkFromStart;
}

template <typename T, int HD, int MODE>
int launch_tma(const PagedAttentionParams& p, cudaStream_t stream) {
  KvTensorMaps maps{};
  if (encode_kv_maps<T, HD, (MODE & kPairs) != 0 && HD == 128>(p, maps)) {
    static bool configured = false;
    return launch<HD>(wgmma_tma_prefill_kernel<T, HD, MODE>, configured, kTmaThreads, p, stream, true, maps,
                      prefill_walk());
  }
  static bool configured = false;
  return launch<HD>(wgmma_prefill_kernel<T, HD, false>, configured, kThreads, p, stream, false);
}

// An fp8 cache (kFp8Choice; wgmma_prefill_serves encoded its maps already, so
// this fails only where the driver changed its mind).
template <typename T, int HD>
int launch_tma_fp8(const PagedAttentionParams& p, cudaStream_t stream) {
  KvTensorMaps maps{};
  if (!encode_fp8_kv_maps<HD>(p, maps)) return cudaErrorNotSupported;
  static bool configured = false;
  return launch<HD>(wgmma_tma_prefill_kernel<T, HD, kFp8>, configured, kTmaThreads, p, stream, true, maps,
                    prefill_walk());
}

template <typename T, int HD>
int launch_head_dim(const PagedAttentionParams& p, int choice, cudaStream_t stream) {
  if (choice == kFp8Choice) return launch_tma_fp8<T, HD>(p, stream);
  // NOTE: the TMA kernel's computing warpgroups have 232 registers; softcap's
  // tanh needs more, so softcap stays on the plain one (as do block sizes the
  // TMA kernel does not serve: encode_kv_maps says no).
  if (p.softcap > 0.f) {
    static bool configured = false;
    return launch<HD>(wgmma_prefill_kernel<T, HD, true>, configured, kThreads, p, stream, false);
  }
  switch (choice - kTmaChoice) {
    case 0: return launch_tma<T, HD, 0>(p, stream);
    case kPairs: return launch_tma<T, HD, kPairs>(p, stream);
    default: break;
  }
  static bool configured = false;
  return launch<HD>(wgmma_prefill_kernel<T, HD, false>, configured, kThreads, p, stream, false);
}

template <typename T>
int dispatch_head_dim(const PagedAttentionParams& p, int choice, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_head_dim<T, 64>(p, choice, stream);
    case 128: return launch_head_dim<T, 128>(p, choice, stream);
    default: return cudaErrorInvalidValue;
  }
}

// PAGEDCORE_PREFILL_KERNEL: "wgmma" (1: the plain kernel), "wgmma-tma" (2: the
// TMA kernel), "wgmma-tma-pairs" (6: one copy per block for both 64-dim
// halves), "wgmma-tma-fp8" (10, kFp8Choice: the TMA kernel over an fp8 cache;
// over a 16-bit cache the same as auto), "mma" (0: the mma.sync kernel) or
// anything else unknown (0); unset, empty or "auto": the variant measured
// fastest for the head dim and block size (kAuto*), over an fp8 cache
// kFp8Choice at head dim 128 and mma.sync at 64 (not timed apart there).
// NOTE: measured on the H200 (bench/check_wgmma.py, at 83b8cea; every variant
// then built correct): 8k causal d128 bs16 mma 3117 us, wgmma 2190 (251
// TFLOP/s), wgmma-tma 1167 (471), FA2 varlen 1716; bs128 wgmma-tma 1002 (549);
// 2048 over 6144 cached 484 (FA2 745); 16 x 512 over 1-4k 836 (FA2 1189);
// SmolLM2 16 x 512 d64 wgmma-tma 45.5 against mma 46.2 (a tie). So wgmma-tma
// at head dim 128, mma.sync at 64. The variants deleted after that run (git
// log: wgmma-ws/-pp with a cp.async producer warpgroup, 2490 us; wgmma-late,
// 1841; wgmma-tma-plain/-async, the plain kernel copying by TMA, 1456/1483;
// wgmma-tma-pp, 1173; the "-rev" item orders: no gain) lost on every case.
// Then at 5afe504 (every variant correct over the test grid): 8k causal d128
// bs16 wgmma-tma 1158 us, -pairs 1030 (534 TFLOP/s), -ids 1185, -runs 1264
// (1084 when the blocks are consecutive), -ids-pairs 1096; bs128 wgmma-tma
// 1028, -pairs 1069; 2048 over 6144 cached (bs16) 493 against -pairs 429, 16 x
// 512 over 1-4k 844 against 780. So -pairs (one copy a block for both 64-dim
// halves) at block sizes up to 32 (32 not timed apart: it halves the copies as
// at 16), wgmma-tma above. -ids (block ids a tile ahead), -runs (a tile of
// consecutive blocks as one copy per half), -ids-runs, -ids-pairs were deleted.
// An fp8 e4m3 cache at 73b39de (bench/check_wgmma.py): 8k causal d128 bs16
// wgmma-tma-fp8 1904 us (289 TFLOP/s) against mma.sync 3384 (the bf16 cache's
// -pairs 1032); window 200 with splits 35.0 against 53.6; racecheck and memcheck
// clean over its test grid. So kFp8Choice at head dim 128.
constexpr int kAutoD128 = kTmaChoice;
constexpr int kAutoD128SmallBlocks = kTmaChoice + kPairs;
constexpr int kAutoD64 = 0;
int auto_choice(const PagedAttentionParams& p) {
  if (p.kv_dtype == DType::kFloat8E4M3) return p.head_dim == 128 ? kFp8Choice : 0;
  if (p.head_dim == 128) return p.block_size <= 32 ? kAutoD128SmallBlocks : kAutoD128;
  return p.head_dim == 64 ? kAutoD64 : 0;
}
int kernel_choice(const PagedAttentionParams& p) {
  // NOTE: read on every call (a getenv per layer is noise) so that a process
  // can switch kernels, as the tests and benchmarks do.
  const char* env = std::getenv("PAGEDCORE_PREFILL_KERNEL");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return auto_choice(p);
  if (std::strcmp(env, "wgmma-tma-fp8") == 0) return p.kv_dtype == DType::kFloat8E4M3 ? kFp8Choice : auto_choice(p);
  if (std::strcmp(env, "wgmma") == 0) return 1;
  if (std::strcmp(env, "wgmma-tma") == 0) return kTmaChoice;
  if (std::strcmp(env, "wgmma-tma-pairs") == 0) return kTmaChoice + kPairs;
  return 0;  // "mma", or anything else
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Compute capability 9.0 (what sm_90a code runs on).
bool device_is_sm90() { return compute_capability() == 90; }

}  // namespace

bool wgmma_prefill_available() { return device_is_sm90(); }

bool wgmma_prefill_serves(const PagedAttentionParams& p) {
  const int choice = kernel_choice(p);
  if (choice == 0) return false;
  if (!(p.scale > 0.f)) return false;  // the softmax takes the max of unscaled scores
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  // (fp8: the TMA kernel only, which has no softcap and no plain fallback; k_scale
  // joins the score scale, which must stay > 0)
  if (fp8 ? choice != kFp8Choice || p.softcap > 0.f || !(p.k_scale > 0.f) : p.kv_dtype != p.dtype) return false;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  if (p.tile_tokens * (p.num_heads / p.num_kv_heads) > kRows) return false;
  if (!aligned16(p.query) || !aligned16(p.key_cache) || !aligned16(p.value_cache) || !aligned16(p.out) ||
      p.query_stride % 8 != 0) {
    return false;
  }
  if (!device_is_sm90()) return false;
  if (!fp8) return true;
  // NOTE: an fp8 cache that the tensor maps cannot describe (block sizes that
  // are not powers of two in 8..128, a driver without the encoder or refusing
  // the cache) stays on the mma.sync kernel: encoded here once more per launch
  // (microseconds of host time on each eager or piecewise fp8 prefill launch; graphs
  // capture the launch once).
  KvTensorMaps maps{};
  return p.head_dim == 64 ? encode_fp8_kv_maps<64>(p, maps) : encode_fp8_kv_maps<128>(p, maps);
}

int paged_attention_wgmma(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_work == 0) return cudaSuccess;
  const int choice = kernel_choice(p);
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, choice, stream);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, choice, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore::cuda
