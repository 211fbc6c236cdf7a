// Helpers shared by the engine and scheduler tests: step drivers around the
// fake model (fake_model.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fake_model.h"
#include "pagedcore/engine.h"

namespace pagedcore::testing {

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

// One schedule() + update() with the fake model, which must have seen every
// earlier step of this engine.
inline const StepBatch& fake_step(Engine& engine, FakeModel& model, Transcript& t) {
  const StepBatch& b = engine.schedule();
  const std::vector<TokenId> sampled = model.run(b);
  record(engine.update(sampled.data(), static_cast<int32_t>(sampled.size())), t);
  return b;
}

// Runs steps until every request finished (or max_steps, then fails).
inline int drain(Engine& engine, FakeModel& model, Transcript& t, int max_steps = 100000) {
  int steps = 0;
  while (engine.has_unfinished_requests()) {
    if (++steps > max_steps) throw std::runtime_error("drain: engine made no progress");
    fake_step(engine, model, t);
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
