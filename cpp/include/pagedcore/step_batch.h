// What one engine step hands to the model runner, and what update() hands back.
//
// Both are views into buffers the engine allocates once, sized for the worst
// case of its configuration. They stay valid until the next schedule() (for
// StepBatch) or update() (for StepResult) call on the same engine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedcore/config.h"
#include "pagedcore/types.h"

namespace pagedcore {

// The inputs of one forward pass over a batch of sequences, flattened.
// Rows (sequences) with exactly one new token come first ("decode rows"), the
// rest (prompt chunks) after them; tokens are laid out row after row.
//
// The runner must, in this order: copy swap_out pairs (GPU -> CPU), swap_in
// pairs (CPU -> GPU), block_copies (GPU -> GPU, every layer), then run the
// forward pass, writing the KV of token i to slot_mapping[i], and sample the
// logits of rows sample_indices.
struct StepBatch {
  int32_t num_tokens = 0;
  int32_t num_seqs = 0;
  int32_t num_decode_seqs = 0;    // leading rows with one new token
  int32_t num_samples = 0;
  int32_t num_block_copies = 0;
  int32_t num_swap_out = 0;
  int32_t num_swap_in = 0;
  // Prompt logprobs (RequestParams::prompt_logprobs): logits rows besides the
  // samples, grouped in runs, one run per sequence that has some.
  int32_t num_prompt_logprob_tokens = 0;
  int32_t num_prompt_logprob_seqs = 0;
  // Async scheduling: input tokens whose ids the host does not know yet.
  int32_t num_deferred_inputs = 0;
  int32_t block_size = 0;
  int32_t max_blocks_per_seq = 0;  // row stride of block_tables

  const int32_t* input_ids = nullptr;         // [num_tokens]
  const int32_t* positions = nullptr;         // [num_tokens] position within the sequence
  const int32_t* slot_mapping = nullptr;      // [num_tokens] block * block_size + offset
  const int64_t* seq_ids = nullptr;           // [num_seqs]
  const int32_t* query_start_loc = nullptr;   // [num_seqs + 1] first token of each row
  const int32_t* num_computed_tokens = nullptr;  // [num_seqs] tokens cached before this step
  const int32_t* seq_lens = nullptr;          // [num_seqs] tokens cached after this step
  // [num_seqs, max_blocks_per_seq]; row r is valid for its first
  // ceil(seq_lens[r] / block_size) entries (kNullBlock for blocks released by the
  // sliding window); the rest of the row is unspecified.
  const int32_t* block_tables = nullptr;
  const int32_t* sample_indices = nullptr;    // [num_samples] token index whose logits to sample
  const int64_t* sample_seq_ids = nullptr;    // [num_samples] sequence that gets the sample
  // [num_samples] slot of the sample's request (Engine::request_slot): a small
  // integer, stable while the request lives, for per-request parameter arrays.
  const int32_t* sample_slots = nullptr;
  // [num_samples] outputs the sequence has before this sample (min_tokens, ...).
  const int32_t* sample_num_outputs = nullptr;
  // [num_prompt_logprob_tokens] token index whose logits score a prompt token,
  // and that prompt token (the one at the next position, which may lie in a
  // later chunk). Never a sampled index: the last prompt position is sampled.
  const int32_t* prompt_logprob_indices = nullptr;
  const int32_t* prompt_logprob_token_ids = nullptr;
  const int64_t* prompt_logprob_seq_ids = nullptr;  // [num_prompt_logprob_seqs]
  // [num_prompt_logprob_seqs + 1] first entry of each run in the arrays above.
  const int32_t* prompt_logprob_start_loc = nullptr;
  // [num_prompt_logprob_seqs] prompt position (>= 1) of the first token a run
  // scores; a run scores consecutive positions.
  const int32_t* prompt_logprob_first_positions = nullptr;
  // Async scheduling (Engine::append_placeholders): token i =
  // deferred_input_indices[j] of this step is the token sampled by sample
  // deferred_input_samples[j] of the newest unresolved step, whose value has
  // not reached the host. input_ids holds 0 there; the runner must write, on
  // the device, that step's sampled id into the token's input before the
  // forward pass. Only decode rows have them (their one token), and every
  // entry refers to the same step: the one before this.
  const int32_t* deferred_input_indices = nullptr;  // [num_deferred_inputs] token index
  const int32_t* deferred_input_samples = nullptr;  // [num_deferred_inputs] sample of that step
  const int32_t* block_copies = nullptr;      // [num_block_copies, 2] (src, dst) GPU blocks
  const int32_t* swap_out = nullptr;          // [num_swap_out, 2] (GPU src, CPU dst)
  const int32_t* swap_in = nullptr;           // [num_swap_in, 2] (CPU src, GPU dst)
};

// What update() (or resolve()) did with each sample, in sample order.
struct StepResult {
  int32_t num_outputs = 0;
  const int64_t* seq_ids = nullptr;         // [num_outputs]
  // [num_outputs] the appended token; -1 for a sample resolve() dropped
  // because its sequence ended before the step resolved (see Engine::resolve).
  const int32_t* token_ids = nullptr;
  const uint8_t* finish_reasons = nullptr;  // [num_outputs] FinishReason values
  const int32_t* stop_reasons = nullptr;    // [num_outputs] stop token id, or -1
  // Requests whose every sequence has finished in this update; the engine has
  // forgotten them.
  std::vector<std::string> finished_request_ids;
};

// The engine's preallocated storage behind StepBatch and StepResult.
class StepBuffers {
 public:
  explicit StepBuffers(const EngineConfig& config);

  StepBatch batch;
  StepResult result;

  std::vector<int32_t> input_ids, positions, slot_mapping, query_start_loc, num_computed_tokens,
      seq_lens, block_tables, sample_indices, sample_slots, sample_num_outputs, block_copies,
      swap_out, swap_in, prompt_logprob_indices, prompt_logprob_token_ids,
      prompt_logprob_start_loc, prompt_logprob_first_positions, deferred_input_indices,
      deferred_input_samples;
  std::vector<int64_t> seq_ids, sample_seq_ids, prompt_logprob_seq_ids;

  std::vector<int64_t> out_seq_ids;
  std::vector<int32_t> out_token_ids, out_stop_reasons;
  std::vector<uint8_t> out_finish_reasons;

  // Points batch/result at the buffers; called once by the constructor.
  void bind();
};

}  // namespace pagedcore
