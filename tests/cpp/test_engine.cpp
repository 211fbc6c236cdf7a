#include "pagedcore/engine.h"

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "engine_test_util.h"
#include "pagedcore/errors.h"

namespace pagedcore {
namespace {

using namespace pagedcore::testing;

EngineConfig config(int32_t num_blocks = 32, int32_t block_size = 8) {
  EngineConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 64;
  return c;
}

// Everything observable about the engine's state, for "nothing changed" checks.
auto snapshot(const Engine& e) {
  const EngineStats s = e.stats();
  std::vector<std::tuple<SeqId, std::vector<TokenId>, std::vector<BlockId>, int32_t>> seqs;
  for (const Sequence* q : e.scheduler().running()) {
    seqs.emplace_back(q->seq_id, q->tokens, q->blocks.block_table, q->num_computed);
  }
  for (const Sequence* q : e.scheduler().waiting().items()) {
    seqs.emplace_back(q->seq_id, q->tokens, q->blocks.block_table, q->num_computed);
  }
  return std::make_tuple(s.num_free_blocks, s.num_cached_blocks, s.num_requests,
                         s.num_running_seqs, s.num_waiting_seqs, s.num_steps,
                         s.num_generation_tokens, e.has_pending_step(), seqs);
}

TEST(Engine, ParallelSamplingForksAfterThePromptAndSharesItsBlocks) {
  Engine e(config());
  FakeModel m(e);
  const SeqId first = e.add_request("r", iota_tokens(12), params_max_tokens(3, /*n=*/3));
  EXPECT_EQ(first, 0);
  const StepBatch& b = e.schedule();
  ASSERT_EQ(b.num_samples, 3);
  EXPECT_EQ(std::vector<int64_t>(b.sample_seq_ids, b.sample_seq_ids + 3),
            (std::vector<int64_t>{0, 1, 2}));
  m.run(b);  // the model reads and writes the cache; the test picks the tokens
  Transcript t;
  record(e.update(std::vector<TokenId>{7, 8, 9}.data(), 3), t);
  // Three sequences, one prompt: blocks {1, 2} shared three ways.
  for (SeqId id : {0, 1, 2}) {
    EXPECT_EQ(e.seq_block_table(id), (std::vector<BlockId>{1, 2})) << id;
  }
  EXPECT_EQ(e.kv().gpu().ref_count(1), 3);
  EXPECT_EQ(e.kv().gpu().ref_count(2), 3);
  std::vector<TokenId> expected = iota_tokens(12);
  expected.push_back(8);
  EXPECT_EQ(e.seq_token_ids(1), expected);
  // Next step: position 12 sits in shared partial block 2; the first two
  // writers copy it, the last writes in place.
  const StepBatch& d = e.schedule();
  ASSERT_EQ(d.num_block_copies, 2);
  EXPECT_EQ(std::vector<int32_t>(d.block_copies, d.block_copies + 4),
            (std::vector<int32_t>{2, 3, 2, 4}));
  EXPECT_EQ(e.seq_block_table(0), (std::vector<BlockId>{1, 3}));
  EXPECT_EQ(e.seq_block_table(1), (std::vector<BlockId>{1, 4}));
  EXPECT_EQ(e.seq_block_table(2), (std::vector<BlockId>{1, 2}));
  EXPECT_EQ(std::vector<int32_t>(d.slot_mapping, d.slot_mapping + 3),
            (std::vector<int32_t>{3 * 8 + 4, 4 * 8 + 4, 2 * 8 + 4}));
  // Blocks 3 and 4 must now hold block 2's first four positions.
  m.run(d);
  EXPECT_EQ(m.counts().copies, 2);
  record(e.update(std::vector<TokenId>{10, 11, 12}.data(), 3), t);
  drain(e, m, t);
  EXPECT_EQ(t.outputs[0].size(), 3u);
  EXPECT_EQ(t.outputs[1].size(), 3u);
  EXPECT_EQ(t.outputs[2].size(), 3u);
  EXPECT_EQ(t.finished_requests, (std::vector<std::string>{"r"}));
  EXPECT_EQ(e.stats().num_free_blocks, 32);
  EXPECT_EQ(e.stats().num_prompt_tokens, 12);
  EXPECT_EQ(e.stats().num_generation_tokens, 9);
}

TEST(Engine, PromptOfWholeBlocksForksWithoutCopies) {
  Engine e(config());
  FakeModel m(e);
  e.add_request("r", iota_tokens(16), params_max_tokens(2, 2));
  Transcript t;
  fake_step(e, m, t);
  const StepBatch& d = e.schedule();
  EXPECT_EQ(d.num_block_copies, 0);
  EXPECT_EQ(e.seq_block_table(0), (std::vector<BlockId>{1, 2, 3}));
  EXPECT_EQ(e.seq_block_table(1), (std::vector<BlockId>{1, 2, 4}));
  const std::vector<TokenId> s = m.run(d);
  record(e.update(s.data(), 2), t);
  EXPECT_EQ(e.stats().num_free_blocks, 32);
}

TEST(Engine, StopConditions) {
  EngineConfig c = config();
  c.max_num_batched_tokens = 128;
  Engine e(c);
  RequestParams eos = params_max_tokens(10);
  eos.eos_token_ids = {50};
  RequestParams stop_tok = params_max_tokens(10);
  stop_tok.stop_token_ids = {60};
  RequestParams min_toks = params_max_tokens(10);
  min_toks.eos_token_ids = {50};
  min_toks.stop_token_ids = {60};
  min_toks.min_tokens = 2;
  RequestParams ignore = params_max_tokens(2);
  ignore.eos_token_ids = {50};
  ignore.ignore_eos = true;
  e.add_request("eos", iota_tokens(3), eos);            // seq 0
  e.add_request("stop", iota_tokens(3), stop_tok);      // seq 1
  e.add_request("min", iota_tokens(3), min_toks);       // seq 2
  e.add_request("ignore", iota_tokens(3), ignore);      // seq 3
  e.add_request("model_len", iota_tokens(62), params_max_tokens(100));  // seq 4

  e.schedule();
  const StepResult& r = e.update(std::vector<TokenId>{50, 60, 50, 50, 7}.data(), 5);
  ASSERT_EQ(r.num_outputs, 5);
  EXPECT_EQ(r.finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));
  EXPECT_EQ(r.stop_reasons[0], -1);
  EXPECT_EQ(r.finish_reasons[1], static_cast<uint8_t>(FinishReason::kStop));
  EXPECT_EQ(r.stop_reasons[1], 60);
  EXPECT_EQ(r.finish_reasons[2], 0);  // below min_tokens
  EXPECT_EQ(r.finish_reasons[3], 0);  // EOS ignored
  EXPECT_EQ(r.finish_reasons[4], 0);  // 63 tokens of 64
  EXPECT_EQ(r.finished_request_ids, (std::vector<std::string>{"eos", "stop"}));

