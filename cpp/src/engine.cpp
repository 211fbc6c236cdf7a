#include "pagedcore/engine.h"

#include <algorithm>
#include <functional>

#include "check.h"

namespace pagedcore {

namespace {

const EngineConfig& validated(const EngineConfig& config) {
  config.validate();
  return config;
}

bool contains(const std::vector<TokenId>& ids, TokenId token) {
  return std::find(ids.begin(), ids.end(), token) != ids.end();
}

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

// The most tokens a sequence of this request ever has in the KV cache. The
// last sampled token is never computed: the sequence finishes when it is
// appended (max_tokens, or max_model_len reached).
int64_t max_computed_tokens(int32_t prompt_len, const RequestParams& params,
                            int32_t max_model_len) {
  return std::min<int64_t>(int64_t{prompt_len} + params.max_tokens - 1,
                           std::max(prompt_len, max_model_len - 1));
}

}  // namespace

Engine::Engine(const EngineConfig& config)
    : config_(validated(config)),
      kv_(config.num_blocks, config.num_cpu_blocks, config.block_size,
          config.enable_prefix_caching, config.sliding_window, config.prefix_hash_bits),
      scheduler_(config_, kv_),
      buffers_(config_) {
  sample_seq_.resize(config.max_num_seqs);
  sample_fork_index_.resize(config.max_num_seqs);
  row_seq_.assign(config.max_num_seqs, -1);
  row_version_.assign(config.max_num_seqs, 0);
  row_written_.assign(config.max_num_seqs, 0);
  finished_requests_.reserve(config.max_num_seqs);
  narrowed_.resize(config.max_num_seqs);
  for (UnresolvedStep& u : unresolved_) {
    u.seq_ids.resize(config.max_num_seqs);
    u.positions.resize(config.max_num_seqs);
  }
  buffers_.result.finished_request_ids.reserve(config.max_num_seqs);
}

Engine::~Engine() = default;

void Engine::require_no_pending_step(const char* call) const {
  if (step_pending_) {
    throw InvalidState(detail::concat(call,
                                      "() called while a step is pending: call update() first"));
  }
}

void Engine::require_no_unresolved_step(const char* call) const {
  if (num_unresolved_steps_ > 0) {
    throw InvalidState(detail::concat(call, "() called while ", num_unresolved_steps_,
                                      " step(s) wait for their sampled values: call resolve() first"));
  }
}

void Engine::debug_check() const {
  if constexpr (detail::kDebugChecks) check_invariants();
}

Sequence* Engine::find_seq(SeqId seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) {
    throw NotFound(detail::concat("seq_id ", seq_id, " is not a live sequence"));
  }
  return it->second;
}

void Engine::validate_request(const std::string& request_id, const TokenId* prompt,
                              int32_t prompt_len, const RequestParams& params) const {
  using detail::concat;
  if (request_id.empty()) throw InvalidArgument("request_id must not be empty");
  if (requests_.count(request_id)) {
    throw InvalidArgument(concat("request_id '", request_id, "' is already in use"));
  }
  if (prompt_len < 1) throw InvalidArgument("prompt_token_ids must not be empty");
  if (prompt_len > config_.max_model_len) {
    throw InvalidArgument(concat("prompt_token_ids has ", prompt_len,
                                 " tokens, more than max_model_len (", config_.max_model_len, ")"));
  }
  auto check_token = [this](const char* field, size_t i, TokenId t) {
    if (t < 0 || (config_.vocab_size > 0 && t >= config_.vocab_size)) {
      throw InvalidArgument(concat(field, "[", i, "] = ", t, " is not a token id",
                                   config_.vocab_size > 0 ? concat(" in [0, ", config_.vocab_size, ")")
                                                          : std::string(" (negative)")));
    }
  };
  for (int32_t i = 0; i < prompt_len; ++i) check_token("prompt_token_ids", i, prompt[i]);
  for (size_t i = 0; i < params.eos_token_ids.size(); ++i) {
    check_token("eos_token_ids", i, params.eos_token_ids[i]);
  }
  for (size_t i = 0; i < params.stop_token_ids.size(); ++i) {
    check_token("stop_token_ids", i, params.stop_token_ids[i]);
  }
  if (params.n < 1) throw InvalidArgument(concat("n must be >= 1, got ", params.n));
  if (params.n > config_.max_num_seqs) {
    throw InvalidArgument(concat("n must be <= max_num_seqs (", config_.max_num_seqs, "), got ",
                                 params.n));
  }
  if (params.max_tokens < 1) {
    throw InvalidArgument(concat("max_tokens must be >= 1, got ", params.max_tokens));
  }
  if (params.min_tokens < 0 || params.min_tokens > params.max_tokens) {
    throw InvalidArgument(concat("min_tokens must be in [0, max_tokens=", params.max_tokens,
                                 "], got ", params.min_tokens));
  }
  if (params.priority != 0 && config_.scheduling_policy == SchedulingPolicy::kFcfs) {
    throw InvalidArgument(concat("priority must be 0 when scheduling_policy is 'fcfs', got ",
                                 params.priority));
  }
  // The most blocks one sequence of this request can hold at once. With a
  // sliding window that is the window plus one step's chunk, not the length.
  const int64_t max_len = max_computed_tokens(prompt_len, params, config_.max_model_len);
  int32_t needed = ceil_div(max_len, config_.block_size);
  if (config_.sliding_window > 0) {
    const int64_t live = config_.sliding_window - 1 +
                         std::min<int64_t>(config_.max_num_batched_tokens, max_len);
    needed = std::min(needed, ceil_div(live, config_.block_size) + 1);
  }
  if (needed > config_.num_blocks) {
    throw InvalidArgument(concat("request '", request_id, "' needs up to ", needed,
                                 " KV blocks (", prompt_len, " prompt + ", params.max_tokens,
                                 " max_tokens, block_size ", config_.block_size,
                                 ") but num_blocks is ", config_.num_blocks,
                                 ": it could never run"));
  }
}

