// Internal: merging the key splits of one (work item or decode row, kv head)
// by their log-sum-exp, shared by the merge kernel and the attention kernels'
// last-CTA merge. Partial maxima are in natural-log units.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda::merge {

// Key splits a decode row of `keys` keys runs: decode_splits, fewer for a
// short row (none under 2 kAttentionDecodeSplitKeys keys, else at least
// decode_split_keys keys per split). Every CTA of the row computes the same
// number; those past it return at once.
__device__ __forceinline__ int decode_active_splits(const PagedAttentionParams& p, int keys) {
  if (p.decode_split_keys <= 0 || p.decode_splits <= 1) return p.decode_splits;
  if (keys < 2 * kAttentionDecodeSplitKeys) return 1;
  return max(1, min(p.decode_splits, keys / p.decode_split_keys));
}

// Keys a decode row reads (its sliding window, if any).
__device__ __forceinline__ int decode_keys(const PagedAttentionParams& p, int row) {
  const int ctx = p.seq_lens[row];
  return p.sliding_window > 0 ? min(ctx, p.sliding_window) : ctx;
}

// Floats of shared memory merge_splits needs.
constexpr int kScratchFloats = kAttentionMaxSplits * kAttentionPartialVectors / 4;

template <typename T>
__device__ __forceinline__ T cast_out(float x) {
  if constexpr (sizeof(T) == 4) {
    return x;
  } else {
    return static_cast<T>(x);
  }
}

// The weights of every (split, vector) first, in shared memory, then each
// thread sums a 4-float column over the splits. Reads the partials through L2
// (other CTAs of the same launch may have written them). Every thread of the
// block must call it.
template <typename T, int HD, int THREADS, bool DECODE>
__device__ void merge_splits(const PagedAttentionParams& p, int work, int kv_head, float* s_w) {
  constexpr int kSlots = kAttentionPartialVectors;
  // Vectors merged per pass: s_w holds a (max, sum) pair per (split, vector),
  // later that pair's weight. A decode row's <= 16 vectors take one pass.
  constexpr int kChunk = kSlots / 8;
  static_assert(2 * kAttentionMaxSplits * kChunk <= kScratchFloats, "merge scratch");
  float2* s_ml = reinterpret_cast<float2*>(s_w);
  const int row = DECODE ? p.decode_seq[work] : p.work_seq[work];
  if (row < 0) return;  // a padded plan's spare item: never ran
  const int q_begin = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q_begin;
  const int t0 = DECODE ? 0 : p.work_q_start[work];
  const int splits = DECODE ? decode_active_splits(p, decode_keys(p, row)) : p.num_splits;
  // NOTE: the partials' layout keeps the planned split count.
  const int stride_splits = DECODE ? p.decode_splits : p.num_splits;
  if (DECODE && splits == 1) return;  // the row ran unsplit and wrote its output itself
  const float* partial_out = DECODE ? p.decode_partial_out : p.partial_out;
  const float* partial_lse = DECODE ? p.decode_partial_lse : p.partial_lse;
  const int group = p.num_heads / p.num_kv_heads;
  const int num_vectors = (DECODE ? q_len : min(p.tile_tokens, q_len - t0)) * group;
  const int64_t first = ((static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * stride_splits) * kSlots;
  T* out = static_cast<T*>(p.out);
  for (int v0 = 0; v0 < num_vectors; v0 += kChunk) {
    const int nv = min(kChunk, num_vectors - v0);
    __syncthreads();
    // NOTE: one (max, sum) load per thread, all in flight at once; a loop over
    // the splits per vector waited for each load in turn (an L2 round trip per
    // split: ~16 of them at B=1 L=4k).
    for (int i = threadIdx.x; i < splits * nv; i += THREADS) {
      const int s = i / nv, v = i % nv;
      const int64_t slot = first + static_cast<int64_t>(s) * kSlots + v0 + v;
      s_ml[s * kChunk + v] = __ldcg(reinterpret_cast<const float2*>(partial_lse + 2 * slot));
    }
    __syncthreads();
    for (int v = threadIdx.x; v < nv; v += THREADS) {
      float gmax = -FLT_MAX;
      for (int s = 0; s < splits; ++s) {
        const float2 ml = s_ml[s * kChunk + v];
        if (ml.y > 0.f) gmax = fmaxf(gmax, ml.x);
      }
      float total = 0.f;
      for (int s = 0; s < splits; ++s) {
        const float2 ml = s_ml[s * kChunk + v];
        const float w = ml.y > 0.f ? ml.y * __expf(ml.x - gmax) : 0.f;
        s_w[2 * (s * kChunk + v)] = w;  // (this thread alone reads or writes this pair)
        total += w;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int s = 0; s < splits; ++s) s_w[2 * (s * kChunk + v)] *= inv;
    }
    __syncthreads();
    constexpr int Q = HD / 4;  // float4 columns per vector
    for (int i = threadIdx.x; i < nv * Q; i += THREADS) {
      const int v = i / Q;
      const int d = (i % Q) * 4;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      // NOTE: the loads do not depend on the weights, so that an unrolled
      // loop has them all in flight at once (a branch per split serialised
      // them); a zero weight's partial is dropped by a select, not a
      // product, in case its slot holds anything but a finite number.
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const int64_t slot = first + static_cast<int64_t>(s) * kSlots + v0 + v;
        const float4 x = __ldcg(reinterpret_cast<const float4*>(partial_out + slot * HD + d));
        const float w = s_w[2 * (s * kChunk + v)];
        const bool use = w != 0.f;
        acc.x += use ? w * x.x : 0.f;
        acc.y += use ? w * x.y : 0.f;
        acc.z += use ? w * x.z : 0.f;
        acc.w += use ? w * x.w : 0.f;
      }
      const int vv = v0 + v;
      T* dst = out + ((q_begin + t0 + static_cast<int64_t>(vv / group)) * p.num_heads + kv_head * group + vv % group) * HD + d;
      dst[0] = cast_out<T>(acc.x);
      dst[1] = cast_out<T>(acc.y);
      dst[2] = cast_out<T>(acc.z);
      dst[3] = cast_out<T>(acc.w);
    }
  }
}

