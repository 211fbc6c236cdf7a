// Helpers shared by the engine and scheduler tests: a fake deterministic model
// and step drivers.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "pagedcore/engine.h"

namespace pagedcore::testing {

// The fake model: the next token of a sequence is a pure function of its
// history and of its sequence id (so the n samples of a request differ).
// Outputs therefore never depend on batching, chunking, preemption or caching.
inline TokenId fake_next_token(const std::vector<TokenId>& history, SeqId seq_id,
                               int32_t vocab = 1000) {
  uint64_t h = 1469598103934665603ULL ^ static_cast<uint64_t>(seq_id) * 0x9E3779B97F4A7C15ULL;
  for (TokenId t : history) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ULL;
  h ^= h >> 29;
  return static_cast<TokenId>(h % static_cast<uint64_t>(vocab));
}

// Index of the row (sequence) holding token `token_index` of the batch.
inline int32_t row_of_token(const StepBatch& b, int32_t token_index) {
  int32_t row = 0;
  while (b.query_start_loc[row + 1] <= token_index) ++row;
  return row;
}

// Samples every entry of the batch with the fake model.
inline std::vector<TokenId> fake_sample(const Engine& engine, const StepBatch& b) {
  std::vector<TokenId> out(b.num_samples);
  for (int32_t k = 0; k < b.num_samples; ++k) {
    // The row's sequence holds the sampled position's history (a parent
    // awaiting its fork stands for all its children).
    const SeqId row_seq = b.seq_ids[row_of_token(b, b.sample_indices[k])];
    const int32_t vocab = engine.config().vocab_size > 0 ? engine.config().vocab_size : 1000;
    out[k] = fake_next_token(engine.seq_token_ids(row_seq), b.sample_seq_ids[k], vocab);
  }
  return out;
}

// Everything the test saw come out of update(), by sequence id.
struct Transcript {
  std::map<SeqId, std::vector<TokenId>> outputs;
  std::map<SeqId, FinishReason> finish;
  std::vector<std::string> finished_requests;
};

inline void record(const StepResult& r, Transcript& t) {
  for (int32_t k = 0; k < r.num_outputs; ++k) {
    t.outputs[r.seq_ids[k]].push_back(r.token_ids[k]);
    if (r.finish_reasons[k] != 0) t.finish[r.seq_ids[k]] = static_cast<FinishReason>(r.finish_reasons[k]);
  }
  for (const auto& id : r.finished_request_ids) t.finished_requests.push_back(id);
}

// One schedule() + update() with the fake model.
inline const StepBatch& fake_step(Engine& engine, Transcript& t) {
  const StepBatch& b = engine.schedule();
  const std::vector<TokenId> sampled = fake_sample(engine, b);
  record(engine.update(sampled.data(), static_cast<int32_t>(sampled.size())), t);
  return b;
}

// Runs steps until every request finished (or max_steps, then fails).
inline int drain(Engine& engine, Transcript& t, int max_steps = 100000) {
  int steps = 0;
  while (engine.has_unfinished_requests()) {
    if (++steps > max_steps) throw std::runtime_error("drain: engine made no progress");
    fake_step(engine, t);
  }
  return steps;
}

inline std::vector<TokenId> iota_tokens(int32_t n, TokenId base = 1) {
  std::vector<TokenId> v(n);
  for (int32_t i = 0; i < n; ++i) v[i] = base + i;
  return v;
}

inline RequestParams params_max_tokens(int32_t max_tokens, int32_t n = 1) {
  RequestParams p;
  p.max_tokens = max_tokens;
  p.n = n;
  return p;
}

}  // namespace pagedcore::testing