SeqId Engine::add_request(const std::string& request_id, const TokenId* prompt,
                          int32_t prompt_len, const RequestParams& params) {
  validate_request(request_id, prompt, prompt_len, params);
  auto request = std::make_unique<Request>();
  request->request_id = request_id;
  request->params = params;
  request->first_seq_id = next_seq_id_;
  request->awaiting_fork = params.n > 1;
  request->num_unfinished = params.n;
  // NOTE: the smallest free slot first keeps slots dense for the runner's
  // per-request arrays.
  if (free_slots_.empty()) {
    request->slot = static_cast<int32_t>(slot_owner_.size());
    slot_owner_.push_back(true);
  } else {
    std::pop_heap(free_slots_.begin(), free_slots_.end(), std::greater<int32_t>());
    request->slot = free_slots_.back();
    free_slots_.pop_back();
    slot_owner_[request->slot] = true;
  }

  auto seq = std::make_unique<Sequence>();
  seq->seq_id = next_seq_id_;
  seq->request = request.get();
  seq->index = 0;
  // Room for every token the sequence can reach, so that update() never
  // reallocates it.
  const int64_t max_tokens_total = std::min<int64_t>(int64_t{prompt_len} + params.max_tokens,
                                                      int64_t{config_.max_model_len} + 1);
  seq->tokens.reserve(max_tokens_total);
  seq->tokens.assign(prompt, prompt + prompt_len);
  seq->prompt_len = prompt_len;
  seq->weight = params.n;
  seq->priority = params.priority;
  seq->arrival = next_arrival_;
  request->max_seq_blocks = ceil_div(
      max_computed_tokens(prompt_len, params, config_.max_model_len), config_.block_size);
  seq->blocks.reserve(request->max_seq_blocks);

  Sequence* raw = seq.get();
  request->seqs.push_back(std::move(seq));
  seqs_.emplace(raw->seq_id, raw);
  requests_.emplace(request_id, std::move(request));
  scheduler_.add_waiting(raw);
  next_seq_id_ += params.n;
  ++next_arrival_;
  debug_check();
  return raw->seq_id;
}

void Engine::finish_seq(Sequence* seq, FinishReason reason, int32_t stop_reason) {
  kv_.free(seq->blocks);
  seq->status = SeqStatus::kFinished;
  seq->finish_reason = reason;
  seq->stop_reason = stop_reason;
  seqs_.erase(seq->seq_id);
  Request* request = seq->request;
  request->num_unfinished -= seq->weight;
  if (request->num_unfinished == 0) finished_requests_.push_back(request);
}

void Engine::forget_request(Request* request) {
  for (const auto& seq : request->seqs) seqs_.erase(seq->seq_id);
  slot_owner_[request->slot] = false;
  free_slots_.push_back(request->slot);
  std::push_heap(free_slots_.begin(), free_slots_.end(), std::greater<int32_t>());
  requests_.erase(request->request_id);  // destroys the request and its sequences
}

void Engine::abort(const std::string& request_id) {
  require_no_pending_step("abort");
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    throw NotFound(detail::concat("request_id '", request_id, "' is not a live request"));
  }
  Request* request = it->second.get();
  for (const auto& seq : request->seqs) {
    if (seq->status == SeqStatus::kFinished) continue;
    scheduler_.remove(seq.get());
    kv_.free(seq->blocks);
    seq->status = SeqStatus::kFinished;
    seq->finish_reason = FinishReason::kAbort;
  }
  forget_request(request);
  debug_check();
}

