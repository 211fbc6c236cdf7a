// Decode attention over an fp8 (e4m3) KV cache on Hopper's fp8 tensor cores
// (sm_90a): the cache's bytes are the wgmma operands, never widened. Opt-in
// (PAGEDCORE_DECODE_WGMMA=1; attention_mma.cu's launch_decode says why).
//
// One CTA (one warpgroup, 128 threads) takes a (decode row, kv head, key split),
// like the mma.sync decode kernel; its keys arrive in 128-key tiles by TMA,
// one bulk tensor copy per cache block (K and V, 128-byte swizzle), three
// tiles in flight. The row's query vectors (query tokens x the heads of the
// kv head, at most 16) are the N of every product, keys or head dims its M:
//   S^T = K Q^T   wgmma m64n32k32 e4m3, K (64 keys x 32 dims a step) and Q^T
//                 from shared memory: warp w holds keys 64 mb + 16 w + (g, g + 8);
//   online softmax per vector: each warp's maximum, then the warpgroup's
//                 through shared memory (all four warps add into one O);
//   O^T += V^T P^T  wgmma m64n32k32 e4m3, V^T from registers (ldmatrix.trans of
//                 byte pairs and two prmt a register: warp w holds head dims
//                 64 mb + 16 w + 2 g + (0, 1)), P^T from shared memory.
// Q and P enter as two e4m3 terms each (N = 32: the 16 vectors' first terms,
// then their second terms, summed after the product), which hold bf16's 8
// significant bits; Q per vector scaled by a power of two (its largest |q| to
// 128-256, undone in the score scale), P taken 2^kPOff larger so that its small
// values stay clear of e4m3's subnormals (the running max then lets it grow
// only 2^kSlack before a rescale). So the rounding beyond the cache's own is
// bf16's, besides e4m3's subnormal floor: bf16 queries only (fp16's 11 bits
// would take three terms). k_scale folds into the score scale, v_scale into
// the output.
//
// A CTA's keys start at a block boundary (a box is a whole block), its share
// rounded to whole tiles. Keys of a tile outside the row's range [k_lo, end)
// are masked in S; their V bytes (anything: the cache's unwritten slots, stale
// rows of the stage, NaN too) are zeroed in the registers before the product,
// where 0 x NaN would be NaN. Split rows merge in their last CTA
// (merge::count_and_merge_decode).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "attention_merge.cuh"
#include "attention_wgmma.h"
#include "device_ops.cuh"
#include "pdl.cuh"
#include "wgmma_ops.cuh"

