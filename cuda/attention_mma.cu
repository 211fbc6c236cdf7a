// Paged attention on tensor cores (bf16 / fp16 queries; bf16, fp16 or fp8
// e4m3 KV cache).
//
// One CTA (4 warps) takes a (work item, kv head, key split). Its keys stream
// through shared memory in tiles of KT keys, kStages tiles deep, each tile
// copied with cp.async (16 bytes per thread per copy, zero-filled past the
// range). A warp holds 16 query vectors (query tokens x the heads of one kv
// head, GQA) as mma A fragments in registers:
//   S = Q K^T  with mma.m16n8k16 (K fragments through ldmatrix),
//   online softmax on S's fragments (exp2, one running max per vector),
//   O += P V   with P re-packed from S's fragments (V through ldmatrix.trans).
// Decode CTAs have one group of 16 vectors (the heads of one token), so their
// four warps split each tile's keys and merge through shared memory at the
// end; prefill CTAs hold 64 vectors, one group per warp, all warps reading
// every key of a tile. With several key splits the last CTA of each (item, kv
// head) to finish combines the partial results by their log-sum-exp (or a
// merge kernel, without counters).
//
// An fp8 cache is staged as bytes and widened to fp16 in registers: K rows by
// 4-byte loads (the head dims of each k step permuted the same way in Q and
// K), V by ldmatrix.trans on byte pairs, whose even and odd head dims then
// feed two mma tiles. Its scales fold into the score scale (k) and the output
// (v). Decode over fp8 at head dim 128 (not deep) puts the keys in the mma's
// rows instead (KM, below): K the A operand, the query vectors its columns.
#include <cuda.h>  // CUtensorMap and its enums (the encoder comes through the runtime: no libcuda link)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "attention_merge.cuh"
#include "attention_mma.h"
#include "attention_wgmma.h"
#include "device_ops.cuh"
#include "pagedcore/cuda/kernels.h"
#include "pdl.cuh"
#include "tensor_map.cuh"
#include "wgmma_ops.cuh"  // (its mbarrier and TMA pieces; the wgmma ones, unused here, emit no code)

namespace pagedcore::cuda {

namespace {

using dev::fast_exp2;
using dev::ldmatrix_x4_trans;
using dev::mma16816;
using dev::Pair;
using dev::raise_max;
using dev::store_pair;
using dev::to_float2;

constexpr int kPrefillWarps = kAttentionMmaTileVectors / 16;  // prefill CTAs: 16 query vectors per warp
constexpr int kTable = 1024;  // block ids staged in shared memory at once
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int kTileKeys = 64;  // keys per shared-memory tile

// Tiles in shared memory at once: three (head dim 256: two). Two for decode
// (three CTAs per SM) measured 1.5x slower at B=64 L=4k than three.
template <int HD, bool DECODE>
__host__ __device__ constexpr int num_stages() {
  return HD <= 128 ? 3 : 2;
}
// A decode launch of few CTAs (batch 1) has the SMs to itself: its CTAs keep
// more tiles in flight (one CTA per SM), so that a split's keys arrive in
// about one round trip instead of one per tile after the first two.
template <int HD>
__host__ __device__ constexpr int deep_stages() {
  return HD <= 128 ? 5 : 3;
}

// PAD: how a staged K/V row is laid out. 16: padded by 16 bytes, so that
// ldmatrix rows land on distinct banks; but every other row's 32-byte sectors
// straddle two 32-byte units of shared memory, and cp.async then asks L2 for
// each of them twice (ncu: 1.5x the sectors of the rows read). 0: swizzled
// instead (chunk c of row r at c ^ (r % 8) within its eight chunks; rows whose
// chunks come in eights): each sector lands whole in one 32-byte unit and
// ldmatrix rows on distinct banks. Decode swizzles 16-bit rows at head dim 128
// (H200, B=64 L=4k: 268 -> 249 us); at head dim 64 and over fp8, whose launches
// are bound by instructions rather than bytes, it measured 1-8% slower.
// (Padding by 32 bytes also keeps sectors whole but puts an ldmatrix phase's 8
// rows on 4 bank groups: measured slower.)
template <typename CT, int HD>
__host__ __device__ constexpr bool can_swizzle() {
  return (HD * static_cast<int>(sizeof(CT)) / 16) % 8 == 0;
}

template <typename CT, int HD, int PAD = 16>
__host__ __device__ constexpr int staged_row_bytes() {
  return HD * static_cast<int>(sizeof(CT)) + PAD;
}

// Byte b of staged row r in a stage of rows `srow` bytes apart.
template <int PAD>
__device__ __forceinline__ int staged_offset(int r, int b, int srow) {
  return r * srow + (PAD == 0 ? b ^ ((r & 7) << 4) : b);  // (the XOR moves b's chunk within its eight)
}

template <typename CT, int HD, int STAGES, int KT = kTileKeys, int PAD = 16>
__host__ __device__ constexpr size_t smem_bytes() {
  size_t bytes = kTable * 4 + static_cast<size_t>(STAGES) * 2 * KT * staged_row_bytes<CT, HD, PAD>();
  return bytes;
}

// TMA decode (the kernel's TMA): the stages start at a 1024-byte boundary (the
// 128-byte swizzle's phase is the shared address's bits 7-9), their mbarriers
// after them.
template <typename CT, int HD, int STAGES, int KT>
__host__ __device__ constexpr size_t tma_smem_bytes() {
  return smem_bytes<CT, HD, STAGES, KT, 0>() + 1024 + 2 * 8 * STAGES;  // (full and empty mbarriers)
}

// Decode CTAs' warps: four, each a quarter of a tile's keys.
constexpr int kDecodeWarps = 4;

// Run-time switches of a decode launch (the kernel's second argument).
// kEarlyMeta: the row's lengths, split range and first block ids are read
// before the wait for the kernel before (none of the step's kernels writes
// them: host copies and ordinary launches do, full dependencies), so that once
// the wait returns the first K/V tiles go out at once.
constexpr int kEarlyMeta = 1;
// kEarlyPrefetch (with kEarlyMeta): the K/V rows of the first tiles the
// pipeline issues are prefetched into L2 before the wait as well.
constexpr int kEarlyPrefetch = 2;
// kOnePassMerge (the default; PAGEDCORE_DECODE_MERGE=0 turns it off): a split
// row's last CTA merges by merge::count_and_merge_decode.
constexpr int kOnePassMerge = 4;
// kTmaSpread (TMA tiles; the default, PAGEDCORE_DECODE_TMA_SPREAD=0 turns it
// off): a tile's boxes issued by the four warps (lane j of warp w: block 4 j +
// w), not by warp 0 alone, whose serial issue (a box an instruction, ~16 a tile
// at block size 16) made the other warps wait for it at each tile's barrier
// (ncu at af338c9, fp8 B=64 L=4k: 23% of the stall samples at that barrier);
// warp 0's lane 0 arms the stage's mbarrier with the tile's bytes before the
// barrier the issue follows. NOTE: measured on the H200 (decode_variants.py at
// f9d4d41, one alternating run, us, warp 0 -> every warp): fp8 B=64 L=4k 143.9
// -> 141.8, B=512 L=4k one kv head 143.2 -> 138.9.
constexpr int kTmaSpread = 16;
// kClusterAsync (CLUSTER launches; the default, PAGEDCORE_DECODE_CLUSTER_ASYNC=0
// for the barrier's way): the pushes by st.async, each completing its bytes on
// the owner's mbarrier, which the owner waits for, instead of the cluster
// barrier's release (a GPU-scope MEMBAR in every thread on sm_90) and acquire;
// a relaxed cluster barrier before the exit keeps every CTA until the last push
// has landed.
constexpr int kClusterAsync = 32;
// flags >> kClusterKeysShift (CLUSTER launches; PAGEDCORE_DECODE_CLUSTER_KEYS /
// 64): a row that would run in splits (512 keys and more) is shared by the
// cluster too while its keys are at most CLUSTER times that many 64-key tiles
// (0: only rows that would run unsplit); where the launch merges its splits in
// the kernel (the counters set), so that no merge kernel looks for partials
// of it.
constexpr int kClusterKeysShift = 8;
// What a CLUSTER launch returns, launching nothing, when more of its clusters
// than fit on the GPU at once were asked for (an internal code: the dispatch
// then launches the plain kernel; PAGEDCORE_DECODE_CLUSTER=-C makes it the error).
constexpr cudaError_t kClusterLaunchTooLarge = cudaErrorCooperativeLaunchTooLarge;
// The kernel's TMA: 0 (cp.async), 1 (the boxes issued by warp 0 or, with
// kTmaSpread, by every warp, each tile behind a barrier of the CTA) or
// kTmaSkew (the default; PAGEDCORE_DECODE_TMA_SKEW=0 for 1): the four warps
// issue the boxes as with kTmaSpread, but no barrier orders the tiles: a warp
// arrives on the stage's empty mbarrier once it has read the tile, and after
// its own compute of tile t refills the stage of tile t - 1 (waiting on its
// empty mbarrier, which every warp has usually passed by then) with tile t +
// kStages - 1, so that the warps may drift apart by a tile instead of meeting
// at each tile. NOTE: measured on the H200 (decode_variants.py at c4f57cf, us,
// barrier -> skew, two runs in one call): fp8 B=64 L=4k 141.8 -> 138.0 and
// 142.0 -> 138.3, B=64 L=1k 46.2 -> 44.8, B=512 L=4k one kv head 138.4 ->
// 136.7. Also measured there and deleted: a fifth (producer) warp issuing
// every tile, the stages freed by the same empty mbarriers and all kStages
// tiles in flight (9827bfd): 141.8 -> 142.2, 46.2 -> 47.2, 138.4 -> 139.8 —
// two CTAs an SM of five warps put three warps on some scheduler, which caps
// the registers at 168 (spilling) where the four-warp kernel takes ~205.
constexpr int kTmaSkew = 2;
// LEAN (the default over the skew's TMA tiles since the thirty-seventh session;
// PAGEDCORE_DECODE_TMA_LEAN=0 keeps the kernel before it; the same arithmetic,
// bit for bit, with fewer instructions a tile): kLeanSoftmax: K's high byte pairs
// widened from the word's high half (no shift); the scores' mask only on tiles
// that are not whole (one branch a tile, where the select ran on every score);
// and the row maxima reduced across lanes only when some lane's own maximum
// would raise its row's (m is the same on the 8 lanes of a row, so the vote is
// the same: the shuffles leave the common path). kLeanNarrow, with it: launches
// whose plan says that no decode row holds more than 8 query vectors
// (p.decode_max_query_tokens x group) and that have no softcap take a kernel
// built for that: one column tile (the second's 32 mma a warp a tile, idle
// there, go: ptxas issued them predicated off), no softcap arm, 119 registers
// for ~205. A row of more vectors in such a launch would be a planning bug: the
// kernel traps. Counted on prototypes at 1b60b77 (the common path's issued SASS,
// a warp a tile): 858, 824 with the high halves alone, 834 with the vote alone,
// 748 narrow, 601 both. NOTE: measured on an H100 at 1e7be4a (decode_variants.py,
// us, the old kernel / kLeanSoftmax alone / kLeanNarrow alone / both, in one
// process): fp8 B=64 L=4k 188.1 / 186.3 / 186.7 / 184.9; B=64 L=1k 56.7 / 55.4 /
// 55.5 / 54.5, again 56.3 / 55.0 / 55.1 / 54.1; B=512 L=4k one kv head 184.5 /
// 182.5 / 183.3 / 181.5; SmolLM2's fp8 shape and the 8B graph plan the same in
// all four; a third run, old / both: 188.1 / 184.6, 56.2 / 54.3, 184.4 / 181.3.
// Each alone is gone as a choice (kLeanSoftmax alone is the default's wide
// kernel, where a plan does not allow narrow).
constexpr int kLeanSoftmax = 2, kLeanNarrow = 1;
// NOTE: three trials over the lean kernels, measured on an H100 in the
// thirty-eighth session (decode_variants.py at 1f137d6, two runs, us, default ->
// trial; fp8 B=64 L=4k, B=64 L=1k, B=512 L=4k one kv head), all deleted:
// refills without the proxy fence (kLeanNoFence: lane 0's MEMBAR.ALL.CTA and
// FENCE before a stage's boxes, the stage's reads ordered by its empty mbarrier
// alone) 195.1 -> 195.0 / 195.2, 56.6 / 56.5 -> 56.3, 187.3 / 187.5 -> 187.2 /
// 187.1: no gain past the noise. The narrow kernel pipelined across tiles
// (kLeanPipelined: tile t's softmax from scores of the iteration before, then
// Q K(t + 1) and P V(t) in one basic block, the last tile of a chunk peeled;
// the same arithmetic) 195.1 -> 193.5 at B=64 L=4k in both runs, but 56.6 ->
// 57.4 at L=1k and 187.3 -> 190.4 at B=512 (one kv head): lost there. The next wave's
// first tiles prefetched into L2 by the CTAs before them once their last refill
// was out (kLeanNextWave: the successor's block ids read after the first
// boxes, 2 x block size prefetches a lane at the drain) 195.1 -> 197.6, 56.6 ->
// 57.4, 187.3 -> 191.5: lost everywhere. bf16 B=64 L=4k (not these kernels)
// 355.0 in all four.
// NOTE: TMA tiles: a refill of the stage the last tile freed before the wait
// for the next tile (not after it; 73c4263, both kernels) measured 145.8 / 142.2
// against 146.1 / 140.4 us at fp8 B=64 L=4k (L2 promotion 256 / 128): deleted.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// ---- Thread-block clusters for short decode rows (the kernel's CLUSTER; sm_90) ----
//
// A decode row that one CTA would take alone (merge::decode_active_splits
// gives 1: under 512 keys), or in splits but of few keys (kClusterKeysShift),
// is shared by the CLUSTER CTAs of one cluster along the grid's z (cluster
// dims 1 x 1 x CLUSTER): each takes a CLUSTER-th of the keys, merges its warps
// as an unsplit CTA does, then pushes each (vector, four dims) item's partial,
// and each vector's (max, sum), into the shared memory of the CTA that owns
// the item (rank item % CLUSTER) with remote stores; one cluster barrier later
// every owner folds its items' CLUSTER partials and writes them out. No
// partials in global memory, no counter, no GPU-wide fence and atomic, where a
// split costs batch 1 ~2.5 us (the one-pass merge). The receive buffer lies
// past the stages: a peer's pushes may land while this CTA still reads its
// tiles. (A cluster merge tried at 5afe504 lost, 9.2 / 11.6 against
// 8.5 us at B=1 L=256: one CTA pulled every peer's warp shares by remote loads,
// a loop of dependent round trips, while the others waited.)
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_arrive() {  // (release: this CTA's stores before)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {  // (acquire: the peers' stores before their arrive)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}

// The address of the shared variable at `addr` in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, int rank) {
  uint32_t out = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
#endif
  return out;
}

__device__ __forceinline__ void cluster_store(uint32_t addr, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
#endif
}

__device__ __forceinline__ void cluster_store(uint32_t addr, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
#endif
}

// Returns once this CTA's mbarrier at `bar` has completed the phase of parity
// `parity`, with cluster-scope acquire: the peers' st.async bytes that completed
// it (each a cluster-scope release) are visible after it (mbar_wait's default
// acquire is the CTA's scope, which a peer's release does not formally pair with).
__device__ __forceinline__ void cluster_mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// st.async: the store completes its bytes on the mbarrier at `bar` (a
// mapped address of the destination CTA's barrier).
__device__ __forceinline__ void cluster_store_async(uint32_t addr, float4 v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(addr),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
               : "memory");
#endif
}

__device__ __forceinline__ void cluster_store_async(uint32_t addr, float2 v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(addr),
               "f"(v.x), "f"(v.y), "r"(bar)
               : "memory");
#endif
}

