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
  int64_t dropped = 0;  // samples resolve() dropped (their sequence had ended)
};

inline void record(const StepResult& r, Transcript& t) {
  for (int32_t k = 0; k < r.num_outputs; ++k) {
    if (r.token_ids[k] < 0) {
      ++t.dropped;
      continue;
    }
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

// Async scheduling with the fake model: each step is scheduled and run before
// the previous step's samples reach the engine (the model takes the deferred
// inputs from them), then that previous step is resolved.
class AsyncDriver {
 public:
  AsyncDriver(Engine& engine, FakeModel& model) : engine_(engine), model_(model) {}

  const StepBatch& step(Transcript& t) {
    const StepBatch& b = engine_.schedule();
    engine_.append_placeholders();
    std::vector<TokenId> sampled = model_.run(b, &previous_);
    if (engine_.num_unresolved_steps() == 2) resolve_previous(t);
    previous_ = std::move(sampled);
    return b;
  }

  // Resolves the step still waiting, if any.
  void flush(Transcript& t) {
    if (engine_.num_unresolved_steps() > 0) resolve_previous(t);
  }

  int drain(Transcript& t, int max_steps = 100000) {
    int steps = 0;
    while (engine_.has_unfinished_requests()) {
      if (++steps > max_steps) throw std::runtime_error("drain: engine made no progress");
      step(t);
    }
    flush(t);
    return steps;
  }

  const std::vector<TokenId>& previous() const { return previous_; }

 private:
  void resolve_previous(Transcript& t) {
    record(engine_.resolve(previous_.data(), static_cast<int32_t>(previous_.size())), t);
  }

  Engine& engine_;
  FakeModel& model_;
  std::vector<TokenId> previous_;
};

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