const StepBatch& Engine::schedule() {
  require_no_pending_step("schedule");
  if (num_unresolved_steps_ > 1) {
    // NOTE: deferred inputs name samples of one step, the newest unresolved;
    // with two, a sequence skipped by the newer one would need the older's.
    throw InvalidState("schedule() called while two steps wait for their sampled values: "
                       "call resolve() first");
  }
  ++step_;
  scheduler_.schedule(step_);
  fill_batch();
  step_pending_ = true;
  debug_check();
  return buffers_.batch;
}

void Engine::fill_batch() {
  StepBuffers& b = buffers_;
  const int32_t bs = config_.block_size;
  const size_t row_stride = static_cast<size_t>(config_.max_blocks_per_seq());
  int32_t tok = 0;
  int32_t row = 0;
  int32_t sample = 0;
  int32_t scored = 0;   // prompt-logprob entries
  int32_t num_runs = 0;  // prompt-logprob runs
  int32_t deferred = 0;  // inputs whose ids are still on the device
  auto emit = [&](const ScheduledSeq& s) {
    const Sequence& seq = *s.seq;
    const std::vector<BlockId>& table = seq.blocks.block_table;
    b.seq_ids[row] = seq.seq_id;
    b.query_start_loc[row] = tok;
    b.num_computed_tokens[row] = s.num_computed_before;
    b.seq_lens[row] = s.num_computed_before + s.num_new;
    // NOTE: only what changed since this row last held this sequence: entries
    // from its last written one on (a copy-on-write may have replaced it).
    size_t from = 0;
    if (row_seq_[row] == seq.seq_id && row_version_[row] == seq.blocks.version) {
      from = static_cast<size_t>(std::max(0, row_written_[row] - 1));
    }
    std::copy(table.begin() + static_cast<std::ptrdiff_t>(from), table.end(),
              b.block_tables.begin() + static_cast<std::ptrdiff_t>(row * row_stride + from));
    row_seq_[row] = seq.seq_id;
    row_version_[row] = seq.blocks.version;
    row_written_[row] = static_cast<int32_t>(table.size());
    const int32_t row_start = tok;
    for (int32_t p = s.num_computed_before; p < s.num_computed_before + s.num_new; ++p, ++tok) {
      TokenId input = seq.tokens[p];
      if (p >= seq.num_known_tokens()) {
        // Sampled by the unresolved step before this one: the runner takes it
        // from that step's sampled ids on the device.
        PAGEDCORE_CHECK(s.num_new == 1 && seq.num_unresolved == 1 && seq.pending_sample >= 0,
                        "seq ", seq.seq_id, " computes unresolved position ", p, " with ",
                        seq.num_unresolved, " unresolved, pending sample ", seq.pending_sample,
                        ", ", s.num_new, " new tokens");
        b.deferred_input_indices[deferred] = tok;
        b.deferred_input_samples[deferred] = seq.pending_sample;
        ++deferred;
        input = 0;
      }
      b.input_ids[tok] = input;
      b.positions[tok] = p;
      b.slot_mapping[tok] = table[p / bs] * bs + p % bs;
    }
    Request& request = *seq.request;
    if (request.needs_prompt_logprobs(seq.prompt_len)) {
      // NOTE: positions listed before (a chunk recomputed after a preemption)
      // are not listed again: the runner has sent their logprobs already.
      const int32_t first = std::max(s.num_computed_before, request.prompt_logprobs_done);
      const int32_t end = std::min(s.num_computed_before + s.num_new, seq.prompt_len - 1);
      if (first < end) {
        b.prompt_logprob_seq_ids[num_runs] = seq.seq_id;
        b.prompt_logprob_start_loc[num_runs] = scored;
        b.prompt_logprob_first_positions[num_runs] = first + 1;
        ++num_runs;
        for (int32_t p = first; p < end; ++p, ++scored) {
          b.prompt_logprob_indices[scored] = row_start + (p - s.num_computed_before);
          b.prompt_logprob_token_ids[scored] = seq.tokens[p + 1];
        }
        request.prompt_logprobs_done = end;
      }
    }
    for (int32_t k = 0; k < s.num_samples; ++k, ++sample) {
      b.sample_indices[sample] = tok - 1;
      // Samples 1..n-1 of a parent go to the children its fork will create.
      b.sample_seq_ids[sample] = k == 0 ? seq.seq_id : seq.request->first_seq_id + k;
      b.sample_slots[sample] = seq.request->slot;
      b.sample_num_outputs[sample] = seq.num_outputs();
      sample_seq_[sample] = s.seq;
      sample_fork_index_[sample] = k;
    }
    ++row;
  };
  const auto& scheduled = scheduler_.scheduled();
  for (const ScheduledSeq& s : scheduled) {
    if (s.num_new == 1) emit(s);
  }
  const int32_t num_decode = row;
  for (const ScheduledSeq& s : scheduled) {
    if (s.num_new != 1) emit(s);
  }
  b.query_start_loc[row] = tok;
  b.prompt_logprob_start_loc[num_runs] = scored;

  auto put_pairs = [](const std::vector<BlockPair>& pairs, std::vector<int32_t>& out) {
    for (size_t i = 0; i < pairs.size(); ++i) {
      out[2 * i] = pairs[i].src;
      out[2 * i + 1] = pairs[i].dst;
    }
    return static_cast<int32_t>(pairs.size());
  };
  StepBatch& batch = b.batch;
  batch.num_block_copies = put_pairs(scheduler_.copies(), b.block_copies);
  batch.num_swap_out = put_pairs(scheduler_.swap_out(), b.swap_out);
  batch.num_swap_in = put_pairs(scheduler_.swap_in(), b.swap_in);
  batch.num_tokens = tok;
  batch.num_seqs = row;
  batch.num_decode_seqs = num_decode;
  batch.num_samples = sample;
  batch.num_prompt_logprob_tokens = scored;
  batch.num_prompt_logprob_seqs = num_runs;
  batch.num_deferred_inputs = deferred;
  PAGEDCORE_CHECK(tok == scheduler_.num_scheduled_tokens(), "batch has ", tok, " tokens, ",
                  scheduler_.num_scheduled_tokens(), " scheduled");
}

