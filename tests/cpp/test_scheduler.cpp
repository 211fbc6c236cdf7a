// Scheduler behaviour, observed through the engine's step batches.
#include "pagedcore/scheduler.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "pagedcore/engine.h"
#include "pagedcore/errors.h"
#include "pagedcore/log.h"

namespace pagedcore {
namespace {

using namespace pagedcore::testing;

template <typename T>
std::vector<T> vec(const T* p, int32_t n) {
  return std::vector<T>(p, p + n);
}

std::vector<int32_t> table_row(const StepBatch& b, int32_t row) {
  const int32_t n = (b.seq_lens[row] + b.block_size - 1) / b.block_size;
  return vec(b.block_tables + static_cast<size_t>(row) * b.max_blocks_per_seq, n);
}

EngineConfig small_config() {
  EngineConfig c;
  c.num_blocks = 64;
  c.block_size = 8;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 20;
  c.max_model_len = 64;
  c.enable_prefix_caching = false;
  return c;
}

void update_with(Engine& e, std::vector<TokenId> tokens) {
  e.update(tokens.data(), static_cast<int32_t>(tokens.size()));
}

TEST(Scheduler, TokenBudgetIsSharedAndDecodeRowsComeFirst) {
  Engine e(small_config());
  e.add_request("r0", iota_tokens(8, 1), params_max_tokens(5));
  e.add_request("r1", iota_tokens(8, 11), params_max_tokens(5));
  e.add_request("r2", iota_tokens(8, 21), params_max_tokens(5));

  const StepBatch& b1 = e.schedule();
  EXPECT_EQ(b1.num_tokens, 20);
  EXPECT_EQ(b1.num_seqs, 3);
  EXPECT_EQ(b1.num_decode_seqs, 0);
  EXPECT_EQ(vec(b1.seq_ids, 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(vec(b1.seq_lens, 3), (std::vector<int32_t>{8, 8, 4}));
  EXPECT_EQ(vec(b1.query_start_loc, 4), (std::vector<int32_t>{0, 8, 16, 20}));
  EXPECT_EQ(vec(b1.input_ids, 20), (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15,
                                                         16, 17, 18, 21, 22, 23, 24}));
  std::vector<int32_t> slots(20);
  std::iota(slots.begin(), slots.end(), 8);  // blocks 1, 2, 3 in a row
  EXPECT_EQ(vec(b1.slot_mapping, 20), slots);
  // r2's prompt is cut: it samples nothing yet.
  EXPECT_EQ(b1.num_samples, 2);
  EXPECT_EQ(vec(b1.sample_indices, 2), (std::vector<int32_t>{7, 15}));
  EXPECT_EQ(vec(b1.sample_seq_ids, 2), (std::vector<int64_t>{0, 1}));
  update_with(e, {100, 200});

  const StepBatch& b2 = e.schedule();
  EXPECT_EQ(b2.num_tokens, 6);
  EXPECT_EQ(b2.num_decode_seqs, 2);
  EXPECT_EQ(vec(b2.seq_ids, 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(vec(b2.input_ids, 6), (std::vector<int32_t>{100, 200, 25, 26, 27, 28}));
  EXPECT_EQ(vec(b2.positions, 6), (std::vector<int32_t>{8, 8, 4, 5, 6, 7}));
  EXPECT_EQ(vec(b2.num_computed_tokens, 3), (std::vector<int32_t>{8, 8, 4}));
  EXPECT_EQ(vec(b2.seq_lens, 3), (std::vector<int32_t>{9, 9, 8}));
  // New blocks 4 and 5 for the decodes; r2 fills the rest of block 3.
  EXPECT_EQ(vec(b2.slot_mapping, 6), (std::vector<int32_t>{32, 40, 28, 29, 30, 31}));
  EXPECT_EQ(table_row(b2, 0), (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(table_row(b2, 1), (std::vector<int32_t>{2, 5}));
  EXPECT_EQ(table_row(b2, 2), (std::vector<int32_t>{3}));
  EXPECT_EQ(vec(b2.sample_indices, 3), (std::vector<int32_t>{0, 1, 5}));
  update_with(e, {101, 201, 300});
  e.check_invariants();
}

TEST(Scheduler, ReserveMaxModelLenAdmitsOnlyWhatFullContextsWouldFit) {
  // 64 blocks of 8 tokens, max_model_len 64 (8 blocks): reserving the whole context
  // admits 8 sequences; paging admits all 12 (each needs 2 blocks now).
  for (const bool reserve : {false, true}) {
    EngineConfig c = small_config();
    c.max_num_seqs = 16;
    c.max_num_batched_tokens = 512;
    c.reserve_max_model_len = reserve;
    Engine e(c);
    for (int i = 0; i < 12; ++i) {
      e.add_request("r" + std::to_string(i), iota_tokens(9, 1 + 10 * i), params_max_tokens(3));
    }
    const StepBatch& b = e.schedule();
    EXPECT_EQ(b.num_seqs, reserve ? 8 : 12);
    const EngineStats st = e.stats();
    EXPECT_EQ(st.num_used_blocks, 2 * b.num_seqs);  // blocks are still taken as tokens arrive
    EXPECT_EQ(st.num_kv_tokens, 9 * b.num_seqs);
    EXPECT_EQ(st.num_reserved_blocks, reserve ? 8 * 8 : 2 * 12);
    EXPECT_EQ(st.num_preemptions, 0);
  }
}

TEST(Scheduler, LongPromptIsChunkedAcrossSteps) {
  EngineConfig c = small_config();
  c.max_num_batched_tokens = 16;
  Engine e(c);
  e.add_request("long", iota_tokens(49), params_max_tokens(3));
  for (int step = 0; step < 3; ++step) {
    const StepBatch& b = e.schedule();
    ASSERT_EQ(b.num_tokens, 16) << "step " << step;
    EXPECT_EQ(b.positions[0], 16 * step);
    EXPECT_EQ(b.num_computed_tokens[0], 16 * step);
    EXPECT_EQ(b.seq_lens[0], 16 * step + 16);
    EXPECT_EQ(b.num_samples, 0);
    EXPECT_EQ(table_row(b, 0), iota_tokens(2 * step + 2, 1));
    update_with(e, {});
  }
  const StepBatch& last = e.schedule();
  EXPECT_EQ(last.num_tokens, 1);
  EXPECT_EQ(last.positions[0], 48);
  EXPECT_EQ(last.input_ids[0], 49);
  EXPECT_EQ(last.slot_mapping[0], 7 * 8 + 0);
  EXPECT_EQ(last.num_samples, 1);
  EXPECT_EQ(last.sample_indices[0], 0);
  update_with(e, {500});
  const StepBatch& decode = e.schedule();
  EXPECT_EQ(decode.input_ids[0], 500);
  EXPECT_EQ(decode.positions[0], 49);
  EXPECT_EQ(decode.slot_mapping[0], 7 * 8 + 1);
  update_with(e, {501});
}

TEST(Scheduler, MixedPrefillCapHoldsStepTokensWhileDecodesRunAndGrowsWithTheQueue) {
  EngineConfig c = small_config();
  c.max_num_batched_tokens = 64;
  c.max_num_mixed_prefill_tokens = 10;
  c.mixed_prefill_waiting_per_cap = 2;  // each waiting sequence adds 10 / 2 prompt tokens
  Engine e(c);
  e.add_request("r0", iota_tokens(12, 1), params_max_tokens(4));
  const StepBatch& b1 = e.schedule();  // no decode row: the cap does not apply
  EXPECT_EQ(b1.num_tokens, 12);
  update_with(e, {100});

  e.add_request("r1", iota_tokens(25, 101), params_max_tokens(2));
  // r0 decodes, r1 waits: r0's row, 10 - 1 prompt tokens and 5 for the queue
  const StepBatch& b2 = e.schedule();
  EXPECT_EQ(b2.num_tokens, 15);
  EXPECT_EQ(b2.num_decode_seqs, 1);
  EXPECT_EQ(vec(b2.seq_lens, 2), (std::vector<int32_t>{13, 14}));
  EXPECT_EQ(b2.num_samples, 1);
  update_with(e, {101});
  const StepBatch& b3 = e.schedule();  // r1's running prefill, nothing waits: 9 more
  EXPECT_EQ(b3.num_tokens, 10);
  EXPECT_EQ(vec(b3.seq_lens, 2), (std::vector<int32_t>{14, 23}));
  EXPECT_EQ(vec(b3.num_computed_tokens, 2), (std::vector<int32_t>{13, 14}));
  update_with(e, {102});

  // Two waiting: 9 + 10 prompt tokens, r1's last 2 and both prompts at once.
  e.add_request("r2", iota_tokens(6, 201), params_max_tokens(2));
  e.add_request("r3", iota_tokens(6, 301), params_max_tokens(2));
  const StepBatch& b4 = e.schedule();
  EXPECT_EQ(b4.num_tokens, 1 + 2 + 6 + 6);
  EXPECT_EQ(vec(b4.seq_lens, 4), (std::vector<int32_t>{15, 25, 6, 6}));
  EXPECT_EQ(b4.num_samples, 4);
  update_with(e, {103, 400, 500, 600});
  EXPECT_EQ(e.stats().num_running_seqs, 3);  // r0 done (4 tokens), the others decode
  e.check_invariants();
}

TEST(Scheduler, MixedPrefillCapIsLiftedWhileMoreThanMaxWaitingWait) {
  EngineConfig c = small_config();
  c.max_num_batched_tokens = 64;
  c.max_num_mixed_prefill_tokens = 10;
  c.mixed_prefill_max_waiting = 1;
  Engine e(c);
  e.add_request("r0", iota_tokens(12, 1), params_max_tokens(4));
  e.schedule();
  update_with(e, {100});
  e.add_request("r1", iota_tokens(6, 101), params_max_tokens(2));
  const StepBatch& b2 = e.schedule();  // one waiting: capped, r0's row and 10 - 1
  EXPECT_EQ(b2.num_tokens, 1 + 6);
  update_with(e, {101, 200});
  e.add_request("r2", iota_tokens(20, 201), params_max_tokens(2));
  e.add_request("r3", iota_tokens(20, 301), params_max_tokens(2));
  // Two waiting (more than 1): the whole budget, both prompts beside two rows.
  const StepBatch& b3 = e.schedule();
  EXPECT_EQ(b3.num_decode_seqs, 2);
  EXPECT_EQ(b3.num_tokens, 2 + 20 + 20);
  update_with(e, {102, 103, 104, 105});
  e.check_invariants();
}

TEST(Scheduler, MixedPrefillLiftTokensCapALiftedStepUntilTheQueuePassesLiftMaxWaiting) {
  EngineConfig c = small_config();
  c.max_num_batched_tokens = 64;
  c.max_num_mixed_prefill_tokens = 10;
  c.mixed_prefill_max_waiting = 1;
  c.mixed_prefill_lift_tokens = 20;
  c.mixed_prefill_lift_max_waiting = 2;
  Engine e(c);
  e.add_request("r0", iota_tokens(12, 1), params_max_tokens(8));
  e.schedule();
  update_with(e, {100});
  for (int i = 0; i < 2; ++i) e.add_request("a" + std::to_string(i), iota_tokens(15, 101 + 20 * i), params_max_tokens(2));
  // Two waiting (over 1, not over 2): the lifted cap, r0's row and 20 - 1 prompt tokens:
  // a0 whole, a1's first 4.
  const StepBatch& b2 = e.schedule();
  EXPECT_EQ(b2.num_decode_seqs, 1);
  EXPECT_EQ(b2.num_tokens, 20);
  EXPECT_EQ(vec(b2.seq_lens, 3), (std::vector<int32_t>{13, 15, 4}));
  update_with(e, {101, 200});
  // Three more wait (over 2): the whole budget, a1's last 11 and every prompt beside two rows.
  for (int i = 0; i < 3; ++i) e.add_request("b" + std::to_string(i), iota_tokens(15, 301 + 20 * i), params_max_tokens(2));
  const StepBatch& b3 = e.schedule();
  EXPECT_EQ(b3.num_decode_seqs, 2);
  EXPECT_EQ(b3.num_tokens, 2 + 11 + 3 * 15);
  e.check_invariants();
}

TEST(Scheduler, MixedPrefillCapLeavesAFloorOfPromptTokensWhileRowsFillIt) {
  // cap 32: at least half as many prompt tokens as decode rows (and at least 1).
  EngineConfig c = small_config();
  c.max_num_seqs = 64;
  c.max_num_batched_tokens = 256;
  c.max_num_mixed_prefill_tokens = 32;
  c.mixed_prefill_max_waiting = 1;
  Engine e(c);
  std::vector<TokenId> sampled;
  for (int i = 0; i < 31; ++i) {
    e.add_request("d" + std::to_string(i), iota_tokens(2, 1 + 2 * i), params_max_tokens(8));
    sampled.push_back(100 + i);
  }
  const StepBatch& b1 = e.schedule();  // no decode row yet: the whole budget
  EXPECT_EQ(b1.num_tokens, 62);
  update_with(e, sampled);

  e.add_request("long", iota_tokens(40, 500), params_max_tokens(2));
  const StepBatch& b2 = e.schedule();  // 31 rows: 32 - 31 = 1, the floor 31 / 2 = 15 wins
  EXPECT_EQ(b2.num_decode_seqs, 31);
  EXPECT_EQ(b2.num_tokens, 31 + 15);
  EXPECT_EQ(b2.seq_lens[31], 15);
  e.check_invariants();
}

TEST(Scheduler, MaxNumSeqsCountsEverySampleOfARequest) {
  EngineConfig c = small_config();
  c.max_num_seqs = 2;
  c.max_num_batched_tokens = 64;
  Engine e(c);
  FakeModel m(e);
  e.add_request("a", iota_tokens(3, 1), params_max_tokens(2));          // seq 0
  e.add_request("b", iota_tokens(3, 11), params_max_tokens(2, /*n=*/2));  // seqs 1, 2
  e.add_request("c", iota_tokens(3, 21), params_max_tokens(2));          // seq 3
  const StepBatch& b1 = e.schedule();
  // b needs two seats; with one taken it waits, and c waits behind it (FCFS).
  ASSERT_EQ(b1.num_seqs, 1);
  EXPECT_EQ(b1.seq_ids[0], 0);
  m.run(b1);  // the model keeps the cache; the test picks the tokens
  Transcript t;
  record(e.update(std::vector<TokenId>{7}.data(), 1), t);
  const StepBatch& b2 = e.schedule();  // a decodes; still no room for b
  ASSERT_EQ(b2.num_seqs, 1);
  m.run(b2);
  record(e.update(std::vector<TokenId>{8}.data(), 1), t);
  EXPECT_EQ(t.finished_requests, (std::vector<std::string>{"a"}));
  const StepBatch& b3 = e.schedule();
  ASSERT_EQ(b3.num_seqs, 1);
  EXPECT_EQ(b3.seq_ids[0], 1);
  EXPECT_EQ(b3.num_samples, 2);  // one row, two samples: the fork
  EXPECT_EQ(vec(b3.sample_seq_ids, 2), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(vec(b3.sample_indices, 2), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(e.stats().num_waiting_seqs, 1);
  m.run(b3);
  record(e.update(std::vector<TokenId>{9, 10}.data(), 2), t);
  drain(e, m, t);
  EXPECT_EQ(t.outputs.size(), 4u);
}

TEST(Scheduler, FcfsHeadOfLineBlocksSmallerLaterRequests) {
  EngineConfig c = small_config();
  c.num_blocks = 4;
  c.max_num_batched_tokens = 64;
  Engine e(c);
  FakeModel m(e);
  e.add_request("big", iota_tokens(24, 1), params_max_tokens(8));  // 3 blocks now, 4 at most
  e.add_request("mid", iota_tokens(16, 31), params_max_tokens(4));  // needs 2 blocks
  e.add_request("tiny", iota_tokens(2, 61), params_max_tokens(1));  // would fit in 1
  const StepBatch& b = e.schedule();
  EXPECT_EQ(b.num_seqs, 1);
  EXPECT_EQ(b.seq_ids[0], 0);
  EXPECT_EQ(e.kv().gpu().num_free_blocks(), 1);
  m.run(b);
  Transcript t;
  record(e.update(std::vector<TokenId>{5}.data(), 1), t);
  // tiny fits in the free block all along, but waits behind mid until big ends.
  std::map<SeqId, int> first_step;
  for (int step = 1; e.has_unfinished_requests(); ++step) {
    const StepBatch& s = fake_step(e, m, t);
    for (int32_t r = 0; r < s.num_seqs; ++r) first_step.emplace(s.seq_ids[r], step);
  }
  EXPECT_EQ(t.finished_requests.front(), "big");
  EXPECT_EQ(first_step.at(1), first_step.at(2));
  EXPECT_EQ(first_step.at(1), static_cast<int>(t.outputs[0].size()));
}

TEST(Scheduler, PriorityOrdersAdmissionAndChoosesTheVictim) {
  EngineConfig c = small_config();
  c.scheduling_policy = SchedulingPolicy::kPriority;
  c.max_num_seqs = 2;
  c.max_num_batched_tokens = 64;
  Engine e(c);
  FakeModel m(e);
  auto with_priority = [](int32_t prio) {
    RequestParams p = params_max_tokens(2);
    p.priority = prio;
    return p;
  };
  e.add_request("p5", iota_tokens(2, 1), with_priority(5));    // seq 0
  e.add_request("p1a", iota_tokens(2, 11), with_priority(1));  // seq 1
  e.add_request("p1b", iota_tokens(2, 21), with_priority(1));  // seq 2
  e.add_request("p0", iota_tokens(2, 31), with_priority(0));   // seq 3
  const StepBatch& b = e.schedule();
  ASSERT_EQ(b.num_seqs, 2);
  EXPECT_EQ(vec(b.seq_ids, 2), (std::vector<int64_t>{3, 1}));
  m.run(b);
  Transcript t;
  record(e.update(std::vector<TokenId>{1, 2}.data(), 2), t);
  drain(e, m, t);
  EXPECT_EQ(t.finished_requests, (std::vector<std::string>{"p0", "p1a", "p1b", "p5"}));

  // Victim choice: the running sequence with the largest priority value loses,
  // even though it arrived first.
  EngineConfig tight = c;
  tight.num_blocks = 4;
  Engine f(tight);
  FakeModel mf(f);
  RequestParams low = params_max_tokens(16);
  low.priority = 9;
  RequestParams high = params_max_tokens(16);
  high.priority = 0;
  f.add_request("low", iota_tokens(8, 1), low);     // seq 0
  f.add_request("high", iota_tokens(8, 11), high);  // seq 1
  Transcript u;
  std::vector<int64_t> first_rows;
  for (int step = 0; step < 10; ++step) {
    const StepBatch& s = fake_step(f, mf, u);
    first_rows.push_back(s.seq_ids[0]);
    EXPECT_EQ(f.stats().num_preemptions, step < 9 ? 0 : 1) << step;
  }
  // Step 10 computes position 16 of both, a fifth block: low is preempted.
  EXPECT_EQ(f.stats().num_waiting_seqs, 1);
  EXPECT_EQ(first_rows, std::vector<int64_t>(10, 1));
  drain(f, mf, u);
  EXPECT_EQ(u.finished_requests, (std::vector<std::string>{"high", "low"}));
}

// Runs the same requests in a roomy engine and a cramped one; outputs must match.
// The fake model reads every history back through the block tables, so a
// wrong swap or copy pair fails the run even where the outputs would agree.
struct PreemptionRun {
  Transcript transcript;
  EngineStats stats;
  FakeModel::Counts model;
};

PreemptionRun run_workload(EngineConfig c, const std::function<void(const StepBatch&)>& observe) {
  Engine e(c);
  FakeModel m(e);
  for (int i = 0; i < 6; ++i) {
    e.add_request("r" + std::to_string(i), iota_tokens(5 + 3 * i, 10 * i + 1),
                  params_max_tokens(10 + i, i % 3 == 0 ? 2 : 1));
  }
  PreemptionRun run;
  int steps = 0;
  while (e.has_unfinished_requests()) {
    if (++steps > 10000) throw std::runtime_error("workload made no progress");
    const StepBatch& b = fake_step(e, m, run.transcript);
    if (observe) observe(b);
    e.check_invariants();
  }
  run.stats = e.stats();
  run.model = m.counts();
  EXPECT_EQ(run.stats.num_free_blocks, c.num_blocks);
  EXPECT_EQ(run.stats.num_free_cpu_blocks, c.num_cpu_blocks);
  return run;
}

TEST(Scheduler, PreemptionByRecomputeLosesNothing) {
  EngineConfig roomy = small_config();
  roomy.max_num_batched_tokens = 32;
  roomy.num_blocks = 256;
  const PreemptionRun reference = run_workload(roomy, nullptr);
  EXPECT_EQ(reference.stats.num_preemptions, 0);

  for (bool caching : {false, true}) {
    EngineConfig cramped = roomy;
    cramped.num_blocks = 6;
    cramped.enable_prefix_caching = caching;
    int recompute_rows = 0;
    const PreemptionRun run = run_workload(cramped, [&](const StepBatch& b) {
      // A resumed sequence recomputes its outputs too: its row starts at the
      // cached prefix and covers tokens past its prompt.
      for (int32_t r = b.num_decode_seqs; r < b.num_seqs; ++r) {
        if (b.seq_lens[r] > 5 + 3 * 5) ++recompute_rows;
      }
    });
    EXPECT_GT(run.stats.num_recompute_preemptions, 0) << "caching " << caching;
    EXPECT_EQ(run.stats.num_swap_preemptions, 0);
    EXPECT_GT(recompute_rows, 0);
    EXPECT_GT(run.model.copies, 0);  // the n = 2 requests fork mid-block
    EXPECT_EQ(run.transcript.outputs, reference.transcript.outputs) << "caching " << caching;
    EXPECT_EQ(run.transcript.finish, reference.transcript.finish);
  }
}

TEST(Scheduler, PreemptionBySwapLosesNothing) {
  EngineConfig roomy = small_config();
  roomy.max_num_batched_tokens = 32;
  roomy.num_blocks = 256;
  const PreemptionRun reference = run_workload(roomy, nullptr);

  EngineConfig cramped = roomy;
  cramped.num_blocks = 6;
  cramped.preemption_mode = PreemptionMode::kSwap;
  cramped.num_cpu_blocks = 32;
  int swap_out_steps = 0, swap_in_steps = 0;
  const PreemptionRun run = run_workload(cramped, [&](const StepBatch& b) {
    if (b.num_swap_out > 0) ++swap_out_steps;
    if (b.num_swap_in > 0) ++swap_in_steps;
    EXPECT_FALSE(b.num_swap_out > 0 && b.num_swap_in > 0) << "swap out and in in one step";
  });
  EXPECT_GT(run.stats.num_swap_preemptions, 0);
  EXPECT_GT(swap_out_steps, 0);
  EXPECT_GT(swap_in_steps, 0);
  EXPECT_GT(run.model.swap_in, 0);
  EXPECT_GT(run.model.copies, 0);
  EXPECT_EQ(run.transcript.outputs, reference.transcript.outputs);

  // CPU pool too small for any victim: falls back to recompute.
  cramped.num_cpu_blocks = 1;
  const PreemptionRun fallback = run_workload(cramped, nullptr);
  EXPECT_GT(fallback.stats.num_recompute_preemptions, 0);
  EXPECT_EQ(fallback.transcript.outputs, reference.transcript.outputs);
}

TEST(Scheduler, SwapPairsAndResumptionAreExact) {
  EngineConfig c = small_config();
  c.num_blocks = 4;
  c.max_num_batched_tokens = 64;
  c.preemption_mode = PreemptionMode::kSwap;
  c.num_cpu_blocks = 8;
  Engine e(c);
  FakeModel m(e);
  e.add_request("r0", iota_tokens(8, 1), params_max_tokens(16));   // seq 0
  e.add_request("r1", iota_tokens(8, 11), params_max_tokens(16));  // seq 1
  Transcript t;
  // Steps 1-9 compute positions 0..15 of both: blocks r0 {1, 3}, r1 {2, 4}.
  for (int i = 0; i < 9; ++i) fake_step(e, m, t);
  EXPECT_EQ(e.seq_block_table(0), (std::vector<BlockId>{1, 3}));
  EXPECT_EQ(e.seq_block_table(1), (std::vector<BlockId>{2, 4}));
  const StepBatch& b = e.schedule();
  // Position 16 needs a new block each: r1 is swapped out, r0 proceeds alone.
  ASSERT_EQ(b.num_swap_out, 2);
  EXPECT_EQ(vec(b.swap_out, 4), (std::vector<int32_t>{2, 1, 4, 2}));
  EXPECT_EQ(b.num_swap_in, 0);
  ASSERT_EQ(b.num_seqs, 1);
  EXPECT_EQ(b.seq_ids[0], 0);
  const std::vector<TokenId> s = m.run(b);
  record(e.update(s.data(), 1), t);
  EXPECT_EQ(e.stats().num_swapped_seqs, 1);
  EXPECT_EQ(e.stats().num_free_cpu_blocks, 6);
  // r0 runs to the end (24 tokens, 3 blocks), then r1 comes back.
  bool swapped_in = false;
  while (e.has_unfinished_requests()) {
    const StepBatch& step = e.schedule();
    if (step.num_swap_in > 0) {
      swapped_in = true;
      EXPECT_EQ(step.num_swap_in, 2);
      EXPECT_EQ(step.swap_in[0], 1);  // CPU block 1 (r1's first block)
      EXPECT_EQ(step.swap_in[2], 2);
      ASSERT_EQ(step.num_seqs, 1);
      EXPECT_EQ(step.seq_ids[0], 1);
      // Its KV came back: one decode token at position 16, nothing recomputed.
      EXPECT_EQ(step.num_tokens, 1);
      EXPECT_EQ(step.positions[0], 16);
      EXPECT_EQ(step.num_computed_tokens[0], 16);
      const std::vector<int32_t> row = table_row(step, 0);
      EXPECT_EQ(row[0], step.swap_in[1]);
      EXPECT_EQ(row[1], step.swap_in[3]);
    }
    const std::vector<TokenId> sampled = m.run(step);
    record(e.update(sampled.data(), static_cast<int32_t>(sampled.size())), t);
  }
  EXPECT_TRUE(swapped_in);
  EXPECT_EQ(t.outputs[0].size(), 16u);
  EXPECT_EQ(t.outputs[1].size(), 16u);
  EXPECT_EQ(e.stats().num_free_cpu_blocks, 8);
}

TEST(Scheduler, NoAdmissionInAStepThatPreempts) {
  EngineConfig c = small_config();
  c.num_blocks = 4;
  c.max_num_batched_tokens = 64;
  Engine e(c);
  FakeModel m(e);
  e.add_request("r0", iota_tokens(8, 1), params_max_tokens(16));
  e.add_request("r1", iota_tokens(8, 11), params_max_tokens(16));
  Transcript t;
  for (int i = 0; i < 9; ++i) fake_step(e, m, t);
  e.add_request("r2", iota_tokens(1, 21), params_max_tokens(1));
  const StepBatch& b = e.schedule();  // preempts r1, frees 2 blocks, 1 stays free
  EXPECT_EQ(e.stats().num_preemptions, 1);
  EXPECT_EQ(b.num_seqs, 1);  // r2 would fit, but waits for the next step
  EXPECT_EQ(e.kv().gpu().num_free_blocks(), 1);
  const std::vector<TokenId> s = m.run(b);
  record(e.update(s.data(), 1), t);
  drain(e, m, t);
}

TEST(Scheduler, EachPreemptionIsLogged) {
  std::vector<std::string> warnings;
  set_log_sink([&](LogLevel level, const std::string& msg) {
    if (level == LogLevel::kWarning) warnings.push_back(msg);
  });
  EngineConfig c = small_config();
  c.num_blocks = 4;
  c.max_num_batched_tokens = 64;
  Engine e(c);
  FakeModel m(e);
  e.add_request("r0", iota_tokens(8, 1), params_max_tokens(16));
  e.add_request("r1", iota_tokens(8, 11), params_max_tokens(16));
  Transcript t;
  drain(e, m, t);
  set_log_sink(nullptr);
  ASSERT_EQ(static_cast<int64_t>(warnings.size()), e.stats().num_preemptions);
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings[0].find("request 'r1' preempted by recompute"), std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[0].find("total preemptions: 1"), std::string::npos) << warnings[0];
}

TEST(Scheduler, AThrowingLogSinkLeavesTheEngineIntact) {
  // The preemption warning is logged from inside schedule(); a sink that
  // throws (a Python logging filter, a KeyboardInterrupt) must not cut the
  // step in half.
  int calls = 0;
  set_log_sink([&](LogLevel, const std::string&) {
    ++calls;
    throw std::runtime_error("sink down");
  });
  EngineConfig c = small_config();
  c.num_blocks = 3;
  Engine e(c);
  FakeModel m(e);
  e.add_request("r0", iota_tokens(7, 1), params_max_tokens(9));
  e.add_request("r1", iota_tokens(7, 11), params_max_tokens(9));
  Transcript t;
  EXPECT_NO_THROW(drain(e, m, t));
  set_log_sink(nullptr);
  EXPECT_GT(e.stats().num_preemptions, 0);
  EXPECT_EQ(calls, e.stats().num_preemptions);
  EXPECT_EQ(t.outputs[0].size(), 9u);
  EXPECT_EQ(t.outputs[1].size(), 9u);
  e.check_invariants();
}

// Aborts one request at a given stage while another keeps running.
enum Stage { kWaiting, kMidPrefill, kDecoding, kSwappedOut, kPreemptedRecompute, kAwaitingFork, kForked };

const Sequence* find_live(const Engine& e, SeqId id) {
  for (const Sequence* s : e.scheduler().running()) {
    if (s->seq_id == id) return s;
  }
  for (const Sequence* s : e.scheduler().waiting().items()) {
    if (s->seq_id == id) return s;
  }
  return nullptr;
}

class AbortAtStage : public ::testing::TestWithParam<int> {};

TEST_P(AbortAtStage, FreesEverythingAndLeavesOthersIntact) {
  const auto stage = static_cast<Stage>(GetParam());
  EngineConfig c = small_config();
  c.max_num_batched_tokens = 6;
  c.preemption_mode = PreemptionMode::kSwap;
  c.num_cpu_blocks = stage == kPreemptedRecompute ? 1 : 16;
  // Stages before preemption get room; the preemption stages a pool of 7.
  c.num_blocks = (stage == kSwappedOut || stage == kPreemptedRecompute) ? 4 : 32;
  Engine e(c);
  FakeModel m(e);
  Transcript t;
  // "other" arrives first, so it is never the preemption victim.
  e.add_request("other", iota_tokens(3, 100), params_max_tokens(24));
  const int n = (stage == kAwaitingFork || stage == kForked) ? 3 : 1;
  const SeqId victim = e.add_request("victim", iota_tokens(13, 1), params_max_tokens(12, n));
  switch (stage) {
    case kWaiting:
      break;
    case kMidPrefill:
    case kAwaitingFork:
      fake_step(e, m, t);  // 3 tokens of other, 3 of victim
      break;
    case kDecoding:
      for (int i = 0; i < 5; ++i) fake_step(e, m, t);
      break;
    case kSwappedOut:
    case kPreemptedRecompute:
      for (int i = 0; e.stats().num_preemptions == 0; ++i) {
        ASSERT_LT(i, 100);
        fake_step(e, m, t);
      }
      break;
    case kForked:
      for (int i = 0; i < 4; ++i) fake_step(e, m, t);
      break;
  }
  const Sequence* v = find_live(e, victim);
  ASSERT_NE(v, nullptr);
  switch (stage) {
    case kWaiting:
      EXPECT_EQ(v->status, SeqStatus::kWaiting);
      EXPECT_EQ(v->num_computed, 0);
      break;
    case kMidPrefill:
    case kAwaitingFork:
      EXPECT_EQ(v->status, SeqStatus::kRunning);
      EXPECT_EQ(v->num_computed, 3);
      EXPECT_EQ(v->weight, n);
      break;
    case kDecoding:
      EXPECT_EQ(v->status, SeqStatus::kRunning);
      EXPECT_GT(v->num_outputs(), 0);
      break;
    case kSwappedOut:
      EXPECT_EQ(v->status, SeqStatus::kSwapped);
      EXPECT_GT(v->num_outputs(), 0);
      EXPECT_LT(e.stats().num_free_cpu_blocks, c.num_cpu_blocks);
      break;
    case kPreemptedRecompute:
      EXPECT_EQ(v->status, SeqStatus::kWaiting);
      EXPECT_GT(v->num_outputs(), 0);
      break;
    case kForked:
      EXPECT_EQ(e.stats().num_running_seqs, 4);
      EXPECT_EQ(v->weight, 1);
      break;
  }
  e.abort("victim");
  e.check_invariants();
  EXPECT_THROW(e.abort("victim"), NotFound);
  EXPECT_THROW(e.seq_token_ids(victim), NotFound);
  EXPECT_EQ(e.num_unfinished_requests(), 1);
  EXPECT_EQ(e.stats().num_free_cpu_blocks, c.num_cpu_blocks);
  drain(e, m, t);
  EXPECT_EQ(t.outputs[0].size(), 24u);
  EXPECT_EQ(e.stats().num_free_blocks, c.num_blocks);
  EXPECT_EQ(e.stats().num_requests, 0);
}

INSTANTIATE_TEST_SUITE_P(Stages, AbortAtStage, ::testing::Range(0, 7));

TEST(Scheduler, CallsOutOfOrderAreRejected) {
  Engine e(small_config());
  FakeModel m(e);
  e.add_request("r", iota_tokens(3), params_max_tokens(2));
  EXPECT_THROW(e.update(static_cast<const TokenId*>(nullptr), 0), InvalidState);
  const StepBatch& b = e.schedule();
  EXPECT_THROW(e.schedule(), InvalidState);
  EXPECT_THROW(e.abort("r"), InvalidState);
  EXPECT_THROW(e.finish(0), InvalidState);
  EXPECT_THROW(e.fork(0), InvalidState);
  // Adding while a step is pending is fine: it only queues.
  e.add_request("late", iota_tokens(2), params_max_tokens(1));
  const std::vector<TokenId> s = m.run(b);
  e.update(s.data(), static_cast<int32_t>(s.size()));
  e.check_invariants();
}

}  // namespace
}  // namespace pagedcore
