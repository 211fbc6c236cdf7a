// Decides which sequences run in a step and how many tokens each computes.
//
// One token budget per step (max_num_batched_tokens) and at most max_num_seqs
// seats. Running sequences go first, in scheduling order: each gets all its
// uncomputed tokens (one for a decode, the rest of its prompt for a prefill)
// capped by what is left of the budget, so long prompts are chunked across
// steps. When blocks run out, the running sequence that runs last is
// preempted (by recompute, or by swap when configured and the CPU pool has
// room), possibly the one being scheduled. Waiting sequences are admitted in
// order only in steps without preemption, and the first that does not fit
// stops admission (head-of-line order, as FCFS promises). With
// max_num_mixed_prefill_tokens, a step that runs decode rows takes at most
// that many tokens, its decode rows included (plus, if configured, a share
// that grows with the waiting queue), while the waiting queue is short (the
// running streams' next token is not held up by a long prefill).
//
// The scheduler reads only the head of the waiting queue: a step's cost does
// not depend on how many sequences wait.
//
// Async scheduling (Engine::append_placeholders): a running sequence whose
// last placeholder reached its length stop (Sequence::finish_pending) is
// skipped, and full blocks are registered in the prefix cache only as far as
// the sequence's tokens are known.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedcore/config.h"
#include "pagedcore/kv_cache_manager.h"
#include "pagedcore/sequence.h"
#include "pagedcore/waiting_queue.h"

namespace pagedcore {

struct ScheduledSeq {
  Sequence* seq;
  int32_t num_computed_before;  // tokens in the cache before this step
  int32_t num_new;              // tokens computed in this step
  int32_t num_samples;          // 0 (prompt chunk), 1, or n (a parent's last prompt chunk)
};

struct SchedulerStats {
  int64_t num_preemptions = 0;
  int64_t num_recompute_preemptions = 0;
  int64_t num_swap_preemptions = 0;
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up at first admission
  int64_t prefix_cache_hits = 0;     // of those, tokens found in the cache
};

class Scheduler {
 public:
  Scheduler(const EngineConfig& config, KVCacheManager& kv);

  // A new sequence, or one preempted. Status must be kWaiting or kSwapped.
  void add_waiting(Sequence* seq);
  // A running sequence created outside schedule() (a fork). Status kRunning.
  void add_running(Sequence* seq);
  // Takes seq out of its queue (running or waiting). The caller frees its blocks.
  void remove(Sequence* seq);
  // Changes the seats a running sequence takes (a parent that forks its n
  // samples goes from n seats to 1).
  void set_weight(Sequence* seq, int32_t weight);
  // Removes every sequence whose status is kFinished from the running list.
  void drop_finished();

  // Plans step `step`: fills scheduled(), copies(), swap_out(), swap_in(),
  // advances num_computed of the scheduled sequences and registers their full
  // blocks in the prefix cache.
  void schedule(int64_t step);

  const std::vector<ScheduledSeq>& scheduled() const { return scheduled_; }
  const std::vector<BlockPair>& copies() const { return copies_; }
  const std::vector<BlockPair>& swap_out() const { return swap_out_; }
  const std::vector<BlockPair>& swap_in() const { return swap_in_; }
  int32_t num_scheduled_tokens() const { return num_scheduled_tokens_; }

  const std::vector<Sequence*>& running() const { return running_; }
  const WaitingQueue& waiting() const { return waiting_; }
  int32_t num_running_seats() const { return running_seats_; }
  int32_t num_swapped() const { return num_swapped_; }
  const SchedulerStats& stats() const { return stats_; }

  // Throws InternalError when the queues disagree with the sequences' states.
  void check_consistency() const;

 private:
  void preempt_last_running(int64_t step);
  bool try_admit(Sequence* seq, int32_t* budget);
  void record(Sequence* seq, int32_t num_new, int64_t step);

  const EngineConfig config_;
  KVCacheManager& kv_;
  std::vector<Sequence*> running_;  // sorted by runs_before
  WaitingQueue waiting_;
  int32_t running_seats_ = 0;
  int32_t num_swapped_ = 0;
  SchedulerStats stats_;

  std::vector<ScheduledSeq> scheduled_;
  std::vector<BlockPair> copies_;
  std::vector<BlockPair> swap_out_;
  std::vector<BlockPair> swap_in_;
  int32_t num_scheduled_tokens_ = 0;
};

}  // namespace pagedcore