  e.schedule();
  const StepResult& r2 = e.update(std::vector<TokenId>{60, 50, 7}.data(), 3);
  EXPECT_EQ(r2.seq_ids[0], 2);
  EXPECT_EQ(r2.finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));  // 2nd output
  EXPECT_EQ(r2.stop_reasons[0], 60);
  EXPECT_EQ(r2.finish_reasons[1], static_cast<uint8_t>(FinishReason::kLength));  // max_tokens 2
  EXPECT_EQ(r2.finish_reasons[2], static_cast<uint8_t>(FinishReason::kLength));  // max_model_len
  EXPECT_FALSE(e.has_unfinished_requests());
  EXPECT_EQ(e.stats().num_free_blocks, 32);
}

TEST(Engine, PromptOfMaxModelLenGivesOneToken) {
  Engine e(config());
  FakeModel m(e);
  e.add_request("full", iota_tokens(64), params_max_tokens(5));
  Transcript t;
  drain(e, m, t);
  EXPECT_EQ(t.outputs[0].size(), 1u);
  EXPECT_EQ(t.finish[0], FinishReason::kLength);
}

TEST(Engine, FinishFromTheCallerAndFork) {
  Engine e(config());
  FakeModel m(e);
  e.add_request("a", iota_tokens(5), params_max_tokens(10, 2));  // seqs 0, 1
  Transcript t;
  fake_step(e, m, t);
  EXPECT_FALSE(e.finish(0));  // a stop string ended sample 0
  EXPECT_THROW(e.finish(0), NotFound);
  const SeqId child = e.fork(1);
  EXPECT_EQ(child, 2);
  EXPECT_EQ(e.seq_token_ids(child), e.seq_token_ids(1));
  EXPECT_EQ(e.seq_block_table(child), e.seq_block_table(1));
  EXPECT_EQ(e.stats().num_running_seqs, 2);
  EXPECT_FALSE(e.finish(1, FinishReason::kAbort));
  EXPECT_THROW(e.finish(child, FinishReason::kLength), InvalidArgument);
  EXPECT_TRUE(e.finish(child));  // the last one: the request is done
  EXPECT_FALSE(e.has_unfinished_requests());
  EXPECT_EQ(e.stats().num_free_blocks, 32);
  EXPECT_THROW(e.fork(1), NotFound);
}

