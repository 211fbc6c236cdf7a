// Internal: the Hopper (sm_90a) prefill attention kernel on wgmma (not installed).
#pragma once

#include <cuda_runtime.h>

#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda {

// Whether paged_attention_wgmma serves the work items (prefill tiles) of `p`:
// the kernel was compiled (a build for sm_90), PAGEDCORE_PREFILL_KERNEL picks
// a wgmma variant (wgmma, wgmma-ws, wgmma-pp, wgmma-late, wgmma-tma,
// wgmma-tma-pp, wgmma-tma-plain, wgmma-tma-async, each also with a "-rev"
// suffix: work items longest first; unset or auto: the one measured fastest
// for the head dim, or mma.sync), scale > 0, the current device is compute
// capability 9.0, queries and cache are both bf16 or both fp16, head_dim is
// 64 or 128, and queries, cache and output are 16-byte aligned (query rows too).
bool wgmma_prefill_serves(const PagedAttentionParams& p);

// Runs the work items of `p` (not its decode rows) on a wgmma kernel — the
// warp-specialized one for PAGEDCORE_PREFILL_KERNEL=wgmma-ws (wgmma-pp: with
// ping-pong between its computing warpgroups) without softcap, the TMA ones
// for wgmma-tma / wgmma-tma-pp / wgmma-tma-plain / wgmma-tma-async without
// softcap at block sizes 8..128 that are powers of two (and where the driver
// encodes their tensor maps), else the plain one (wgmma-late: its copies after
// the GEMMs) — merging key splits like the mma.sync kernel. Call only when
// wgmma_prefill_serves(p).
int paged_attention_wgmma(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace pagedcore::cuda
