// Internal: the Hopper (sm_90a) kernels on wgmma: prefill attention, and the
// opt-in fp8 decode (not installed).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda {

// Whether paged_attention_wgmma serves the work items (prefill tiles) of `p`:
// the kernel was compiled (a build for sm_90), PAGEDCORE_PREFILL_KERNEL picks
// a wgmma kernel (wgmma, wgmma-tma, wgmma-tma-pairs, wgmma-tma-fp8; unset or
// auto: the one measured fastest for the head dim and block size —
// wgmma-tma-pairs at 128 up to block size 32, wgmma-tma above, mma.sync at
// 64), scale > 0, the current device is compute capability 9.0, queries are
// bf16 or fp16 and the cache the same dtype — or fp8 e4m3 under
// wgmma-tma-fp8 only, without softcap, k_scale > 0, block sizes 8..128 that
// are powers of two and tensor maps the driver encodes — head_dim is 64 or
// 128, and queries, cache and output are 16-byte aligned (query rows too).
bool wgmma_prefill_serves(const PagedAttentionParams& p);

// Runs the work items of `p` (not its decode rows) on a wgmma kernel — the TMA
// one for wgmma-tma* without softcap at block sizes 8..128 that are powers of
// two (and where the driver encodes its tensor maps) and for fp8 caches, else
// the plain one —
// merging key splits like the mma.sync kernel. Call only when
// wgmma_prefill_serves(p).
int paged_attention_wgmma(const PagedAttentionParams& p, cudaStream_t stream);

// The K and V tensor maps of an fp8 cache at head dim 128 (attention_mma.cu's
// encode_decode_maps: dims (128 bytes, kv heads, block_size, num_blocks), box
// one block of one kv head, 128-byte swizzle).
struct DecodeFp8Maps {
  CUtensorMap k;
  CUtensorMap v;
};

// The decode rows of `p` over an fp8 e4m3 cache on e4m3 wgmma
// (attention_decode_wgmma.cu): head dim 128, bf16 queries, at most 16
// query vectors a row, block sizes 8..128 that are powers of two, split rows
// merged by their last CTA (decode_split_counters set). cudaErrorNotSupported
// where it does not serve; call only on a compute capability 9.0 device.
int decode_fp8_wgmma(const PagedAttentionParams& p, const DecodeFp8Maps& maps, cudaStream_t stream);

}  // namespace pagedcore::cuda
