// Randomized operation sequences; every invariant is checked after every step.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "pagedcore/engine.h"
#include "pagedcore/errors.h"
#include "pagedcore/log.h"

namespace pagedcore {
namespace {

using namespace pagedcore::testing;

struct RandomCase {
  uint32_t seed;
  int32_t num_blocks;
  int32_t block_size;
  bool prefix_caching;
  PreemptionMode mode;
  int32_t num_cpu_blocks;
  int32_t sliding_window;
  SchedulingPolicy policy;
  int32_t hash_bits;
  // Async scheduling: each step is scheduled (and run) before the previous
  // one's values arrive (append_placeholders, then resolve of the one before).
  bool async_steps = false;
  // EngineConfig::max_num_mixed_prefill_tokens (with mixed_prefill_waiting_per_cap 2
  // and mixed_prefill_max_waiting 4: the queue's share varies, and steps with and
  // without the cap both occur).
  int32_t mixed_prefill_cap = 0;
};

std::string case_name(const RandomCase& c) {
  return "seed" + std::to_string(c.seed) + "_blocks" + std::to_string(c.num_blocks) + "_bs" +
         std::to_string(c.block_size) + (c.prefix_caching ? "_cache" : "") +
         (c.mode == PreemptionMode::kSwap ? "_swap" : "_recompute") +
         (c.sliding_window ? "_window" : "") +
         (c.policy == SchedulingPolicy::kPriority ? "_priority" : "_fcfs") +
         (c.hash_bits < 64 ? "_collide" : "") + (c.async_steps ? "_async" : "") +
         (c.mixed_prefill_cap ? "_mixed" + std::to_string(c.mixed_prefill_cap) : "");
}

class RandomOperations : public ::testing::TestWithParam<RandomCase> {};

TEST_P(RandomOperations, InvariantsHoldAfterEveryOperation) {
  const RandomCase rc = GetParam();
  EngineConfig c;
  c.num_blocks = rc.num_blocks;
  c.block_size = rc.block_size;
  c.max_num_seqs = 12;
  c.max_num_batched_tokens = 48;
  c.max_model_len = 128;
  c.enable_prefix_caching = rc.prefix_caching;
  c.preemption_mode = rc.mode;
  c.num_cpu_blocks = rc.num_cpu_blocks;
  c.sliding_window = rc.sliding_window;
  c.scheduling_policy = rc.policy;
  c.vocab_size = 64;
  c.prefix_hash_bits = rc.hash_bits;
  c.max_num_mixed_prefill_tokens = rc.mixed_prefill_cap;
  c.mixed_prefill_waiting_per_cap = 2;
  c.mixed_prefill_max_waiting = 4;
  int64_t preemption_warnings = 0;
  set_log_sink([&](LogLevel level, const std::string& msg) {
    if (level == LogLevel::kWarning && msg.find("preempted") != std::string::npos) {
      ++preemption_warnings;
    }
  });
  Engine e(c);
  // Checks every row's cached history after every step (the tokens sampled
  // below are random, not the model's).
  FakeModel m(e);
  std::mt19937 rng(rc.seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // A few shared prefixes so that the prefix cache sees hits.
  std::vector<std::vector<TokenId>> prefixes;
  for (int i = 0; i < 3; ++i) {
    std::vector<TokenId> p(uniform(1, 40));
    for (TokenId& t : p) t = uniform(0, 63);
    prefixes.push_back(p);
  }
  std::set<std::string> live;
  int next_id = 0, steps = 0, aborts = 0, finishes = 0, forks = 0;
  // Requests with prompt logprobs: their prompt and the next position the
  // engine must list (each prompt position after the first exactly once).
  std::map<std::string, std::pair<std::vector<TokenId>, int32_t>> scored;
  int64_t num_scored = 0;
  // Async steps: the values and sequences of the unresolved step, which the
  // next step's deferred inputs read and which resolve() then gets.
  std::vector<TokenId> previous;
  std::vector<int64_t> previous_seq_ids;
  int64_t dropped = 0;
  auto resolve_previous = [&]() {
    const StepResult& res = e.resolve(previous.data(), static_cast<int32_t>(previous.size()));
    ASSERT_EQ(res.num_outputs, static_cast<int32_t>(previous.size()));
    for (int32_t k = 0; k < res.num_outputs; ++k) {
      ASSERT_EQ(res.seq_ids[k], previous_seq_ids[k]);
      if (res.token_ids[k] < 0) {
        ++dropped;
      } else {
        ASSERT_EQ(res.token_ids[k], previous[k]);
      }
    }
    for (const auto& id : res.finished_request_ids) {
      ASSERT_EQ(live.erase(id), 1u);
      auto it = scored.find(id);
      if (it != scored.end()) {
        ASSERT_EQ(it->second.second, static_cast<int32_t>(it->second.first.size())) << id;
      }
    }
  };
  auto request_of = [&](SeqId seq_id) -> std::string {
    for (const Sequence* s : e.scheduler().running()) {
      if (s->seq_id == seq_id) return s->request->request_id;
    }
    return "";
  };
  auto live_seqs = [&](bool running_only) {
    std::vector<SeqId> ids;
    for (const Sequence* s : e.scheduler().running()) {
      if (!s->request->awaiting_fork) ids.push_back(s->seq_id);
    }
    if (!running_only) {
      for (const Sequence* s : e.scheduler().waiting().items()) ids.push_back(s->seq_id);
    }
    return ids;
  };

  for (int op = 0; op < 3000; ++op) {
    const int r = uniform(0, 99);
    if (r < 22) {
      std::vector<TokenId> prompt = prefixes[uniform(0, 2)];
      prompt.resize(uniform(1, static_cast<int>(prompt.size())));
      for (int i = uniform(0, 30); i > 0; --i) prompt.push_back(uniform(0, 63));
      RequestParams p;
      p.n = uniform(1, 3);
      p.max_tokens = uniform(1, 40);
      p.min_tokens = uniform(0, 2) == 0 ? uniform(0, p.max_tokens) : 0;
      p.eos_token_ids = {uniform(0, 63)};
      if (uniform(0, 1)) p.stop_token_ids = {uniform(0, 63), uniform(0, 63)};
      p.ignore_eos = uniform(0, 4) == 0;
      if (rc.policy == SchedulingPolicy::kPriority) p.priority = uniform(-2, 2);
      p.prompt_logprobs = uniform(0, 2) == 0;
      const std::string id = "r" + std::to_string(next_id++);
      try {
        e.add_request(id, prompt, p);
        live.insert(id);
        if (p.prompt_logprobs) scored[id] = {prompt, 1};
      } catch (const InvalidArgument&) {
        // Could never fit in a tiny pool: rejected, nothing changed.
      }
    } else if (r < 80) {
      const StepBatch& b = e.schedule();
      e.check_invariants();
      for (int32_t run = 0; run < b.num_prompt_logprob_seqs; ++run) {
        // (A run's sequence was scheduled: it is running.)
        auto it = scored.find(request_of(b.prompt_logprob_seq_ids[run]));
        ASSERT_NE(it, scored.end()) << "a run for a request without prompt logprobs";
        auto& [prompt, next] = it->second;
        ASSERT_EQ(b.prompt_logprob_first_positions[run], next);
        for (int32_t k = b.prompt_logprob_start_loc[run]; k < b.prompt_logprob_start_loc[run + 1]; ++k) {
          ASSERT_LT(next, static_cast<int32_t>(prompt.size()));
          ASSERT_EQ(b.prompt_logprob_token_ids[k], prompt[next]);
          ASSERT_EQ(b.positions[b.prompt_logprob_indices[k]], next - 1);
          ++next;
          ++num_scored;
        }
      }
      if (rc.async_steps) {
        e.append_placeholders();
        m.run(b, &previous);
        std::vector<TokenId> sampled(b.num_samples);
        for (TokenId& t : sampled) t = uniform(0, 63);
        if (e.num_unresolved_steps() == 2) resolve_previous();
        previous = sampled;
        previous_seq_ids.assign(b.sample_seq_ids, b.sample_seq_ids + b.num_samples);
        ++steps;
        e.check_invariants();
        continue;
      }
      m.run(b);
      std::vector<TokenId> sampled(b.num_samples);
      for (TokenId& t : sampled) t = uniform(0, 63);
      const StepResult& res = e.update(sampled.data(), b.num_samples);
      ASSERT_EQ(res.num_outputs, b.num_samples);
      for (int32_t k = 0; k < res.num_outputs; ++k) {
        // Each sample went to the sequence the batch announced.
        ASSERT_EQ(res.seq_ids[k], b.sample_seq_ids[k]);
        ASSERT_EQ(res.token_ids[k], sampled[k]);
      }
      for (const auto& id : res.finished_request_ids) {
        ASSERT_EQ(live.erase(id), 1u);
        // A request that sampled has its whole prompt listed.
        auto it = scored.find(id);
        if (it != scored.end()) {
          ASSERT_EQ(it->second.second, static_cast<int32_t>(it->second.first.size())) << id;
        }
      }
      ++steps;
    } else if (r < 86) {
      if (live.empty()) continue;
      auto it = live.begin();
      std::advance(it, uniform(0, static_cast<int>(live.size()) - 1));
      e.abort(*it);
      live.erase(it);
      ++aborts;
    } else if (r < 93) {
      const std::vector<SeqId> ids = live_seqs(false);
      if (ids.empty()) continue;
      const SeqId victim = ids[uniform(0, static_cast<int>(ids.size()) - 1)];
      // Its request, looked up before the sequence goes away.
      std::string owner;
      for (const Sequence* s : e.scheduler().running()) {
        if (s->seq_id == victim) owner = s->request->request_id;
      }
      for (const Sequence* s : e.scheduler().waiting().items()) {
        if (s->seq_id == victim) owner = s->request->request_id;
      }
      if (e.finish(victim)) ASSERT_EQ(live.erase(owner), 1u);
      ++finishes;
    } else {
      // (Beam search's fork needs every value known: resolve what is in flight.)
      if (e.num_unresolved_steps() > 0) resolve_previous();
      const std::vector<SeqId> ids = live_seqs(true);
      if (ids.empty()) continue;
      try {
        e.fork(ids[uniform(0, static_cast<int>(ids.size()) - 1)]);
        ++forks;
      } catch (const InvalidArgument&) {
        // No seat left.
      }
    }
    e.check_invariants();
    const EngineStats s = e.stats();
    ASSERT_EQ(s.num_free_blocks + s.num_used_blocks, c.num_blocks);
    ASSERT_EQ(s.num_requests, static_cast<int32_t>(live.size()));
  }
  if (e.num_unresolved_steps() > 0) resolve_previous();
  Transcript t;
  drain(e, m, t);
  e.check_invariants();
  set_log_sink(nullptr);
  const EngineStats s = e.stats();
  EXPECT_EQ(preemption_warnings, s.num_preemptions);
  EXPECT_EQ(s.num_free_blocks, c.num_blocks);
  EXPECT_EQ(s.num_free_cpu_blocks, c.num_cpu_blocks);
  EXPECT_EQ(s.num_requests, 0);
  EXPECT_EQ(s.num_running_seqs + s.num_waiting_seqs, 0);
  // The run exercised what it claims to.
  EXPECT_GT(steps, 1000);
  EXPECT_GT(aborts, 50);
  EXPECT_GT(finishes, 50);
  EXPECT_GT(forks, 50);
  EXPECT_GT(num_scored, 500);
  if (rc.async_steps) EXPECT_GT(dropped, 20);  // samples of sequences ended in flight
  if (rc.num_blocks <= 24) EXPECT_GT(s.num_preemptions, 0);
  if (rc.mode == PreemptionMode::kSwap && rc.num_blocks <= 24) EXPECT_GT(s.num_swap_preemptions, 0);
  if (rc.prefix_caching && rc.hash_bits == 64) EXPECT_GT(s.prefix_cache_hits, 0);
  const FakeModel::Counts& kv = m.counts();
  EXPECT_GT(kv.copies, 0);  // forks and n > 1 requests copy-on-write
  if (rc.mode == PreemptionMode::kSwap && rc.num_blocks <= 24) EXPECT_GT(kv.swap_in, 0);
  if (rc.sliding_window > 0) EXPECT_GT(kv.null_entries, 0);
}

std::vector<RandomCase> random_cases() {
  using PM = PreemptionMode;
  using SP = SchedulingPolicy;
  return {
      {1, 24, 8, true, PM::kRecompute, 0, 0, SP::kFcfs, 64},
      {2, 24, 8, false, PM::kRecompute, 0, 0, SP::kFcfs, 64},
      {3, 24, 8, true, PM::kSwap, 40, 0, SP::kFcfs, 64},
      {4, 20, 8, true, PM::kSwap, 6, 0, SP::kPriority, 64},
      {5, 24, 8, true, PM::kRecompute, 0, 12, SP::kFcfs, 64},
      {6, 200, 16, true, PM::kRecompute, 0, 0, SP::kPriority, 64},
      {7, 24, 8, true, PM::kRecompute, 0, 0, SP::kFcfs, 0},
      {8, 24, 8, true, PM::kSwap, 40, 20, SP::kPriority, 2},
      {9, 16, 32, true, PM::kRecompute, 0, 0, SP::kFcfs, 64},
      {11, 24, 8, true, PM::kRecompute, 0, 0, SP::kFcfs, 64, true},
      {12, 20, 8, true, PM::kSwap, 6, 0, SP::kPriority, 64, true},
      {13, 24, 8, true, PM::kSwap, 40, 20, SP::kPriority, 2, true},
      {14, 200, 16, false, PM::kRecompute, 0, 12, SP::kFcfs, 64, true},
      {15, 24, 8, true, PM::kRecompute, 0, 0, SP::kFcfs, 64, false, 6},
      {16, 20, 8, true, PM::kSwap, 6, 0, SP::kPriority, 64, true, 6},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, RandomOperations, ::testing::ValuesIn(random_cases()),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace pagedcore