// Items (a vector's four dims) of a decode row that each owner receives from
// each CTA of its cluster, and the receive buffer's bytes: those items'
// float4s from every CTA, then every CTA's (max, sum) per vector, then the
// mbarrier of kClusterAsync (16 bytes).
template <int HD, int CLUSTER>
__host__ __device__ constexpr int cluster_slots() {
  return kAttentionDecodeVectors * (HD / 4) / CLUSTER;
}
template <int HD, int CLUSTER>
__host__ __device__ constexpr size_t cluster_recv_bytes() {
  return CLUSTER > 1
             ? static_cast<size_t>(CLUSTER) * (cluster_slots<HD, CLUSTER>() * 16 + kAttentionDecodeVectors * 8) + 16
             : 0;
}

// ---- TMA for decode (PAGEDCORE_DECODE_TMA; sm_90 and later) ----
//
// The K and V tensor maps of a launch (encoded on the host, passed by value as
// a __grid_constant__ argument, so that CUDA graphs capture them with the
// launch); kernels without TMA take the empty DecodeMaps<false>.
template <bool TMA>
struct DecodeMaps {};
template <>
struct DecodeMaps<true> {
  CUtensorMap k;
  CUtensorMap v;
};

// mbarrier and bulk tensor copies (wgmma_ops.cuh's): Hopper instructions,
// compiled out of the sm_80 build (the host never launches a TMA kernel there:
// decode_tma_serves).
__device__ __forceinline__ void tma_mbar_init(uint32_t bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  wgmma::mbar_init(bar, count);
  wgmma::mbar_init_fence();
#endif
}
__device__ __forceinline__ void tma_expect_bytes(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  wgmma::mbar_arrive_expect_tx(bar, bytes);
#endif
}
__device__ __forceinline__ void tma_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  wgmma::mbar_wait(bar, parity);
#endif
}
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                             uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  wgmma::tma_load_4d(dst, map, c0, c1, c2, c3, bar);
#endif
}
__device__ __forceinline__ void tma_arrive(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  wgmma::mbar_arrive(bar);
#endif
}
__device__ __forceinline__ void tma_fence_proxy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  wgmma::fence_proxy_async();
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

template <typename MT>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<MT, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Two consecutive T of the query, re-packed for the mma type.
template <typename T, typename MT>
__device__ __forceinline__ uint32_t load_pair(const T* src) {
  if constexpr (std::is_same_v<T, MT>) {
    return *reinterpret_cast<const uint32_t*>(src);
  } else {
    const float2 f = to_float2(*reinterpret_cast<const Pair<T>*>(src));
    return pack2<MT>(f.x, f.y);
  }
}

// Two e4m3 bytes (low byte first) -> a half2 in a register.
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The high two e4m3 bytes of a word -> a half2: fp8x2_to_half2(w >> 16) without
// the shift (the cvt reads the word's high 16-bit half; SASS F2FP ... R.H1).
__device__ __forceinline__ uint32_t fp8x2_hi_to_half2(uint32_t w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t d;
  asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;}" : "=r"(d) : "r"(w));
  return d;
#else
  return fp8x2_to_half2(w >> 16);
#endif
}

// Two e4m3 bytes of x -> a half2 holding each value times 2^-8: e4m3's sign,
// exponent and mantissa bits land in place in an fp16 of exponent bias 15
// (e4m3's is 7), subnormals included; the 2^8 goes into the scales. `sel` (a
// prmt selector) puts each byte in the low half of a 16-bit lane and the
// byte's sign, replicated, in the high half (selector nibbles 8-15: prmt's
// sign mode); a shift by 7 then puts the sign in bit 15 and the exponent and
// mantissa in bits 13-7, and one mask clears the sign's copy in bit 14 and the
// bits shifted in from below. Three integer instructions instead of the
// conversion unit's cvt. (e4m3's NaN, 0x7f, turns into a finite 1.875 * 2^-0;
// caches hold no NaN.) NOTE: the form before (byte in the high half, then
// (u & 0x80008000) | ((u >> 1) & 0x3f803f80)) took four; the bits are the same.
// Measured on the H200 (decode_variants.py at 9e16b8c): fp8 B=64 L=4k 174 -> 158.5
// us (the shift runs as IMAD.SHL, off the integer logic pipe that bounds these launches).
__device__ __forceinline__ uint32_t fp8x2_to_half2_scaled(uint32_t x, uint32_t sel) {
  uint32_t u;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(u) : "r"(x), "r"(0u), "r"(sel));
  return (u << 7) & 0xbf80bf80u;
}
// Selectors for fp8x2_to_half2_scaled: bytes (0, 1), (2, 3), (0, 2), (1, 3) of x.
constexpr uint32_t kFp8Bytes01 = 0x9180, kFp8Bytes23 = 0xB3A2, kFp8Bytes02 = 0xA280, kFp8Bytes13 = 0xB391;
constexpr float kFastFp8Scale = 256.f;  // undoes fp8x2_to_half2_scaled's 2^-8

// An 8x8 matrix of 16-bit values in the mma fragment layout (a thread's two
// values: row lane / 4, columns 2 (lane % 4) + 0, 1), transposed.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t addr, uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// How an fp8 cache is widened (the kernel's CVT): K and V by the conversion
// unit (0), or each by fp8x2_to_half2_scaled's integer operations (the bits).
constexpr int kCvtIntK = 1, kCvtIntV = 2, kCvtInt = kCvtIntK | kCvtIntV;

// STAGES: tiles in flight (num_stages or, for small decode launches,
// deep_stages); CVT: fp8's widening (kCvtInt...); KT: keys per tile (fp8
// decode: 128 where not deep); PAD: staged rows' layout; KM: keys in the mma's
// M (decode only; below). flags: kEarlyMeta, kEarlyPrefetch, kOnePassMerge
// (decode only).
//
// KM (the default for fp8's 128-key tiles at head dim 128; elsewhere a trial
// that lost: launch_decode's notes): the decode warps compute S^T = K Q^T and
// O^T += V^T P^T, keys (and then head dims) as the mma's 16 rows and the query
// vectors as its 8 columns, a second column tile only for rows of more than 8
// vectors. A row of at most 8 vectors (the 8B shape's 4 heads a kv head) then
// takes half the mma of Q K^T (each mma 16 keys x 8 vectors, where the
// default's is 16 vectors, 12 of them empty at 4 heads, x 8 keys) and half
// those of P V; K is the A operand (ldmatrix, or fp8 words widened as now), V^T
// comes by ldmatrix.trans, and P^T moves from the score fragments to B
// fragments by movmatrix.trans.
//
// TMA (decode over fp8 at head dim 128 with keys in M, PAGEDCORE_DECODE_TMA):
// each tile's K and V rows come by one bulk tensor copy per cache block (a
// box of block_size rows of one kv head, 128-byte swizzle = PAD 0's layout),
// issued by warp 0 (lane j: block j of the tile) and awaited on the stage's
// mbarrier, instead of 16 cp.async per thread a tile. A box is a whole block,
// so a CTA's keys start at a block boundary (its share rounded to whole
// tiles): keys of a tile outside the CTA's range are masked by select (K may
// hold anything there), and V is widened by integer operations (VINT), which
// make every byte finite, so that P = 0 times them is 0. Rows past the
// range's last block are left as they were (stale bytes, masked alike).
//
// CLUSTER (the plan's decode_cluster or PAGEDCORE_DECODE_CLUSTER; decode, not TMA): launched in
// clusters of CLUSTER CTAs along z, which share each row that would run
// unsplit (above, "Thread-block clusters").
template <typename T, typename CT, int HD, bool DECODE, int STAGES, int CVT, int KT = kTileKeys, int PAD = 16,
          bool KM = false, int TMA = 0, int CLUSTER = 1, int LEAN = 0>
