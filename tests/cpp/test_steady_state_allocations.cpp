// A decode step in the steady state allocates no memory: this binary replaces
// the global operator new to count calls while steps run. It links a copy of
// the core built without PAGEDCORE_DEBUG_CHECKS (those checks allocate).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "engine_test_util.h"
#include "pagedcore/engine.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};
}  // namespace

void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace pagedcore {
namespace {

using namespace pagedcore::testing;

void expect_allocation_free_steps(int32_t running, int32_t waiting, bool prefix_caching) {
  EngineConfig c;
  c.num_blocks = 8192;
  c.block_size = 16;
  c.max_num_seqs = running;
  c.max_num_batched_tokens = 8192;
  c.max_model_len = 2048;
  c.enable_prefix_caching = prefix_caching;
  Engine e(c);
  for (int32_t i = 0; i < running + waiting; ++i) {
    e.add_request("r" + std::to_string(i), iota_tokens(100 + i % 37, i), params_max_tokens(1000));
  }
  std::vector<TokenId> sampled(running, 5);
  // Warm up: admit and prefill everyone, then a few decode steps.
  for (int step = 0; step < 20; ++step) {
    const StepBatch& b = e.schedule();
    e.update(sampled.data(), b.num_samples);
  }
  g_allocations = 0;
  g_counting = true;
  for (int step = 0; step < 300; ++step) {
    const StepBatch& b = e.schedule();
    if (b.num_seqs != running) break;
    e.update(sampled.data(), b.num_samples);
  }
  g_counting = false;
  EXPECT_EQ(e.stats().num_running_seqs, running);
  EXPECT_EQ(e.stats().num_waiting_seqs, waiting);
  // 300 steps cross many block boundaries: new blocks, registrations.
  EXPECT_EQ(g_allocations.load(), 0) << running << " running, " << waiting << " waiting";
}

TEST(SteadyState, DecodeStepsAllocateNothing) {
  expect_allocation_free_steps(64, 0, true);
  expect_allocation_free_steps(64, 500, true);
  expect_allocation_free_steps(256, 0, false);
}

TEST(SteadyState, TheCounterSeesAllocations) {
  g_allocations = 0;
  g_counting = true;
  auto* v = new std::vector<int>(10);
  g_counting = false;
  delete v;
  EXPECT_GE(g_allocations.load(), 1);
}

}  // namespace
}  // namespace pagedcore
