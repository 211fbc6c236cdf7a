// out = input @ weight^T (+ bias) for 2..16 rows on tensor cores (mma.sync
// m16n8k16, bf16/fp16 in, float32 accumulation), bound by the weight's bytes like
// the one-row kernel (linear_kernels.cu). Contract: LinearParams in
// pagedcore/cuda/layer_kernels.h.
//
// Work: a warp owns a group of 16 output features (the mma's M: weight rows) and
// all the token rows (N: one n8 tile up to 8 rows, two up to 16), over a range of
// k. The k of a group is split over `splits` warps of a CTA and, on Hopper, over
// the `cluster` CTAs of a thread-block cluster; the partial sums meet in shared
// memory (distributed shared memory across the cluster) and are added in a fixed
// order, so a result does not depend on timing.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", 16-bit types), per
// 32-bit register of two elements, the lower-numbered in the low half. Lane =
// 4 * g + t (g = lane / 4 in 0..7, t = lane % 4). Logical k in 0..15 of one mma:
//   A (16x16, row): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//                   a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (16x8, col):  b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C (16x8 f32):   c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// A dot product does not care about the order of k, so A and B take the same
// permutation of k: a chunk of 32 physical k (one 16-byte load of 8 elements per
// lane and row) feeds two mmas; lane t's elements are physical k 8t..8t+7 of the
// chunk, and mma j (0, 1) takes elements 4j..4j+3 of them as its logical k
// {2t, 2t+1, 2t+8, 2t+9}. In 32-bit words w0..w3 of a lane's load:
//   mma j: a = {lo.w[2j], hi.w[2j], lo.w[2j+1], hi.w[2j+1]}, b = {x.w[2j], x.w[2j+1]}
// where lo, hi are weight rows g, g+8 of the group and x is token row g (tile 0)
// or g+8 (tile 1). Logical k l of mma j of chunk c is physical
//   32c + 8 * ((l % 8) / 2) + 4j + 2 * (l / 8) + l % 2,
// a bijection of the chunk, the same for A and B. The accumulator c then holds
// out[token 2t, 2t+1 (+8 in tile 1)][feature g, g+8 of the group].
//
// in_features is a multiple of 8, so a lane's 16 bytes are wholly inside or
// wholly past the row: past it, A and B are zeros. Weight rows past out_features
// re-read the last row (never written); token rows past num_tokens are zeros.
//
// Launched with PDL (pdl.cuh): each warp's first weight loads are in flight
// before the kernel that writes the input has finished.
#include "linear_mma.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "device_ops.cuh"
#include "pdl.cuh"