__global__ void __launch_bounds__(DECODE ? 32 * kDecodeWarps : 32 * kPrefillWarps)
    mma_attention_kernel(PagedAttentionParams p, int flags, const __grid_constant__ DecodeMaps<TMA != 0> maps) {
  constexpr int kWarps = DECODE ? kDecodeWarps : kPrefillWarps;
  constexpr int kThreads = 32 * kWarps;
  constexpr bool FP8 = std::is_same_v<CT, uint8_t>;
  using MT = std::conditional_t<FP8, __half, T>;
  static_assert(DECODE || KT == kTileKeys, "prefill tiles are 64 keys");
  constexpr int kStages = STAGES;
  static_assert(CVT == 0 || FP8, "the integer widening is fp8's");
  constexpr bool KINT = (CVT & kCvtIntK) != 0, VINT = (CVT & kCvtIntV) != 0;
  constexpr int CHUNKS = HD * static_cast<int>(sizeof(CT)) / 16;  // 16-byte pieces of a cache row
  constexpr int SROW = staged_row_bytes<CT, HD, PAD>();
  static_assert(PAD != 0 || can_swizzle<CT, HD>(), "swizzled rows hold whole eights of chunks");
  static_assert(!KM || (DECODE && HD % 32 == 0), "keys in M: decode, head dims of whole 32s");
  static_assert(!TMA || (KM && FP8 && HD == 128 && PAD == 0 && (CVT & kCvtIntV) != 0 && KT <= 128),
                "TMA: fp8 keys in M at head dim 128, swizzled rows, V widened by integer operations");
  static_assert(CLUSTER == 1 || (DECODE && !TMA && (CLUSTER & (CLUSTER - 1)) == 0 && CLUSTER <= 8),
                "clusters: decode without TMA, 2, 4 or 8 CTAs");
  static_assert(LEAN == 0 || (KM && FP8 && !KINT), "LEAN: keys in M over fp8, K widened by the cvt");
  constexpr bool kLeanSm = (LEAN & kLeanSoftmax) != 0, kNarrow = (LEAN & kLeanNarrow) != 0;
  auto soff = [](int r, int b) { return staged_offset<PAD>(r, b, SROW); };
  constexpr int WK = DECODE ? KT / kWarps : KT;                      // keys per warp per tile
  constexpr int KSTEPS = HD / 16;
  constexpr int NT = HD / 8;   // output fragments (8 dims each)
  constexpr int SUB = WK < 32 ? WK : 32;  // keys per compute pass
  constexpr int ST = SUB / 8;  // score fragments (8 keys each)
  static_assert(HD % 16 == 0 && SUB % 16 == 0 && WK % SUB == 0, "tile shape");
  // NOTE: 128-byte aligned, so that staged rows' 32-byte sectors and swizzled
  // 128-byte lines sit where the layout puts them (a 16-byte aligned base after
  // any static shared variable shifted every row by 16 bytes).
  extern __shared__ __align__(128) unsigned char smem[];
  int32_t* s_table = reinterpret_cast<int32_t*>(smem);
  unsigned char* stages = smem + kTable * 4;
  if constexpr (TMA) stages += (1024 - (smem_addr(stages) & 1023)) & 1023;  // (tma_smem_bytes)
  // TMA: stage s's mbarrier (after the stages); bit s of tma_phase, the parity
  // its next wait expects.
  const uint32_t tma_bars = smem_addr(stages + kStages * 2 * KT * SROW);
  uint32_t tma_phase = 0;
  // kTmaSkew: stage s's empty mbarrier (after the full ones; each warp
  // arrives once it has read the stage's tile); bit s of empty_phase, the
  // parity of stage s's next empty phase.
  constexpr bool kSkew = TMA == kTmaSkew;
  const uint32_t empty_bars = tma_bars + 8 * kStages;
  uint32_t empty_phase = 0;
  if constexpr (TMA) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) tma_mbar_init(tma_bars + 8 * s, 1);
      if constexpr (kSkew) {
        for (int s = 0; s < kStages; ++s) tma_mbar_init(empty_bars + 8 * s, kWarps);
      }
    }
    // (the chunk loop's first __syncthreads orders the inits before any use)
  }
  // CLUSTER: the receive buffer past the stages. Item i's partial goes to rank
  // i % CLUSTER, slot i / CLUSTER (from this CTA: row `split` of slots), each
  // vector's (max in log2 units, sum) to every rank (row `split` of pairs);
  // kClusterAsync: the mbarrier their bytes complete on.
  constexpr int kSlots = cluster_slots<HD, CLUSTER>();
  float4* s_recv = reinterpret_cast<float4*>(stages + kStages * 2 * KT * SROW);
  float2* s_pairs = reinterpret_cast<float2*>(s_recv + CLUSTER * kSlots);
  const uint32_t recv_bar = smem_addr(s_pairs + CLUSTER * kAttentionDecodeVectors);
  const bool cluster_async = CLUSTER > 1 && (flags & kClusterAsync) != 0;
  const bool early = DECODE && (flags & kEarlyMeta) != 0;
  const bool spread = (TMA == 1 && (flags & kTmaSpread) != 0) || kSkew;
  if (!early) pdl_wait();  // (the queries and this step's keys come from the kernel before)
  pdl_launch_dependents();

  // NOTE: the kv head is the fastest grid index, so that the CTAs of one row run
  // together and read its K/V rows (all kv heads of a token are adjacent) at
  // about the same time.
  const int kv_head = blockIdx.x;
  const int work = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads;
  int row, t0, tile_tokens, splits;
  bool in_cluster = false;  // (CLUSTER) the row's keys shared by the cluster's CTAs
  if constexpr (DECODE) {
    row = p.decode_seq[work];
    if (row < 0) return;  // a padded plan's spare item: no work, no output
    t0 = 0;
    const int keys = merge::decode_keys(p, row);
    splits = merge::decode_active_splits(p, keys);
    // (CLUSTER: a row of one split, or of up to CLUSTER x the flags' tiles where
    // the kernel merges its splits, takes the first cluster's CTAs, each a
    // CLUSTER-th of its keys; the merges outside see a row of one split that
    // wrote its output itself, or, counters set, nothing: the counter untouched;
    // a row under p.decode_cluster_min_keys runs as in the plain kernel, its first
    // CTA alone, the others of its cluster returning below)
    if constexpr (CLUSTER > 1) {
      const int tiles = flags >> kClusterKeysShift;
      in_cluster = keys >= p.decode_cluster_min_keys &&
                   (splits == 1 || (p.decode_split_counters != nullptr && keys <= CLUSTER * tiles * kTileKeys));
      if (in_cluster) splits = CLUSTER;
    }
    if (split >= splits) return;  // a short row: fewer splits than planned
    if (in_cluster) {
      if (cluster_async && threadIdx.x == 0) {
        // The bytes this CTA receives: its items' partials and every vector's
        // pair, from each CTA of the cluster.
        const int vectors = (p.query_start_loc[row + 1] - p.query_start_loc[row]) * (p.num_heads / p.num_kv_heads);
        const int items = vectors * (HD / 4);
        const int owned = items > split ? (items - split + CLUSTER - 1) / CLUSTER : 0;
        tma_mbar_init(recv_bar, 1);  // (with the fence that shows its init to the cluster)
        tma_expect_bytes(recv_bar, static_cast<uint32_t>(CLUSTER * (owned * 16 + vectors * 8)));
      }
      // (every CTA of the cluster has started, and its mbarrier is set, before
      // the first remote store: the wait before the pushes)
      cluster_arrive_relaxed();
    }
  } else {
    row = p.work_seq[work];
    if (row < 0) return;  // a padded plan's spare item
    t0 = p.work_q_start[work];
    splits = p.num_splits;
  }
  const int q_begin = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q_begin;
  // A decode item is a whole row: 1 query, or a few (query tokens x group <= 16).
  tile_tokens = DECODE ? q_len : min(p.tile_tokens, q_len - t0);
  const int ctx = p.seq_lens[row];
  const int num_vectors = tile_tokens * group;
  const int first_pos = ctx - q_len + t0;
  const int last_pos = first_pos + tile_tokens - 1;
  const int k_lo = p.sliding_window > 0 ? max(0, first_pos - p.sliding_window + 1) : 0;
  const int k_hi = last_pos + 1;
  // TMA: from k_lo's block on, in shares of whole tiles (keys before k_lo:
  // the sliding window's mask).
  const int k_first = TMA ? k_lo & ~(p.block_size - 1) : k_lo;
  const int per_split = TMA ? (k_hi - k_first + splits * KT - 1) / (splits * KT) * KT
                            : (k_hi - k_lo + splits - 1) / splits;
  const int s_lo = k_first + split * per_split;
  const int s_hi = min(k_hi, s_lo + per_split);
  if (early) {
    // The first chunk's block ids (the loop below stages the later ones), then
    // the wait: what follows reads the queries and the keys.
    const int32_t* table = p.block_tables + static_cast<int64_t>(row) * p.block_tables_stride;
    const int bs = p.block_size;
    if (s_lo < s_hi) {
      const int b0 = s_lo / bs;
      const int c1 = min(s_hi, (b0 + kTable) * bs);
      for (int i = threadIdx.x; i <= (c1 - 1) / bs - b0; i += kThreads) s_table[i] = table[b0 + i];
      if (flags & kEarlyPrefetch) {
        // The prologue's tiles into L2 (a hint: no data is read, so keys the
        // kernel before may still write are no hazard).
        __syncthreads();
        constexpr int LINES = (HD * static_cast<int>(sizeof(CT)) + 127) / 128;  // 128-byte lines a row
        const int n = min(c1 - s_lo, (kStages - 1) * KT);
        const int64_t slot = static_cast<int64_t>(p.num_kv_heads) * HD;
        for (int i = threadIdx.x; i < n * LINES; i += kThreads) {
          const int key = s_lo + i / LINES;
          const int b = key / bs;
          const int64_t off = s_table[b - b0] * slot * bs + (key - b * bs) * slot + kv_head * HD +
                              (i % LINES) * (128 / static_cast<int>(sizeof(CT)));
          prefetch_l2(static_cast<const CT*>(p.key_cache) + off);
          prefetch_l2(static_cast<const CT*>(p.value_cache) + off);
        }
      }
    }
    pdl_wait();
  }

  // This thread's two fragment rows (vectors) and their query positions.
  const int qd = lane % 4;  // quad lane: which column pair
  const int row_base = DECODE ? 0 : warp * 16;
  const int vr[2] = {row_base + lane / 4, row_base + lane / 4 + 8};
  int vpos[2];
  bool vvalid[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    vvalid[i] = vr[i] < num_vectors;
    vpos[i] = first_pos + vr[i] / group;
  }
  const int warp_first_pos = first_pos + row_base / group;
  const int warp_last_pos = first_pos + (min(num_vectors, row_base + 16) - 1) / group;
  const bool warp_active = row_base < num_vectors;

  // Q as A fragments: [k step][4 registers].
  uint32_t qf[KSTEPS][4];
  {
    const T* query = static_cast<const T*>(p.query);
    const T* qrow[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t tok = q_begin + t0 + (vvalid[i] ? vr[i] / group : 0);
      const int head = kv_head * group + (vvalid[i] ? vr[i] % group : 0);
      qrow[i] = query + tok * p.query_stride + static_cast<int64_t>(head) * HD;
    }
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      // fp8: fragment columns (2q, 2q+1, 2q+8, 2q+9) hold dims 16s + 4q .. 4q+3.
      const int d = FP8 ? 16 * s + 4 * qd : 16 * s + 2 * qd;
      const int d_hi = FP8 ? d + 2 : d + 8;
      qf[s][0] = vvalid[0] ? load_pair<T, MT>(qrow[0] + d) : 0u;
      qf[s][1] = vvalid[1] ? load_pair<T, MT>(qrow[1] + d) : 0u;
      qf[s][2] = vvalid[0] ? load_pair<T, MT>(qrow[0] + d_hi) : 0u;
      qf[s][3] = vvalid[1] ? load_pair<T, MT>(qrow[1] + d_hi) : 0u;
    }
  }
  const float score_scale = p.scale * (FP8 ? p.k_scale * (KINT ? kFastFp8Scale : 1.f) : 1.f);
  const float softcap = kNarrow ? 0.f : p.softcap;  // (kNarrow: launched without one)
  const float score_log2 = score_scale * kLog2e;       // no cap: scores in log2 units at once
  const float softcap_log2 = softcap * kLog2e;
  const float cap_scale = softcap > 0.f ? score_scale / softcap : 0.f;
  const bool hi_rows = !kNarrow && (!DECODE || num_vectors > 8);  // fragment rows 8-15 in use
  if constexpr (kNarrow) {
    if (num_vectors > 8) __trap();  // (the plan's decode_max_query_tokens was wrong)
  }

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  // Per query vector the thread holds: its two fragment rows (KM: four columns,
  // vectors 2 * qd + (0, 1) and, past 8 vectors, 8 + 2 * qd + (0, 1)).
  constexpr int kRows = KM ? 4 : 2;
  float m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;  // running max, log2 units
    l[r] = 0.f;        // this thread's share of the running sum
  }

  const CT* key_cache = static_cast<const CT*>(p.key_cache);
  const CT* value_cache = static_cast<const CT*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(row) * p.block_tables_stride;
  const int bs = p.block_size;
  // Block sizes are powers of two in practice: shifts then, divisions otherwise.
  const int bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  const int slot_elems = p.num_kv_heads * HD;                          // one token, all kv heads
  const CT* key_base = key_cache + kv_head * HD;
  const CT* value_base = value_cache + kv_head * HD;
  const int wk0 = DECODE ? warp * WK : 0;  // the warp's first key within a tile
  // The staged bytes a warp reads (ldmatrix rows, fp8 words): row rb + rl, byte
  // bc + bl, where rb is a multiple of 8, rl and bl depend on the lane, bc is a
  // compile-time offset whose bits are apart from bl's. The lane's part is
  // computed once; each read adds (padded rows) or XORs (swizzled) bc to it.
  auto lane_part = [](int rl, int bl) { return PAD == 0 ? rl * SROW + (bl ^ ((rl & 7) << 4)) : rl * SROW + bl; };
  auto at = [](int rb, int lp, int bc) { return rb * SROW + (PAD == 0 ? lp ^ bc : lp + bc); };
  const int k_lane = FP8 ? lane_part(lane / 4, 4 * qd) : lane_part(lane % 8, 16 * (lane / 8));
  const int v_lane = lane_part(lane % 8 + 8 * ((lane / 8) % 2), 16 * (lane / 16));
  // KM over a 16-bit cache: V^T's A fragments (16 dims x 16 keys) by ldmatrix.trans.
  const int vt_lane = lane_part(lane % 8 + 8 * (lane / 16), 16 * ((lane / 8) % 2));
  // fp8 V: byte pairs (dims 2e, 2e+1) of keys 2q, 2q+1, as ldmatrix.trans gives
  // them; even dims and odd dims, each as the two keys' half2.
  auto even_dims = [](uint32_t x) {
    return VINT ? fp8x2_to_half2_scaled(x, kFp8Bytes02) : fp8x2_to_half2(__byte_perm(x, 0, 0x0020));
  };
  auto odd_dims = [](uint32_t x) {
    return VINT ? fp8x2_to_half2_scaled(x, kFp8Bytes13) : fp8x2_to_half2(__byte_perm(x, 0, 0x0031));
  };

  // The copies' shape and each thread's fixed part of them (load_tile below).
  constexpr int kTpr = CHUNKS >= 8 ? 8 : (CHUNKS >= 4 ? 4 : (CHUNKS >= 2 ? 2 : 1));  // threads a key row
  constexpr int kCopyPer = (CHUNKS + kTpr - 1) / kTpr;                               // copies a thread a row
  constexpr int kCopyRows = kThreads / kTpr < KT ? kThreads / kTpr : KT;           // key rows a pass
  static_assert(KT % kCopyRows == 0 && kCopyRows % 8 == 0, "copy shape");
  const int copy_row = threadIdx.x / kTpr % kCopyRows;
  const int copy_chunk = threadIdx.x % kTpr;
  const int copy_lane = lane_part(copy_row, 16 * copy_chunk);
  const uint64_t copy_src = reinterpret_cast<uint64_t>(key_base) + 16 * copy_chunk;
  const uint64_t v_minus_k = reinterpret_cast<uint64_t>(value_base) - reinterpret_cast<uint64_t>(key_base);
  const uint32_t slot_bytes = static_cast<uint32_t>(slot_elems) * sizeof(CT);
  const uint32_t block_bytes = static_cast<uint32_t>(bs) * slot_bytes;

  for (int c0 = s_lo; c0 < s_hi;) {
    const int b0 = c0 / bs;
    const int c1 = min(s_hi, (b0 + kTable) * bs);
    const int n_tiles = (c1 - c0 + KT - 1) / KT;
    // kTmaSpread: tile t's bytes (K and V of the blocks holding keys of the chunk).
    auto tma_bytes = [&](int t) {
      return static_cast<uint32_t>(min(KT / bs, (c1 - c0 - t * KT + bs - 1) / bs) * bs * HD * 2);
    };
    __syncthreads();  // the previous chunk's table and stages are consumed
    if (!early || c0 != s_lo) {
      for (int i = threadIdx.x; i <= (c1 - 1) / bs - b0; i += kThreads) s_table[i] = table[b0 + i];
    }
    if (spread && threadIdx.x == 0) {
      for (int t = 0; t < min(kStages - 1, n_tiles); ++t) tma_expect_bytes(tma_bars + 8 * t, tma_bytes(t));
    }
    __syncthreads();

    // NOTE: TPR consecutive threads copy one key's K and V rows, 16 bytes
    // each per copy, so that every copy instruction of a warp reads whole
    // 128-byte lines. A thread's source address per key row is its chunk of
    // the head (fixed) plus the block's and the slot's offsets: two wide
    // multiply-adds on 32-bit factors, the V row a fixed distance away, and
    // the thread's later chunks immediates (cp.async's address offset).
    auto load_tile = [&](int t) {
      if (threadIdx.x >= kCopyRows * kTpr) return;
      unsigned char* ks = stages + (t % kStages) * 2 * KT * SROW;
      const uint32_t kdst = smem_addr(ks);
      const uint32_t vdst = kdst + KT * SROW;
#pragma unroll
      for (int pass = 0; pass < KT / kCopyRows; ++pass) {
        const int key = c0 + t * KT + pass * kCopyRows + copy_row;
        const bool valid = key < c1;
        const int kc = valid ? key : c1 - 1;  // (a key of the chunk: its block id is staged)
        const int b = bs_shift >= 0 ? kc >> bs_shift : kc / bs;
        const uint64_t src = copy_src + static_cast<uint64_t>(static_cast<uint32_t>(s_table[b - b0])) * block_bytes +
                             static_cast<uint32_t>(kc - b * bs) * slot_bytes;
#pragma unroll
        for (int k = 0; k < kCopyPer; ++k) {
          if (CHUNKS % kTpr == 0 || copy_chunk + kTpr * k < CHUNKS) {
            const int d = at(pass * kCopyRows, copy_lane, 16 * kTpr * k);  // byte (chunk) * 16 of the staged row
            cp_async16(kdst + d, reinterpret_cast<const void*>(src + 16 * kTpr * k), valid);
            cp_async16(vdst + d, reinterpret_cast<const void*>(src + v_minus_k + 16 * kTpr * k), valid);
          }
        }
      }
    };

    // TMA: tile t's blocks by warp 0 (the caller), lane j block j (those holding
    // keys of the chunk), lane 0 arming the stage's mbarrier with their K and V bytes.
    auto tma_tile = [&](int t) {
      const int kb = c0 + t * KT + lane * bs;  // (c0: a block boundary)
      const bool load = lane * bs < KT && kb < c1;
      const uint32_t bar = tma_bars + 8 * (t % kStages);
      const int blocks = __popc(__ballot_sync(0xffffffffu, load));
      if (lane == 0) {
        tma_fence_proxy();  // (the stage's reads by the generic proxy, then the async writes)
        tma_expect_bytes(bar, blocks * bs * HD * 2);
      }
      __syncwarp();
      if constexpr (TMA) {
        if (load) {
          const uint32_t dst = smem_addr(stages + (t % kStages) * 2 * KT * SROW) + lane * bs * SROW;
          const int block = s_table[(bs_shift >= 0 ? kb >> bs_shift : kb / bs) - b0];
          tma_load_box(dst, &maps.k, 0, kv_head, 0, block, bar);
          tma_load_box(dst + KT * SROW, &maps.v, 0, kv_head, 0, block, bar);
        }
      }
    };
    // kTmaSpread: tile t's blocks by every warp (lane j of warp w: block 4 j +
    // w), the stage armed before.
    auto tma_spread = [&](int t) {
      const int j = lane * kWarps + warp;
      const int kb = c0 + t * KT + j * bs;  // (c0: a block boundary)
      if (lane == 0) tma_fence_proxy();
      __syncwarp();
      if constexpr (TMA) {
        if (j * bs < KT && kb < c1) {
          const uint32_t dst = smem_addr(stages + (t % kStages) * 2 * KT * SROW) + j * bs * SROW;
          const int block = s_table[(bs_shift >= 0 ? kb >> bs_shift : kb / bs) - b0];
          tma_load_box(dst, &maps.k, 0, kv_head, 0, block, tma_bars + 8 * (t % kStages));
          tma_load_box(dst + KT * SROW, &maps.v, 0, kv_head, 0, block, tma_bars + 8 * (t % kStages));
        }
      }
    };

#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) {
      if constexpr (TMA) {
        if (spread) {
          if (t < n_tiles) tma_spread(t);
        } else if (warp == 0 && t < n_tiles) {
          tma_tile(t);
        }
      } else {
        if (t < n_tiles) load_tile(t);
        cp_async_commit();
      }
    }
    for (int t = 0; t < n_tiles; ++t) {
      if constexpr (TMA) {
        const int st = t % kStages;
        tma_wait(tma_bars + 8 * st, (tma_phase >> st) & 1u);
        tma_phase ^= 1u << st;
        // (spread and skew: tile t + kStages - 1's stage held tile t - 1, whose
        // phase this thread has waited for: armed now, filled after the
        // barrier below or, skew, after this tile)
        const bool refill = t + kStages - 1 < n_tiles;
        if (spread && refill && threadIdx.x == 0) {
          tma_expect_bytes(tma_bars + 8 * ((t + kStages - 1) % kStages), tma_bytes(t + kStages - 1));
        }
        if constexpr (TMA == 1) {
          __syncthreads();  // tile t-1 is consumed
          if (spread) {
            if (refill) tma_spread(t + kStages - 1);
          } else if (warp == 0 && refill) {
            tma_tile(t + kStages - 1);
          }
        }
      } else {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile t has landed for every thread; tile t-1 is consumed
        if (t + kStages - 1 < n_tiles) load_tile(t + kStages - 1);
        cp_async_commit();
      }
      const unsigned char* const ks = stages + (t % kStages) * 2 * KT * SROW;
      const unsigned char* const vs = ks + KT * SROW;
      // NOTE: a prefill warp's 64 keys go in two passes of 32 (a loop, not
      // unrolled): half the code and the score registers.
#pragma unroll 1
      for (int sub = 0; sub < WK / SUB; ++sub) {
        const int wk = wk0 + sub * SUB;  // the warp's first key within the tile
        const int kbase = c0 + t * KT + wk;
        const bool skip = !warp_active || kbase >= c1 || kbase > warp_last_pos;
        if (skip) break;  // later passes are further right

        if constexpr (KM) {
          constexpr int KB = SUB / 16;  // 16-key blocks a pass
          constexpr int HT = HD / 16;   // 16-dim row tiles of O^T
          const int col_tiles = hi_rows ? 2 : 1;
          // S^T = K Q^T: [column tile][key block]; odd k steps apart (two chains).
          float st[2][KB][4], st2[2][KB][4];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
              for (int i = 0; i < 4; ++i) st[nt][kb][i] = st2[nt][kb][i] = 0.f;
            }
          }
          const uint32_t kaddr = smem_addr(ks);
#pragma unroll
          for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
              uint32_t a[4];  // keys wk + 16 kb + (lane / 4, + 8) x the k step's dims
              if constexpr (FP8) {
                const uint32_t w0 = *reinterpret_cast<const uint32_t*>(ks + at(wk + 16 * kb, k_lane, 16 * s));
                const uint32_t w1 = *reinterpret_cast<const uint32_t*>(ks + at(wk + 16 * kb + 8, k_lane, 16 * s));
                a[0] = KINT ? fp8x2_to_half2_scaled(w0, kFp8Bytes01) : fp8x2_to_half2(w0);
                a[1] = KINT ? fp8x2_to_half2_scaled(w1, kFp8Bytes01) : fp8x2_to_half2(w1);
                if constexpr (kLeanSm) {
                  a[2] = fp8x2_hi_to_half2(w0);
                  a[3] = fp8x2_hi_to_half2(w1);
                } else {
                  a[2] = KINT ? fp8x2_to_half2_scaled(w0, kFp8Bytes23) : fp8x2_to_half2(w0 >> 16);
                  a[3] = KINT ? fp8x2_to_half2_scaled(w1, kFp8Bytes23) : fp8x2_to_half2(w1 >> 16);
                }
              } else {
                ldmatrix_x4(kaddr + at(wk + 16 * kb, v_lane, 32 * s), a);
              }
              // Q^T's B fragments: qf's rows lane / 4 (+ 8) are vectors lane / 4 (+ 8).
#pragma unroll
              for (int nt = 0; nt < 2; ++nt) {
                if (nt < col_tiles) mma16816<MT>(s % 2 ? st2[nt][kb] : st[nt][kb], a, qf[s][nt], qf[s][2 + nt]);
              }
            }
          }
          // Scale, cap, mask; element (nt, kb, i): key kbase + 16 kb + lane / 4 + 8 (i / 2),
          // vector 8 nt + 2 qd + i % 2, the thread's row state r = 2 nt + i % 2.
          const bool whole = kbase + SUB <= c1 && kbase + SUB - 1 <= warp_first_pos &&
                             (p.sliding_window == 0 || kbase > warp_last_pos - p.sliding_window);
          float tmax[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
          int key_from[4], key_to[4];
          auto key_bounds = [&]() {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int v = 8 * (r / 2) + 2 * qd + r % 2;
              const int pos = first_pos + v / group;
              key_from[r] = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
              key_to[r] = v < num_vectors ? min(pos, c1 - 1) : -1;
            }
          };
          auto reduce_rows = [&](int r) {  // (row r's maximum over its 8 lanes)
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 4));
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 8));
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 16));
          };
          constexpr float kSlack = 8.f;  // (as below)
          bool grow = false;
          if constexpr (kLeanSm) {  // (the same scores and maxima; above, kLeanSoftmax)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              if (nt >= col_tiles) continue;
#pragma unroll
              for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const float v = st[nt][kb][i] + st2[nt][kb][i];
                  st[nt][kb][i] = softcap > 0.f ? softcap_log2 * tanhf(v * cap_scale) : v * score_log2;
                }
              }
            }
            if (!whole) {
              key_bounds();
#pragma unroll
              for (int nt = 0; nt < 2; ++nt) {
                if (nt >= col_tiles) continue;
#pragma unroll
                for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
                  for (int i = 0; i < 4; ++i) {
                    const int r = 2 * nt + i % 2;
                    const int key = kbase + 16 * kb + lane / 4 + 8 * (i / 2);
                    if (!(key >= key_from[r] && key <= key_to[r])) st[nt][kb][i] = -INFINITY;
                  }
                }
              }
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              if (nt >= col_tiles) continue;
#pragma unroll
              for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
                for (int i = 0; i < 4; ++i) tmax[2 * nt + i % 2] = fmaxf(tmax[2 * nt + i % 2], st[nt][kb][i]);
              }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) grow |= tmax[r] > m[r] + kSlack;  // (this lane's maxima)
          } else {
            key_bounds();
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              if (nt >= col_tiles) continue;
#pragma unroll
              for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const int r = 2 * nt + i % 2;
                  const float v = st[nt][kb][i] + st2[nt][kb][i];
                  float x = softcap > 0.f ? softcap_log2 * tanhf(v * cap_scale) : v * score_log2;
                  if (!whole) {
                    const int key = kbase + 16 * kb + lane / 4 + 8 * (i / 2);
                    x = key >= key_from[r] && key <= key_to[r] ? x : -INFINITY;
                  }
                  st[nt][kb][i] = x;
                  tmax[r] = fmaxf(tmax[r], x);
                }
              }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              reduce_rows(r);
              grow |= tmax[r] > m[r] + kSlack;
            }
          }
          if (__any_sync(0xffffffffu, grow)) {
            if constexpr (kLeanSm) {  // (the rows' maxima across their 8 lanes, now)
#pragma unroll
              for (int r = 0; r < 4; ++r) reduce_rows(r);
            }
            float corr[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) corr[r] = raise_max(m[r], l[r], tmax[r]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
              for (int t = 0; t < HT; ++t) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[nt * HT + t][i] *= corr[2 * nt + i % 2];
              }
            }
          }
          // P^T as B fragments: each 8 keys x 8 vectors half, packed, transposed
          // (a column tile past col_tiles is left unset: no mma reads it).
          uint32_t pb[2][KB][2];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if (nt >= col_tiles) continue;
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
              float e[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int r = 2 * nt + i % 2;
                e[i] = fast_exp2(st[nt][kb][i] - (m[r] == -INFINITY ? 0.f : m[r]));
                l[r] += e[i];
              }
              pb[nt][kb][0] = movmatrix_trans(pack2<MT>(e[0], e[1]));
              pb[nt][kb][1] = movmatrix_trans(pack2<MT>(e[2], e[3]));
            }
          }
          // O^T += V^T P^T: row tile t of O^T is head dims 16 t + (lane / 4, + 8)
          // (fp8: 16 t + 2 (lane / 4) + (0, 1): even and odd dims of a byte pair).
          const uint32_t vaddr = smem_addr(vs);
