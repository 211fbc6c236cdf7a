// Internal: the tensor-core path of the decode steps' linear kernel, 2..16 rows
// (not installed; contract in pagedcore/cuda/layer_kernels.h, LinearParams).
#pragma once

#include <cuda_runtime.h>

#include "pagedcore/cuda/layer_kernels.h"

namespace pagedcore::cuda {

// out = input @ weight^T (+ bias) for 2 <= p.num_tokens <= kLinearMaxRows, on
// checked parameters (linear() checks them): bf16/fp16, in_features a multiple of
// 8, 16-byte aligned input and weight, input_stride a multiple of 8.
cudaError_t linear_mma(const LinearParams& p, cudaStream_t stream);

}  // namespace pagedcore::cuda