namespace pagedcore::cuda {

namespace {

namespace cg = cooperative_groups;
using dev::from_float;
using dev::load_streaming;
using dev::mma16816;
using dev::to_float;

constexpr int kWarps = 8;       // warps per CTA
constexpr int kLogWarps = 3;
static_assert(kWarps == 1 << kLogWarps, "kLogWarps");
constexpr int kChunk = 32;      // k per chunk: 16 bytes of a row per lane of a quad
constexpr int kUnroll = 4;      // chunks in flight per warp (2 weight loads each per lane)
constexpr int kMaxCluster = 8;  // portable cluster size

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// NT: n8 tiles of tokens (1: up to 8 rows, 2: up to 16). splits: warps of a CTA
// that share a group's k (a power of two dividing kWarps; the CTA holds
// kWarps / splits groups); cluster: CTAs of a cluster that share it (1 below
// sm_90). The group's k is cut into splits * cluster contiguous ranges of chunks.
// GATED (LinearParams::silu_and_mul): a group's rows g are gate rows and its rows
// g + 8 the matching up rows (features j and I + j, I = out_features / 2), so that
// a lane holds both sums of an output and writes silu(gate) * up, with
// silu_and_mul()'s arithmetic over the product rounded to the dtype.
//
// NOTE (issue 11): the other fusion, silu(gate) * up computed while loading the down
// product's input from [gate | up] rows (SILU_IN, merged in 62a1d4d), was measured on
// the H200 on 2026-12-02 (bench/linear_variants.py, us per call, against the best of
// silu_and_mul + cuBLAS and silu_and_mul + this kernel) and lost everywhere: 8B down
// M=2 39.5 vs 33.6 (1.18x), M=8 39.4 vs 34.5 (1.14x), M=16 69.7 vs 34.8 (2.0x), with
// silu computed once per CTA in shared memory over a cluster of CTAs; per warp
// 65.9-114.8; SmolLM2 down 1.05x / 1.07x / 1.44x at M=2 / 8 / 16. The silu of every
// input element (ex2 and rcp on the MUFU, ~30 instructions) costs more than the weight
// reads it hides behind, and the separate activation kernel is small. It was deleted;
// do not retry it without a new idea for that cost.
template <bool GATED>
__host__ __device__ inline int num_groups(const LinearParams& p) {
  return GATED ? (p.out_features / 2 + 7) / 8 : (p.out_features + 15) / 16;
}

// SPREAD (the default; PAGEDCORE_LINEAR_MMA=old, read at each launch, i.e. at a
// graph's capture, takes the other way for comparisons): the warp's place and its
// k range from shifts (splits and cluster are powers of two), and the group's warps
// share the partial sums' reduction and the stores. The other way: integer divisions
// (64-bit ones for the k range) before the first weight load, and one warp of a group
// sums all the registers after the barrier. Both add in the same order: the same bits.
//
// NOTE: measured on the H200 on 2026-12-03 (bench/RESULTS.md, thirteenth session):
// SmolLM2's products at 16 rows 3.0 / 3.9 / 3.8 us -> 1.9 / 2.7 / 3.0 (qkv, gate_up,
// down; linear_variants.py), and its batch-16 decode step 0.91 -> 0.73-0.74 ms of
// device time in two calls (batch 1 0.65-0.68: 1.37-1.38x -> 1.09-1.12x). Shifts alone
// (with the old reduction) gave 0.878.
template <typename T, int NT, bool GATED, bool SPREAD>
__global__ void __launch_bounds__(32 * kWarps, 2) linear_mma_kernel(LinearParams p, int splits, int cluster,
                                                                    int log_splits, int log_cluster) {
  // [warp][accumulator register][lane]: a lane's partial sums, then (in the first
  // warp of each group) the CTA's sums.
  __shared__ float partial[kWarps][NT * 4][32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int block = static_cast<int>(blockIdx.x);
  // (clusters are consecutive blocks along x)
  const int rank = SPREAD ? block & (cluster - 1) : block % cluster;
  const int split = SPREAD ? warp & (splits - 1) : warp % splits;
  const int group = SPREAD ? ((block >> log_cluster) << (kLogWarps - log_splits)) + (warp >> log_splits)
                          : block / cluster * (kWarps / splits) + warp / splits;
  const int groups = num_groups<GATED>(p);
  const bool active = group < groups;
  const int chunks = (p.in_features + kChunk - 1) / kChunk;
  const int parts = splits * cluster;
  const int part = rank * splits + split;
  const int log_parts = log_splits + log_cluster;
  const int chunk_begin = !active ? 0
                          : SPREAD ? static_cast<int>((static_cast<int64_t>(chunks) * part) >> log_parts)
                                   : static_cast<int>(static_cast<int64_t>(chunks) * part / parts);
  const int chunk_end = !active ? 0
                        : SPREAD ? static_cast<int>((static_cast<int64_t>(chunks) * (part + 1)) >> log_parts)
                                 : static_cast<int>(static_cast<int64_t>(chunks) * (part + 1) / parts);
  const int rows = p.num_tokens;

  const T* weight = static_cast<const T*>(p.weight);
  const int last_row = p.out_features - 1;
  const int half = p.out_features / 2;
  const int row_lo = GATED ? min(group * 8 + g, half - 1) : min(group * 16 + g, last_row);
  const int row_hi = GATED ? half + min(group * 8 + g, half - 1) : min(group * 16 + g + 8, last_row);
  const T* w_lo = weight + static_cast<int64_t>(row_lo) * p.in_features + 8 * t;
  const T* w_hi = weight + static_cast<int64_t>(row_hi) * p.in_features + 8 * t;
  const T* input = static_cast<const T*>(p.input);

  uint4 a[kUnroll][2];
  const auto load_weights = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u;
      if (c < chunk_end && c * kChunk + 8 * t < p.in_features) {
        a[u][0] = load_streaming(w_lo + c * kChunk);
        a[u][1] = load_streaming(w_hi + c * kChunk);
      } else {
        a[u][0] = make_uint4(0, 0, 0, 0);
        a[u][1] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[i][r] = 0.f;
  }

  // The first weight loads go out before the kernel that writes the input ends (PDL).
  load_weights(chunk_begin);
  pdl_wait();
  pdl_launch_dependents();
  for (int c0 = chunk_begin; c0 < chunk_end; c0 += kUnroll) {
    if (c0 != chunk_begin) load_weights(c0);
    uint4 b[kUnroll][NT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u;
      const bool in_k = c < chunk_end && c * kChunk + 8 * t < p.in_features;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int token = g + 8 * i;
        b[u][i] = in_k && token < rows
                      ? __ldg(reinterpret_cast<const uint4*>(input + token * p.input_stride + c * kChunk + 8 * t))
                      : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c0 + u >= chunk_end) break;  // (warp-uniform: every lane runs the mma)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t frag[4] = {word(a[u][0], 2 * j), word(a[u][1], 2 * j), word(a[u][0], 2 * j + 1),
                                  word(a[u][1], 2 * j + 1)};
#pragma unroll
        for (int i = 0; i < NT; ++i) mma16816<T>(acc[i], frag, word(b[u][i], 2 * j), word(b[u][i], 2 * j + 1));
      }
    }
  }