#pragma unroll
          for (int kb = 0; kb < KB; ++kb) {
            if constexpr (FP8) {
#pragma unroll
              for (int j = 0; j < HD / 32; ++j) {
                uint32_t b[4];  // keys (+ 0, + 8) x byte pairs (16 j, 16 j + 8) + lane / 4
                ldmatrix_x4_trans(vaddr + at(wk + 16 * kb, v_lane, 32 * j), b);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const uint32_t a[4] = {even_dims(b[2 * h]), odd_dims(b[2 * h]), even_dims(b[2 * h + 1]),
                                         odd_dims(b[2 * h + 1])};
#pragma unroll
                  for (int nt = 0; nt < 2; ++nt) {
                    if (nt < col_tiles) mma16816<MT>(acc[nt * HT + 2 * j + h], a, pb[nt][kb][0], pb[nt][kb][1]);
                  }
                }
              }
            } else {
#pragma unroll
              for (int t = 0; t < HT; ++t) {
                uint32_t a[4];
                ldmatrix_x4_trans(vaddr + at(wk + 16 * kb, vt_lane, 32 * t), a);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                  if (nt < col_tiles) mma16816<MT>(acc[nt * HT + t], a, pb[nt][kb][0], pb[nt][kb][1]);
                }
              }
            }
          }
          continue;
        }

        // S = Q K^T over the warp's SUB keys.
        float sc[ST][4];