namespace pagedcore::cuda {

namespace {

using dev::fast_exp2;
using dev::ldmatrix_x4_trans;
using dev::Pair;
using dev::raise_max;
using dev::store_pair;
using dev::to_float2;

constexpr int kHD = 128;       // head dim (bytes of a staged row)
constexpr int kKT = 128;       // keys a tile
constexpr int kThreads = 128;  // one warpgroup
constexpr int kTableIds = 1024;  // block ids staged at once
constexpr int kVectors = 16;   // query vectors a row at most (a decode item)
constexpr int kN = 2 * kVectors;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kPOff = 6.f;   // P taken 2^kPOff larger (log2 units)
constexpr float kSlack = 2.f;  // the max may lag the scores by this (log2 units)

// Shared memory from a 1024-aligned base: the stages (K tile, V tile: 128
// rows of 128 bytes each, swizzled), Q^T and P^T (kN rows of 128 bytes,
// swizzled: row n < 16 vector n's first term, row 16 + n its second), the
// block ids, the warps' maxima [warp][vector], the vectors' unscales, the
// stages' mbarriers.
constexpr int kTileBytes = kKT * kHD;
template <int STAGES>
struct Layout {
  static constexpr int kQOff = STAGES * 2 * kTileBytes;
  static constexpr int kPOffset = kQOff + kN * kHD;
  static constexpr int kTableOff = kPOffset + kN * kKT;
  static constexpr int kMaxOff = kTableOff + kTableIds * 4;
  static constexpr int kUnscaleOff = kMaxOff + 4 * kVectors * 4;
  static constexpr int kBarOff = kUnscaleOff + kVectors * 4;
  static constexpr size_t kSmemBytes = kBarOff + 8 * STAGES + 1024;  // (+ the base's alignment)
};

// Byte b of row r of a 128-byte-row swizzled tile (TMA's SWIZZLE_128B, wgmma's
// 128-byte swizzle): 16-byte chunk c at c ^ (r % 8).
__device__ __forceinline__ uint32_t sw(int r, int b) { return r * 128 + (b ^ ((r & 7) << 4)); }

// Two floats -> two e4m3 bytes (x the low one), to nearest, saturated.
__device__ __forceinline__ uint32_t e4m3x2(float x, float y) {
  return __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3);
}
// Two e4m3 bytes (low first) -> float2.
__device__ __forceinline__ float2 e4m3x2_value(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  __half2 v;
  *reinterpret_cast<__half2_raw*>(&v) = h;
  return __half22float2(v);
}
// Four floats (x0 the low byte) -> two e4m3 words: hi, and lo, e4m3 of what hi leaves.
__device__ __forceinline__ void e4m3x4_terms(float x0, float x1, float x2, float x3, uint32_t& hi, uint32_t& lo) {
  const uint32_t h01 = e4m3x2(x0, x1), h23 = e4m3x2(x2, x3);
  const float2 b01 = e4m3x2_value(h01), b23 = e4m3x2_value(h23);
  hi = h01 | (h23 << 16);
  lo = e4m3x2(x0 - b01.x, x1 - b01.y) | (e4m3x2(x2 - b23.x, x3 - b23.y) << 16);
}

// D[64 x 32] (+)= A[64 x 32] B[32 x 32], e4m3, float accumulators; A and B
// K-major in shared memory.
__device__ __forceinline__ void mma_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// D[64 x 32] += A[64 x 32] B[32 x 32]; A in registers (warp w's rows 16w..16w+15,
// mma.m16n8k32's A fragment), B K-major in shared memory.
__device__ __forceinline__ void mma_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// Accumulator element e of a thread (wgmma m64n32: rows 16 w + g + 8 (e % 4 / 2),
// columns 8 (e / 4) + 2 q + e % 2): chunks 0 and 1 hold vectors' first terms,
// 2 and 3 their second terms; the thread's column state r = 2 (e / 4 % 2) + e % 2
// is vector 8 (r / 2) + 2 q + r % 2.
__device__ __forceinline__ int vector_of(int r, int q) { return 8 * (r / 2) + 2 * q + r % 2; }

// STAGES: tiles in flight (3: two CTAs an SM).
template <typename T, int STAGES>
__global__ void __launch_bounds__(kThreads)
    decode_fp8_wgmma_kernel(PagedAttentionParams p, const __grid_constant__ DecodeFp8Maps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kStages = STAGES;
  using L = Layout<STAGES>;
  constexpr int kQOff = L::kQOff, kPOffset = L::kPOffset, kTableOff = L::kTableOff, kMaxOff = L::kMaxOff,
                kUnscaleOff = L::kUnscaleOff, kBarOff = L::kBarOff;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (wgmma::smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t base = wgmma::smem_addr(smem);
  int32_t* s_table = reinterpret_cast<int32_t*>(smem + kTableOff);
  float* s_max = reinterpret_cast<float*>(smem + kMaxOff);
  float* s_unscale = reinterpret_cast<float*>(smem + kUnscaleOff);
  const uint32_t bars = base + kBarOff;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) wgmma::mbar_init(bars + 8 * s, 1);
    wgmma::mbar_init_fence();
    wgmma::tma_prefetch_map(&maps.k);
    wgmma::tma_prefetch_map(&maps.v);
  }
  pdl_wait();  // (the queries and this step's keys come from the kernels before)
  pdl_launch_dependents();