TEST(Engine, ForkIsRefusedWhenItCannotProceed) {
  EngineConfig c = config();
  c.max_num_seqs = 2;
  Engine e(c);
  FakeModel m(e);
  e.add_request("a", iota_tokens(5), params_max_tokens(10, 2));
  EXPECT_THROW(e.fork(0), InvalidArgument);  // waiting
  Transcript t;
  fake_step(e, m, t);
  EXPECT_THROW(e.fork(0), InvalidArgument);  // no seat left
  e.add_request("b", iota_tokens(5), params_max_tokens(10, 2));
  const auto before = snapshot(e);
  EXPECT_THROW(e.fork(2), InvalidArgument);  // b's parent has not forked yet (and waits)
  EXPECT_EQ(snapshot(e), before);
  e.abort("a");
  fake_step(e, m, t);
  fake_step(e, m, t);  // b runs and forks
  EXPECT_THROW(e.fork(2), InvalidArgument);  // seats full again
  EXPECT_THROW(e.fork(99), NotFound);
}

TEST(Engine, PrefixCacheHitsAcrossRequests) {
  Engine e(config());
  FakeModel m(e);
  const std::vector<TokenId> system = iota_tokens(24, 500);
  std::vector<TokenId> p1 = system, p2 = system;
  p1.push_back(1);
  p1.push_back(2);
  p2.push_back(3);
  e.add_request("first", p1, params_max_tokens(2));
  Transcript t;
  drain(e, m, t);
  // 27 tokens computed (26 prompt + 1 decode): three full blocks stay cached.
  EXPECT_EQ(e.stats().num_cached_blocks, 3);
  e.add_request("second", p2, params_max_tokens(2));
  const StepBatch& b = e.schedule();
  // 24 shared tokens come from the cache; only token 25 is computed.
  EXPECT_EQ(b.num_tokens, 1);
  EXPECT_EQ(b.num_computed_tokens[0], 24);
  EXPECT_EQ(b.positions[0], 24);
  const std::vector<TokenId> s = m.run(b);
  record(e.update(s.data(), 1), t);
  const EngineStats st = e.stats();
  EXPECT_EQ(st.prefix_cache_queries, 26 + 25);
  EXPECT_EQ(st.prefix_cache_hits, 24);
  EXPECT_DOUBLE_EQ(st.prefix_cache_hit_rate, 24.0 / 51.0);
  drain(e, m, t);
  EXPECT_EQ(e.stats().num_free_blocks, 32);
}

TEST(Engine, CacheSaltSeparatesPrefixes) {
  Engine e(config());
  FakeModel m(e);
  RequestParams salted = params_max_tokens(1);
  salted.cache_salt = 77;
  e.add_request("a", iota_tokens(17), params_max_tokens(1));
  Transcript t;
  drain(e, m, t);
  e.add_request("b", iota_tokens(17), salted);
  EXPECT_EQ(e.schedule().num_tokens, 17);  // 1 without the salt
}