#pragma unroll
        for (int n = 0; n < ST; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
        const uint32_t k_base = smem_addr(ks);
        // NOTE: with few score fragments (decode), odd k steps accumulate apart
        // so that two mma chains per fragment run at once.
        constexpr bool SPLIT_K = ST <= 2 && KSTEPS >= 4;
        float sc2[SPLIT_K ? ST : 1][4];
#pragma unroll
        for (int n = 0; n < (SPLIT_K ? ST : 1); ++n) sc2[n][0] = sc2[n][1] = sc2[n][2] = sc2[n][3] = 0.f;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
          const int key = wk + 8 * n + (lane % 8);
          if constexpr (FP8) {
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
              const uint32_t w = *reinterpret_cast<const uint32_t*>(ks + at(wk + 8 * n, k_lane, 16 * s));
              const uint32_t b0 = KINT ? fp8x2_to_half2_scaled(w, kFp8Bytes01) : fp8x2_to_half2(w);
              const uint32_t b1 = KINT ? fp8x2_to_half2_scaled(w, kFp8Bytes23) : fp8x2_to_half2(w >> 16);
              mma16816<MT>(SPLIT_K && (s % 2) ? sc2[SPLIT_K ? n : 0] : sc[n], qf[s], b0, b1);
            }
            continue;
          }
#pragma unroll
          for (int s = 0; s < KSTEPS; s += 2) {
            if (s + 1 < KSTEPS) {
              uint32_t b[4];
              ldmatrix_x4(k_base + at(wk + 8 * n, k_lane, 32 * s), b);  // (s even)
              mma16816<MT>(sc[n], qf[s], b[0], b[1]);
              mma16816<MT>(SPLIT_K ? sc2[SPLIT_K ? n : 0] : sc[n], qf[s + 1], b[2], b[3]);
            } else {
              uint32_t b[2];
              ldmatrix_x2(k_base + soff(key, (16 * s + 8 * ((lane / 8) % 2)) * 2), b);
              mma16816<MT>(sc[n], qf[s], b[0], b[1]);
            }
          }
        }
        if constexpr (SPLIT_K) {
#pragma unroll
          for (int n = 0; n < ST; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[n][i] += sc2[n][i];
          }
        }
        // Scale, cap, mask; the running max and sum per row.
        float tile_max[2] = {-INFINITY, -INFINITY};
        // Every key of the warp's share visible to every row: no mask to apply.
        const bool whole = kbase + SUB <= c1 && kbase + SUB - 1 <= warp_first_pos &&
                           (p.sliding_window == 0 || kbase > warp_last_pos - p.sliding_window);
        // Keys a row sees in this chunk: [key_from, key_to] (empty for padding rows).
        int key_from[2], key_to[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          key_from[r] = p.sliding_window > 0 ? vpos[r] - p.sliding_window + 1 : 0;
          key_to[r] = vvalid[r] ? min(vpos[r], c1 - 1) : -1;
        }
        // NOTE: rows r = 1 (fragment rows 8-15) hold no query vector in a
        // decode CTA of at most 8 heads: their scores are left alone.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 1 && !hi_rows) continue;
#pragma unroll
          for (int n = 0; n < ST; ++n) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float x = softcap > 0.f ? softcap_log2 * tanhf(sc[n][2 * r + c] * cap_scale) : sc[n][2 * r + c] * score_log2;
              if (!whole) {
                const int key = kbase + 8 * n + 2 * qd + c;
                x = key >= key_from[r] && key <= key_to[r] ? x : -INFINITY;
              }
              sc[n][2 * r + c] = x;
              tile_max[r] = fmaxf(tile_max[r], x);
            }
          }
        }
        // NOTE: the running max moves only when a row's max grew by more than
        // kSlack (log2 units) — exponentials stay <= 2^kSlack — so most tiles
        // skip rescaling the accumulators.
        constexpr float kSlack = 8.f;
        bool grow = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
          tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
          grow |= tile_max[r] > m[r] + kSlack;
        }
        if (__any_sync(0xffffffffu, grow)) {
          float corr[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) corr[r] = raise_max(m[r], l[r], tile_max[r]);
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            acc[n][0] *= corr[0];
            acc[n][1] *= corr[0];
            acc[n][2] *= corr[1];
            acc[n][3] *= corr[1];
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 1 && !hi_rows) continue;
          const float base = m[r] == -INFINITY ? 0.f : m[r];
#pragma unroll
          for (int n = 0; n < ST; ++n) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float e = fast_exp2(sc[n][2 * r + c] - base);
              sc[n][2 * r + c] = e;
              l[r] += e;
            }
          }
        }
        // O += P V.
        const uint32_t v_base = smem_addr(vs);
#pragma unroll
        for (int kk = 0; kk < SUB / 16; ++kk) {
          const uint32_t pa[4] = {pack2<MT>(sc[2 * kk][0], sc[2 * kk][1]), pack2<MT>(sc[2 * kk][2], sc[2 * kk][3]),
                                  pack2<MT>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                  pack2<MT>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
          const int key = wk + 16 * kk + (lane % 8) + 8 * ((lane / 8) % 2);
          if constexpr (FP8) {
            // Keys 2q, 2q+1 (and + 8): even dims feed fragment 4j (+2), odd
            // dims 4j + 1 (+3); j covers 32 dims.
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) {
              uint32_t b[4];
              ldmatrix_x4_trans(v_base + at(wk + 16 * kk, v_lane, 32 * j), b);
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const uint32_t lo = b[2 * h], hi = b[2 * h + 1];
                mma16816<MT>(acc[4 * j + 2 * h], pa, even_dims(lo), even_dims(hi));
                mma16816<MT>(acc[4 * j + 2 * h + 1], pa, odd_dims(lo), odd_dims(hi));
              }
            }
            if constexpr (HD % 32 != 0) {
              constexpr int j = HD / 32;
              uint32_t b[2];
              ldmatrix_x2_trans(v_base + soff(key, 32 * j), b);
              mma16816<MT>(acc[4 * j], pa, even_dims(b[0]), even_dims(b[1]));
              mma16816<MT>(acc[4 * j + 1], pa, odd_dims(b[0]), odd_dims(b[1]));
            }
            continue;
          }
#pragma unroll
          for (int j = 0; j < NT / 2; ++j) {
            uint32_t b[4];
            ldmatrix_x4_trans(v_base + at(wk + 16 * kk, v_lane, 32 * j), b);
            mma16816<MT>(acc[2 * j], pa, b[0], b[1]);
            mma16816<MT>(acc[2 * j + 1], pa, b[2], b[3]);
          }
        }
      }
      if constexpr (kSkew) {
        __syncwarp();  // (every lane's reads of the stage are done)
        if (lane == 0) tma_arrive(empty_bars + 8 * (t % kStages));
        empty_phase ^= 1u << (t % kStages);
        if (t + kStages - 1 < n_tiles) {
          if (t >= 1) {  // (tile t - 1's phase: its bit was toggled once since)
            const int sp = (t - 1) % kStages;
            tma_wait(empty_bars + 8 * sp, ((empty_phase >> sp) & 1u) ^ 1u);
          }
          tma_spread(t + kStages - 1);
        }
      }
    }
    if constexpr (!TMA) cp_async_wait<0>();  // (TMA: every tile issued was awaited)
    c0 = c1;
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if constexpr (KM) {  // (a vector's keys are spread over the lanes of one qd)
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 4);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 8);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 16);
    } else {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
  }
  const float out_scale = FP8 ? p.v_scale * (VINT ? kFastFp8Scale : 1.f) : 1.f;
  // Head dim of acc[n][c] (c = 0, 1; rows 8-15 the same): fp8 fragments pair up
  // the even and odd dims of 16-dim blocks.
  auto out_dim = [qd](int n, int c) {
    return FP8 ? 16 * (n / 2) + 4 * qd + 2 * c + (n % 2) : 8 * n + 2 * qd + c;
  };

  if constexpr (DECODE) {
    // Merge the four warps' key shares: [warp][16 rows][HD] plus (max, sum).
    float* s_acc = reinterpret_cast<float*>(stages);
    float* s_m = s_acc + kWarps * 16 * HD;
    float* s_l = s_m + kWarps * 16;
    static_assert(smem_bytes<CT, HD, STAGES, KT, PAD>() - kTable * 4 >= (kWarps * 16 * HD + 2 * kWarps * 16) * 4,
                  "merge space");
    static_assert(smem_bytes<CT, HD, STAGES, KT, PAD>() - kTable * 4 >= merge::kScratchFloats * 4, "split merge space");
    __syncthreads();
    if constexpr (KM) {
      // acc[nt * HD / 16 + t][i]: vector 8 nt + 2 qd + i % 2, head dim 16 t + lane / 4
      // + 8 (i / 2) (fp8: 16 t + 2 (lane / 4) + i / 2).
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if (nt == 1 && !hi_rows) continue;
#pragma unroll
        for (int t = 0; t < HD / 16; ++t) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int v = 8 * nt + 2 * qd + i % 2;
            const int d = FP8 ? 16 * t + 2 * (lane / 4) + i / 2 : 16 * t + lane / 4 + 8 * (i / 2);
            s_acc[(warp * 16 + v) * HD + d] = acc[nt * (HD / 16) + t][i];
          }
        }
      }
      if (lane < 4) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int v = 8 * (r / 2) + 2 * qd + r % 2;
          s_m[warp * 16 + v] = m[r];
          s_l[warp * 16 + v] = l[r];
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (i >= 2 && !hi_rows) continue;  // (fragment rows 8-15 hold no vector)
          const int r = lane / 4 + 8 * (i / 2);
          s_acc[(warp * 16 + r) * HD + out_dim(n, i % 2)] = acc[n][i];
        }
      }
      if (qd == 0) {
        s_m[warp * 16 + lane / 4] = m[0];
        s_m[warp * 16 + lane / 4 + 8] = m[1];
        s_l[warp * 16 + lane / 4] = l[0];
        s_l[warp * 16 + lane / 4 + 8] = l[1];
      }
    }
    __syncthreads();
    if constexpr (CLUSTER > 1) {
      if (in_cluster) cluster_wait();
    }
    // Four consecutive dims of one vector a thread: the warps' weights once per
    // four outputs, 16-byte shared loads.
    static_assert(HD % 4 == 0, "four dims a thread");
    for (int i = threadIdx.x; i < num_vectors * (HD / 4); i += kThreads) {
      const int h = i / (HD / 4);  // the vector: query token h / group, head kv_head * group + h % group
      const int d = i % (HD / 4) * 4;
      float gmax = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (s_l[w * 16 + h] > 0.f) gmax = fmaxf(gmax, s_m[w * 16 + h]);
      }
      float num[4] = {0.f, 0.f, 0.f, 0.f}, den = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float lw = s_l[w * 16 + h];
        if (lw <= 0.f) continue;
        const float wt = exp2f(s_m[w * 16 + h] - gmax);
        const float4 a = *reinterpret_cast<const float4*>(s_acc + (w * 16 + h) * HD + d);
        num[0] += wt * a.x;
        num[1] += wt * a.y;
        num[2] += wt * a.z;
        num[3] += wt * a.w;
        den += wt * lw;
      }
      const float inv = den > 0.f ? out_scale / den : 0.f;
      if (splits == 1) {
        T* dst = static_cast<T*>(p.out) +
                 (static_cast<int64_t>(q_begin + h / group) * p.num_heads + kv_head * group + h % group) * HD + d;
        store_pair(dst, num[0] * inv, num[1] * inv);
        store_pair(dst + 2, num[2] * inv, num[3] * inv);
      } else if (CLUSTER > 1 && in_cluster) {
        const int owner = i % CLUSTER;
        const uint32_t dst = cluster_map(smem_addr(s_recv + split * kSlots + i / CLUSTER), owner);
        const float4 part = make_float4(num[0] * inv, num[1] * inv, num[2] * inv, num[3] * inv);
        if (cluster_async) {
          cluster_store_async(dst, part, cluster_map(recv_bar, owner));
        } else {
          cluster_store(dst, part);
        }
        if (d == 0) {
#pragma unroll
          for (int r = 0; r < CLUSTER; ++r) {
            const uint32_t pair = cluster_map(smem_addr(s_pairs + split * kAttentionDecodeVectors + h), r);
            if (cluster_async) {
              cluster_store_async(pair, make_float2(gmax, den), cluster_map(recv_bar, r));
            } else {
              cluster_store(pair, make_float2(gmax, den));
            }
          }
        }
      } else {
        const int64_t slot =
            ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * p.decode_splits + split) *
                kAttentionPartialVectors + h;
        *reinterpret_cast<float4*>(p.decode_partial_out + slot * HD + d) =
            make_float4(num[0] * inv, num[1] * inv, num[2] * inv, num[3] * inv);
        if (d == 0) {
          p.decode_partial_lse[2 * slot] = gmax * kLn2;
          p.decode_partial_lse[2 * slot + 1] = den;
        }
      }
    }
    if constexpr (CLUSTER > 1) {
      if (in_cluster) {
        if (cluster_async) {
          cluster_mbar_wait(recv_bar, 0);  // every CTA's pushes into this one have landed
          cluster_arrive_relaxed();  // (the exit's barrier, awaited after the merge)
        } else {
          cluster_arrive();  // this CTA's pushes are done
          cluster_wait();    // every CTA's pushes into this one have landed
        }
        // This CTA's items (i = CLUSTER j + split): the CLUSTER partials folded
        // by a running maximum (log2 units).
        const int items = num_vectors * (HD / 4);
        for (int j = threadIdx.x; j * CLUSTER + split < items; j += kThreads) {
          const int i = j * CLUSTER + split;
          const int h = i / (HD / 4);
          const int d = i % (HD / 4) * 4;
          float mx = -FLT_MAX, total = 0.f;
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int r = 0; r < CLUSTER; ++r) {
            merge::fold_split<true>(s_pairs[r * kAttentionDecodeVectors + h], s_recv[r * kSlots + j], mx, total, acc);
          }
          const float inv = total > 0.f ? 1.f / total : 0.f;
          T* dst = static_cast<T*>(p.out) +
                   (static_cast<int64_t>(q_begin + h / group) * p.num_heads + kv_head * group + h % group) * HD + d;
          store_pair(dst, acc.x * inv, acc.y * inv);
          store_pair(dst + 2, acc.z * inv, acc.w * inv);
        }
        // (kClusterAsync: no CTA leaves before every CTA has received all its
        // pushes, so that no st.async is in flight from or to an exited CTA)
        if (cluster_async) cluster_wait();
        return;  // (no peer reads or writes this CTA's shared memory after the barrier)
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!vvalid[r]) continue;
      const float inv = l[r] > 0.f ? out_scale / l[r] : 0.f;
      const int v = vr[r];
      if (splits == 1) {
        const int64_t tok = q_begin + t0 + v / group;
        const int head = kv_head * group + v % group;
        T* dst = static_cast<T*>(p.out) + (tok * p.num_heads + head) * HD;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          if constexpr (FP8) {
            dst[out_dim(n, 0)] = static_cast<T>(acc[n][2 * r] * inv);
            dst[out_dim(n, 1)] = static_cast<T>(acc[n][2 * r + 1] * inv);
          } else {
            store_pair(dst + out_dim(n, 0), acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
          }
        }
      } else {
        const int64_t slot =
            ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * splits + split) * kAttentionPartialVectors + v;
        float* dst = p.partial_out + slot * HD;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          dst[out_dim(n, 0)] = acc[n][2 * r] * inv;
          dst[out_dim(n, 1)] = acc[n][2 * r + 1] * inv;
        }
        if (qd == 0) {
          p.partial_lse[2 * slot] = m[r] == -INFINITY ? -FLT_MAX : m[r] * kLn2;
          p.partial_lse[2 * slot + 1] = l[r];
        }
      }
    }
  }
  if (splits > 1 && (DECODE ? p.decode_split_counters : p.split_counters) != nullptr) {
    // The last split of this (item, kv head) to finish merges them all.
    bool one_pass = false;
    if constexpr (DECODE) one_pass = (flags & kOnePassMerge) != 0;
    if (one_pass) {
      if constexpr (DECODE) merge::count_and_merge_decode<T, HD, kThreads>(p, work, kv_head);
    } else {
      merge::count_and_merge<T, HD, kThreads, DECODE>(p, work, kv_head, reinterpret_cast<float*>(stages));
    }
  }
}