  const int kv_head = blockIdx.x;
  const int work = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int row = p.decode_seq[work];
  if (row < 0) return;  // a padded plan's spare item
  const int splits = merge::decode_active_splits(p, merge::decode_keys(p, row));
  if (split >= splits) return;  // a short row: fewer splits than planned
  const int group = p.num_heads / p.num_kv_heads;
  const int q_begin = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q_begin;
  const int ctx = p.seq_lens[row];
  const int num_vectors = q_len * group;  // (<= kVectors: the host's check)
  const int first_pos = ctx - q_len;
  const int k_lo = p.sliding_window > 0 ? max(0, first_pos - p.sliding_window + 1) : 0;
  const int k_hi = ctx;
  const int bs = p.block_size;
  const int bs_shift = __ffs(bs) - 1;  // (powers of two: the host's check)
  const int k_first = k_lo & ~(bs - 1);
  const int per_split = (k_hi - k_first + splits * kKT - 1) / (splits * kKT) * kKT;
  const int s_lo = k_first + split * per_split;
  const int s_hi = min(k_hi, s_lo + per_split);
  const bool hi_vectors = num_vectors > 8;  // the column states r = 2, 3 in use

  // Q^T: thread t takes vector t / 8's dims 16 (t % 8) .. + 15, scaled by a
  // power of two (the vector's largest |q| to [128, 256)), as two e4m3 terms.
  {
    const int v = threadIdx.x / 8, c = threadIdx.x % 8;
    float x[16];
    float amax = 0.f;
    if (v < num_vectors) {
      const T* src = static_cast<const T*>(p.query) + (q_begin + static_cast<int64_t>(v / group)) * p.query_stride +
                     static_cast<int64_t>(kv_head * group + v % group) * kHD + 16 * c;
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float2 f = to_float2(*reinterpret_cast<const Pair<T>*>(src + i));
        x[i] = f.x;
        x[i + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = 0.f;
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    int e;
    frexpf(amax, &e);  // amax in [2^(e-1), 2^e)
    const float up = ldexpf(1.f, 8 - e);
    if (c == 0) s_unscale[v] = ldexpf(1.f, e - 8);
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      e4m3x4_terms(x[4 * i] * up, x[4 * i + 1] * up, x[4 * i + 2] * up, x[4 * i + 3] * up, hi[i], lo[i]);
    }
    *reinterpret_cast<uint4*>(smem + kQOff + sw(v, 16 * c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(smem + kQOff + sw(kVectors + v, 16 * c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    wgmma::fence_proxy_async();  // (generic writes, read by wgmma)
  }
  __syncthreads();  // Q^T, the unscales and the mbarriers are ready

  const float score_scale = p.scale * p.k_scale;
  const float softcap = p.softcap;
  float col_log2[4], col_cap[4];  // per column state: the score's factor (no cap), or tanh's argument's
  int key_to[4], key_from[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int v = vector_of(r, q);
    const float unscale = s_unscale[v];
    col_log2[r] = score_scale * unscale * kLog2e;
    col_cap[r] = softcap > 0.f ? score_scale * unscale / softcap : 0.f;
    const int pos = first_pos + v / group;
    key_from[r] = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
    key_to[r] = v < num_vectors ? pos : -1;
  }
  const float softcap_log2 = softcap * kLog2e;

  float m[4], l[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  float o[2][16];  // O^T: [dims block mb][element]: rows head dims 64 mb + 16 w + 2 g + (0, 1)
#pragma unroll
  for (int mb = 0; mb < 2; ++mb) {
#pragma unroll
    for (int e = 0; e < 16; ++e) o[mb][e] = 0.f;
  }
  uint32_t phase = 0;  // bit s: the parity stage s's next wait expects
  const int32_t* table = p.block_tables + static_cast<int64_t>(row) * p.block_tables_stride;
  // V^T A fragments: lane j addresses matrix j / 8's row j % 8, which holds key
  // 64 (j / 8 % 2) + 16 s + 4 (j / 16) + (j % 8) / 2 + 8 (j % 2) of k step s:
  // after the prmt, register 0's byte i (k step position 4 q + i) is key
  // 64 (i / 2) + 16 s + q + 8 (i % 2), register 2's the same + 4 — the
  // positions P^T's words take (below).
  const int mi = lane / 8, mr = lane % 8;
  const int v_key = 64 * (mi % 2) + 4 * (mi / 2) + mr / 2 + 8 * (mr % 2);

  for (int c0 = s_lo; c0 < s_hi;) {
    const int b0 = c0 >> bs_shift;
    const int c1 = min(s_hi, (b0 + kTableIds) * bs);
    const int n_tiles = (c1 - c0 + kKT - 1) / kKT;
    __syncthreads();  // the previous chunk's table and stages are consumed
    for (int i = threadIdx.x; i <= ((c1 - 1) >> bs_shift) - b0; i += kThreads) s_table[i] = table[b0 + i];
    __syncthreads();

    // Tile t's blocks by warp 0: lane j block j (those holding keys of the
    // chunk), lane 0 arming the stage's mbarrier with their K and V bytes.
    auto issue_tile = [&](int t) {
      const int kb = c0 + t * kKT + lane * bs;
      const bool load = lane * bs < kKT && kb < c1;
      const uint32_t bar = bars + 8 * (t % kStages);
      const int blocks = __popc(__ballot_sync(0xffffffffu, load));
      if (lane == 0) {
        wgmma::fence_proxy_async();  // (the stage's reads by ldmatrix, then the async writes)
        wgmma::mbar_arrive_expect_tx(bar, blocks * bs * kHD * 2);
      }
      __syncwarp();
      if (load) {
        const uint32_t dst = base + (t % kStages) * 2 * kTileBytes + lane * bs * kHD;
        const int block = s_table[(kb >> bs_shift) - b0];
        wgmma::tma_load_4d(dst, &maps.k, 0, kv_head, 0, block, bar);
        wgmma::tma_load_4d(dst + kTileBytes, &maps.v, 0, kv_head, 0, block, bar);
      }
    };
    if (warp == 0) {
#pragma unroll
      for (int t = 0; t < kStages - 1; ++t) {
        if (t < n_tiles) issue_tile(t);
      }
    }
    for (int t = 0; t < n_tiles; ++t) {
      const int st = t % kStages;
      wgmma::mbar_wait(bars + 8 * st, (phase >> st) & 1u);
      phase ^= 1u << st;
      __syncthreads();  // tile t-1 is consumed (its stage, P^T and the maxima free)
      if (warp == 0 && t + kStages - 1 < n_tiles) issue_tile(t + kStages - 1);
      const uint32_t kt = base + st * 2 * kTileBytes;
      const uint32_t vt = kt + kTileBytes;
      const int kbase = c0 + t * kKT;

      // S^T = K Q^T: [keys block mb][element].
      float s[2][16];
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
#pragma unroll
        for (int e = 0; e < 16; ++e) s[mb][e] = 0.f;
      }
      wgmma::pin(s[0]);
      wgmma::pin(s[1]);
      wgmma::fence();
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
#pragma unroll
        for (int k = 0; k < kHD / 32; ++k) {
          mma_ss(s[mb], wgmma::desc(kt + mb * 64 * 128 + 32 * k, 16, 1024), wgmma::desc(base + kQOff + 32 * k, 16, 1024),
                 k > 0);
        }
      }
      wgmma::commit();
      wgmma::wait<0>();  // (this S, and the tile before's P V)
      wgmma::pin(s[0]);
      wgmma::pin(s[1]);
      wgmma::pin(o[0]);
      wgmma::pin(o[1]);

      // Scores (log2 units), masked: x[mb][h][r], key kbase + 64 mb + 16 w + g + 8 h.
      const bool whole = kbase >= k_lo && kbase + kKT <= c1 && kbase + kKT - 1 <= first_pos &&
                         (p.sliding_window == 0 || kbase > ctx - 1 - p.sliding_window);
      float x[2][2][4];
      float tmax[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int e = 4 * (r / 2) + 2 * h + r % 2;
            const float v = s[mb][e] + s[mb][e + 8];  // (the two terms of Q)
            float y = softcap > 0.f ? softcap_log2 * tanhf(v * col_cap[r]) : v * col_log2[r];
            if (!whole) {
              const int key = kbase + 64 * mb + 16 * warp + g + 8 * h;
              y = key >= key_from[r] && key <= key_to[r] && key >= k_lo && key < c1 ? y : -INFINITY;
            }
            x[mb][h][r] = y;
            tmax[r] = fmaxf(tmax[r], y);
          }
        }
      }
      // The warpgroup's maximum per vector: over g, then the four warps.
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 4));
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 8));
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 16));
        if (g == 0) s_max[warp * kVectors + vector_of(r, q)] = tmax[r];
      }
      wgmma::named_sync(1, kThreads);
      bool grow = false;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int v = vector_of(r, q);
        tmax[r] = fmaxf(fmaxf(s_max[v], s_max[kVectors + v]), fmaxf(s_max[2 * kVectors + v], s_max[3 * kVectors + v]));
        grow |= tmax[r] > m[r] + kSlack;
      }
      if (__any_sync(0xffffffffu, grow)) {
        float corr[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) corr[r] = raise_max(m[r], l[r], tmax[r]);
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
#pragma unroll
          for (int e = 0; e < 16; ++e) o[mb][e] *= corr[2 * (e / 4 % 2) + e % 2];
        }
      }
      // P^T: the thread's four keys of a vector (64 mb + 16 w + g + 8 h) as one
      // word at position 32 w + 4 g (byte 2 mb + h), both terms.
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r >= 2 && !hi_vectors) continue;
        const float mr_ = (m[r] == -INFINITY ? 0.f : m[r]) - kPOff;
        float e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          e[i] = fast_exp2(x[i / 2][i % 2][r] - mr_);
          l[r] += e[i];
        }
        uint32_t hi, lo;
        e4m3x4_terms(e[0], e[1], e[2], e[3], hi, lo);
        const int v = vector_of(r, q);
        *reinterpret_cast<uint32_t*>(smem + kPOffset + sw(v, 32 * warp + 4 * g)) = hi;
        *reinterpret_cast<uint32_t*>(smem + kPOffset + sw(kVectors + v, 32 * warp + 4 * g)) = lo;
      }
      if (!hi_vectors) {  // (vectors 8-15: zero, so that the product's unused columns stay finite)
#pragma unroll
        for (int r = 2; r < 4; ++r) {
          const int v = vector_of(r, q);
          *reinterpret_cast<uint32_t*>(smem + kPOffset + sw(v, 32 * warp + 4 * g)) = 0u;
          *reinterpret_cast<uint32_t*>(smem + kPOffset + sw(kVectors + v, 32 * warp + 4 * g)) = 0u;
        }
      }
      wgmma::fence_proxy_async();
      wgmma::named_sync(1, kThreads);  // P^T is whole

      // O^T += V^T P^T: k step ks = the keys warp ks held above.
      uint32_t a[4][2][4];  // [k step][dims block][register]
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int key = v_key + 16 * ks;
        uint32_t keep[2] = {0xffffffffu, 0xffffffffu};
        if (!(kbase >= k_lo && kbase + kKT <= c1)) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int k = kbase + 64 * (i / 2) + 16 * ks + 4 * j + q + 8 * (i % 2);
              if (k < k_lo || k >= c1) keep[j] &= ~(0xffu << (8 * i));
            }
          }
        }
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          uint32_t b[4];
          ldmatrix_x4_trans(vt + sw(key, 16 * (4 * mb + warp)), b);
          a[ks][mb][0] = __byte_perm(b[0], b[1], 0x6420) & keep[0];
          a[ks][mb][1] = __byte_perm(b[0], b[1], 0x7531) & keep[0];
          a[ks][mb][2] = __byte_perm(b[2], b[3], 0x6420) & keep[1];
          a[ks][mb][3] = __byte_perm(b[2], b[3], 0x7531) & keep[1];
        }
      }
      wgmma::pin(o[0]);
      wgmma::pin(o[1]);
      wgmma::fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) mma_rs(o[mb], a[ks][mb], wgmma::desc(base + kPOffset + 32 * ks, 16, 1024));
      }
      wgmma::commit();
      // NOTE: not awaited here: the next tile's S wait retires it (the group
      // before), so that its latency passes under the next tile's barrier, TMA
      // wait and S issue; until then nothing touches o, a or P^T (the stage's V
      // is in registers already).
    }
    c0 = c1;
  }
  wgmma::wait<0>();
  wgmma::pin(o[0]);
  wgmma::pin(o[1]);

  // l per vector: over g, then the warps (s_max reused; its last readers
  // passed the tile's second barrier).
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 4);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 8);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 16);
  }
  __syncthreads();
  if (g == 0) {
#pragma unroll
    for (int r = 0; r < 4; ++r) s_max[warp * kVectors + vector_of(r, q)] = l[r];
  }
  __syncthreads();
  const float out_scale = p.v_scale;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int v = vector_of(r, q);
    if (v >= num_vectors) continue;
    const float den = s_max[v] + s_max[kVectors + v] + s_max[2 * kVectors + v] + s_max[3 * kVectors + v];
    const float inv = den > 0.f ? out_scale / den : 0.f;
    const int ch = r / 2;  // the first term's chunk; the second's is ch + 2
    if (splits == 1) {
      T* dst = static_cast<T*>(p.out) +
               (static_cast<int64_t>(q_begin + v / group) * p.num_heads + kv_head * group + v % group) * kHD;
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        const int e = 4 * ch + r % 2;
        // rows g and g + 8: head dims 64 mb + 16 w + 2 g and the one after
        store_pair(dst + 64 * mb + 16 * warp + 2 * g, (o[mb][e] + o[mb][e + 8]) * inv, (o[mb][e + 2] + o[mb][e + 10]) * inv);
      }
    } else {
      const int64_t slot =
          ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * p.decode_splits + split) *
              kAttentionPartialVectors + v;
      float* dst = p.decode_partial_out + slot * kHD;
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        const int e = 4 * ch + r % 2;
        *reinterpret_cast<float2*>(dst + 64 * mb + 16 * warp + 2 * g) =
            make_float2((o[mb][e] + o[mb][e + 8]) * inv, (o[mb][e + 2] + o[mb][e + 10]) * inv);
      }
      if (warp == 0 && g == 0) {
        p.decode_partial_lse[2 * slot] = m[r] == -INFINITY ? -FLT_MAX : (m[r] - kPOff) * kLn2;
        p.decode_partial_lse[2 * slot + 1] = den;
      }
    }
  }
  if (splits > 1) merge::count_and_merge_decode<T, kHD, kThreads>(p, work, kv_head);
