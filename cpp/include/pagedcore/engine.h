// The engine: requests in, step batches out, sampled tokens back in.
//
// Usage (one step):
//   const StepBatch& batch = engine.schedule();
//   ... the runner performs the batch's swaps/copies, runs the model and
//       samples one token per entry of batch.sample_indices ...
//   const StepResult& result = engine.update(sampled, batch.num_samples);
//
// Async scheduling (schedule step n+1 before step n's sampled ids reach the
// host) splits update() in two:
//   const StepBatch& batch = engine.schedule();   // step n+1
//   engine.append_placeholders();                 // its samples: values owed
//   ... the runner copies step n's sampled ids (still on the device) into the
//       inputs batch.deferred_input_indices, runs step n+1 and samples ...
//   const StepResult& result = engine.resolve(step_n_sampled, num_samples_n);
// append_placeholders() appends a placeholder token per sample (the sequence
// grows, gets its slot and block in the next step, and max_tokens /
// max_model_len apply at once); resolve() gives the oldest unresolved step its
// values, applies EOS / stop tokens then, hashes blocks whose tokens became
// known, and finishes what ended. A sequence that turns out ended was
// scheduled once more; resolve() of that later step drops its sample.
// At most two steps are unresolved at a time (schedule() takes at most one).
//
// The engine never touches tensors and the runner never decides who runs.
// Every call is single-threaded; the engine is not thread-safe. Calls that
// throw leave the engine exactly as it was before the call.
//
// A C++ host includes this header and links pagedcore::core
// (find_package(pagedcore)).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pagedcore/config.h"
#include "pagedcore/kv_cache_manager.h"
#include "pagedcore/scheduler.h"
#include "pagedcore/sequence.h"
#include "pagedcore/step_batch.h"