// An integer from the environment, or `fallback` (read at each launch: a getenv
// per layer is noise next to a kernel, and benchmarks flip them in-process).
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

template <typename T, typename CT, int HD, bool DECODE, int STAGES, int CVT, int KT = kTileKeys, int PAD = 16,
          bool KM = false, int TMA = 0, int CLUSTER = 1, int LEAN = 0>
int launch_variant(const PagedAttentionParams& p, cudaStream_t stream, int flags = 0,
                   const DecodeMaps<TMA != 0>& maps = DecodeMaps<TMA != 0>{}) {
  if constexpr (DECODE && PAD == 16 && HD == 128 && sizeof(CT) == 2) {
    // Decode stages swizzled rows at head dim 128 over a 16-bit cache (the
    // layouts: above can_swizzle); PAGEDCORE_ATTN_PAD=16 (read per launch;
    // benchmarks): padded rows instead. (The warps' merge must fit the stages.)
    constexpr bool kSwizzleFits =
        can_swizzle<CT, HD>() &&
        smem_bytes<CT, HD, STAGES, KT, 0>() - kTable * 4 >= (kDecodeWarps * 16 * HD + 2 * kDecodeWarps * 16) * 4;
    if constexpr (kSwizzleFits) {
      if (env_int("PAGEDCORE_ATTN_PAD", 0) == 0) {
        return launch_variant<T, CT, HD, DECODE, STAGES, CVT, KT, 0, KM, TMA, CLUSTER, LEAN>(p, stream, flags);
      }
    }
  }
  constexpr size_t smem = (TMA ? tma_smem_bytes<CT, HD, STAGES, KT>() : smem_bytes<CT, HD, STAGES, KT, PAD>()) +
                          cluster_recv_bytes<HD, CLUSTER>();
  constexpr int threads = DECODE ? 32 * kDecodeWarps : 32 * kPrefillWarps;
  auto* kernel = mma_attention_kernel<T, CT, HD, DECODE, STAGES, CVT, KT, PAD, KM, TMA, CLUSTER, LEAN>;
  static bool configured = false;  // NOTE: per instantiation; raising the limit is idempotent
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const int items = DECODE ? p.num_decode : p.num_work;
  const int splits = DECODE ? p.decode_splits : p.num_splits;
  if (items > 65535) return cudaErrorInvalidConfiguration;
  cudaError_t e;
  if constexpr (CLUSTER > 1) {  // (the splits rounded up to whole clusters)
    const int z = ((splits > 1 ? splits : 1) + CLUSTER - 1) / CLUSTER * CLUSTER;
    // A cluster's CTAs share one GPC: at one CTA an SM, fewer clusters than SMs / CLUSTER
    // may fit at once. A launch of more would run in two waves: refused with
    // kClusterLaunchTooLarge (the caller launches the plain kernel instead).
    static int max_clusters = -1;  // NOTE: per instantiation, as `configured`
    if (max_clusters < 0) {
      cudaLaunchConfig_t config = {};
      cudaLaunchAttribute attribute[1];
      attribute[0].id = cudaLaunchAttributeClusterDimension;
      attribute[0].val.clusterDim.x = 1;
      attribute[0].val.clusterDim.y = 1;
      attribute[0].val.clusterDim.z = CLUSTER;
      config.gridDim = dim3(1, 1, CLUSTER);
      config.blockDim = dim3(threads);
      config.dynamicSmemBytes = smem;
      config.attrs = attribute;
      config.numAttrs = 1;
      int n = 0;
      e = cudaOccupancyMaxActiveClusters(&n, kernel, &config);
      if (e != cudaSuccess) return e;
      max_clusters = n;
    }
    if (static_cast<int64_t>(p.num_kv_heads) * items * (z / CLUSTER) > max_clusters) return kClusterLaunchTooLarge;
    e = launch_pdl_cluster(kernel, dim3(p.num_kv_heads, items, z), dim3(1, 1, CLUSTER), dim3(threads), smem, stream,
                           p, flags, maps);
  } else {
    e = launch_pdl(kernel, dim3(p.num_kv_heads, items, splits), dim3(threads), smem, stream, p, flags, maps);
  }
  if (e != cudaSuccess || splits == 1 || (DECODE ? p.decode_split_counters : p.split_counters) != nullptr) return e;
  return merge_attention_splits(p, DECODE, stream);
}

// ---- TMA decode, the host's part ----

// What the TMA decode needs of a launch: a Hopper device, block sizes that are
// powers of two 8..128 (a box is one block, at most 16 boxes a 128-key tile),
// caches 16-byte aligned (the tensor map's base).
bool decode_tma_serves(const PagedAttentionParams& p) {
  const int bs = p.block_size;
  return bs >= 8 && bs <= 128 && (bs & (bs - 1)) == 0 && p.num_blocks > 0 &&
         reinterpret_cast<uintptr_t>(p.key_cache) % 16 == 0 && reinterpret_cast<uintptr_t>(p.value_cache) % 16 == 0 &&
         compute_capability() >= 90;
}

// The K and V tensor maps of an fp8 cache at head dim HD (bytes): dims (HD,
// kv heads, block_size, num_blocks), box (HD, 1, block_size, 1) — one block's
// rows of one kv head — 128-byte swizzle. Encoded once per cache (a per-thread
// cache of the last 64 caches seen; an eager decode step asks once per layer).
// False if the driver cannot.
template <int HD>
bool encode_decode_maps(const PagedAttentionParams& p, DecodeMaps<true>& maps, int default_l2) {
  static_assert(HD == 128, "a row of 128 bytes: one swizzle span");
  struct Entry {
    const void* k = nullptr;
    const void* v = nullptr;
    int64_t blocks = 0;
    int bs = 0, kv_heads = 0, l2 = 0;
    DecodeMaps<true> maps;
  };
  // The boxes' L2 promotion in bytes (PAGEDCORE_DECODE_TMA_L2: 0, 64, 128 or
  // 256; `default_l2` without it): 128 is a box row, one kv head's 128 bytes;
  // 256 also brings the neighbouring kv head's row into L2.
  // NOTE: measured on the H200 (decode_variants.py, us, 256 -> 128 -> none):
  // fp8 B=64 L=4k 146.0 -> 139.5 -> 139.4 (c126ef9), 146.1 -> 140.4 / 141.1
  // (73c4263, twice), B=64 L=1k 47.9 -> 44.8 -> 44.9, B=512 L=4k one kv head
  // 145.1 -> 139.4 -> 139.5; bench/kv_stream_probe.cu, the same tiles copied
  // without math: 130.0 -> 122.9 (4.13 -> 4.37 TB/s). The wgmma decode kernel
  // went the other way, 147.6 -> 152.3: it keeps 256.
  const int l2 = env_int("PAGEDCORE_DECODE_TMA_L2", default_l2);
  CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  switch (l2) {
    case 0: promotion = CU_TENSOR_MAP_L2_PROMOTION_NONE; break;
    case 64: promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_64B; break;
    case 128: promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B; break;
    case 256: break;
    default: return false;
  }
  constexpr int kEntries = 64;
  thread_local Entry cache[kEntries];
  thread_local int next = 0;
  for (const Entry& e : cache) {
    if (e.k == p.key_cache && e.v == p.value_cache && e.blocks == p.num_blocks && e.bs == p.block_size &&
        e.kv_heads == p.num_kv_heads && e.l2 == l2) {
      maps = e.maps;
      return true;
    }
  }
  const EncodeTiledFn encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t row = HD;  // bytes
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(HD), static_cast<cuuint64_t>(p.num_kv_heads),
                              static_cast<cuuint64_t>(p.block_size), static_cast<cuuint64_t>(p.num_blocks)};
  const cuuint64_t strides[3] = {row, row * p.num_kv_heads, row * p.num_kv_heads * p.block_size};  // dims 1..3
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(HD), 1, static_cast<cuuint32_t>(p.block_size), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  auto one = [&](CUtensorMap* map, const void* base) {
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  Entry& e = cache[next];
  if (!one(&e.maps.k, p.key_cache) || !one(&e.maps.v, p.value_cache)) {
    e = Entry{};
    return false;
  }
  e.k = p.key_cache;
  e.v = p.value_cache;
  e.blocks = p.num_blocks;
  e.bs = p.block_size;
  e.kv_heads = p.num_kv_heads;
  e.l2 = l2;
  next = (next + 1) % kEntries;
  maps = e.maps;
  return true;
}

