// Internal: the tensor-core attention path and the split merge it shares
// with the float32 kernels (not installed).
#pragma once

#include <cuda_runtime.h>

#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda {

// bf16 / fp16 queries over a cache of the same type or fp8 e4m3.
int paged_attention_mma(const PagedAttentionParams& p, cudaStream_t stream);

// Multiprocessors of the current device (asked once per device).
int multiprocessor_count();

// The current device's compute capability as 10 * major + minor (asked once
// per device; 0 where it cannot be asked).
int compute_capability();

// Combines the key splits' partial outputs (decode rows or work items).
int merge_attention_splits(const PagedAttentionParams& p, bool decode, cudaStream_t stream);

}  // namespace pagedcore::cuda