  // Partial sums: the group's warps in order of their k ranges, then the
  // cluster's CTAs in order of rank (fixed order: deterministic).
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) partial[warp][i * 4 + r][lane] = acc[i][r];
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  const T* bias = static_cast<const T*>(p.bias);
  if constexpr (SPREAD) {
    // Every warp of the group sums and writes some of the registers (units: one
    // register, or a gated output's gate and up registers), adding in the same order
    // of warps and ranks as the other way, so the bits are the same: a shorter chain
    // after the barrier and less code than one warp summing all of them.
    constexpr int kUnits = GATED ? NT * 2 : NT * 4;
    const int first = warp - split;  // the group's first warp
    const auto reg_of = [](int unit, int q) { return GATED ? (unit / 2) * 4 + 2 * q + unit % 2 : unit; };
    const auto cta_sum = [&](int reg) {
      float s = partial[first][reg][lane];
#pragma unroll 1
      for (int w = 1; w < splits; ++w) s += partial[first + w][reg][lane];
      return s;
    };
    // The output of a unit from the sums of its registers.
    const auto emit = [&](int unit, float s0, float s1) {
      if constexpr (GATED) {
        const int feature = group * 8 + g;
        const int token = 8 * (unit / 2) + 2 * t + unit % 2;
        if (feature >= half || token >= rows) return;
        const float bg = bias != nullptr ? to_float(bias[feature]) : 0.f;
        const float bu = bias != nullptr ? to_float(bias[half + feature]) : 0.f;
        // (as the other way's gated epilogue below)
        const float gv = to_float(from_float<T>(s0 + bg));
        const float uv = to_float(from_float<T>(s1 + bu));
        const float silu = to_float(from_float<T>(__fdiv_rn(gv, __fadd_rn(1.f, expf(-gv)))));
        out[token * p.out_stride + feature] = from_float<T>(__fmul_rn(silu, uv));
      } else {
        // register unit = 4 i + 2 h + e: token 8 i + 2 t + e, feature g + 8 h of the group
        const int feature = group * 16 + g + 8 * ((unit % 4) / 2);
        const int token = 8 * (unit / 4) + 2 * t + unit % 2;
        if (feature >= p.out_features || token >= rows) return;
        const float b = bias != nullptr ? to_float(bias[feature]) : 0.f;
        out[token * p.out_stride + feature] = from_float<T>(s0 + b);
      }
    };
    if (cluster == 1) {
      if (!active) return;
#pragma unroll 1
      for (int unit = split; unit < kUnits; unit += splits) {
        emit(unit, cta_sum(reg_of(unit, 0)), GATED ? cta_sum(reg_of(unit, 1)) : 0.f);
      }
      return;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // (only this warp reads or writes these registers of the group now)
#pragma unroll 1
    for (int unit = split; unit < kUnits; unit += splits) {
      partial[first][reg_of(unit, 0)][lane] = cta_sum(reg_of(unit, 0));
      if constexpr (GATED) partial[first][reg_of(unit, 1)][lane] = cta_sum(reg_of(unit, 1));
    }
    cg::cluster_group cluster_group = cg::this_cluster();
    cluster_group.sync();  // every CTA's sums are in its shared memory
    if (rank == 0 && active) {
      const auto total = [&](int reg) {
        float s = partial[first][reg][lane];
#pragma unroll 1
        for (int c = 1; c < cluster; ++c) s += cluster_group.map_shared_rank(&partial[first][0][0], c)[reg * 32 + lane];
        return s;
      };
#pragma unroll 1
      for (int unit = split; unit < kUnits; unit += splits) {
        emit(unit, total(reg_of(unit, 0)), GATED ? total(reg_of(unit, 1)) : 0.f);
      }
    }
    cluster_group.sync();  // no CTA leaves while rank 0 reads its shared memory
#endif
    return;
  }
  float sum[NT * 4] = {};
  if (split == 0) {
#pragma unroll
    for (int r = 0; r < NT * 4; ++r) {
      float s = partial[warp][r][lane];
      for (int w = 1; w < splits; ++w) s += partial[warp + w][r][lane];
      sum[r] = s;
      partial[warp][r][lane] = s;  // (only this lane reads or writes this word now)
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) {
    cg::cluster_group cluster_group = cg::this_cluster();
    cluster_group.sync();  // every CTA's sums are in its shared memory
    if (rank == 0 && split == 0) {
      for (int q = 1; q < cluster; ++q) {
        const float* remote = cluster_group.map_shared_rank(&partial[warp][0][0], q);
#pragma unroll
        for (int r = 0; r < NT * 4; ++r) sum[r] += remote[r * 32 + lane];
      }
    }
    cluster_group.sync();  // no CTA leaves while rank 0 reads its shared memory
  }
#endif
  if (rank != 0 || split != 0 || !active) return;
  if constexpr (GATED) {
    const int feature = group * 8 + g;
    if (feature >= half) return;  // (the rows past I re-read the last gate and up rows)
    const float bg = bias != nullptr ? to_float(bias[feature]) : 0.f;
    const float bu = bias != nullptr ? to_float(bias[half + feature]) : 0.f;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = 8 * i + 2 * t + e;
        if (token >= rows) continue;
        // (as linear_kernels.cu's gated epilogue: the product rounded to the dtype,
        // silu rounded to the dtype, times up, rounded once)
        const float gv = to_float(from_float<T>(sum[i * 4 + e] + bg));
        const float uv = to_float(from_float<T>(sum[i * 4 + 2 + e] + bu));
        const float silu = to_float(from_float<T>(__fdiv_rn(gv, __fadd_rn(1.f, expf(-gv)))));
        out[token * p.out_stride + feature] = from_float<T>(__fmul_rn(silu, uv));
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int feature = group * 16 + g + 8 * h;
      if (feature >= p.out_features) continue;
      const float b = bias != nullptr ? to_float(bias[feature]) : 0.f;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = 8 * i + 2 * t + e;
          if (token < rows) out[token * p.out_stride + feature] = from_float<T>(sum[i * 4 + 2 * h + e] + b);
        }
      }
    }
  }
}