namespace pagedcore {

struct EngineStats {
  int32_t num_blocks = 0;          // usable GPU blocks
  int32_t num_free_blocks = 0;     // incl. cached blocks that can be evicted
  int32_t num_cached_blocks = 0;   // free blocks that still hold reusable content
  int32_t num_used_blocks = 0;     // owned by at least one sequence
  int32_t num_cpu_blocks = 0;
  int32_t num_free_cpu_blocks = 0;
  int32_t num_requests = 0;        // unfinished requests
  int32_t num_running_seqs = 0;    // running sequences (a parent awaiting its fork counts once)
  int32_t num_waiting_seqs = 0;    // waiting, swapped ones included
  int32_t num_swapped_seqs = 0;
  int64_t num_steps = 0;
  int64_t num_preemptions = 0;
  int64_t num_recompute_preemptions = 0;
  int64_t num_swap_preemptions = 0;
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up
  int64_t prefix_cache_hits = 0;     // prompt tokens found cached
  double prefix_cache_hit_rate = 0;  // hits / queries, 0 before any query
  int64_t num_prompt_tokens = 0;     // prompt tokens of requests that sampled their first token
  int64_t num_generation_tokens = 0; // tokens appended by update()
  // Tokens whose KV the running sequences hold (each sequence counts its own,
  // shared prefixes included), and the blocks they have reserved: the blocks
  // they hold, or with reserve_max_model_len, max_blocks_per_seq per seat.
  int64_t num_kv_tokens = 0;
  int64_t num_reserved_blocks = 0;
};

class Engine {
 public:
  // Throws InvalidArgument when config.validate() does.
  explicit Engine(const EngineConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineConfig& config() const { return config_; }
  // Rows the KV-cache tensors need: usable blocks + the null block (row 0).
  int32_t num_physical_blocks() const { return config_.num_blocks + 1; }
  int32_t num_physical_cpu_blocks() const { return config_.num_cpu_blocks + 1; }

  // Queues a request. Returns the id of its first sequence; its n sequences
  // get ids first .. first + n - 1. Throws InvalidArgument for an empty or
  // too long prompt, a bad token id, n < 1 or > max_num_seqs, max_tokens < 1,
  // min_tokens outside [0, max_tokens], a priority under FCFS, or a request
  // that could not fit in the whole cache even alone; InvalidArgument also for
  // a request_id already in use.
  SeqId add_request(const std::string& request_id, const TokenId* prompt, int32_t prompt_len,
                    const RequestParams& params);
  SeqId add_request(const std::string& request_id, const std::vector<TokenId>& prompt,
                    const RequestParams& params) {
    return add_request(request_id, prompt.data(), static_cast<int32_t>(prompt.size()), params);
  }

  // Drops a request in any state and frees its blocks. Throws NotFound for an
  // unknown (or already finished) id. Call only when no step is pending;
  // unresolved steps are fine (their samples of the request are dropped).
  void abort(const std::string& request_id);

  // Plans the next step. Call only when no step is pending and at most one
  // step is unresolved; then call update() (no step unresolved) or
  // append_placeholders().
  const StepBatch& schedule();

  // Appends sampled[k] to the sequence of sample k of the pending step (forking
  // n-sample parents first), applies EOS / stop-token / min_tokens / max_tokens
  // / max_model_len stops and frees finished sequences.
  // Throws InvalidArgument (state unchanged) when num_sampled differs from the
  // batch's num_samples or a token id is out of range; InvalidState when no
  // step is pending or a step is unresolved (use resolve()).
  // The same as append_placeholders() followed by resolve(sampled).
  const StepResult& update(const TokenId* sampled, int32_t num_sampled);
  // The same for 64-bit ids (checked to fit a TokenId before anything changes).
  const StepResult& update(const int64_t* sampled, int32_t num_sampled);

  // ---- async scheduling ------------------------------------------------------
  // Ends the pending step without its sampled values: forks n-sample parents,
  // appends kPlaceholderToken to the sequence of each sample and marks the
  // sequences that reach max_tokens or max_model_len with it (they are not
  // scheduled again and finish when the step resolves). The step becomes
  // unresolved; schedule() may run again before it resolves, and then lists
  // the placeholders as deferred inputs (StepBatch::deferred_input_indices).
  // Throws InvalidState when no step is pending.
  void append_placeholders();

  // The sampled values of the oldest unresolved step, in its sample order:
  // writes each into its placeholder, applies EOS / stop-token stops (from
  // min_tokens outputs on, counted up to that token), then the max_tokens /
  // max_model_len stop that append_placeholders() found, frees finished
  // sequences and registers the blocks whose tokens are now all known in the
  // prefix cache. A sample whose sequence ended before this call (an EOS of an
  // earlier step, abort(), finish()) is dropped: the result lists it with
  // token -1 and FinishReason::kNone. Call only when no step is pending.
  // Throws InvalidState when no step is unresolved or one is pending,
  // InvalidArgument (state unchanged) when num_sampled differs from that
  // step's sample count or a token id is out of range.
  const StepResult& resolve(const TokenId* sampled, int32_t num_sampled);
  const StepResult& resolve(const int64_t* sampled, int32_t num_sampled);
  // Steps that append_placeholders() ended and resolve() has not (0, 1 or 2).
  int32_t num_unresolved_steps() const { return num_unresolved_steps_; }
  // Samples of the oldest unresolved step (what resolve() expects); 0 if none.
  int32_t num_unresolved_samples() const;

  // Finishes a sequence for a reason decided by the caller (a stop string):
  // reason kStop, or kAbort. Returns true when this finished its request (the
  // engine then forgets the request). Throws NotFound for an unknown or
  // finished sequence. Call only when no step is pending; unresolved steps
  // are fine (their samples of the sequence are dropped).
  bool finish(SeqId seq_id, FinishReason reason = FinishReason::kStop);

  // Creates a sequence of the same request sharing every block (and token)
  // of seq_id, which must be running, not awaiting its fork, with its last
  // token not computed yet (true of every running sequence between steps).
  // Returns the new id. Throws NotFound for an unknown sequence,
  // InvalidArgument when max_num_seqs seats are taken or seq_id is not running.
  // Call only when no step is pending or unresolved.
  SeqId fork(SeqId seq_id);

  // Rewrites the last token of a live sequence, which must be an output token
  // not computed yet (true of every running sequence between steps). Beam
  // search uses it after fork(): each beam continues with its chosen token.
  // Throws NotFound, or InvalidArgument (not an uncomputed output token, or a
  // bad token id). Call only when no step is pending or unresolved.
  void set_last_token(SeqId seq_id, TokenId token);

  // The slot of a live request: the smallest integer >= 0 not used by another
  // live request, fixed for the request's life (StepBatch::sample_slots
  // refers to it). Slots stay below max_request_slots(). Throws NotFound.
  int32_t request_slot(const std::string& request_id) const;
  int32_t max_request_slots() const { return static_cast<int32_t>(slot_owner_.size()); }

  EngineStats stats() const;
  bool has_pending_step() const { return step_pending_; }
  int32_t num_unfinished_requests() const { return static_cast<int32_t>(requests_.size()); }
  bool has_unfinished_requests() const { return !requests_.empty(); }
  // Tokens (prompt + outputs) of a live sequence. Throws NotFound.
  const std::vector<TokenId>& seq_token_ids(SeqId seq_id) const;
  // GPU block table of a live sequence. Throws NotFound.
  const std::vector<BlockId>& seq_block_table(SeqId seq_id) const;

  // Checks every invariant across the allocator, the block tables and the
  // queues; throws InternalError on the first that fails. O(blocks + tokens).
  // Built with PAGEDCORE_DEBUG_CHECKS, the engine runs it after every call
  // that changes state.
  void check_invariants() const;

  // Internals, for tests and benchmarks.
  const KVCacheManager& kv() const { return kv_; }
  const Scheduler& scheduler() const { return scheduler_; }

 private:
  void validate_request(const std::string& request_id, const TokenId* prompt, int32_t prompt_len,
                        const RequestParams& params) const;
  Sequence* find_seq(SeqId seq_id) const;
  void fill_batch();
  Sequence* fork_child(Sequence* parent, SeqId child_id, int32_t index);
  // Sets the finish state, frees the blocks, counts it off its request.
  void finish_seq(Sequence* seq, FinishReason reason, int32_t stop_reason);
  void forget_request(Request* request);
  void require_no_pending_step(const char* call) const;
  void require_no_unresolved_step(const char* call) const;
  // Checks the token ids a caller hands in; throws InvalidArgument.
  void check_sampled(const TokenId* sampled, int32_t num_sampled) const;
  // Applies the values of the oldest unresolved step (checked by the caller).
  const StepResult& apply_resolved(const TokenId* sampled);
  // Throws unless a step is pending and num_sampled matches its samples.
  void require_update_call(int32_t num_sampled) const;
  void debug_check() const;

  const EngineConfig config_;
  KVCacheManager kv_;
  Scheduler scheduler_;
  StepBuffers buffers_;

  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::unordered_map<SeqId, Sequence*> seqs_;  // live (unfinished) sequences
  std::vector<bool> slot_owner_;               // slot -> taken by a live request
  std::vector<int32_t> free_slots_;            // freed slots, taken before new ones
  SeqId next_seq_id_ = 0;
  uint64_t next_arrival_ = 0;
  int64_t step_ = 0;
  bool step_pending_ = false;
  int64_t num_prompt_tokens_ = 0;
  int64_t num_generation_tokens_ = 0;

  // Per sample of the pending step: the sequence that was scheduled and which
  // of its n samples this is (non-zero only for a parent awaiting its fork).
  std::vector<Sequence*> sample_seq_;
  std::vector<int32_t> sample_fork_index_;
  // What each row of the batch's block tables holds from earlier steps: the
  // sequence, its table version and how many entries were written. A row that
  // keeps its sequence at the same version only gets the entries from its last
  // one on (fill_batch's cost then follows new blocks, not context length).
  std::vector<SeqId> row_seq_;
  std::vector<uint32_t> row_version_;
  std::vector<int32_t> row_written_;
  // Unresolved steps (append_placeholders() ... resolve()), oldest first, in a
  // ring of two: per sample, the sequence and the position of its placeholder.
  struct UnresolvedStep {
    int32_t num_samples = 0;
    std::vector<SeqId> seq_ids;
    std::vector<int32_t> positions;
  };
  UnresolvedStep unresolved_[2];
  int32_t oldest_unresolved_ = 0;
  int32_t num_unresolved_steps_ = 0;
  std::vector<Request*> finished_requests_;  // scratch of update()
  std::vector<TokenId> narrowed_;            // scratch of update(const int64_t*, ...)
};

}  // namespace pagedcore