// Decode launches of at most PAGEDCORE_DECODE_DEEP_CTAS CTAs (default: one per
// multiprocessor, the deep variant's occupancy; 0 turns it off) take the deep
// pipeline; fp8 caches are widened by integer operations (K by the conversion
// unit in 128-key tiles: PAGEDCORE_FP8_CVT_MIX) unless PAGEDCORE_FP8_FAST_CVT=0.
// NOTE: measured on the H200 (bench/decode_variants.py):
// deep 14.6 against 15.1 us at B=1 L=4k, no change at L=256; at two per SM it
// also took B=1 L=32k (264 CTAs of ~1000 keys) and lost there, 61.5 against 52.3.
// Integer fp8 widening: 197.5 against 200.8 us at B=64 L=4k (within the noise) in
// its four-instruction form; 158.5 against 192.3 in three (9e16b8c).
//
// Variants (issue 13; bench/decode_variants.py measures each):
//   PAGEDCORE_DECODE_EARLY_META=1  kEarlyMeta: lengths and first block ids
//     before the PDL wait (every decode launch); =2 also kEarlyPrefetch; =0
//     off. Default: 1 over 16-bit caches, 0 over fp8. NOTE: measured on the
//     H200 (decode_variants.py at 5afe504, us, off -> on): B=1 L=256 8.5 -> 7.7,
//     L=4k 12.9 -> 12.2, L=32k 47.0 -> 46.1, B=64 L=1k 76.4 -> 75.1, L=4k
//     265.3 -> 264.0; under the decode graphs' plan 8B B=1 L=160 8.7 -> 6.9,
//     B=16 10.0 -> 8.9, SmolLM2 B=1 5.8 -> 5.0, B=16 6.2 -> 5.4; one loss,
//     SmolLM2 B=64 L=1k 20.3 -> 21.4. fp8: B=64 L=4k 198.6 -> 193.2 but B=1 L=4k
//     15.0 -> 16.0, so off there. =2 (L2 prefetch) gained nothing more.
//   PAGEDCORE_FP8_WIDE_TILES=1  fp8 launches that are not deep, integer
//     widening, head dim 64 or 128: 128-key tiles (the bytes of a 64-key bf16
//     tile), three stages, two CTAs an SM at d128: half the tiles' fixed
//     costs (barriers, max updates) per key, four score fragments a pass.
//     On by default (=0 turns it off): fp8 B=64 L=4k 198.6 -> 183.1 us (0.69x of bf16).
//   PAGEDCORE_DECODE_WIDE_D64=1  16-bit caches at head dim 64, launches that
//     are not deep: 128-key tiles, two stages, swizzled rows (three CTAs an
//     SM): half the tiles' fixed costs per key. On by default (=0: 64-key
//     tiles, three stages, padded rows). NOTE: measured on the H200
//     (decode_variants.py at 927106d, alternating; SmolLM2 B=64 L=1k, 192 CTAs):
//     19.0 -> 18.3 us with the rows split in two (planning's balance rule),
//     17.0 unsplit, which is why that rule is now off by default.
//   PAGEDCORE_FP8_CVT_MIX=1  fp8 128-key tiles: K widened by the conversion
//     unit (F2FP, two bytes an instruction, no integer operations), V by
//     integer operations, so that two pipes share the widening. Default; =0:
//     both by integer operations; =2: both by the conversion unit (V's even and
//     odd bytes gathered by a prmt first; fp8 B=64 L=4k 161.6 -> 157.4 and
//     156.6 -> 155.2 us in two runs, within their spread).
//     NOTE: measured on the H200 (decode_variants.py at 0f0306a / 55f182e): fp8
//     B=64 L=4k 157.4 -> 150.9 / 158.1 -> 150.8 us (V by cvt instead: 152.1; in
//     the deep pipeline, B=1 L=4k: 12.3 -> 12.2, so not there). ncu (same
//     launch, base clocks): ALU pipe 40% active, issue slots 42%, two warps an
//     SM sub-partition: no pipe and not issue is full; the latency of each
//     warp's dependent chains, with two warps to hide it, bounds the launch.
//   PAGEDCORE_DECODE_KEYS_IN_M  the decode warps with keys as the mma's rows
//     (the kernel's KM): half the mma of a row of at most 8 vectors. Unset:
//     fp8 128-key tiles at head dim 128 (not deep) only; =1 everywhere it is
//     built; =0 nowhere. NOTE: measured on the H200 (decode_variants.py,
//     alternating, us, default -> keys in M). At f82f8d1: B=1 L=256 5.3 -> 6.3,
//     L=4k 10.1 -> 11.0, L=32k 39.9 -> 40.7, B=64 L=1k 67.2 -> 68.5, L=4k 244.8 ->
//     247.4, SmolLM2 B=64 L=1k 17.0 -> 17.5, 8B B=1 / B=16 L=160 under the graph
//     plan 4.8 -> 5.5 / 5.5 -> 6.2, fp8 B=64 L=4k 161.6 -> 152.6. At 9fac98c (fp8;
//     V widened by integer operations / by cvt / K too by integer operations):
//     B=64 L=4k 156.6 -> 152.4 / 152.4 / 152.7, B=64 L=1k 50.6 -> 48.0 / 47.6 /
//     49.0, SmolLM2 (head dim 64) B=64 L=1k 14.6 -> 14.9 / 14.6 / 15.5, 8B B=16
//     L=4k under the graph plan (deep) 66.6 -> 69.8, B=1 L=4k 12.7 -> 12.7.
//   PAGEDCORE_DECODE_TMA  fp8 128-key tiles with keys in M at head dim 128: K
//     and V by bulk tensor copies, one per cache block (the kernel's TMA), on
//     Hopper at block sizes 8..128 (powers of two). Default; =0: by cp.async.
//     PAGEDCORE_DECODE_TMA_SPREAD=0: the boxes issued by warp 0 alone (kTmaSpread),
//     PAGEDCORE_DECODE_TMA_SKEW=0: by every warp behind each tile's barrier (kTmaSkew).
//     NOTE: measured on the H200 (decode_variants.py, us, cp.async -> TMA): at
//     c4367ca fp8 B=64 L=4k 153.6 -> 147.1, at 5064502 152.9 -> 146.4 (0.60x of
//     bf16's 246.0); fp8 B=64 L=1k, SmolLM2 fp8, the deep launches within 0.2.
//     Deleted after that run: refilling a stage by the last warp done with its
//     tile (a shared counter, no CTA barrier a tile, all three stages ahead):
//     148.2; again against the skew (cc3293b, measured at 8f61536): fp8 B=64
//     L=4k 138.8 -> 146.3 and 138.4 -> 146.6, B=64 L=1k 45.1 -> 49.2, B=512
//     L=4k one kv head 137.2 -> 146.3. Deleted after its one run (633d88f): eight warps a CTA, 16 keys
//     a warp a tile, six stages, one CTA an SM: fp8 B=64 L=4k 141.2 -> 222.7,
//     B=64 L=1k 45.7 -> 71.0. Reverted after its one run (8816492): 16-bit tiles by TMA in two
//     64-dim panels a row (four boxes a block piece, V rows past a range
//     zeroed), deep and shallow: B=1 L=256 5.4 -> 7.8, L=4k 9.3 -> 11.3, B=64
//     L=4k 247.0 -> 258.0, 8B B=1 L=160 graph plan 4.8 -> 6.6; and NaN outputs in
//     its tests on split rows, cause not found.
//   PAGEDCORE_DECODE_CLUSTER=C (4 or 8; 0: none; -C: an error where not served;
//     unset: the plan's decode_cluster, 4 where its longest decode row has 128
//     keys or more, planning._planned_cluster)  deep
//     launches over 16-bit caches at head dims 64 and 128 whose CTAs, the
//     splits rounded up to clusters of C, fit one wave and whose clusters fit
//     the GPU at once: a row that would run
//     unsplit (under 512 keys), or in splits but of at most C x
//     PAGEDCORE_DECODE_CLUSTER_KEYS keys (default 128; 0: none), is shared by C
//     CTAs of a cluster, merged through distributed shared memory ("Thread-block
//     clusters" above); the pushes by st.async on the owners' mbarriers
//     (kClusterAsync; PAGEDCORE_DECODE_CLUSTER_ASYNC=0: remote stores behind a
//     cluster barrier). Made for issue 13's B=1 L=256 (5.3-5.5 us against <= 4;
//     a row of 64 keys alone takes 3.3) and batch 1's split rows (L=512 / 1k:
//     6.0 / 7.2 us, a split through global memory ~2.5 of it). NOTE: measured
//     on the H200 (decode_variants.py at 61d22b2, us, plain -> clusters of 4
//     with st.async): B=1 L=16 3.1 -> 3.7 (hence the plan's 128 keys), L=128
//     4.0 -> 3.8, L=256 5.3 -> 3.9, L=400 7.6 -> 4.6, L=512 6.0 -> 4.7, SmolLM2
//     B=1 L=160 graph plan 4.0 -> 3.4; the barrier's way 0.1-0.3 slower; 8B
//     graph plans (128 CTAs: 32 clusters of 4, 16 of 8) do not fit at once and
//     run the plain kernel.
//   PAGEDCORE_DECODE_MERGE  how a split row's last CTA merges. Unset (or 1):
//     merge::count_and_merge_decode, one thread's fences instead of every
//     thread's, the (max, sum) pairs and partials loaded in one pass; =0:
//     merge::count_and_merge (every thread fences; pairs, then partials).
//     NOTE: measured on the H200 (decode_variants.py at 4c12dba, us, =0 -> one
//     pass): B=1 L=512 9.2 -> 8.0, L=4k 10.4 -> 9.4, L=32k 40.3 -> 39.1, fp8 B=1
//     L=4k 13.2 -> 12.0, 8B B=1 L=32k graph plan 40.4 -> 39.2; every launch
//     without splits within 0.1. A split still costs batch 1 ~2.5 us (B=1 L=512
//     in two splits of 256: 8.0; one split of 256: 5.5), ~3.5 before.
// Deleted after its one run (c3399c4, PAGEDCORE_DECODE_EARLY_KV): over 16-bit
// caches with early metadata, the first chunk's prologue K/V copies issued
// before the PDL wait (this step's keys, which the rotary may still be writing,
// after it; then the queries). It gains only where the kernel before is long,
// which in a layer it is not. Measured on the H200 (us, off -> on): graphs of 20
// decode launches (decode_variants.py), each launch's copies overlapping the
// launch before: B=1 L=256 6.3 -> 4.7, L=32k 39.2 -> 36.8, B=64 L=1k 67.9 ->
// 65.3, L=4k 245.0 -> 242.7, SmolLM2 B=64 L=1k 17.4 -> 15.8, under the decode
// graphs' plan 8B B=1 L=160 5.4 -> 4.2 but B=16 L=160 / 256 6.2 -> 6.6 / 7.1 ->
// 7.6. Behind the rotary's cache write, as a layer runs it (bench_kernels_gpu.py's
// after_cache_write_case: the pair's time less the rotary's, two rounds): B=1
// L=256 6.35 / 6.35 -> 6.57 / 6.72, L=4k 9.76 / 9.80 -> 10.05 / 10.12 (the
// rotary's ~1 us hides little, and issuing the copies first delays the queries).
// Deleted after the nineteenth session's run (decode_variants.py at f4ff310, us,
// default -> variant): the deep pipeline in 128-key tiles, three stages, swizzled
// (16-bit caches at head dims 64 and 128): B=1 L=256 5.4 -> 5.0, L=512 8.9 ->
// 8.5, but L=16 3.1 -> 3.6 and under the decode graphs' plans 8B B=1 / B=16
// L=160 4.8 -> 5.2 / 5.6 -> 6.1, SmolLM2 B=1 L=160 4.0 -> 4.3 (a split of
// fewer than 256 keys pays the wider tile's fixed costs).
// Deleted after the eighteenth session's runs (decode_variants.py at 0f0306a,
// 55f182e and 6769cb6; us, default -> variant):
// - K/V rows copied by 4 threads instead of 8 at head dim 128
//   (PAGEDCORE_ATTN_COPY_THREADS=4; fewer copy instructions, half the copies in
//   flight a pass): B=64 L=4k 239.7 -> 299.8, L=1k 66.2 -> 76.9, B=1 L=32k 39.8
//   -> 44.9, fp8 B=64 L=4k 157.4 -> 175.2.
// - eight-warp CTAs of 128-key tiles in the deep pipeline: B=1 L=256 5.5 -> 5.4,
//   L=32k 39.8 -> 39.1, but under the decode graphs' plan 8B B=1 L=160 4.7 ->
//   5.3, B=16 5.5 -> 6.1.
// - fp8 128-key tiles two deep, swizzled (three CTAs an SM): 157.4 -> 173.9 at
//   B=64 L=4k (512 CTAs: 1.3 waves); with 2 / 3 key splits forced to fill whole
//   waves 153.3 -> 160.0 / 163.6 (splits alone, two CTAs an SM: 175.3 / 189.4;
//   bf16 B=64 L=4k 246.0 -> 257.0 / 261.6).
// - fp8 64-key tiles, swizzled, <= 128 registers (88 bytes spilled): four CTAs
//   an SM, B=64's 512 CTAs in one wave: 150.8 -> 174.5.
// - four score fragments' mma chains split in two (SPLIT_K at ST = 4): fp8 150.8
//   -> 152.5, SmolLM2 B=64 L=1k 16.6 -> 17.1.
// Deleted after the twelfth session's runs (bench/RESULTS.md; d3441b5, eaa1fc4):
// eight-warp decode CTAs of two or three 128-key tiles (PAGEDCORE_DECODE_WIDE):
// B=64 L=1k 82.7-88.2 against 74.8 us, fp8 B=64 L=4k 226-230 against 186, B=1
// L=32k 52-55 against 45.6; their gains at batch 16 under the graph plan came
// from one CTA an SM, which the one-wave split plan (planning._decode_splits)
// now gives the deep pipeline without their losses.
// Deleted after the run at 5afe504, losers everywhere (git log --grep decode4): 32-key
// tiles of two warps with 4 or 6 stages (B=64 L=4k 350.0 / 270.4 against
// 265.3 us) and rows under 512 keys shared by a cluster of 2 or 4 CTAs,
// merged through distributed shared memory (B=1 L=256 9.2 / 11.6 against 8.5).
template <typename T, typename CT, int HD>
int launch_decode(const PagedAttentionParams& p, cudaStream_t stream, int flags, bool deep, bool fast) {
  constexpr bool FP8 = std::is_same_v<CT, uint8_t>;
  constexpr int kCvt = FP8 ? kCvtInt : 0;
  // Keys in the mma's M (the kernel's KM; the default pipelines' shapes
  // otherwise): fp8's 128-key tiles at head dim 128 where not deep take it by
  // default; PAGEDCORE_DECODE_KEYS_IN_M=1 takes it wherever it is built (bf16
  // queries, or fp16 over fp8, at head dims 64 and 128), =0 nowhere.
  constexpr bool kKmBuilt =
      (std::is_same_v<T, __nv_bfloat16> || (FP8 && std::is_same_v<T, __half>)) && (HD == 64 || HD == 128);
  if constexpr (kKmBuilt) {
    const int km = env_int("PAGEDCORE_DECODE_KEYS_IN_M", -1);
    const bool km_default = FP8 && HD == 128 && fast && !deep && env_int("PAGEDCORE_FP8_WIDE_TILES", 1) != 0;
    if (km > 0 ? (!FP8 || fast) : (km < 0 && km_default)) {
      if constexpr (!FP8) {  // (PAGEDCORE_DECODE_CLUSTER=-C asks for the clusters or an error)
        if (deep && env_int("PAGEDCORE_DECODE_CLUSTER", 0) < 0) return cudaErrorNotSupported;
      }
      if (deep) return launch_variant<T, CT, HD, true, deep_stages<HD>(), kCvt, kTileKeys, 16, true>(p, stream, flags);
      if constexpr (FP8) {
        const int mix = env_int("PAGEDCORE_FP8_CVT_MIX", 1);
        if constexpr (HD == 128) {
#ifdef PAGEDCORE_WITH_WGMMA
          // PAGEDCORE_DECODE_WGMMA=1: e4m3 wgmma, the cache's bytes never widened
          // (attention_decode_wgmma.cu), where it serves, on compute capability 9.0
          // with the default mix; =2: an error where it does not serve (tests).
          // Off by default: measured on the H200 (decode_variants.py, us, widened
          // by TMA -> wgmma): at d9d598b fp8 B=64 L=4k 147.2 -> 149.4, B=64 L=1k
          // 48.0 -> 49.5; at aa83e2a (P V retired by the next tile's S wait) 146.1
          // -> 148.7, 48.4 -> 49.9. A third of the widened kernel's instructions
          // and the same time: neither kernel is bound by its instructions.
          const int wg = env_int("PAGEDCORE_DECODE_WGMMA", 0);
          if (wg != 0 && mix == 1 && ((flags & kOnePassMerge) != 0 || p.decode_splits == 1) &&
              compute_capability() == 90) {
            DecodeMaps<true> maps;
            if (decode_tma_serves(p) && encode_decode_maps<HD>(p, maps, 256)) {
              const int e = decode_fp8_wgmma(p, DecodeFp8Maps{maps.k, maps.v}, stream);
              if (e != cudaErrorNotSupported) return e;
            }
          }
          if (wg == 2) return cudaErrorNotSupported;
#endif
          // K/V tiles by bulk tensor copies (the kernel's TMA) where served,
          // with the default mix (else by cp.async); PAGEDCORE_DECODE_TMA=0:
          // never; =2: an error where not served (tests).
          const int tma = env_int("PAGEDCORE_DECODE_TMA", 1);
          if (tma != 0) {
            DecodeMaps<true> maps;
            if (mix == 1 && decode_tma_serves(p) && encode_decode_maps<HD>(p, maps, 128)) {
              // (PAGEDCORE_DECODE_TMA_SPREAD=0, warp 0's issue, keeps each tile's barrier)
              if ((flags & kTmaSpread) != 0 && env_int("PAGEDCORE_DECODE_TMA_SKEW", 1) != 0) {
                // (above, kLeanSoftmax and kLeanNarrow; PAGEDCORE_DECODE_TMA_LEAN=0: neither)
                if (env_int("PAGEDCORE_DECODE_TMA_LEAN", 1) != 0) {
                  if (p.softcap == 0.f && p.decode_max_query_tokens > 0 &&
                      p.decode_max_query_tokens * (p.num_heads / p.num_kv_heads) <= 8) {
                    // At block sizes up to 64, the narrow kernel in 64-key tiles, three
                    // stages (53 KB, 117-119 registers): four CTAs an SM, so that fp8
                    // B=64's 512 CTAs run in one wave, with twice the warps a scheduler
                    // to hide each tile's chains; PAGEDCORE_DECODE_TMA_KT64=0: 128-key
                    // tiles, as at larger blocks. Measured on an H100 (decode_variants.py,
                    // two runs, us, 128 -> 64 keys, at 9dc434d): fp8 B=64 L=4k 185.1 ->
                    // 183.7 and 185.2 -> 183.9, L=1k 55.1 -> 52.0 and 55.4 -> 52.3, B=512
                    // one kv head 181.5 -> 179.9 and 182.0 -> 180.2; bf16 and head dim 64
                    // unchanged (not these kernels).
                    if (env_int("PAGEDCORE_DECODE_TMA_KT64", 1) != 0 && p.block_size <= 64) {
                      return launch_variant<T, CT, HD, true, 3, kCvtIntV, 64, 0, true, kTmaSkew, 1,
                                            kLeanSoftmax | kLeanNarrow>(p, stream, flags, maps);
                    }
                    return launch_variant<T, CT, HD, true, 3, kCvtIntV, 128, 0, true, kTmaSkew, 1,
                                          kLeanSoftmax | kLeanNarrow>(p, stream, flags, maps);
                  }
                  return launch_variant<T, CT, HD, true, 3, kCvtIntV, 128, 0, true, kTmaSkew, 1, kLeanSoftmax>(
                      p, stream, flags, maps);
                }
                return launch_variant<T, CT, HD, true, 3, kCvtIntV, 128, 0, true, kTmaSkew>(p, stream, flags, maps);
              }
              return launch_variant<T, CT, HD, true, 3, kCvtIntV, 128, 0, true, 1>(p, stream, flags, maps);
            }
            if (tma == 2) return cudaErrorNotSupported;
          }
        }
        switch (mix) {  // (as below)
          case 0: return launch_variant<T, CT, HD, true, 3, kCvtInt, 128, 16, true>(p, stream, flags);
          case 2: return launch_variant<T, CT, HD, true, 3, 0, 128, 16, true>(p, stream, flags);
          default: return launch_variant<T, CT, HD, true, 3, kCvtIntV, 128, 16, true>(p, stream, flags);
        }
      } else if constexpr (HD == 64) {
        return launch_variant<T, CT, HD, true, 2, 0, 128, 0, true>(p, stream, flags);
      } else {
        return launch_variant<T, CT, HD, true, num_stages<HD, true>(), 0, kTileKeys, 16, true>(p, stream, flags);
      }
    }
  }
  if (deep) {
    if constexpr (!FP8 && (HD == 64 || HD == 128)) {
      // Rows of one split shared by clusters of C CTAs (4 or 8), where the launch's
      // CTAs (the splits rounded up to whole clusters) fit one wave of one an SM on
      // compute capability 9.0 and up and its clusters fit the GPU at once: C is the
      // plan's (p.decode_cluster, by default 4 where a row has 128 keys or more),
      // unless PAGEDCORE_DECODE_CLUSTER (read per launch) sets it: C, 0 (off), or
      // -C (an error where it does not serve: tests). The pushes go by st.async on
      // the owners' mbarriers (PAGEDCORE_DECODE_CLUSTER_ASYNC=0: remote stores
      // behind a second cluster barrier).
      const char* switch_value = std::getenv("PAGEDCORE_DECODE_CLUSTER");
      const bool forced = switch_value != nullptr && *switch_value != '\0';
      const int cluster = env_int("PAGEDCORE_DECODE_CLUSTER", p.decode_cluster);
      if (cluster != 0) {
        const int c = cluster < 0 ? -cluster : cluster;
        const int z = ((p.decode_splits > 1 ? p.decode_splits : 1) + c - 1) / c * c;
        const int64_t ctas = static_cast<int64_t>(p.num_kv_heads) * p.num_decode * z;
        if ((c == 4 || c == 8) && compute_capability() >= 90 && ctas <= multiprocessor_count()) {
          // Rows under PAGEDCORE_DECODE_CLUSTER_MIN_KEYS (read per launch; 128 by
          // default, the plans' threshold; 0: none) run by their cluster's first CTA
          // alone: the decode graphs' plans cannot see the rows' lengths. NOTE:
          // measured on the H200 (decode_variants.py at a3b0456, us, min 0 -> 128 ->
          // clusters off): SmolLM2 B=1 L=32 graph plan 3.5 -> 2.9 -> 2.8, L=160 graph
          // plan 3.6 -> 3.6 -> 4.1, B=1 L=256 4.1 -> 4.2 -> 5.5, L=16 3.3 -> 3.2 -> 3.2.
          PagedAttentionParams q = p;
          q.decode_cluster_min_keys = env_int("PAGEDCORE_DECODE_CLUSTER_MIN_KEYS", 128);
          const int f = flags | (env_int("PAGEDCORE_DECODE_CLUSTER_ASYNC", 1) != 0 ? kClusterAsync : 0) |
                        (env_int("PAGEDCORE_DECODE_CLUSTER_KEYS", 128) / kTileKeys) << kClusterKeysShift;
          const int e =
              c == 4 ? launch_variant<T, CT, HD, true, deep_stages<HD>(), 0, kTileKeys, 16, false, 0, 4>(q, stream, f)
                     : launch_variant<T, CT, HD, true, deep_stages<HD>(), 0, kTileKeys, 16, false, 0, 8>(q, stream, f);
          if (e != kClusterLaunchTooLarge || cluster < 0) return e;
          // More clusters than fit at once: the plain launch below (where the switch
          // asked for clusters, said once, so that a trial's timing equal to the plain
          // kernel's is not read as the clusters').
          static bool told = false;
          if (forced && !told) {
            told = true;
            std::fprintf(stderr,
                         "pagedcore: PAGEDCORE_DECODE_CLUSTER=%d: a launch of %lld CTAs holds more clusters than "
                         "fit on the GPU at once; such launches run the plain kernel\n",
                         cluster, static_cast<long long>(ctas));
          }
        } else if (cluster < 0) {
          return cudaErrorNotSupported;
        }
      }
    }
    return fast ? launch_variant<T, CT, HD, true, deep_stages<HD>(), kCvt, kTileKeys>(p, stream, flags)
                : launch_variant<T, CT, HD, true, deep_stages<HD>(), 0, kTileKeys>(p, stream, flags);
  }
  if constexpr (FP8 && (HD == 64 || HD == 128)) {
    if (fast && env_int("PAGEDCORE_FP8_WIDE_TILES", 1) != 0) {
      switch (env_int("PAGEDCORE_FP8_CVT_MIX", 1)) {
        case 0: return launch_variant<T, CT, HD, true, 3, kCvtInt, 128>(p, stream, flags);
        case 2: return launch_variant<T, CT, HD, true, 3, 0, 128>(p, stream, flags);
        default: return launch_variant<T, CT, HD, true, 3, kCvtIntV, 128>(p, stream, flags);
      }
    }
  }
  if constexpr (!FP8 && HD == 64) {
    // 128-key tiles, two in flight, swizzled rows (68 KB: three CTAs an SM).
    if (env_int("PAGEDCORE_DECODE_WIDE_D64", 1) != 0) {
      return launch_variant<T, CT, HD, true, 2, 0, 128, 0>(p, stream, flags);
    }
  }
  return fast ? launch_variant<T, CT, HD, true, num_stages<HD, true>(), kCvt, kTileKeys>(p, stream, flags)
              : launch_variant<T, CT, HD, true, num_stages<HD, true>(), 0, kTileKeys>(p, stream, flags);
}