Sequence* Engine::fork_child(Sequence* parent, SeqId child_id, int32_t index) {
  auto child = std::make_unique<Sequence>();
  child->seq_id = child_id;
  child->request = parent->request;
  child->index = index;
  child->tokens.reserve(parent->tokens.capacity());
  child->tokens.assign(parent->tokens.begin(), parent->tokens.end());
  child->prompt_len = parent->prompt_len;
  child->num_computed = parent->num_computed;
  child->status = SeqStatus::kRunning;
  child->priority = parent->priority;
  child->arrival = parent->arrival;
  child->last_scheduled_step = parent->last_scheduled_step;
  child->blocks.reserve(parent->request->max_seq_blocks);
  kv_.fork(parent->blocks, child->blocks);
  Sequence* raw = child.get();
  parent->request->seqs.push_back(std::move(child));
  seqs_.emplace(child_id, raw);
  scheduler_.add_running(raw);
  return raw;
}

void Engine::require_update_call(int32_t num_sampled) const {
  if (!step_pending_) throw InvalidState("update() called without a pending schedule()");
  require_no_unresolved_step("update");
  if (num_sampled != buffers_.batch.num_samples) {
    throw InvalidArgument(detail::concat("sampled_token_ids has ", num_sampled,
                                         " entries but the step has ",
                                         buffers_.batch.num_samples, " samples"));
  }
}

void Engine::check_sampled(const TokenId* sampled, int32_t num_sampled) const {
  for (int32_t k = 0; k < num_sampled; ++k) {
    const TokenId t = sampled[k];
    if (t < 0 || (config_.vocab_size > 0 && t >= config_.vocab_size)) {
      throw InvalidArgument(
          detail::concat("sampled_token_ids[", k, "] = ", t, " is not a token id"));
    }
  }
}

const StepResult& Engine::update(const TokenId* sampled, int32_t num_sampled) {
  require_update_call(num_sampled);
  check_sampled(sampled, num_sampled);
  append_placeholders();
  return apply_resolved(sampled);
}

const StepResult& Engine::update(const int64_t* sampled, int32_t num_sampled) {
  require_update_call(num_sampled);
  for (int32_t k = 0; k < num_sampled; ++k) {
    if (sampled[k] < 0 || sampled[k] > INT32_MAX) {
      throw InvalidArgument(
          detail::concat("sampled_token_ids[", k, "] = ", sampled[k], " is not a token id"));
    }
    narrowed_[k] = static_cast<TokenId>(sampled[k]);
  }
  return update(narrowed_.data(), num_sampled);
}

