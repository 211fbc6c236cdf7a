// Engine configuration and per-request parameters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedcore/types.h"

namespace pagedcore {

// Fixed at engine construction. validate() throws InvalidArgument naming the
// field and its value when a field is out of range.
struct EngineConfig {
  // Usable GPU KV-cache blocks. The KV tensors need num_blocks + 1 rows
  // (Engine::num_physical_blocks()): row 0 is the null block.
  int32_t num_blocks = 1024;
  // Tokens per block: 8, 16, 32, 64 or 128.
  int32_t block_size = 16;
  // Most sequences running at once (a request with n samples counts n).
  int32_t max_num_seqs = 256;
  // Token budget of one step: decode tokens plus prefill chunk tokens.
  int32_t max_num_batched_tokens = 2048;
  // 0: no cap but max_num_batched_tokens. N > 0: a step that runs decode rows
  // (running sequences with one token to compute) computes at most N tokens in
  // all: its R decode rows and up to N - R prompt tokens (chunks of running
  // prefills and admissions together; at least max(1, R / 2) however many
  // rows run), so that a step that gives the running streams their next
  // token costs about a decode step (their inter-token latency; on CUDA it
  // fits the whole graph of N tokens while R <= 2N / 3), while longer prompts are chunked over
  // more steps. With mixed_prefill_waiting_per_cap U > 0, W waiting sequences
  // add N * W / U prompt tokens (another N for every U waiting: a step grows
  // with the queue in proportion). The cap holds only while at most
  // mixed_prefill_max_waiting sequences wait: a longer queue (a burst,
  // saturation) is admitted with the whole budget, or, with
  // mixed_prefill_lift_tokens L > 0, with steps of at most L tokens (rows
  // included, the same floor) while at most mixed_prefill_lift_max_waiting
  // wait: a burst at moderate load then takes a few steps of a mid-sized
  // graph instead of one of the whole budget (the streams' latency tail).
  int32_t max_num_mixed_prefill_tokens = 0;
  int32_t mixed_prefill_waiting_per_cap = 0;
  int32_t mixed_prefill_max_waiting = 8;
  int32_t mixed_prefill_lift_tokens = 0;
  int32_t mixed_prefill_lift_max_waiting = 64;
  // Longest sequence (prompt + output) in tokens.
  int32_t max_model_len = 2048;
  // Reuse full blocks whose content (the whole prefix up to them) was computed before.
  bool enable_prefix_caching = true;
  PreemptionMode preemption_mode = PreemptionMode::kRecompute;
  SchedulingPolicy scheduling_policy = SchedulingPolicy::kFcfs;
  // CPU blocks for swap preemption (the CPU KV tensors need num_cpu_blocks + 1 rows).
  // Required (> 0) when preemption_mode is kSwap.
  int32_t num_cpu_blocks = 0;
  // 0: full attention. W > 0: each query attends to the W most recent positions
  // (itself included); blocks wholly before that window are released.
  int32_t sliding_window = 0;
  // 0: token ids are not range-checked. V > 0: token ids must be < V.
  int32_t vocab_size = 0;
  // Bits of the block content hash that are kept (0..64). Fewer bits force hash
  // collisions; only tests want that: a hit always verifies tokens and parent.
  int32_t prefix_hash_bits = 64;
  // The baseline paging is measured against (bench/bench_memory.py): admit a
  // sequence only when every running sequence, it included, could grow to
  // max_model_len, as if each had its whole context reserved up front. Blocks
  // are still taken as tokens arrive, so nothing else changes.
  bool reserve_max_model_len = false;

  void validate() const;
  // ceil(max_model_len / block_size): the width of a block-table row.
  int32_t max_blocks_per_seq() const;
};

// What a request asks of the engine: how many samples and when to stop.
// Sampling itself (temperature, top_p, ...) belongs to the model runner.
struct RequestParams {
  int32_t n = 1;              // samples; they share the prompt's blocks
  int32_t max_tokens = 16;    // >= 1; capped by max_model_len - prompt length
  int32_t min_tokens = 0;     // no stop (EOS, stop token) before this many outputs
  bool ignore_eos = false;
  std::vector<TokenId> eos_token_ids;   // finish with reason kStop, stop_reason -1
  std::vector<TokenId> stop_token_ids;  // finish with reason kStop, stop_reason = the token
  int32_t priority = 0;       // only with SchedulingPolicy::kPriority; lower runs first
  // Mixed into the prefix-cache hash of every block: requests with different
  // salts never share cached blocks.
  uint64_t cache_salt = 0;
  // The runner needs the logits of every prompt position but the last (the
  // log-probabilities of prompt tokens 1..prompt_len-1): each step lists the
  // positions it computes for the first time (StepBatch::prompt_logprob_*),
  // each exactly once over the request's life, chunks and recompute
  // preemptions included. The prefix cache is not read for positions not
  // listed yet (their logits must be computed), but it is still filled.
  bool prompt_logprobs = false;
};

// Token ids given as 64-bit integers (Python ints, numpy int64), checked to be
// in [0, 2^31); InvalidArgument names `field`, the index and the value.
std::vector<TokenId> to_token_ids(const int64_t* ids, size_t n, const char* field);

const char* to_string(PreemptionMode mode);
const char* to_string(SchedulingPolicy policy);
// Parse "recompute"/"swap" and "fcfs"/"priority"; InvalidArgument otherwise.
PreemptionMode parse_preemption_mode(const std::string& name);
SchedulingPolicy parse_scheduling_policy(const std::string& name);

}  // namespace pagedcore