// Blocks of a kernel instance resident per SM (the occupancy calculator, once).
template <typename T, int NT, bool GATED>
int blocks_per_sm() {
  // (the default's; the other reduction's resources are the same: 2 CTAs of 256 threads)
  static const int blocks = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, linear_mma_kernel<T, NT, GATED, true>, 32 * kWarps, 0) !=
        cudaSuccess) {
      cudaGetLastError();  // (leave no sticky error behind for the caller)
      b = 1;
    }
    return b > 0 ? b : 1;
  }();
  return blocks;
}

struct Device {
  int sms = 132;
  bool clusters = false;  // launches thread-block clusters (sm_90+)
};

// The current device's (queried once per device; PAGEDCORE_LINEAR_CLUSTER=0, read
// once per process, keeps every split of k inside a CTA, for comparisons).
Device current_device() {
  constexpr int kDevices = 64;
  static const bool clusters_allowed = [] {
    const char* env = std::getenv("PAGEDCORE_LINEAR_CLUSTER");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  static std::mutex mutex;
  static Device known[kDevices];
  static bool queried[kDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) {
    cudaGetLastError();  // (leave no sticky error behind for the caller)
    return Device{};
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (!queried[device]) {
    int sms = 0, cluster_launch = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device) != cudaSuccess) {
      cudaGetLastError();
      return Device{};
    }
    known[device].sms = sms > 0 ? sms : known[device].sms;
    known[device].clusters = clusters_allowed && cluster_launch != 0;
    queried[device] = true;
  }
  return known[device];
}