void Engine::append_placeholders() {
  if (!step_pending_) {
    throw InvalidState("append_placeholders() called without a pending schedule()");
  }
  PAGEDCORE_CHECK(num_unresolved_steps_ < 2, num_unresolved_steps_, " unresolved steps");
  UnresolvedStep& rec = unresolved_[(oldest_unresolved_ + num_unresolved_steps_) % 2];
  const int32_t num_samples = buffers_.batch.num_samples;
  for (int32_t k = 0; k < num_samples; ++k) {
    Sequence* seq = sample_seq_[k];
    Request* request = seq->request;
    const int32_t fork_index = sample_fork_index_[k];
    if (fork_index == 0 && request->awaiting_fork) {
      // The prompt is computed: the parent becomes n sequences sharing its
      // blocks, before any of them appends a token.
      scheduler_.set_weight(seq, 1);
      for (int32_t j = 1; j < request->params.n; ++j) {
        fork_child(seq, request->first_seq_id + j, j);
      }
      request->awaiting_fork = false;
    }
    Sequence* target = fork_index == 0 ? seq : request->seqs[fork_index].get();
    target->tokens.push_back(kPlaceholderToken);
    ++target->num_unresolved;
    target->pending_sample = k;
    // NOTE: the length stops do not depend on the value: decided now, so that
    // the sequence is not scheduled past them.
    if (target->num_outputs() >= request->params.max_tokens ||
        target->num_tokens() >= config_.max_model_len) {
      target->finish_pending = true;
    }
    rec.seq_ids[k] = target->seq_id;
    rec.positions[k] = target->num_tokens() - 1;
  }
  rec.num_samples = num_samples;
  ++num_unresolved_steps_;
  step_pending_ = false;
  debug_check();
}

int32_t Engine::num_unresolved_samples() const {
  return num_unresolved_steps_ > 0 ? unresolved_[oldest_unresolved_].num_samples : 0;
}

const StepResult& Engine::resolve(const TokenId* sampled, int32_t num_sampled) {
  require_no_pending_step("resolve");
  if (num_unresolved_steps_ == 0) {
    throw InvalidState("resolve() called without an unresolved step: call append_placeholders()");
  }
  if (num_sampled != num_unresolved_samples()) {
    throw InvalidArgument(detail::concat("sampled_token_ids has ", num_sampled,
                                         " entries but the unresolved step has ",
                                         num_unresolved_samples(), " samples"));
  }
  check_sampled(sampled, num_sampled);
  return apply_resolved(sampled);
}

const StepResult& Engine::resolve(const int64_t* sampled, int32_t num_sampled) {
  // (The states first, so that a bad call is reported as such, not as a bad id.)
  if (!step_pending_ && num_unresolved_steps_ > 0 && num_sampled == num_unresolved_samples()) {
    for (int32_t k = 0; k < num_sampled; ++k) {
      if (sampled[k] < 0 || sampled[k] > INT32_MAX) {
        throw InvalidArgument(
            detail::concat("sampled_token_ids[", k, "] = ", sampled[k], " is not a token id"));
      }
      narrowed_[k] = static_cast<TokenId>(sampled[k]);
    }
  }
  return resolve(narrowed_.data(), num_sampled);
}

const StepResult& Engine::apply_resolved(const TokenId* sampled) {
  StepBuffers& b = buffers_;
  UnresolvedStep& rec = unresolved_[oldest_unresolved_];
  finished_requests_.clear();
  b.result.finished_request_ids.clear();
  for (int32_t k = 0; k < rec.num_samples; ++k) {
    const SeqId seq_id = rec.seq_ids[k];
    const int32_t pos = rec.positions[k];
    b.out_seq_ids[k] = seq_id;
    b.out_finish_reasons[k] = static_cast<uint8_t>(FinishReason::kNone);
    b.out_stop_reasons[k] = -1;
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) {  // ended before its value came: dropped
      b.out_token_ids[k] = -1;
      continue;
    }
    Sequence* seq = it->second;
    PAGEDCORE_CHECK(seq->num_unresolved > 0 && pos == seq->num_known_tokens() &&
                        seq->tokens[pos] == kPlaceholderToken,
                    "seq ", seq_id, " resolves position ", pos, " with ", seq->num_unresolved,
                    " unresolved of ", seq->num_tokens(), " tokens");
    const TokenId token = sampled[k];
    seq->tokens[pos] = token;
    --seq->num_unresolved;
    const bool last = pos == seq->num_tokens() - 1;
    if (last) seq->pending_sample = -1;
    ++num_generation_tokens_;
    if (seq->index == 0 && pos == seq->prompt_len) num_prompt_tokens_ += seq->prompt_len;

    const RequestParams& params = seq->request->params;
    FinishReason reason = FinishReason::kNone;
    int32_t stop_reason = -1;
    if (pos + 1 - seq->prompt_len >= params.min_tokens) {
      if (!params.ignore_eos && contains(params.eos_token_ids, token)) {
        reason = FinishReason::kStop;
      } else if (contains(params.stop_token_ids, token)) {
        reason = FinishReason::kStop;
        stop_reason = token;
      }
    }
    // (finish_pending belongs to its last placeholder: an earlier one, still
    // unresolved when it was appended, does not end it by length.)
    if (reason == FinishReason::kNone && seq->finish_pending && last) reason = FinishReason::kLength;
    b.out_token_ids[k] = token;
    b.out_finish_reasons[k] = static_cast<uint8_t>(reason);
    b.out_stop_reasons[k] = stop_reason;
    if (reason != FinishReason::kNone) {
      // (A running one leaves the running list in drop_finished() below.)
      if (seq->heap_index >= 0) scheduler_.remove(seq);
      finish_seq(seq, reason, stop_reason);
    } else if (seq->status == SeqStatus::kRunning) {
      // Blocks that its computed tokens fill, all known now (see Scheduler::record).
      kv_.register_full_blocks(seq->blocks, seq->tokens.data(),
                               std::min(seq->num_computed, seq->num_known_tokens()),
                               params.cache_salt);
    }
  }
  b.result.num_outputs = rec.num_samples;
  scheduler_.drop_finished();
  for (Request* request : finished_requests_) {
    b.result.finished_request_ids.push_back(request->request_id);
    forget_request(request);
  }
  rec.num_samples = 0;
  oldest_unresolved_ = (oldest_unresolved_ + 1) % 2;
  --num_unresolved_steps_;
  debug_check();
  return b.result;
}

