// Async scheduling: Engine::append_placeholders / resolve, and schedule()
// while a step's sampled values are still on their way.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "pagedcore/engine.h"
#include "pagedcore/errors.h"
#include "pagedcore/log.h"

namespace pagedcore {
namespace {

using namespace pagedcore::testing;

constexpr int32_t kVocab = 16;  // small: EOS and stop tokens come up often
constexpr TokenId kEos = 3;

EngineConfig config(int32_t num_blocks = 64, int32_t block_size = 8) {
  EngineConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 32;
  c.max_model_len = 64;
  c.vocab_size = kVocab;
  return c;
}

RequestParams params(int32_t max_tokens, int32_t n = 1, int32_t min_tokens = 0,
                     std::vector<TokenId> stop = {}, bool ignore_eos = false) {
  RequestParams p;
  p.max_tokens = max_tokens;
  p.n = n;
  p.min_tokens = min_tokens;
  p.eos_token_ids = {kEos};
  p.stop_token_ids = std::move(stop);
  p.ignore_eos = ignore_eos;
  return p;
}

bool contains(const std::vector<TokenId>& v, TokenId t) {
  return std::find(v.begin(), v.end(), t) != v.end();
}

// What a sequence generates, from the fake model's rule alone (the next token
// hashes the history and the sequence id) and the stop rules of update(): no
// engine involved.
std::pair<std::vector<TokenId>, FinishReason> reference(const std::vector<TokenId>& prompt,
                                                        const RequestParams& p, SeqId seq_id,
                                                        int32_t max_model_len) {
  std::vector<TokenId> history = prompt, out;
  while (true) {
    const TokenId t = fake_next_token(history, seq_id, kVocab);
    history.push_back(t);
    out.push_back(t);
    const int32_t n = static_cast<int32_t>(out.size());
    if (n >= p.min_tokens && ((!p.ignore_eos && contains(p.eos_token_ids, t)) ||
                              contains(p.stop_token_ids, t))) {
      return {out, FinishReason::kStop};
    }
    if (n >= p.max_tokens || static_cast<int32_t>(history.size()) >= max_model_len) {
      return {out, FinishReason::kLength};
    }
  }
}

struct Workload {
  std::vector<std::vector<TokenId>> prompts;
  std::vector<RequestParams> params;
};

// Mixed lengths, n > 1, min_tokens, stop tokens, ignore_eos, a prompt of
// max_model_len - 2 (max_model_len stops it), shared prefixes.
Workload workload() {
  Workload w;
  const std::vector<TokenId> shared = {1, 2, 4, 5, 6, 7, 8, 9, 10, 11};
  for (int i = 0; i < 14; ++i) {
    std::vector<TokenId> prompt(shared.begin(), shared.begin() + 2 + (i * 3) % 9);
    for (int j = 0; j < (i * 5) % 11; ++j) prompt.push_back((i + 3 * j) % kVocab);
    w.prompts.push_back(prompt);
    const int32_t max_tokens = 6 + (i * 7) % 20;
    w.params.push_back(params(max_tokens, /*n=*/i % 4 == 1 ? 3 : 1,
                              /*min_tokens=*/i % 5 == 2 ? 4 : 0,
                              /*stop=*/i % 3 == 0 ? std::vector<TokenId>{7} : std::vector<TokenId>{},
                              /*ignore_eos=*/i % 7 == 6));
  }
  w.prompts.push_back(std::vector<TokenId>(62, 5));
  w.params.push_back(params(2, 1, 0, {}, true));
  return w;
}

struct AsyncCase {
  const char* name;
  int32_t num_blocks;
  bool prefix_caching;
  PreemptionMode mode;
  int32_t num_cpu_blocks;
};

class AsyncScheduling : public ::testing::TestWithParam<AsyncCase> {};

TEST_P(AsyncScheduling, OutputsEqualTheReferenceAndNothingLeaks) {
  const AsyncCase ac = GetParam();
  EngineConfig c = config(ac.num_blocks);
  c.enable_prefix_caching = ac.prefix_caching;
  c.preemption_mode = ac.mode;
  c.num_cpu_blocks = ac.num_cpu_blocks;
  set_log_sink([](LogLevel, const std::string&) {});  // preemption warnings
  Engine e(c);
  FakeModel m(e);
  AsyncDriver driver(e, m);
  const Workload w = workload();
  std::map<SeqId, std::pair<std::vector<TokenId>, FinishReason>> expected;
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    const SeqId first = e.add_request("r" + std::to_string(i), w.prompts[i], w.params[i]);
    for (int32_t j = 0; j < w.params[i].n; ++j) {
      expected[first + j] = reference(w.prompts[i], w.params[i], first + j, c.max_model_len);
    }
  }
  Transcript t;
  int64_t deferred = 0;
  while (e.has_unfinished_requests()) {
    const StepBatch& b = driver.step(t);
    deferred += b.num_deferred_inputs;
    e.check_invariants();
  }
  driver.flush(t);
  set_log_sink(nullptr);
  int stops = 0, lengths = 0;
  for (const auto& [seq_id, want] : expected) {
    EXPECT_EQ(t.outputs[seq_id], want.first) << "seq " << seq_id;
    EXPECT_EQ(t.finish[seq_id], want.second) << "seq " << seq_id;
    (want.second == FinishReason::kStop ? stops : lengths) += 1;
  }
  EXPECT_GT(stops, 4);    // EOS or a stop token mid-run...
  EXPECT_GT(lengths, 4);  // ... and max_tokens / max_model_len
  // Each sequence an EOS or stop token ended was scheduled once more (unless
  // that step had already ended it, or it was preempted): that sample dropped.
  EXPECT_GT(t.dropped, 0);
  EXPECT_LE(t.dropped, stops);
  EXPECT_GT(deferred, 50);  // decode inputs came from the device
  const EngineStats s = e.stats();
  EXPECT_EQ(s.num_free_blocks, c.num_blocks);
  EXPECT_EQ(s.num_free_cpu_blocks, c.num_cpu_blocks);
  EXPECT_EQ(s.num_requests, 0);
  EXPECT_EQ(e.num_unresolved_steps(), 0);
  EXPECT_EQ(t.finished_requests.size(), w.prompts.size());
  if (ac.num_blocks < 40) EXPECT_GT(s.num_preemptions, 0);
  if (ac.mode == PreemptionMode::kSwap) EXPECT_GT(m.counts().swap_in, 0);
  if (ac.prefix_caching) EXPECT_GT(s.prefix_cache_hits, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AsyncScheduling,
    ::testing::Values(AsyncCase{"roomy_cache", 64, true, PreemptionMode::kRecompute, 0},
                      AsyncCase{"roomy_nocache", 64, false, PreemptionMode::kRecompute, 0},
                      AsyncCase{"recompute", 24, true, PreemptionMode::kRecompute, 0},
                      AsyncCase{"swap", 24, true, PreemptionMode::kSwap, 64}),
    [](const auto& info) { return std::string(info.param.name); });

// The steps of one request, call by call.
TEST(AsyncScheduling, PlaceholdersBecomeDeferredInputsAndThenValues) {
  Engine e(config());
  FakeModel m(e);
  const SeqId a = e.add_request("a", iota_tokens(5), params(4, 1, 0, {}, true));
  const SeqId b = e.add_request("b", iota_tokens(3, 7), params(4, 1, 0, {}, true));
  const StepBatch& s1 = e.schedule();  // both prompts
  EXPECT_EQ(s1.num_deferred_inputs, 0);
  e.append_placeholders();
  EXPECT_FALSE(e.has_pending_step());
  EXPECT_EQ(e.num_unresolved_steps(), 1);
  EXPECT_EQ(e.num_unresolved_samples(), 2);
  EXPECT_EQ(e.seq_token_ids(a).back(), kPlaceholderToken);
  EXPECT_EQ(e.seq_token_ids(a).size(), 6u);
  const std::vector<TokenId> first = m.run(s1);

  const StepBatch& s2 = e.schedule();  // two decode rows, inputs on the device
  ASSERT_EQ(s2.num_tokens, 2);
  ASSERT_EQ(s2.num_deferred_inputs, 2);
  EXPECT_EQ(std::vector<int32_t>(s2.deferred_input_indices, s2.deferred_input_indices + 2),
            (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(std::vector<int32_t>(s2.deferred_input_samples, s2.deferred_input_samples + 2),
            (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(std::vector<int32_t>(s2.input_ids, s2.input_ids + 2), (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(std::vector<int32_t>(s2.positions, s2.positions + 2), (std::vector<int32_t>{5, 3}));
  EXPECT_EQ(std::vector<int32_t>(s2.sample_num_outputs, s2.sample_num_outputs + 2),
            (std::vector<int32_t>{1, 1}));
  e.append_placeholders();
  EXPECT_EQ(e.num_unresolved_steps(), 2);
  EXPECT_EQ(e.seq_token_ids(b).size(), 5u);
  // A third schedule must wait for the first step's values.
  EXPECT_THROW(e.schedule(), InvalidState);
  const std::vector<TokenId> second = m.run(s2, &first);
  const StepResult& r1 = e.resolve(first.data(), 2);
  ASSERT_EQ(r1.num_outputs, 2);
  EXPECT_EQ(r1.seq_ids[0], a);
  EXPECT_EQ(r1.token_ids[0], first[0]);
  EXPECT_EQ(r1.token_ids[1], first[1]);
  EXPECT_EQ(e.seq_token_ids(a), (std::vector<TokenId>{1, 2, 3, 4, 5, first[0], kPlaceholderToken}));
  EXPECT_EQ(e.num_unresolved_steps(), 1);

  // The deferred input of the next step is the second step's sample.
  const StepBatch& s3 = e.schedule();
  ASSERT_EQ(s3.num_deferred_inputs, 2);
  EXPECT_EQ(s3.positions[0], 6);
  e.append_placeholders();
  const std::vector<TokenId> third = m.run(s3, &second);
  e.resolve(second.data(), 2);
  EXPECT_EQ(e.seq_token_ids(a), (std::vector<TokenId>{1, 2, 3, 4, 5, first[0], second[0],
                                                      kPlaceholderToken}));
  // max_tokens = 4: the fourth placeholder ends both; the next step holds
  // neither, and its resolve finishes them by length.
  const StepBatch& s4 = e.schedule();
  EXPECT_EQ(s4.num_seqs, 2);
  e.append_placeholders();
  const std::vector<TokenId> fourth = m.run(s4, &third);
  e.resolve(third.data(), 2);
  const StepBatch& s5 = e.schedule();
  EXPECT_EQ(s5.num_seqs, 0);
  EXPECT_EQ(e.stats().num_requests, 2);
  e.append_placeholders();
  const StepResult& r4 = e.resolve(fourth.data(), 2);
  EXPECT_EQ(r4.finish_reasons[0], static_cast<uint8_t>(FinishReason::kLength));
  EXPECT_EQ(r4.finish_reasons[1], static_cast<uint8_t>(FinishReason::kLength));
  EXPECT_EQ(r4.finished_request_ids, (std::vector<std::string>{"a", "b"}));
  const StepResult& r5 = e.resolve(static_cast<const TokenId*>(nullptr), 0);
  EXPECT_EQ(r5.num_outputs, 0);
  EXPECT_EQ(e.stats().num_free_blocks, 64);
  EXPECT_EQ(e.stats().num_generation_tokens, 8);
  EXPECT_EQ(e.stats().num_prompt_tokens, 8);
}

TEST(AsyncScheduling, AStopTokenFoundLateDropsTheExtraSampleAndFreesTheBlocks) {
  Engine e(config());
  FakeModel m(e);
  e.add_request("a", iota_tokens(4), params(10));
  const SeqId other = e.add_request("o", iota_tokens(4, 9), params(10, 1, 0, {}, true));
  const StepBatch& s1 = e.schedule();
  e.append_placeholders();
  m.run(s1);
  const StepBatch& s2 = e.schedule();  // holds "a" again, before its EOS is known
  EXPECT_EQ(s2.num_seqs, 2);
  e.append_placeholders();
  const StepResult& r1 = e.resolve(std::vector<TokenId>{kEos, 5}.data(), 2);
  EXPECT_EQ(r1.finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));
  EXPECT_EQ(r1.finished_request_ids, std::vector<std::string>{"a"});
  // "a" no longer holds blocks though the step in flight writes its slot:
  // that step was scheduled before the blocks were freed, and a later step
  // that reuses them runs after it.
  EXPECT_EQ(e.stats().num_used_blocks, 1);
  const StepResult& r2 = e.resolve(std::vector<TokenId>{6, 8}.data(), 2);
  EXPECT_EQ(r2.token_ids[0], -1);  // dropped
  EXPECT_EQ(r2.finish_reasons[0], static_cast<uint8_t>(FinishReason::kNone));
  EXPECT_EQ(r2.seq_ids[1], other);
  EXPECT_EQ(r2.token_ids[1], 8);
  EXPECT_EQ(e.seq_token_ids(other), (std::vector<TokenId>{9, 10, 11, 12, 5, 8}));
  EXPECT_EQ(e.stats().num_generation_tokens, 3);  // the dropped one is not counted
}

TEST(AsyncScheduling, MinTokensCountsOutputsUpToTheResolvedToken) {
  Engine e(config());
  e.add_request("a", iota_tokens(4), params(10, 1, /*min_tokens=*/2));
  e.schedule();
  e.append_placeholders();
  e.schedule();
  e.append_placeholders();
  // The first output is EOS but below min_tokens (the second placeholder does
  // not count yet); the second is EOS and ends it.
  EXPECT_EQ(e.resolve(std::vector<TokenId>{kEos}.data(), 1).finish_reasons[0], 0);
  const StepResult& r = e.resolve(std::vector<TokenId>{kEos}.data(), 1);
  EXPECT_EQ(r.finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));
  EXPECT_EQ(e.stats().num_requests, 0);
}

TEST(AsyncScheduling, BlocksAreHashedOnlyOnceTheirTokensAreKnown) {
  EngineConfig c = config();
  Engine e(c);
  FakeModel m(e);
  // 15 prompt tokens + 1 output fill two blocks of 8.
  e.add_request("a", iota_tokens(15), params(3, 1, 0, {}, true));
  const StepBatch& s1 = e.schedule();
  e.append_placeholders();
  const std::vector<TokenId> first = m.run(s1);
  const StepBatch& s2 = e.schedule();  // computes the placeholder at position 15
  e.append_placeholders();
  const std::vector<TokenId> second = m.run(s2, &first);
  const BlockId full = e.seq_block_table(0)[1];
  EXPECT_FALSE(e.kv().gpu().is_registered(full));  // its last token is not known
  e.resolve(first.data(), 1);
  EXPECT_TRUE(e.kv().gpu().is_registered(full));
  // A prompt equal to those 16 tokens and one more finds both blocks cached.
  std::vector<TokenId> prompt = iota_tokens(15);
  prompt.push_back(first[0]);
  prompt.push_back(1);
  e.add_request("b", prompt, params(1));
  const StepBatch& s3 = e.schedule();
  ASSERT_EQ(s3.num_seqs, 2);
  EXPECT_EQ(s3.num_computed_tokens[1], 16);  // both blocks were hits
  e.append_placeholders();
  m.run(s3, &second);
}

TEST(AsyncScheduling, AbortAndFinishWhileAStepIsUnresolved) {
  Engine e(config());
  FakeModel m(e);
  AsyncDriver driver(e, m);
  e.add_request("a", iota_tokens(5), params(20, 2, 0, {}, true));
  e.add_request("b", iota_tokens(6, 2), params(20, 1, 0, {}, true));
  e.add_request("c", iota_tokens(3, 4), params(20, 1, 0, {}, true));
  Transcript t;
  for (int i = 0; i < 3; ++i) driver.step(t);
  ASSERT_EQ(e.num_unresolved_steps(), 1);
  e.abort("a");  // both samples of "a" in flight
  EXPECT_TRUE(e.finish(3));  // "c"'s only sequence: the request is done
  EXPECT_THROW(e.fork(2), InvalidState);
  EXPECT_THROW(e.set_last_token(2, 1), InvalidState);
  const int64_t dropped = t.dropped;
  driver.step(t);  // resolves the step that held them
  EXPECT_EQ(t.dropped - dropped, 3);
  driver.drain(t);
  EXPECT_EQ(t.outputs[2].size(), 20u);
  EXPECT_EQ(e.stats().num_free_blocks, 64);
  e.check_invariants();
}

TEST(AsyncScheduling, CallsOutOfOrderThrowAndChangeNothing) {
  Engine e(config());
  e.add_request("a", iota_tokens(5), params(5));
  EXPECT_THROW(e.append_placeholders(), InvalidState);  // nothing scheduled
  EXPECT_THROW(e.resolve(static_cast<const TokenId*>(nullptr), 0), InvalidState);    // nothing unresolved
  e.schedule();
  EXPECT_THROW(e.resolve(static_cast<const TokenId*>(nullptr), 0), InvalidState);  // scheduled, not ended
  e.append_placeholders();
  EXPECT_THROW(e.append_placeholders(), InvalidState);
  const TokenId one = 1;
  EXPECT_THROW(e.update(&one, 1), InvalidState);  // its values belong to resolve()
  EXPECT_THROW(e.resolve(static_cast<const TokenId*>(nullptr), 0), InvalidArgument);  // one sample owed
  const TokenId bad = kVocab;
  EXPECT_THROW(e.resolve(&bad, 1), InvalidArgument);
  const int64_t huge = int64_t{1} << 40;
  EXPECT_THROW(e.resolve(&huge, 1), InvalidArgument);
  EXPECT_EQ(e.num_unresolved_steps(), 1);
  EXPECT_EQ(e.seq_token_ids(0).back(), kPlaceholderToken);
  const int64_t fine = 2;
  EXPECT_EQ(e.resolve(&fine, 1).token_ids[0], 2);
  EXPECT_EQ(e.seq_token_ids(0).back(), 2);
  e.check_invariants();
}

}  // namespace
}  // namespace pagedcore
