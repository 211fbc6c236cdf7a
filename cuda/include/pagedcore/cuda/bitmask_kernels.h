// CUDA kernels of structured outputs: a step's grammar bitmasks applied to the logits,
// and the stream's wait for masks that the host computes while the device runs.
//
// Framework-free launchers like kernels.h: a plain struct of pointers and sizes and the
// caller's stream; each returns the cudaError_t of the launch as an int. No allocation,
// no synchronisation.
#pragma once

#include <cstdint>

#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda {

// For each mask i and token t < vocab: logits[row_i, t] = -inf unless bit t % 32 of
// bitmask[i][t / 32] is set (tokens at or past 32 * num_words are blocked too); row_i =
// rows[i], or i when rows is null. Rows outside [0, num_rows) are skipped. With status
// set and *status != 0 (the masks never came: wait_host_flag timed out), every token of
// those rows is set to NaN instead, so that no token can be sampled from them.
struct TokenBitmaskParams {
  void* logits;             // [num_rows, vocab], row stride logits_stride (elements)
  const int32_t* bitmask;   // [num_masks, num_words] contiguous
  const void* rows;         // [num_masks] int32 or int64, distinct; or nullptr
  bool rows_int64;
  const int32_t* status;    // [1] device, or nullptr
  int32_t num_masks;
  int32_t num_rows;
  int32_t vocab;
  int32_t num_words;
  int64_t logits_stride;
  DType dtype;              // fp32, bf16 or fp16
};
int apply_token_bitmask(const TokenBitmaskParams& p, void* stream);

// Holds the stream (one thread spins) until the host writes ticket, or a later one, to
// the flag: *flag - ticket >= 0 as a signed 32-bit difference. Then *status = 0; after
// timeout_ns without it, *status = 1. Work queued behind it (the masks' copy, the
// sampler) runs once the host has computed the masks: the host queues it first.
struct WaitHostFlagParams {
  const uint32_t* flag;     // [1] pinned host memory (the host's address), 4-byte aligned
  uint32_t ticket;
  uint64_t timeout_ns;
  int32_t* status;          // [1] device
};
int wait_host_flag(const WaitHostFlagParams& p, void* stream);

// ---- entry points on integer addresses, for bindings (throw std::runtime_error) ----------

void apply_token_bitmask_at(std::uintptr_t logits, std::uintptr_t bitmask, std::uintptr_t rows,
                            bool rows_int64, std::uintptr_t status, int32_t num_masks,
                            int32_t num_rows, int32_t vocab, int32_t num_words,
                            int64_t logits_stride, DType dtype, std::uintptr_t stream);
void wait_host_flag_at(std::uintptr_t flag, uint32_t ticket, uint64_t timeout_ns,
                       std::uintptr_t status, std::uintptr_t stream);

}  // namespace pagedcore::cuda