bool Engine::finish(SeqId seq_id, FinishReason reason) {
  require_no_pending_step("finish");
  if (reason != FinishReason::kStop && reason != FinishReason::kAbort) {
    throw InvalidArgument(detail::concat("finish reason must be 'stop' or 'abort', got '",
                                         to_string(reason), "'"));
  }
  Sequence* seq = find_seq(seq_id);
  scheduler_.remove(seq);
  finished_requests_.clear();
  finish_seq(seq, reason, -1);
  const bool request_done = !finished_requests_.empty();
  if (request_done) forget_request(seq->request);
  finished_requests_.clear();
  debug_check();
  return request_done;
}

SeqId Engine::fork(SeqId seq_id) {
  using detail::concat;
  require_no_pending_step("fork");
  require_no_unresolved_step("fork");
  Sequence* seq = find_seq(seq_id);
  if (seq->status != SeqStatus::kRunning) {
    throw InvalidArgument(concat("seq_id ", seq_id, " is not running (waiting or swapped)"));
  }
  if (seq->request->awaiting_fork) {
    throw InvalidArgument(concat("seq_id ", seq_id, " has not forked its n=",
                                 seq->request->params.n, " samples yet"));
  }
  if (scheduler_.num_running_seats() + 1 > config_.max_num_seqs) {
    throw InvalidArgument(concat("fork of seq_id ", seq_id, " needs a seat but max_num_seqs (",
                                 config_.max_num_seqs, ") are taken"));
  }
  const SeqId child_id = next_seq_id_++;
  Request* request = seq->request;
  fork_child(seq, child_id, static_cast<int32_t>(request->seqs.size()));
  ++request->num_unfinished;
  debug_check();
  return child_id;
}

void Engine::set_last_token(SeqId seq_id, TokenId token) {
  using detail::concat;
  require_no_pending_step("set_last_token");
  require_no_unresolved_step("set_last_token");
  Sequence* seq = find_seq(seq_id);
  if (seq->num_outputs() < 1 || seq->num_computed >= seq->num_tokens()) {
    throw InvalidArgument(concat("seq_id ", seq_id,
                                 " has no uncomputed output token to replace"));
  }
  if (token < 0 || (config_.vocab_size > 0 && token >= config_.vocab_size)) {
    throw InvalidArgument(concat("token ", token, " is not a token id"));
  }
  seq->tokens.back() = token;
  debug_check();
}

int32_t Engine::request_slot(const std::string& request_id) const {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    throw NotFound(detail::concat("request_id '", request_id, "' is not a live request"));
  }
  return it->second->slot;
}

const std::vector<TokenId>& Engine::seq_token_ids(SeqId seq_id) const {
  return find_seq(seq_id)->tokens;
}

const std::vector<BlockId>& Engine::seq_block_table(SeqId seq_id) const {
  return find_seq(seq_id)->blocks.block_table;
}