// Called by every thread of a CTA after it wrote its split's partials: counts
// the split in; the CTA that brings the count to `splits` merges them and
// resets the counter to 0 (so the buffer stays zero between launches).
template <typename T, int HD, int THREADS, bool DECODE>
__device__ void count_and_merge(const PagedAttentionParams& p, int work, int kv_head, float* s_w) {
  // (no static shared variable for the verdict: it would shift the kernels'
  // dynamic shared memory, whose layouts assume a 128-byte aligned base)
  const int splits = DECODE ? decode_active_splits(p, decode_keys(p, DECODE ? p.decode_seq[work] : 0)) : p.num_splits;
  int32_t* counter = (DECODE ? p.decode_split_counters : p.split_counters) +
                     static_cast<int64_t>(work) * p.num_kv_heads + kv_head;
  __threadfence();  // this CTA's partials are visible before it is counted
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    const int before = atomicAdd(counter, 1);
    last = before == splits - 1;
    if (last) *counter = 0;
  }
  if (__syncthreads_or(last) == 0) return;
  __threadfence();
  merge_splits<T, HD, THREADS, DECODE>(p, work, kv_head, s_w);
}

// Folds one split's partial `x` (already divided by its sum) and its (max,
// sum) pair into a running (max, total, acc): the sums weigh the partials at
// the running maximum. A split without keys (sum 0) is dropped by selects, not
// products, in case its partial holds anything but a finite number. LOG2:
// maxima in log2 units (else natural-log units). Start from mx = -FLT_MAX,
// total = 0, acc = 0; the merged output is acc / total.
template <bool LOG2>
__device__ __forceinline__ void fold_split(float2 ml, float4 x, float& mx, float& total, float4& acc) {
  const bool use = ml.y > 0.f;
  const float m_new = use ? fmaxf(mx, ml.x) : mx;
  const float c = LOG2 ? exp2f(mx - m_new) : __expf(mx - m_new);
  const float w = use ? ml.y * (LOG2 ? exp2f(ml.x - m_new) : __expf(ml.x - m_new)) : 0.f;
  acc.x = acc.x * c + (use ? w * x.x : 0.f);
  acc.y = acc.y * c + (use ? w * x.y : 0.f);
  acc.z = acc.z * c + (use ? w * x.z : 0.f);
  acc.w = acc.w * c + (use ? w * x.w : 0.f);
  total = total * c + w;
  mx = m_new;
}

