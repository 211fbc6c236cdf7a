// Requests and their sequences, as the engine and scheduler see them.
//
// A request with n samples starts as one sequence (the parent, index 0) that
// stands for all n seats until its prompt is computed; the step that samples
// its first tokens forks it into n sequences sharing the prompt's blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pagedcore/config.h"
#include "pagedcore/kv_cache_manager.h"
#include "pagedcore/types.h"

namespace pagedcore {

enum class SeqStatus : uint8_t {
  kWaiting,   // not started, or preempted by recompute (holds no blocks)
  kRunning,   // holds GPU blocks for every computed token
  kSwapped,   // preempted by swap: its blocks are in the CPU pool
  kFinished,  // holds nothing
};

struct Request;

struct Sequence {
  SeqId seq_id = 0;
  Request* request = nullptr;
  int32_t index = 0;                // completion index within the request
  std::vector<TokenId> tokens;      // prompt, then outputs
  int32_t prompt_len = 0;
  // Tokens whose KV is in the cache (or will be, once the scheduled step runs).
  int32_t num_computed = 0;
  SeqStatus status = SeqStatus::kWaiting;
  SeqBlocks blocks;
  // Seats taken in max_num_seqs: n for a parent that has not forked yet.
  int32_t weight = 1;
  // Scheduling order: (priority, arrival, seq_id), smallest first.
  int32_t priority = 0;
  uint64_t arrival = 0;
  int32_t heap_index = -1;          // position in the waiting queue, -1 outside it
  int64_t last_scheduled_step = -1;
  int32_t num_preemptions = 0;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t stop_reason = -1;         // the stop token id that ended it, else -1
  // Async scheduling (Engine::append_placeholders / Engine::resolve): the
  // trailing tokens whose values unresolved steps still owe (0, 1 or 2); they
  // hold kPlaceholderToken until then and are never hashed for the prefix cache.
  int32_t num_unresolved = 0;
  // The sample, within the newest unresolved step, whose value is the last
  // token; -1 when the last token is known. A step scheduled now reads that
  // token's id from the device (StepBatch::deferred_input_indices).
  int32_t pending_sample = -1;
  // A placeholder reached max_tokens or max_model_len: the sequence is never
  // scheduled again and finishes (kLength, or kStop when the value turns out
  // to be a stop token) when that placeholder's step resolves.
  bool finish_pending = false;

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_outputs() const { return num_tokens() - prompt_len; }
  // Tokens whose values are known (all but the unresolved placeholders).
  int32_t num_known_tokens() const { return num_tokens() - num_unresolved; }
  // Tokens that still have to go through the model before the next sample.
  int32_t num_uncomputed() const { return num_tokens() - num_computed; }
};

// True when a runs before b.
inline bool runs_before(const Sequence& a, const Sequence& b) {
  if (a.priority != b.priority) return a.priority < b.priority;
  if (a.arrival != b.arrival) return a.arrival < b.arrival;
  return a.seq_id < b.seq_id;
}

struct Request {
  std::string request_id;
  RequestParams params;
  SeqId first_seq_id = 0;  // ids first_seq_id .. first_seq_id + n - 1 belong to it
  int32_t max_seq_blocks = 0;  // most blocks one of its sequences can hold
  int32_t slot = -1;           // Engine::request_slot
  std::vector<std::unique_ptr<Sequence>> seqs;  // seqs[0] is the parent
  bool awaiting_fork = false;  // n > 1 and the prompt is not computed yet
  int32_t num_unfinished = 0;
  // With params.prompt_logprobs: prompt positions [0, this) have been listed
  // in a step batch for prompt logprobs (at most prompt_len - 1).
  int32_t prompt_logprobs_done = 0;

  // Whether prompt positions still wait to be listed for prompt logprobs.
  bool needs_prompt_logprobs(int32_t prompt_len) const {
    return params.prompt_logprobs && prompt_logprobs_done < prompt_len - 1;
  }
};

}  // namespace pagedcore