EngineStats Engine::stats() const {
  EngineStats s;
  const BlockAllocator& gpu = kv_.gpu();
  s.num_blocks = gpu.num_blocks();
  s.num_free_blocks = gpu.num_free_blocks();
  s.num_cached_blocks = gpu.num_cached_free_blocks();
  s.num_used_blocks = gpu.num_blocks() - gpu.num_free_blocks();
  s.num_cpu_blocks = kv_.cpu().num_blocks();
  s.num_free_cpu_blocks = kv_.cpu().num_free_blocks();
  s.num_requests = static_cast<int32_t>(requests_.size());
  s.num_running_seqs = static_cast<int32_t>(scheduler_.running().size());
  s.num_waiting_seqs = scheduler_.waiting().size();
  s.num_swapped_seqs = scheduler_.num_swapped();
  s.num_steps = step_;
  const SchedulerStats& ss = scheduler_.stats();
  s.num_preemptions = ss.num_preemptions;
  s.num_recompute_preemptions = ss.num_recompute_preemptions;
  s.num_swap_preemptions = ss.num_swap_preemptions;
  s.prefix_cache_queries = ss.prefix_cache_queries;
  s.prefix_cache_hits = ss.prefix_cache_hits;
  s.prefix_cache_hit_rate = ss.prefix_cache_queries > 0
                                ? static_cast<double>(ss.prefix_cache_hits) / ss.prefix_cache_queries
                                : 0.0;
  s.num_prompt_tokens = num_prompt_tokens_;
  s.num_generation_tokens = num_generation_tokens_;
  int64_t seats = 0;
  for (const Sequence* seq : scheduler_.running()) {
    s.num_kv_tokens += seq->num_computed;
    seats += seq->weight;
  }
  s.num_reserved_blocks = config_.reserve_max_model_len
                              ? seats * config_.max_blocks_per_seq()
                              : static_cast<int64_t>(s.num_used_blocks);
  return s;
}