#endif
}

template <typename T, int STAGES>
int launch(const PagedAttentionParams& p, const DecodeFp8Maps& maps, cudaStream_t stream) {
  auto* kernel = decode_fp8_wgmma_kernel<T, STAGES>;
  constexpr size_t kSmemBytes = Layout<STAGES>::kSmemBytes;
  static bool configured = false;  // NOTE: per instantiation; raising the limit is idempotent
  if (!configured) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
    if (e != cudaSuccess) return e;
    configured = true;
  }
  if (p.num_decode > 65535) return cudaErrorInvalidConfiguration;
  return launch_pdl(kernel, dim3(p.num_kv_heads, p.num_decode, p.decode_splits), dim3(kThreads), kSmemBytes, stream,
                    p, maps);
}

}  // namespace

int decode_fp8_wgmma(const PagedAttentionParams& p, const DecodeFp8Maps& maps, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int bs = p.block_size;
  if (p.head_dim != kHD || p.kv_dtype != DType::kFloat8E4M3 || group > kVectors || bs < 8 || bs > kKT ||
      (bs & (bs - 1)) != 0 || (p.decode_splits > 1 && p.decode_split_counters == nullptr)) {
    return cudaErrorNotSupported;
  }
  // NOTE: bf16 queries only: two e4m3 terms hold bf16's 8 significant bits, not
  // fp16's 11 (measured: fp16 queries 2^-12 .. 2^6 apart missed fp16's tolerance,
  // 0.019 against 0.002), so fp16 keeps the widened kernel.
  if (p.dtype != DType::kBFloat16) return cudaErrorNotSupported;
  // NOTE: two stages (three CTAs an SM) measured 150.1 against 148.7 us at fp8
  // B=64 L=4k (decode_variants.py at aa83e2a): three. Six (one CTA an SM, five
  // tiles ahead) took 245.1 us there (e657f39, deleted): one warpgroup an SM
  // cannot keep up with the math, though bench/kv_stream_probe.cu streams the
  // same tiles at one CTA an SM and six stages in 131.8 us.
  return launch<__nv_bfloat16, 3>(p, maps, stream);
}

}  // namespace pagedcore::cuda