template <typename T, typename CT, int HD, bool DECODE>
int launch_kernel(const PagedAttentionParams& p, cudaStream_t stream) {
  constexpr bool FP8 = std::is_same_v<CT, uint8_t>;
  if constexpr (DECODE) {
    const int early = env_int("PAGEDCORE_DECODE_EARLY_META", FP8 ? 0 : 1);
    const int flags = (early == 0 ? 0 : (early == 2 ? kEarlyMeta | kEarlyPrefetch : kEarlyMeta)) |
                      (env_int("PAGEDCORE_DECODE_MERGE", 1) != 0 ? kOnePassMerge : 0) |
                      (env_int("PAGEDCORE_DECODE_TMA_SPREAD", 1) != 0 ? kTmaSpread : 0);
    const int64_t ctas = static_cast<int64_t>(p.num_kv_heads) * p.num_decode * p.decode_splits;
    const bool deep = ctas <= env_int("PAGEDCORE_DECODE_DEEP_CTAS", multiprocessor_count());
    const bool fast = FP8 && env_int("PAGEDCORE_FP8_FAST_CVT", 1) != 0;
    return launch_decode<T, CT, HD>(p, stream, flags, deep, fast);
  } else {
    return launch_variant<T, CT, HD, false, num_stages<HD, false>(), 0>(p, stream);
  }
}

template <typename T, typename CT, int HD>
int launch_all(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_decode > 0) {
    const int e = launch_kernel<T, CT, HD, true>(p, stream);
    if (e != cudaSuccess) return e;
  }
#ifdef PAGEDCORE_WITH_WGMMA
  if (p.num_work > 0 && wgmma_prefill_serves(p)) return paged_attention_wgmma(p, stream);
#endif
  if (p.num_work > 0) return launch_kernel<T, CT, HD, false>(p, stream);
  return cudaSuccess;
}

template <typename T, typename CT>
int dispatch_head_dim(const PagedAttentionParams& p, cudaStream_t s) {
  switch (p.head_dim) {
    case 32: return launch_all<T, CT, 32>(p, s);
    case 64: return launch_all<T, CT, 64>(p, s);
    case 80: return launch_all<T, CT, 80>(p, s);
    case 96: return launch_all<T, CT, 96>(p, s);
    case 128: return launch_all<T, CT, 128>(p, s);
    case 256: return launch_all<T, CT, 256>(p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
int dispatch_cache(const PagedAttentionParams& p, cudaStream_t s) {
  if (p.kv_dtype == DType::kFloat8E4M3) return dispatch_head_dim<T, uint8_t>(p, s);
  if (p.kv_dtype != p.dtype) return cudaErrorInvalidValue;
  return dispatch_head_dim<T, T>(p, s);
}

}  // namespace

namespace {

// A device attribute of the current device, asked once per device (`fallback`
// where it cannot be asked).
template <cudaDeviceAttr A>
int cached_device_attribute(int fallback) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  static bool asked[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return fallback;
  }
  if (!asked[dev]) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, A, dev) != cudaSuccess) {
      cudaGetLastError();
      n = fallback;
    }
    cached[dev] = n;
    asked[dev] = true;
  }
  return cached[dev];
}

}  // namespace

// Multiprocessors of the current device (132, an H100/H200's, where the device
// cannot be asked).
int multiprocessor_count() { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(132); }

int compute_capability() {
  const int major = cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(0);
  return major <= 0 ? 0 : 10 * major + cached_device_attribute<cudaDevAttrComputeCapabilityMinor>(0);
}

int paged_attention_mma(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_cache<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return dispatch_cache<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore::cuda
