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

// async_steps: each step scheduled before the previous one resolves
// (append_placeholders, then resolve of the step before).
void expect_allocation_free_steps(int32_t running, int32_t waiting, bool prefix_caching,
                                  bool async_steps = false) {
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
  int32_t previous_samples = 0;
  // One step; false when it did not hold every running seat.
  auto step = [&]() {
    const StepBatch& b = e.schedule();
    const bool full = b.num_seqs == running;
    if (!async_steps) {
      e.update(sampled.data(), b.num_samples);
      return full;
    }
    e.append_placeholders();
    if (e.num_unresolved_steps() == 2) e.resolve(sampled.data(), previous_samples);
    previous_samples = b.num_samples;
    return full;
  };
  // Warm up: admit and prefill everyone, then a few decode steps.
  for (int i = 0; i < 20; ++i) step();
  g_allocations = 0;
  g_counting = true;
  for (int i = 0; i < 300; ++i) {
    if (!step()) break;
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

TEST(SteadyState, AsyncDecodeStepsAllocateNothing) {
  expect_allocation_free_steps(64, 500, true, /*async_steps=*/true);
  expect_allocation_free_steps(256, 0, false, /*async_steps=*/true);
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