struct Plan {
  int splits;   // warps of a CTA per group (the CTA holds kWarps / splits groups)
  int cluster;  // CTAs of a cluster per group
};

Plan plan_for_parts(int parts) {
  return parts <= kWarps ? Plan{parts, 1} : Plan{kWarps, parts / kWarps};
}

int64_t grid_ctas(int groups, const Plan& pl) {
  const int groups_per_cta = kWarps / pl.splits;
  return static_cast<int64_t>((groups + groups_per_cta - 1) / groups_per_cta) * pl.cluster;
}

// NOTE: how many parts (splits * cluster) a group's k is cut into. A rough model
// of the time, in bytes: the busiest SM's bytes (ceil(CTAs / SMs) CTAs, each with
// its share of the weight plus, at half weight (L2, not DRAM), the input rows of
// its k ranges at 16 rows: warps of a CTA that share a k range share them in L1),
// plus one DRAM latency (kLatencyBytes: ~1 us at an SM's share of the bandwidth)
// per round of loads of a warp, per wave of resident CTAs. The model does not
// look at the number of rows, so that a row's sums do not depend on the rows it
// shares the call with. Few groups (SmolLM2's 36-192) want many parts, so that
// more SMs stream the weight and each warp issues all its loads at once; within 3%
// of the best the fewest parts win (less reduction, fewer clusters). At H200's
// 132 SMs and 2 resident CTAs per SM this gives SmolLM2's qkv and o 16 parts
// (clusters of 2; 120 and 72 CTAs), gate_up 8 (192 CTAs), down 16 (72 CTAs),
// lm_head 1 (384 CTAs); the 8B shape's qkv 16 (768 CTAs), o and down 8 (256),
// gate_up and lm_head 1 (224, 1002). To be measured on the GPU (bench_kernels_gpu.py
// times every split at 16 rows): PAGEDCORE_LINEAR_PARTS=N (read at each launch; 0
// or unset: this model) forces the largest number of parts <= N that the shape and
// device allow.
constexpr double kLatencyBytes = 32 * 1024;
constexpr double kInputWeight = 0.5;  // an input byte from L2 against a weight byte from DRAM
constexpr int kModelRows = 16;

