// The fake model's simulated KV cache catches what a wrong step batch does to
// the cache: each test tampers with one array of a real batch and expects
// KVCacheMismatch, while the batch as the engine made it passes.
#include "fake_model.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "engine_test_util.h"
#include "pagedcore/engine.h"

namespace pagedcore {
namespace {

using namespace pagedcore::testing;

EngineConfig config(int32_t num_blocks = 32) {
  EngineConfig c;
  c.num_blocks = num_blocks;
  c.block_size = 8;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 64;
  return c;
}

// One array of a batch, copied so that a test can change it.
std::vector<int32_t> copy_of(const int32_t* p, int32_t n) { return std::vector<int32_t>(p, p + n); }

// Runs `tampered` on a copy of the model (expecting a mismatch), then the real
// batch on the model itself (expecting none).
void expect_caught(FakeModel& m, const StepBatch& real, const StepBatch& tampered) {
  FakeModel probe = m;
  EXPECT_THROW(probe.run(tampered), KVCacheMismatch);
  EXPECT_NO_THROW(m.run(real));
}

// Three samples of a 12-token prompt share block 2 (positions 8..11); the
// second step copies it for two of them: pairs (2, 3) and (2, 4).
class ForkStep : public ::testing::Test {
 protected:
  ForkStep() : e(config()), m(e) {
    e.add_request("r", iota_tokens(12), params_max_tokens(3, 3));
    const StepBatch& b = e.schedule();
    m.run(b);
    e.update(std::vector<TokenId>{7, 8, 9}.data(), 3);
  }
  Engine e;
  FakeModel m;
};

TEST_F(ForkStep, ReversedCopyPairIsCaught) {
  const StepBatch& d = e.schedule();
  ASSERT_EQ(d.num_block_copies, 2);
  std::vector<int32_t> pairs = copy_of(d.block_copies, 4);
  std::swap(pairs[0], pairs[1]);
  StepBatch bad = d;
  bad.block_copies = pairs.data();
  expect_caught(m, d, bad);
}

TEST_F(ForkStep, DroppedCopyIsCaught) {
  const StepBatch& d = e.schedule();
  StepBatch bad = d;
  bad.num_block_copies = 1;
  expect_caught(m, d, bad);
}

TEST_F(ForkStep, SlotOffByOneIsCaught) {
  const StepBatch& d = e.schedule();
  std::vector<int32_t> slots = copy_of(d.slot_mapping, d.num_tokens);
  slots[0] += 1;
  StepBatch bad = d;
  bad.slot_mapping = slots.data();
  expect_caught(m, d, bad);
}

TEST_F(ForkStep, SiblingsBlockInATableRowIsCaught) {
  // Row 0 reads its second block from row 1's copy: same positions 8..11
  // (both copied block 2), but position 12 holds the sibling's token.
  const StepBatch& d = e.schedule();
  std::vector<int32_t> tables = copy_of(d.block_tables, d.num_seqs * d.max_blocks_per_seq);
  ASSERT_EQ(tables[1], 3);
  tables[1] = tables[d.max_blocks_per_seq + 1];
  StepBatch bad = d;
  bad.block_tables = tables.data();
  expect_caught(m, d, bad);
}

TEST(FakeModel, DroppedSwapInIsCaught) {
  // Two sequences outgrow a pool of 4 blocks; the second is swapped out, and
  // back in once the first finished (its blocks reused by the swap-in).
  EngineConfig c = config(4);
  c.preemption_mode = PreemptionMode::kSwap;
  c.num_cpu_blocks = 8;
  Engine e(c);
  FakeModel m(e);
  e.add_request("r0", iota_tokens(8, 1), params_max_tokens(16));
  e.add_request("r1", iota_tokens(8, 11), params_max_tokens(16));
  Transcript t;
  for (int step = 0; step < 100; ++step) {
    const StepBatch& b = e.schedule();
    if (b.num_swap_in > 0) {
      ASSERT_EQ(b.num_swap_in, 2);
      StepBatch bad = b;
      bad.num_swap_in = 1;
      expect_caught(m, b, bad);
      EXPECT_EQ(m.counts().swap_out, 2);
      return;
    }
    const std::vector<TokenId> s = m.run(b);
    record(e.update(s.data(), static_cast<int32_t>(s.size())), t);
  }
  FAIL() << "no swap-in";
}

TEST(FakeModel, SampleHashesTheHistoryReadFromTheCache) {
  // The same next token fake_next_token gives for the full history; with a
  // window, for the positions the last query sees.
  for (int32_t window : {0, 12}) {
    EngineConfig c = config();
    c.sliding_window = window;
    Engine e(c);
    FakeModel m(e);
    e.add_request("r", iota_tokens(20, 5), params_max_tokens(4));
    const std::vector<TokenId> s = m.run(e.schedule());
    const std::vector<TokenId> prompt = iota_tokens(20, 5);
    const std::vector<TokenId> seen(prompt.begin() + (window ? 20 - window : 0), prompt.end());
    EXPECT_EQ(s, std::vector<TokenId>{fake_next_token(seen, 0)}) << window;
  }
}

}  // namespace
}  // namespace pagedcore