// The decode kernels' last-CTA merge in fewer round trips (the decode launch's
// kOnePassMerge, the default; PAGEDCORE_DECODE_MERGE=0 takes count_and_merge).
// The count: one thread's fence, relaxed atomic and (in the last CTA) fence
// after the CTA's barrier, which orders every thread's partial stores before
// that fence (the pattern of a grid-wide barrier), where count_and_merge
// fences in every thread. The merge: each thread takes four dims of one vector
// over the splits in one pass, a split's (max, sum) pair and partial loaded
// together, eight splits at a time, and folds them in by a running maximum;
// merge_splits loads the pairs first, then (after two barriers) the partials.
// Every thread of the CTA must call it, after storing its partials.
template <typename T, int HD, int THREADS>
__device__ void count_and_merge_decode(const PagedAttentionParams& p, int work, int kv_head) {
  const int row = p.decode_seq[work];
  const int splits = decode_active_splits(p, decode_keys(p, row));
  int32_t* counter = p.decode_split_counters + static_cast<int64_t>(work) * p.num_kv_heads + kv_head;
  __syncthreads();  // every thread's partials are stored
  bool last = false;
  if (threadIdx.x == 0) {
    int before;
    asm volatile(
        "fence.acq_rel.gpu;\n"
        "atom.relaxed.gpu.global.add.s32 %0, [%1], 1;\n"
        : "=r"(before)
        : "l"(counter)
        : "memory");
    last = before == splits - 1;
    if (last) {
      asm volatile("fence.acq_rel.gpu;\n" ::: "memory");  // the other splits' partials are visible
      *counter = 0;
    }
  }
  if (__syncthreads_or(last) == 0) return;
  const int q_begin = p.query_start_loc[row];
  const int group = p.num_heads / p.num_kv_heads;
  const int num_vectors = (p.query_start_loc[row + 1] - q_begin) * group;
  constexpr int kSlots = kAttentionPartialVectors;
  constexpr int Q = HD / 4;  // float4 columns per vector
  const int64_t first = (static_cast<int64_t>(work) * p.num_kv_heads + kv_head) * p.decode_splits * kSlots;
  for (int i = threadIdx.x; i < num_vectors * Q; i += THREADS) {
    const int v = i / Q;
    const int d = (i % Q) * 4;
    float mx = -FLT_MAX, total = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < splits; ++s) {
      const int64_t slot = first + static_cast<int64_t>(s) * kSlots + v;
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.decode_partial_lse + 2 * slot));
      const float4 x = __ldcg(reinterpret_cast<const float4*>(p.decode_partial_out + slot * HD + d));
      fold_split<false>(ml, x, mx, total, acc);
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    T* dst = static_cast<T*>(p.out) +
             ((q_begin + static_cast<int64_t>(v / group)) * p.num_heads + kv_head * group + v % group) * HD + d;
    dst[0] = cast_out<T>(acc.x * inv);
    dst[1] = cast_out<T>(acc.y * inv);
    dst[2] = cast_out<T>(acc.z * inv);
    dst[3] = cast_out<T>(acc.w * inv);
  }
}

}  // namespace pagedcore::cuda::merge