Plan plan(int groups, int chunks, int in_features, const Device& d, int capacity) {
  int forced = 0;
  if (const char* env = std::getenv("PAGEDCORE_LINEAR_PARTS")) forced = std::atoi(env);
  if (forced > 0) {
    const int max_parts = d.clusters ? kWarps * kMaxCluster : kWarps;
    int parts = 1;
    while (parts * 2 <= forced && parts * 2 <= max_parts && parts * 2 <= chunks) parts *= 2;
    return plan_for_parts(parts);
  }
  // Clusters only where a warp of an 8-way split still has >= 4 chunks of k: on the
  // H200 SmolLM2's qkv and o (18 chunks) took 2.9 / 2.8 us at 8 parts and 3.6 / 3.5 at
  // the 16 (clusters of 2) this model gives them; its down (48 chunks) 3.8 at 16, 4.2 at 8.
  const int max_parts = d.clusters && chunks >= 4 * kWarps ? kWarps * kMaxCluster : kWarps;
  const double weight_bytes = 32.0 * groups * in_features;  // 16 rows of 2-byte elements a group
  double costs[8] = {};
  int count = 0;
  for (int parts = 1; parts <= max_parts && parts <= chunks; parts *= 2, ++count) {
    const Plan pl = plan_for_parts(parts);
    const int64_t ctas = grid_ctas(groups, pl);
    const int64_t per_sm = (ctas + d.sms - 1) / d.sms;
    const int64_t waves = (ctas + capacity - 1) / capacity;
    const int chunks_per_warp = (chunks + parts - 1) / parts;
    const int rounds = (chunks_per_warp + kUnroll - 1) / kUnroll;
    // a CTA's input bytes: its splits k ranges of in_features / parts, kModelRows rows
    const double input_bytes = 2.0 * kModelRows * in_features / pl.cluster;
    costs[count] = static_cast<double>(per_sm) *
                       (weight_bytes / static_cast<double>(ctas) + kInputWeight * input_bytes) +
                   static_cast<double>(waves) * rounds * kLatencyBytes;
  }
  double best = costs[0];
  for (int i = 1; i < count; ++i) best = costs[i] < best ? costs[i] : best;
  int i = 0;
  while (costs[i] > 1.03 * best) ++i;
  return plan_for_parts(1 << i);
}

// The kernel's SPREAD: unless PAGEDCORE_LINEAR_MMA=old (read at each launch).
bool spread() {
  const char* env = std::getenv("PAGEDCORE_LINEAR_MMA");
  return env == nullptr || std::strcmp(env, "old") != 0;
}

int log2_of(int power_of_two) {
  int log = 0;
  while ((1 << log) < power_of_two) ++log;
  return log;
}

template <typename T, int NT, bool GATED>
cudaError_t launch(const LinearParams& p, const Plan& pl, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid_ctas(num_groups<GATED>(p), pl)));
  config.blockDim = dim3(32 * kWarps);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned count = 0;
  if (pdl_enabled()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (pl.cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = static_cast<unsigned>(pl.cluster);
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  const int ls = log2_of(pl.splits), lc = log2_of(pl.cluster);
  return spread() ? cudaLaunchKernelEx(&config, linear_mma_kernel<T, NT, GATED, true>, p, pl.splits, pl.cluster, ls, lc)
                  : cudaLaunchKernelEx(&config, linear_mma_kernel<T, NT, GATED, false>, p, pl.splits, pl.cluster, ls, lc);
}

// NOTE: a gated product plans as the plain one over the same weight (the same
// groups when I is a multiple of 8), so that its sums are the plain product's.
template <typename T, int NT, bool GATED>
cudaError_t launch_planned(const LinearParams& p, cudaStream_t stream) {
  const Device d = current_device();
  const int capacity = blocks_per_sm<T, NT, GATED>() * d.sms;
  const Plan pl = plan(num_groups<GATED>(p), (p.in_features + kChunk - 1) / kChunk, p.in_features, d, capacity);
  return launch<T, NT, GATED>(p, pl, stream);
}

template <typename T, bool GATED>
cudaError_t launch_gated(const LinearParams& p, cudaStream_t stream) {
  return p.num_tokens <= 8 ? launch_planned<T, 1, GATED>(p, stream) : launch_planned<T, 2, GATED>(p, stream);
}

template <typename T>
cudaError_t launch_dtype(const LinearParams& p, cudaStream_t stream) {
  return p.silu_and_mul ? launch_gated<T, true>(p, stream) : launch_gated<T, false>(p, stream);
}

}  // namespace

cudaError_t linear_mma(const LinearParams& p, cudaStream_t stream) {
  if (p.num_tokens < 2 || p.num_tokens > 16) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kBFloat16: return launch_dtype<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_dtype<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore::cuda
