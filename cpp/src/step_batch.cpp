#include "pagedcore/step_batch.h"

#include <algorithm>

namespace pagedcore {

StepBuffers::StepBuffers(const EngineConfig& config) {
  const size_t tokens = config.max_num_batched_tokens;
  const size_t seqs = config.max_num_seqs;
  input_ids.resize(tokens);
  positions.resize(tokens);
  slot_mapping.resize(tokens);
  seq_ids.resize(seqs);
  query_start_loc.resize(seqs + 1);
  num_computed_tokens.resize(seqs);
  seq_lens.resize(seqs);
  block_tables.resize(seqs * static_cast<size_t>(config.max_blocks_per_seq()));
  // A step samples at most one token per seat.
  sample_indices.resize(seqs);
  sample_seq_ids.resize(seqs);
  sample_slots.resize(seqs);
  sample_num_outputs.resize(seqs);
  // Every computed token but a sampled one may score a prompt token.
  prompt_logprob_indices.resize(tokens);
  prompt_logprob_token_ids.resize(tokens);
  prompt_logprob_seq_ids.resize(seqs);
  prompt_logprob_start_loc.resize(seqs + 1);
  prompt_logprob_first_positions.resize(seqs);
  // Only decode rows defer their input: at most one per seat.
  deferred_input_indices.resize(seqs);
  deferred_input_samples.resize(seqs);
  // At most one copy-on-write per scheduled sequence and step.
  block_copies.resize(2 * seqs);
  // NOTE: never empty, so data() is a real pointer even with no CPU pool
  // (zero-length views over it must still point somewhere).
  swap_out.resize(std::max<size_t>(2, 2 * static_cast<size_t>(config.num_cpu_blocks)));
  swap_in.resize(std::max<size_t>(2, 2 * static_cast<size_t>(config.num_cpu_blocks)));
  out_seq_ids.resize(seqs);
  out_token_ids.resize(seqs);
  out_stop_reasons.resize(seqs);
  out_finish_reasons.resize(seqs);
  batch.block_size = config.block_size;
  batch.max_blocks_per_seq = config.max_blocks_per_seq();
  bind();
}

void StepBuffers::bind() {
  batch.input_ids = input_ids.data();
  batch.positions = positions.data();
  batch.slot_mapping = slot_mapping.data();
  batch.seq_ids = seq_ids.data();
  batch.query_start_loc = query_start_loc.data();
  batch.num_computed_tokens = num_computed_tokens.data();
  batch.seq_lens = seq_lens.data();
  batch.block_tables = block_tables.data();
  batch.sample_indices = sample_indices.data();
  batch.sample_seq_ids = sample_seq_ids.data();
  batch.sample_slots = sample_slots.data();
  batch.sample_num_outputs = sample_num_outputs.data();
  batch.prompt_logprob_indices = prompt_logprob_indices.data();
  batch.prompt_logprob_token_ids = prompt_logprob_token_ids.data();
  batch.prompt_logprob_seq_ids = prompt_logprob_seq_ids.data();
  batch.prompt_logprob_start_loc = prompt_logprob_start_loc.data();
  batch.prompt_logprob_first_positions = prompt_logprob_first_positions.data();
  batch.deferred_input_indices = deferred_input_indices.data();
  batch.deferred_input_samples = deferred_input_samples.data();
  batch.block_copies = block_copies.data();
  batch.swap_out = swap_out.data();
  batch.swap_in = swap_in.data();
  result.seq_ids = out_seq_ids.data();
  result.token_ids = out_token_ids.data();
  result.finish_reasons = out_finish_reasons.data();
  result.stop_reasons = out_stop_reasons.data();
}

}  // namespace pagedcore