void Engine::check_invariants() const {
  using detail::concat;
  kv_.gpu().check_consistency();
  kv_.cpu().check_consistency();
  scheduler_.check_consistency();
  const int32_t bs = config_.block_size;
  std::vector<int32_t> gpu_refs(num_physical_blocks(), 0);
  std::vector<int32_t> cpu_refs(num_physical_cpu_blocks(), 0);
  size_t live = 0;
  for (const auto& [id, request] : requests_) {
    int32_t unfinished = 0;
    for (const auto& seq_ptr : request->seqs) {
      const Sequence& seq = *seq_ptr;
      if (seq.status == SeqStatus::kFinished) {
        PAGEDCORE_CHECK(seqs_.count(seq.seq_id) == 0, "finished seq ", seq.seq_id, " still live");
        PAGEDCORE_CHECK(seq.blocks.block_table.empty() && seq.blocks.cpu_block_table.empty(),
                        "finished seq ", seq.seq_id, " holds blocks");
        continue;
      }
      ++live;
      unfinished += seq.weight;
      PAGEDCORE_CHECK(seqs_.count(seq.seq_id) == 1 && seqs_.at(seq.seq_id) == &seq, "seq ",
                      seq.seq_id, " missing from the id map");
      PAGEDCORE_CHECK(seq.num_computed >= 0 && seq.num_computed <= seq.num_tokens(), "seq ",
                      seq.seq_id, " computed ", seq.num_computed, " of ", seq.num_tokens());
      PAGEDCORE_CHECK(seq.num_computed <= config_.max_model_len, "seq ", seq.seq_id,
                      " computed past max_model_len");
      PAGEDCORE_CHECK(seq.num_unresolved >= 0 && seq.num_unresolved <= num_unresolved_steps_ &&
                          seq.num_known_tokens() >= seq.prompt_len,
                      "seq ", seq.seq_id, " has ", seq.num_unresolved, " unresolved tokens with ",
                      num_unresolved_steps_, " unresolved steps");
      for (int32_t p = seq.num_known_tokens(); p < seq.num_tokens(); ++p) {
        PAGEDCORE_CHECK(seq.tokens[p] == kPlaceholderToken, "seq ", seq.seq_id,
                        " unresolved position ", p, " holds ", seq.tokens[p]);
      }
      PAGEDCORE_CHECK((seq.pending_sample >= 0) == (seq.num_unresolved > 0), "seq ", seq.seq_id,
                      " pending sample ", seq.pending_sample, " with ", seq.num_unresolved,
                      " unresolved tokens");
      PAGEDCORE_CHECK(!seq.finish_pending || seq.num_unresolved >= 1, "seq ", seq.seq_id,
                      " waits to finish with no unresolved token");
      const SeqBlocks& blocks = seq.blocks;
      const int32_t expected_blocks = (seq.num_computed + bs - 1) / bs;
      switch (seq.status) {
        case SeqStatus::kRunning:
          PAGEDCORE_CHECK(!blocks.swapped && blocks.cpu_block_table.empty(), "running seq ",
                          seq.seq_id, " is swapped");
          PAGEDCORE_CHECK(static_cast<int32_t>(blocks.block_table.size()) == expected_blocks,
                          "running seq ", seq.seq_id, " has ", blocks.block_table.size(),
                          " blocks for ", seq.num_computed, " computed tokens");
          PAGEDCORE_CHECK(step_pending_ || seq.num_computed < seq.num_tokens(), "running seq ",
                          seq.seq_id, " has no token to compute between steps");
          break;
        case SeqStatus::kWaiting:
          PAGEDCORE_CHECK(blocks.block_table.empty() && !blocks.swapped && seq.num_computed == 0,
                          "waiting seq ", seq.seq_id, " holds KV");
          break;
        case SeqStatus::kSwapped:
          PAGEDCORE_CHECK(blocks.block_table.empty() && blocks.swapped &&
                              static_cast<int32_t>(blocks.cpu_block_table.size()) ==
                                  expected_blocks,
                          "swapped seq ", seq.seq_id, " has inconsistent tables");
          break;
        case SeqStatus::kFinished:
          break;
      }
      for (size_t i = 0; i < blocks.block_table.size(); ++i) {
        const BlockId blk = blocks.block_table[i];
        const bool released = static_cast<int32_t>(i) < blocks.num_released;
        PAGEDCORE_CHECK(released == (blk == kNullBlock), "seq ", seq.seq_id, " block ", i,
                        " is ", blk, " with ", blocks.num_released, " released");
        PAGEDCORE_CHECK(blk >= 0 && blk < num_physical_blocks(), "block id ", blk, " out of range");
        ++gpu_refs[blk];
      }
      for (BlockId blk : blocks.cpu_block_table) {
        PAGEDCORE_CHECK(blk >= 0 && blk < num_physical_cpu_blocks(), "cpu block ", blk,
                        " out of range");
        ++cpu_refs[blk];
      }
    }
    PAGEDCORE_CHECK(unfinished == request->num_unfinished, "request '", id, "' counts ",
                    request->num_unfinished, " unfinished, sequences say ", unfinished);
    PAGEDCORE_CHECK(unfinished > 0, "request '", id, "' is finished but not forgotten");
  }
  PAGEDCORE_CHECK(live == seqs_.size(), seqs_.size(), " live ids for ", live, " live sequences");
  std::vector<int32_t> slot_users(slot_owner_.size(), 0);
  for (const auto& [id, request] : requests_) {
    PAGEDCORE_CHECK(request->slot >= 0 && request->slot < max_request_slots() &&
                        slot_owner_[request->slot],
                    "request '", id, "' has slot ", request->slot, " not marked taken");
    PAGEDCORE_CHECK(++slot_users[request->slot] == 1, "slot ", request->slot, " shared");
    const int32_t prompt_len = request->seqs[0]->prompt_len;
    PAGEDCORE_CHECK(request->prompt_logprobs_done >= 0 &&
                        request->prompt_logprobs_done <= std::max(0, prompt_len - 1) &&
                        (request->params.prompt_logprobs || request->prompt_logprobs_done == 0),
                    "request '", id, "' has prompt logprobs listed up to ",
                    request->prompt_logprobs_done, " of a ", prompt_len, "-token prompt");
  }
  for (int32_t s : free_slots_) {
    PAGEDCORE_CHECK(!slot_owner_[s] && slot_users[s] == 0, "free slot ", s, " is taken");
  }
  PAGEDCORE_CHECK(requests_.size() + free_slots_.size() == slot_owner_.size(), "slots: ",
                  requests_.size(), " taken + ", free_slots_.size(), " free != ",
                  slot_owner_.size());
  PAGEDCORE_CHECK(live == scheduler_.running().size() + scheduler_.waiting().size(), "queues hold ",
                  scheduler_.running().size() + scheduler_.waiting().size(), " of ", live,
                  " live sequences");
  for (int32_t i = 0; i < num_unresolved_steps_; ++i) {
    const UnresolvedStep& rec = unresolved_[(oldest_unresolved_ + i) % 2];
    for (int32_t k = 0; k < rec.num_samples; ++k) {
      auto it = seqs_.find(rec.seq_ids[k]);
      if (it == seqs_.end()) continue;  // ended: its sample will be dropped
      const Sequence& seq = *it->second;
      PAGEDCORE_CHECK(rec.positions[k] >= seq.num_known_tokens() &&
                          rec.positions[k] < seq.num_tokens(),
                      "unresolved sample ", k, " of seq ", seq.seq_id, " at position ",
                      rec.positions[k], " of its ", seq.num_known_tokens(), " known, ",
                      seq.num_tokens(), " tokens");
    }
  }
  for (BlockId blk = 1; blk < num_physical_blocks(); ++blk) {
    PAGEDCORE_CHECK(kv_.gpu().ref_count(blk) == gpu_refs[blk], "block ", blk, " has ref count ",
                    kv_.gpu().ref_count(blk), " but ", gpu_refs[blk], " block-table references");
  }
  for (BlockId blk = 1; blk < num_physical_cpu_blocks(); ++blk) {
    PAGEDCORE_CHECK(kv_.cpu().ref_count(blk) == cpu_refs[blk], "cpu block ", blk,
                    " has ref count ", kv_.cpu().ref_count(blk), " but ", cpu_refs[blk],
                    " references");
  }
}

}  // namespace pagedcore
