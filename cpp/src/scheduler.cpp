#include "pagedcore/scheduler.h"

#include <algorithm>

#include "check.h"
#include "pagedcore/log.h"

namespace pagedcore {

Scheduler::Scheduler(const EngineConfig& config, KVCacheManager& kv) : config_(config), kv_(kv) {
  running_.reserve(config.max_num_seqs);
  scheduled_.reserve(config.max_num_seqs);
  copies_.reserve(config.max_num_seqs);
  swap_out_.reserve(config.num_cpu_blocks);
  swap_in_.reserve(config.num_cpu_blocks);
}

void Scheduler::add_waiting(Sequence* seq) {
  PAGEDCORE_CHECK(seq->status == SeqStatus::kWaiting || seq->status == SeqStatus::kSwapped,
                  "add_waiting of sequence ", seq->seq_id, " in state ",
                  static_cast<int>(seq->status));
  if (seq->status == SeqStatus::kSwapped) ++num_swapped_;
  waiting_.push(seq);
}

void Scheduler::add_running(Sequence* seq) {
  PAGEDCORE_CHECK(seq->status == SeqStatus::kRunning, "add_running of a sequence not running");
  auto pos = std::upper_bound(running_.begin(), running_.end(), seq,
                              [](const Sequence* a, const Sequence* b) { return runs_before(*a, *b); });
  running_.insert(pos, seq);
  running_seats_ += seq->weight;
}

void Scheduler::remove(Sequence* seq) {
  if (seq->heap_index >= 0) {
    waiting_.remove(seq);
    if (seq->status == SeqStatus::kSwapped) --num_swapped_;
    return;
  }
  auto it = std::find(running_.begin(), running_.end(), seq);
  PAGEDCORE_CHECK(it != running_.end(), "sequence ", seq->seq_id, " is in no queue");
  running_.erase(it);
  running_seats_ -= seq->weight;
}

void Scheduler::set_weight(Sequence* seq, int32_t weight) {
  PAGEDCORE_CHECK(seq->status == SeqStatus::kRunning, "set_weight of a sequence not running");
  running_seats_ += weight - seq->weight;
  seq->weight = weight;
}

void Scheduler::drop_finished() {
  auto end = std::remove_if(running_.begin(), running_.end(), [this](Sequence* s) {
    if (s->status != SeqStatus::kFinished) return false;
    running_seats_ -= s->weight;
    return true;
  });
  running_.erase(end, running_.end());
}

void Scheduler::preempt_last_running(int64_t step) {
  Sequence* victim = running_.back();
  PAGEDCORE_CHECK(victim->last_scheduled_step != step, "preempting sequence ", victim->seq_id,
                  " that is already scheduled in this step");
  running_.pop_back();
  running_seats_ -= victim->weight;
  ++victim->num_preemptions;
  ++stats_.num_preemptions;
  const bool swap = config_.preemption_mode == PreemptionMode::kSwap;
  // Blocks that fell out of the window are not worth copying to the CPU.
  kv_.release_out_of_window(victim->blocks, victim->num_computed);
  const char* how;
  if (swap && kv_.can_swap_out(victim->blocks)) {
    kv_.swap_out(victim->blocks, swap_out_);
    victim->status = SeqStatus::kSwapped;
    ++stats_.num_swap_preemptions;
    how = "swap";
  } else {
    // NOTE: the victim's tokens are all kept; it resumes by recomputing them
    // (from the prefix cache where its blocks survive) and then samples on.
    kv_.free(victim->blocks);
    victim->num_computed = 0;
    victim->status = SeqStatus::kWaiting;
    ++stats_.num_recompute_preemptions;
    how = swap ? "recompute (CPU swap space full)" : "recompute";
  }
  add_waiting(victim);
  log_message(LogLevel::kWarning,
              detail::concat("sequence ", victim->seq_id, " of request '",
                             victim->request->request_id, "' preempted by ", how,
                             ": not enough KV cache blocks (", kv_.gpu().num_free_blocks(),
                             " free of ", kv_.gpu().num_blocks(),
                             "); total preemptions: ", stats_.num_preemptions,
                             ". More blocks (num_blocks / gpu_memory_utilization) or a lower "
                             "max_num_seqs avoid this."));
}

void Scheduler::record(Sequence* seq, int32_t num_new, int64_t step) {
  const int32_t before = seq->num_computed;
  seq->num_computed += num_new;
  seq->last_scheduled_step = step;
  const int32_t samples = seq->num_computed == seq->num_tokens() ? seq->weight : 0;
  scheduled_.push_back({seq, before, num_new, samples});
  num_scheduled_tokens_ += num_new;
  // NOTE: a block is hashed only once its tokens are known: a placeholder
  // (async scheduling) is computed before its value reaches the host, and
  // Engine::resolve registers the block then.
  kv_.register_full_blocks(seq->blocks, seq->tokens.data(),
                           std::min(seq->num_computed, seq->num_known_tokens()),
                           seq->request->params.cache_salt);
}

bool Scheduler::try_admit(Sequence* seq, int32_t* budget) {
  SeqBlocks& blocks = seq->blocks;
  // NOTE: a sequence preempted while its last token was unresolved is never
  // admitted in the step that preempted it, and the engine resolves that token
  // before it schedules again: what is recomputed or swapped in is known.
  PAGEDCORE_CHECK(seq->num_unresolved == 0, "waiting sequence ", seq->seq_id, " has ",
                  seq->num_unresolved, " unresolved tokens");
  int32_t num_new;
  if (seq->status == SeqStatus::kSwapped) {
    num_new = std::min(seq->num_uncomputed(), *budget);
    if (kv_.num_blocks_to_swap_in(blocks, seq->num_computed, num_new) >
        kv_.gpu().num_free_blocks()) {
      return false;
    }
    waiting_.remove(seq);
    --num_swapped_;
    kv_.swap_in(blocks, seq->num_computed, swap_in_);
  } else {
    PAGEDCORE_CHECK(seq->num_computed == 0 && blocks.block_table.empty(),
                    "waiting sequence ", seq->seq_id, " holds KV");
    int32_t num_revived = 0;
    // NOTE: prompt positions still owed prompt logprobs need their logits, so
    // the lookup may not cover them (as vLLM v1 skips the cache for such
    // requests); the blocks computed are registered for others all the same.
    const Request& request = *seq->request;
    const bool capped = request.needs_prompt_logprobs(seq->prompt_len);
    const int32_t lookup_len =
        capped ? std::min(seq->num_tokens(), request.prompt_logprobs_done + 1) : seq->num_tokens();
    const int32_t hits = kv_.lookup_prefix(blocks, seq->tokens.data(), lookup_len,
                                           request.params.cache_salt, &num_revived);
    const int32_t hit_tokens = hits * kv_.block_size();
    num_new = std::min(seq->num_tokens() - hit_tokens, *budget);
    const int32_t bs = kv_.block_size();
    const int32_t fresh = (hit_tokens + num_new + bs - 1) / bs - hits;
    if (fresh + num_revived > kv_.gpu().num_free_blocks()) return false;
    waiting_.remove(seq);
    kv_.commit_prefix(blocks, hits);
    seq->num_computed = hit_tokens;
    if (seq->num_preemptions == 0 && !capped) {  // (a capped lookup is no query of the cache)
      stats_.prefix_cache_queries += seq->num_tokens();
      stats_.prefix_cache_hits += hit_tokens;
    }
  }
  kv_.release_out_of_window(blocks, seq->num_computed);
  kv_.allocate_slots(blocks, seq->num_computed, num_new, copies_);
  seq->status = SeqStatus::kRunning;
  add_running(seq);
  *budget -= num_new;
  return true;
}

void Scheduler::schedule(int64_t step) {
  scheduled_.clear();
  copies_.clear();
  swap_out_.clear();
  swap_in_.clear();
  num_scheduled_tokens_ = 0;
  int32_t budget = config_.max_num_batched_tokens;
  // Prompt tokens (chunks of more than one token, admissions) this step may
  // still take: see EngineConfig::max_num_mixed_prefill_tokens.
  int32_t prefill_budget = budget;
  const size_t waiting = waiting_.size();
  const bool capped = waiting <= static_cast<size_t>(config_.mixed_prefill_max_waiting);
  // (a queue over max_waiting: the lifted cap while it holds, else none: the whole budget)
  const int32_t cap = capped ? config_.max_num_mixed_prefill_tokens
                      : waiting <= static_cast<size_t>(config_.mixed_prefill_lift_max_waiting)
                          ? config_.mixed_prefill_lift_tokens
                          : 0;
  const int32_t per_cap = capped ? config_.mixed_prefill_waiting_per_cap : 0;
  if (config_.max_num_mixed_prefill_tokens > 0 && cap > 0) {
    const auto decode_rows = static_cast<int32_t>(
        std::count_if(running_.begin(), running_.end(), [](const Sequence* s) {
          return !s->finish_pending && s->num_uncomputed() == 1;
        }));
    // NOTE: the cap counts the decode rows too: a mixed step of at most `cap`
    // tokens runs the runner's graph of that many tokens (while rows are fewer
    // than 2 / 3 of it: beyond, the floor below makes it rows * 1.5), where a cap on the
    // prompt tokens alone (rows + cap) would pad up to the next size, twice
    // the cost. The floor (half the rows) keeps prompts moving while rows fill
    // the cap: a step of many rows costs several decode steps of few, and half
    // as many prompt tokens again keeps it within ~1.5x of itself. It was cap / 16
    // until 43899e5: 16 tokens a step beside 500 rows left a burst's last
    // admissions trickling in for tens of steps.
    // NOTE: the queue's share (mixed_prefill_waiting_per_cap), measured on the H200
    // (SmolLM2, 4 HTTP processes, saturation against offline / ITL p99 over p50 at
    // half of that saturation): off (the lift above 8 waiting alone) 0.85-0.93 /
    // 2.27-2.54: at ~390 req/s capped steps take fewer prompt tokens than arrive,
    // the queue passes 8 again and again, and each lifted step (~2,500 tokens) runs
    // in pieces, 5 ms of device and 4 of host time. Never lifted, share 8: 0.75 /
    // 1.72 with the floor cap / 16, 0.80 / 2.01 with half the rows (each at half
    // of its own, lower saturation); share 4, floor cap / 16: 0.87 / 2.40; share 8
    // with the lift: 0.93 / 2.42. No setting met both (>= 0.9, <= 2): the share is
    // off by default. Lifting the cap above max_waiting only to 1,024 tokens (the
    // runner's whole graphs; the full budget above 32 or 64 waiting) gave 0.91-0.93 /
    // 2.15-2.30 (eleventh session): the lifted steps ran in graphs, the p99 stayed.
    // With whole graphs up to 8,192 tokens (twenty-sixth session), no lifted cap:
    // 0.87 / 2.55, 0.93 / 2.25, 0.96 / 2.31; mixed_prefill_lift_tokens 2048 (to
    // the whole budget above 64 waiting): 0.87 / 1.90, 0.79 / 2.81. Runs of one
    // setting spread as widely as the settings: the lifted cap stays opt-in.
    if (decode_rows > 0) {
      const int64_t extra =
          per_cap > 0 ? static_cast<int64_t>(cap) * static_cast<int64_t>(waiting) / per_cap : 0;
      const int64_t share =
          std::max<int64_t>(std::max(cap - decode_rows, decode_rows / 2), 1) + extra;
      prefill_budget = static_cast<int32_t>(std::min<int64_t>(budget, share));
    }
  }
  bool preempted = false;

  // Running sequences, in order. Victims are taken from the back, so a victim
  // is never one already scheduled in this step (unless it is `seq` itself).
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* seq = running_[i];
    // Its last placeholder ended it (max_tokens / max_model_len): it only
    // waits for that token's value (Engine::resolve) to finish.
    if (seq->finish_pending) continue;
    PAGEDCORE_CHECK(seq->num_uncomputed() > 0, "running sequence ", seq->seq_id,
                    " has nothing to compute");
    const bool prefill = seq->num_uncomputed() > 1;
    const int32_t num_new =
        std::min(seq->num_uncomputed(), prefill ? std::min(budget, prefill_budget) : budget);
    // NOTE: a prefill that the cap leaves out stays running and goes on in a
    // later step; decode rows, which the cap is for, are never left out.
    if (num_new == 0) continue;
    kv_.release_out_of_window(seq->blocks, seq->num_computed);
    bool self_preempted = false;
    while (!kv_.can_allocate(seq->blocks, seq->num_computed, num_new)) {
      const bool last = running_.back() == seq;
      preempt_last_running(step);
      preempted = true;
      if (last) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    kv_.allocate_slots(seq->blocks, seq->num_computed, num_new, copies_);
    budget -= num_new;
    if (prefill) prefill_budget -= num_new;
    record(seq, num_new, step);
  }

  // NOTE: no admission in a step that preempted: the freed blocks would go to
  // newcomers while the victims wait, and swap-in pairs would mix with the
  // swap-out pairs of the same step.
  if (!preempted) {
    while (budget > 0 && prefill_budget > 0 && !waiting_.empty()) {
      Sequence* seq = waiting_.top();
      if (running_seats_ + seq->weight > config_.max_num_seqs) break;
      if (config_.reserve_max_model_len &&
          static_cast<int64_t>(running_seats_ + seq->weight) * config_.max_blocks_per_seq() >
              kv_.gpu().num_blocks()) {
        break;
      }
      int32_t room = std::min(budget, prefill_budget);
      const int32_t room_before = room;
      if (!try_admit(seq, &room)) break;
      budget -= room_before - room;
      prefill_budget -= room_before - room;
      record(seq, room_before - room, step);
    }
  }
}

void Scheduler::check_consistency() const {
  waiting_.check_consistency();
  int32_t seats = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    const Sequence* s = running_[i];
    PAGEDCORE_CHECK(s->status == SeqStatus::kRunning, "sequence ", s->seq_id,
                    " in the running list has state ", static_cast<int>(s->status));
    PAGEDCORE_CHECK(s->heap_index == -1, "running sequence ", s->seq_id, " is also waiting");
    if (i > 0) {
      PAGEDCORE_CHECK(runs_before(*running_[i - 1], *s), "running list out of order at ", i);
    }
    seats += s->weight;
  }
  PAGEDCORE_CHECK(seats == running_seats_, "running seats ", running_seats_, " but ", seats,
                  " counted");
  PAGEDCORE_CHECK(seats <= config_.max_num_seqs, seats, " seats over max_num_seqs");
  int32_t swapped = 0;
  for (const Sequence* s : waiting_.items()) {
    PAGEDCORE_CHECK(s->status == SeqStatus::kWaiting || s->status == SeqStatus::kSwapped,
                    "waiting sequence ", s->seq_id, " has state ", static_cast<int>(s->status));
    if (s->status == SeqStatus::kSwapped) ++swapped;
  }
  PAGEDCORE_CHECK(swapped == num_swapped_, "swapped count ", num_swapped_, " but ", swapped);
}

}  // namespace pagedcore