TEST(Engine, ForcedHashCollisionsNeverServeWrongBlocks) {
  EngineConfig c = config();
  c.prefix_hash_bits = 0;  // every block hashes to the same value
  Engine e(c);
  FakeModel m(e);
  e.add_request("a", iota_tokens(17, 1), params_max_tokens(1));
  Transcript t;
  drain(e, m, t);
  e.add_request("b", iota_tokens(17, 100), params_max_tokens(1));
  const StepBatch& b = e.schedule();
  EXPECT_EQ(b.num_tokens, 17);  // nothing served from a's blocks
  const std::vector<TokenId> s = m.run(b);
  e.update(s.data(), 1);
  // A true hit on a's first block. a's second block collided with the first
  // at registration (same hash, other content), so it was never cached.
  e.add_request("a2", iota_tokens(17, 1), params_max_tokens(1));
  const StepBatch& b2 = e.schedule();
  EXPECT_EQ(b2.num_tokens, 9);
  EXPECT_EQ(b2.num_computed_tokens[0], 8);
  m.run(b2);  // the hit block holds a's first 8 tokens
}

TEST(Engine, SlidingWindowBlockTablesHoldNullBlocks) {
  EngineConfig c = config();
  c.sliding_window = 12;
  c.enable_prefix_caching = false;
  Engine e(c);
  FakeModel m(e);
  e.add_request("w", iota_tokens(20), params_max_tokens(8));
  Transcript t;
  fake_step(e, m, t);
  EXPECT_EQ(e.seq_block_table(0), (std::vector<BlockId>{1, 2, 3}));
  // Next query at position 20 sees 9..20: block 0 (0..7) is released.
  const StepBatch& b = e.schedule();
  EXPECT_EQ(b.block_tables[0], kNullBlock);
  EXPECT_EQ(b.block_tables[1], 2);
  EXPECT_EQ(e.stats().num_free_blocks, 32 - 2);
  const std::vector<TokenId> s = m.run(b);
  e.update(s.data(), 1);
  drain(e, m, t);
  EXPECT_EQ(e.stats().num_free_blocks, 32);
  // A window lets a request longer than the pool run.
  EngineConfig tiny = c;
  tiny.num_blocks = 4;
  tiny.max_model_len = 64;
  tiny.max_num_batched_tokens = 8;
  Engine f(tiny);
  FakeModel mf(f);
  f.add_request("long", iota_tokens(40), params_max_tokens(20));
  drain(f, mf, t);
  EXPECT_EQ(f.stats().num_free_blocks, 4);
}

TEST(Engine, SlidingWindowTakesOnlyTheVisiblePartOfACachedPrefix) {
  // A cached prefix longer than the pool must not keep a request waiting: the
  // hits before the window are not taken (null entries), only the visible ones.
  EngineConfig c = config(8);
  c.sliding_window = 16;
  c.max_num_batched_tokens = 32;
  c.max_model_len = 128;
  Engine e(c);
  FakeModel m(e);
  const std::vector<TokenId> b = iota_tokens(80);
  const std::vector<TokenId> a(b.begin(), b.begin() + 40);
  Transcript t;
  e.add_request("a", a, params_max_tokens(1));
  drain(e, m, t);
  EXPECT_EQ(e.stats().num_cached_blocks, 5);
  e.add_request("b", b, params_max_tokens(1));
  const StepBatch& first = e.schedule();
  ASSERT_EQ(first.num_seqs, 1);
  EXPECT_EQ(first.num_computed_tokens[0], 40);  // 5 blocks hit
  EXPECT_EQ(first.num_tokens, 32);
  // Position 40 sees 25..40: blocks 0-2 are dead and stay null.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(first.block_tables[i], kNullBlock) << i;
  EXPECT_NE(first.block_tables[3], kNullBlock);
  EXPECT_EQ(e.stats().prefix_cache_hits, 40);
  const std::vector<TokenId> s = m.run(first);
  record(e.update(s.data(), static_cast<int32_t>(s.size())), t);
  EXPECT_LE(drain(e, m, t), 2);
  EXPECT_EQ(t.finished_requests, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(e.stats().num_free_blocks, 8);
}

TEST(Engine, BadInputThrowsAndChangesNothing) {
  EngineConfig c = config(4);
  c.vocab_size = 1000;
  Engine e(c);
  FakeModel m(e);
  e.add_request("existing", iota_tokens(5), params_max_tokens(3));
  Transcript t;
  fake_step(e, m, t);
  const auto before = snapshot(e);
  auto expect_rejected = [&](auto&& call, const char* needle) {
    try {
      call();
      ADD_FAILURE() << "no exception for " << needle;
    } catch (const InvalidArgument& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
    EXPECT_EQ(snapshot(e), before) << needle;
    e.check_invariants();
  };
  auto add = [&](std::vector<TokenId> prompt, RequestParams p, std::string id = "new") {
    return [&e, prompt, p, id]() { e.add_request(id, prompt, p); };
  };
  RequestParams p = params_max_tokens(3);
  expect_rejected(add(iota_tokens(65), p), "more than max_model_len (64)");
  expect_rejected(add({}, p), "prompt_token_ids must not be empty");
  expect_rejected(add(iota_tokens(3), p, "existing"), "request_id 'existing' is already in use");
  expect_rejected(add(iota_tokens(3), p, ""), "request_id must not be empty");
  expect_rejected(add({1, -5, 2}, p), "prompt_token_ids[1] = -5");
  expect_rejected(add({1, 1000}, p), "prompt_token_ids[1] = 1000 is not a token id in [0, 1000)");
  RequestParams bad = p;
  bad.n = 0;
  expect_rejected(add(iota_tokens(3), bad), "n must be >= 1, got 0");
  bad = p;
  bad.n = 9;
  expect_rejected(add(iota_tokens(3), bad), "n must be <= max_num_seqs (8), got 9");
  bad = p;
  bad.max_tokens = 0;
  expect_rejected(add(iota_tokens(3), bad), "max_tokens must be >= 1, got 0");
  bad = p;
  bad.min_tokens = 4;
  expect_rejected(add(iota_tokens(3), bad), "min_tokens must be in [0, max_tokens=3], got 4");
  bad = p;
  bad.priority = 2;
  expect_rejected(add(iota_tokens(3), bad), "priority must be 0 when scheduling_policy is 'fcfs'");
  bad = p;
  bad.stop_token_ids = {-1};
  expect_rejected(add(iota_tokens(3), bad), "stop_token_ids[0] = -1");
  bad = p;
  bad.max_tokens = 20;  // 36 tokens = 5 blocks of 8, the pool has 4
  expect_rejected(add(iota_tokens(16), bad), "needs up to 5 KV blocks");

  // Wrong-sized and out-of-range updates, then the step still completes.
  const StepBatch& b = e.schedule();
  const auto pending = snapshot(e);
  EXPECT_THROW(e.update(std::vector<TokenId>{1, 2}.data(), 2), InvalidArgument);
  EXPECT_THROW(e.update(std::vector<TokenId>{-3}.data(), 1), InvalidArgument);
  EXPECT_THROW(e.update(std::vector<TokenId>{1000}.data(), 1), InvalidArgument);
  EXPECT_EQ(snapshot(e), pending);
  const std::vector<TokenId> s = m.run(b);
  record(e.update(s.data(), 1), t);
  EXPECT_THROW(e.abort("nope"), NotFound);
  drain(e, m, t);
  EXPECT_EQ(t.outputs[0].size(), 3u);
  EXPECT_EQ(e.stats().num_free_blocks, 4);
}

TEST(Engine, NeverFitsCheckCountsOnlyComputedTokens) {
  // The last sampled token is never computed: 8 prompt + 1 output fit one
  // block of 8; a second output needs a second block.
  Engine e(config(1));
  FakeModel m(e);
  EXPECT_NO_THROW(e.add_request("fits", iota_tokens(8), params_max_tokens(1)));
  EXPECT_THROW(e.add_request("too_big", iota_tokens(8), params_max_tokens(2)), InvalidArgument);
  Transcript t;
  drain(e, m, t);
  EXPECT_EQ(t.outputs[0].size(), 1u);
}

TEST(Engine, SixtyFourBitIdsAreRangeChecked) {
  Engine e(config());
  e.add_request("r", iota_tokens(3), params_max_tokens(2));
  e.schedule();
  const std::vector<int64_t> wide = {int64_t{1} << 32};
  EXPECT_THROW(e.update(wide.data(), 1), InvalidArgument);
  EXPECT_TRUE(e.has_pending_step());
  const std::vector<int64_t> fine = {7};
  EXPECT_EQ(e.update(fine.data(), 1).token_ids[0], 7);
  const std::vector<int64_t> ids = {1, -2};
  EXPECT_THROW(to_token_ids(ids.data(), 2, "prompt_token_ids"), InvalidArgument);
}

TEST(Engine, RequestSlotsAreSmallAndReused) {
  Engine e(config());
  FakeModel m(e);
  e.add_request("a", iota_tokens(3), params_max_tokens(1));
  e.add_request("b", iota_tokens(3), params_max_tokens(5, 2));
  e.add_request("c", iota_tokens(3), params_max_tokens(5));
  EXPECT_EQ(e.request_slot("a"), 0);
  EXPECT_EQ(e.request_slot("b"), 1);
  EXPECT_EQ(e.request_slot("c"), 2);
  const StepBatch& b = e.schedule();
  EXPECT_EQ(std::vector<int32_t>(b.sample_slots, b.sample_slots + 4),
            (std::vector<int32_t>{0, 1, 1, 2}));
  EXPECT_EQ(std::vector<int32_t>(b.sample_num_outputs, b.sample_num_outputs + 4),
            (std::vector<int32_t>{0, 0, 0, 0}));
  Transcript t;
  const std::vector<TokenId> s = m.run(b);
  record(e.update(s.data(), 4), t);  // a finishes: slot 0 is free again
  EXPECT_THROW(e.request_slot("a"), NotFound);
  e.add_request("d", iota_tokens(3), params_max_tokens(1));
  e.add_request("e", iota_tokens(3), params_max_tokens(1));
  EXPECT_EQ(e.request_slot("d"), 0);
  EXPECT_EQ(e.request_slot("e"), 3);
  EXPECT_EQ(e.max_request_slots(), 4);
  const StepBatch& b2 = e.schedule();
  EXPECT_EQ(b2.num_samples, 5);
  EXPECT_EQ(b2.sample_num_outputs[0], 1);  // b's samples decode now
  const std::vector<TokenId> s2 = m.run(b2);
  record(e.update(s2.data(), 5), t);
  drain(e, m, t);
}

TEST(Engine, SetLastTokenRewritesOnlyTheUncomputedOutput) {
  Engine e(config());
  FakeModel m(e);
  e.add_request("beam", iota_tokens(5), params_max_tokens(10));
  EXPECT_THROW(e.set_last_token(0, 9), InvalidArgument);  // nothing generated yet
  Transcript t;
  fake_step(e, m, t);
  const SeqId child = e.fork(0);
  e.set_last_token(child, 42);
  e.set_last_token(0, 41);
  EXPECT_EQ(e.seq_token_ids(0).back(), 41);
  EXPECT_EQ(e.seq_token_ids(child).back(), 42);
  EXPECT_THROW(e.set_last_token(0, -1), InvalidArgument);
  EXPECT_THROW(e.set_last_token(77, 1), NotFound);
  const StepBatch& b = e.schedule();
  EXPECT_EQ(std::vector<int32_t>(b.input_ids, b.input_ids + 2), (std::vector<int32_t>{41, 42}));
  EXPECT_THROW(e.set_last_token(0, 1), InvalidState);
  const std::vector<TokenId> s = m.run(b);
  e.update(s.data(), 2);
  drain(e, m, t);
}

TEST(Engine, ConfigIsValidated) {
  auto rejects = [](auto mutate, const char* needle) {
    EngineConfig c;
    mutate(c);
    try {
      Engine e(c);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const InvalidArgument& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  rejects([](EngineConfig& c) { c.block_size = 12; }, "block_size must be one of 8, 16, 32, 64, 128, got 12");
  rejects([](EngineConfig& c) { c.num_blocks = 0; }, "num_blocks must be >= 1, got 0");
  rejects([](EngineConfig& c) { c.max_num_seqs = 0; }, "max_num_seqs must be >= 1, got 0");
  rejects([](EngineConfig& c) { c.max_num_batched_tokens = -1; }, "max_num_batched_tokens must be >= 1, got -1");
  rejects([](EngineConfig& c) { c.max_model_len = 0; }, "max_model_len must be >= 1, got 0");
  rejects([](EngineConfig& c) { c.preemption_mode = PreemptionMode::kSwap; },
          "num_cpu_blocks must be >= 1 when preemption_mode is 'swap'");
  rejects([](EngineConfig& c) { c.sliding_window = -4; }, "sliding_window must be >= 0");
  rejects([](EngineConfig& c) { c.prefix_hash_bits = 65; }, "prefix_hash_bits must be in [0, 64], got 65");
  EXPECT_THROW(parse_preemption_mode("evict"), InvalidArgument);
  EXPECT_THROW(parse_scheduling_policy("lifo"), InvalidArgument);
  for (int32_t bs : {8, 16, 32, 64, 128}) {
    EngineConfig c;
    c.block_size = bs;
    EXPECT_NO_THROW(Engine{c});
  }
}

TEST(Engine, StepArraysDescribeTheKVLayout) {
  // Every token's slot is inside its row's block table, at its position.
  EngineConfig c = config(64, 8);
  c.max_num_batched_tokens = 20;
  Engine e(c);
  FakeModel m(e);
  for (int i = 0; i < 5; ++i) e.add_request("r" + std::to_string(i), iota_tokens(3 + 7 * i), params_max_tokens(6, 1 + i % 2));
  Transcript t;
  while (e.has_unfinished_requests()) {
    const StepBatch& b = e.schedule();
    for (int32_t r = 0; r < b.num_seqs; ++r) {
      EXPECT_EQ(b.query_start_loc[r + 1] - b.query_start_loc[r], b.seq_lens[r] - b.num_computed_tokens[r]);
      EXPECT_EQ(r < b.num_decode_seqs, b.seq_lens[r] - b.num_computed_tokens[r] == 1);
      for (int32_t i = b.query_start_loc[r]; i < b.query_start_loc[r + 1]; ++i) {
        const int32_t pos = b.positions[i];
        EXPECT_EQ(pos, b.num_computed_tokens[r] + i - b.query_start_loc[r]);
        const int32_t block = b.block_tables[r * b.max_blocks_per_seq + pos / 8];
        EXPECT_EQ(b.slot_mapping[i], block * 8 + pos % 8);
        EXPECT_EQ(b.input_ids[i], e.seq_token_ids(b.seq_ids[r])[pos]);
      }
    }
    const std::vector<TokenId> s = m.run(b);
    record(e.update(s.data(), static_cast<int32_t>(s.size())), t);
  }
  EXPECT_EQ(t.outputs.size(), 7u);
}

// ---- prompt logprobs ------------------------------------------------------

struct Scored {
  SeqId seq;
  int32_t position;  // of the scored prompt token
  TokenId token;
  bool operator==(const Scored& o) const {
    return seq == o.seq && position == o.position && token == o.token;
  }
};

// The prompt-logprob entries of a batch, each checked against the batch's own
// layout: its index lies in its sequence's row, at the position before the
// scored one, and is never a sampled index.
std::vector<Scored> scored_of(const StepBatch& b) {
  std::vector<Scored> out;
  EXPECT_EQ(b.prompt_logprob_start_loc[0], 0);
  EXPECT_EQ(b.prompt_logprob_start_loc[b.num_prompt_logprob_seqs], b.num_prompt_logprob_tokens);
  for (int32_t r = 0; r < b.num_prompt_logprob_seqs; ++r) {
    const SeqId seq = b.prompt_logprob_seq_ids[r];
    int32_t row = 0;
    while (row < b.num_seqs && b.seq_ids[row] != seq) ++row;
    EXPECT_LT(row, b.num_seqs) << "run of seq " << seq << " has no row";
    for (int32_t k = b.prompt_logprob_start_loc[r]; k < b.prompt_logprob_start_loc[r + 1]; ++k) {
      const int32_t position = b.prompt_logprob_first_positions[r] + k - b.prompt_logprob_start_loc[r];
      const int32_t index = b.prompt_logprob_indices[k];
      EXPECT_GE(index, b.query_start_loc[row]);
      EXPECT_LT(index, b.query_start_loc[row + 1]);
      EXPECT_EQ(b.positions[index], position - 1);
      for (int32_t j = 0; j < b.num_samples; ++j) EXPECT_NE(b.sample_indices[j], index);
      out.push_back({seq, position, b.prompt_logprob_token_ids[k]});
    }
  }
  return out;
}

// Drains the engine, collecting every prompt-logprob entry.
std::vector<Scored> drain_scored(Engine& e, FakeModel& m, Transcript& t) {
  std::vector<Scored> all;
  for (int steps = 0; e.has_unfinished_requests(); ++steps) {
    if (steps > 1000) throw std::runtime_error("no progress");
    const StepBatch& b = e.schedule();
    for (const Scored& s : scored_of(b)) all.push_back(s);
    const std::vector<TokenId> sampled = m.run(b);
    record(e.update(sampled.data(), static_cast<int32_t>(sampled.size())), t);
  }
  return all;
}

std::vector<Scored> every_prompt_position(SeqId seq, const std::vector<TokenId>& prompt) {
  std::vector<Scored> out;
  for (int32_t p = 1; p < static_cast<int32_t>(prompt.size()); ++p) out.push_back({seq, p, prompt[p]});
  return out;
}

RequestParams with_prompt_logprobs(RequestParams p) {
  p.prompt_logprobs = true;
  return p;
}

TEST(Engine, PromptLogprobsListEveryPromptPositionOnceOverChunks) {
  EngineConfig c = config();
  c.max_num_batched_tokens = 8;  // the 20-token prompt takes three chunks
  Engine e(c);
  FakeModel m(e);
  const std::vector<TokenId> prompt = iota_tokens(20, 100);
  const SeqId p = e.add_request("p", prompt, with_prompt_logprobs(params_max_tokens(3, /*n=*/2)));
  e.add_request("q", iota_tokens(10, 300), params_max_tokens(3));
  Transcript t;
  // n = 2: the prompt is scored once, by the parent; "q" asked for nothing.
  EXPECT_EQ(drain_scored(e, m, t), every_prompt_position(p, prompt));
  EXPECT_EQ(t.finished_requests.size(), 2u);
}

TEST(Engine, PromptLogprobsSkipReadingThePrefixCacheButFillIt) {
  Engine e(config());
  FakeModel m(e);
  std::vector<TokenId> prompt = iota_tokens(24, 500);
  prompt.push_back(7);
  Transcript t;
  const SeqId a = e.add_request("a", prompt, with_prompt_logprobs(params_max_tokens(1)));
  EXPECT_EQ(drain_scored(e, m, t), every_prompt_position(a, prompt));
  // "a" filled the cache: a request without prompt logprobs reads 24 tokens from it.
  e.add_request("b", prompt, params_max_tokens(1));
  const StepBatch& hit = e.schedule();
  EXPECT_EQ(hit.num_computed_tokens[0], 24);
  EXPECT_EQ(hit.num_prompt_logprob_tokens, 0);
  const std::vector<TokenId> sampled = m.run(hit);
  record(e.update(sampled.data(), 1), t);
  EXPECT_EQ(drain_scored(e, m, t).size(), 0u);
  // One with prompt logprobs computes the whole prompt again.
  const SeqId c = e.add_request("c", prompt, with_prompt_logprobs(params_max_tokens(1)));
  const StepBatch& b = e.schedule();
  EXPECT_EQ(b.num_computed_tokens[0], 0);
  EXPECT_EQ(b.num_tokens, 25);
  EXPECT_EQ(scored_of(b), every_prompt_position(c, prompt));
  const std::vector<TokenId> s = m.run(b);
  record(e.update(s.data(), 1), t);
  // Only "b" queried the cache.
  EXPECT_EQ(e.stats().prefix_cache_queries, 25);
  EXPECT_EQ(e.stats().prefix_cache_hits, 24);
}

TEST(Engine, PromptLogprobsAreListedOnceAcrossARecomputePreemption) {
  EngineConfig c = config(/*num_blocks=*/4, /*block_size=*/8);
  c.max_num_batched_tokens = 8;
  c.enable_prefix_caching = false;  // the preempted prompt is computed again from 0
  Engine e(c);
  FakeModel m(e);
  e.add_request("a", iota_tokens(15, 1), params_max_tokens(18));
  const std::vector<TokenId> prompt = iota_tokens(16, 200);
  const SeqId b = e.add_request("b", prompt, with_prompt_logprobs(params_max_tokens(1)));
  Transcript t;
  EXPECT_EQ(drain_scored(e, m, t), every_prompt_position(b, prompt));
  // "b" was preempted half-way through its prompt (positions 0..7 computed).
  EXPECT_GE(e.stats().num_recompute_preemptions, 1);
}

}  // namespace
}  // namespace pagedcore
