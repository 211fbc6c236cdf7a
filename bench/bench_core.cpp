// Microbenchmarks of the pagedcore C++ core: block allocator, fork with
// copy-on-write, prefix-cache lookup, and the engine's schedule() + update()
// step in steady-state decode.
//
// No benchmark library: a small harness times with std::chrono::steady_clock,
// runs warm-up iterations first, repeats the measurement and reports the
// median. Every random input comes from fixed seeds, so two runs do the same
// work. Each case checks that it really did the work it claims (block counts,
// batch sizes, copy pairs...) and aborts otherwise.
//
// Usage: bench_core [--quick] [--step RUNNING WAITING [STEPS [WARMUP]] [--prompt-len N]]
//   --quick  fewer repetitions (a smoke test; numbers are noisier)
//   --step   only the engine step case with RUNNING running and WAITING waiting
//            sequences, STEPS timed steps (default 600) after WARMUP warm-up
//            steps (default 100): for perf / callgrind, and for
//            bench_binding.py, which compares its numbers with these;
//            --prompt-len sets its prompt length (default 128)
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "pagedcore/pagedcore.h"

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#include <malloc.h>
#define BENCH_HAVE_MALLINFO2 1
#endif

#ifndef BENCH_BUILD_TYPE
#define BENCH_BUILD_TYPE "unknown"
#endif

using namespace pagedcore;
using Clock = std::chrono::steady_clock;

namespace {

// ---- harness ------------------------------------------------------------------

#define BENCH_REQUIRE(cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "bench_core: check failed at %s:%d: %s\n  ", __FILE__,    \
                   __LINE__, #cond);                                                 \
      std::fprintf(stderr, __VA_ARGS__);                                             \
      std::fprintf(stderr, "\n");                                                    \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

// Keeps the compiler from discarding a value it could prove unused.
template <typename T>
inline void do_not_optimize(const T& value) {
#if defined(__GNUC__) || defined(__clang__)
  asm volatile("" : : "r,m"(value) : "memory");
#else
  static volatile const T* sink;
  sink = &value;
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

double median(std::vector<double> v) {
  BENCH_REQUIRE(!v.empty(), "median of nothing");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double percentile(std::vector<double> v, double p) {
  BENCH_REQUIRE(!v.empty(), "percentile of nothing");
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

struct Summary {
  double median = 0;
  double min = 0;
  double max = 0;
  int runs = 0;
};

Summary summarize(const std::vector<double>& samples) {
  Summary s;
  s.median = median(samples);
  s.min = *std::min_element(samples.begin(), samples.end());
  s.max = *std::max_element(samples.begin(), samples.end());
  s.runs = static_cast<int>(samples.size());
  return s;
}

// Runs `body` warmup + runs times; body() returns the cost of one run in ns per
// operation. The warm-up runs are thrown away.
template <typename Body>
Summary repeat(int warmup, int runs, Body&& body) {
  for (int i = 0; i < warmup; ++i) body();
  std::vector<double> samples;
  samples.reserve(runs);
  for (int i = 0; i < runs; ++i) samples.push_back(body());
  return summarize(samples);
}

// ---- result table ------------------------------------------------------------------

struct Row {
  std::string name;
  double value;
  std::string unit;
  std::string target;  // "" when the case is informational
  bool pass;
  std::string note;
};

std::vector<Row> g_rows;

void add_row(const std::string& name, double value, const std::string& unit,
             const std::string& target = "", bool pass = true, const std::string& note = "") {
  g_rows.push_back({name, value, unit, target, pass, note});
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

void print_table() {
  size_t w_name = 4, w_val = 8, w_target = 6;
  std::vector<std::string> values;
  for (const Row& r : g_rows) {
    values.push_back(fmt(r.value >= 100 ? "%.0f" : r.value >= 10 ? "%.1f" : "%.2f", r.value) +
                     " " + r.unit);
    w_name = std::max(w_name, r.name.size());
    w_val = std::max(w_val, values.back().size());
    w_target = std::max(w_target, r.target.size());
  }
  std::printf("\n%-*s  %*s  %-*s  %s\n", static_cast<int>(w_name), "case",
              static_cast<int>(w_val), "measured", static_cast<int>(w_target), "target",
              "result");
  std::printf("%s\n", std::string(w_name + w_val + w_target + 14, '-').c_str());
  int failed = 0;
  for (size_t i = 0; i < g_rows.size(); ++i) {
    const Row& r = g_rows[i];
    const char* verdict = r.target.empty() ? "info" : r.pass ? "PASS" : "FAIL";
    if (!r.target.empty() && !r.pass) ++failed;
    std::printf("%-*s  %*s  %-*s  %s%s%s\n", static_cast<int>(w_name), r.name.c_str(),
                static_cast<int>(w_val), values[i].c_str(), static_cast<int>(w_target),
                r.target.empty() ? "-" : r.target.c_str(), verdict, r.note.empty() ? "" : "  ",
                r.note.c_str());
  }
  std::printf("\n%d of the targets missed\n", failed);
}

// ---- inputs ----------------------------------------------------------------------

constexpr uint32_t kSeed = 20240601;
constexpr TokenId kVocab = 32000;

std::vector<TokenId> random_tokens(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<TokenId> dist(1, kVocab - 1);
  std::vector<TokenId> out(n);
  for (TokenId& t : out) t = dist(rng);
  return out;
}

// Heap bytes in use (glibc), else the resident set size: what adding the
// waiting requests costs in memory.
double heap_kib() {
#ifdef BENCH_HAVE_MALLINFO2
  const struct mallinfo2 mi = mallinfo2();
  return double(mi.uordblks + mi.hblkhd) / 1024.0;
#else
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr);
  }
  return 0;
#endif
}

// ---- 1. block allocator ------------------------------------------------------------

void bench_allocator(bool quick) {
  constexpr int32_t kBlocks = 64 * 1024;
  constexpr int32_t kBlockSize = 16;
  const int warmup = quick ? 2 : 5;
  const int runs = quick ? 9 : 41;
  std::printf("[allocator] pool of %d blocks, block_size %d, caching on; %d runs\n", kBlocks,
              kBlockSize, runs);

  BlockAllocator alloc(kBlocks, kBlockSize, /*enable_caching=*/true);
  std::vector<BlockId> ids(kBlocks);
  std::vector<double> alloc_ns, free_ns;

  // Allocate every block, then free them all (last first, as free_chain does).
  const Summary pair = repeat(warmup, runs, [&] {
    const int64_t t0 = now_ns();
    for (int32_t i = 0; i < kBlocks; ++i) ids[i] = alloc.allocate();
    const int64_t t1 = now_ns();
    alloc.free_chain(ids.data(), kBlocks);
    const int64_t t2 = now_ns();
    do_not_optimize(ids);
    BENCH_REQUIRE(alloc.num_free_blocks() == kBlocks, "%d free after freeing everything",
                  alloc.num_free_blocks());
    alloc_ns.push_back(double(t1 - t0) / kBlocks);
    free_ns.push_back(double(t2 - t1) / kBlocks);
    return double(t2 - t0) / kBlocks;
  });
  // Sanity: the run really handed out every distinct block.
  {
    std::vector<BlockId> sorted(ids);
    std::sort(sorted.begin(), sorted.end());
    BENCH_REQUIRE(sorted.front() == 1 && sorted.back() == kBlocks &&
                      std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                  "allocate() did not hand out blocks 1..%d once each", kBlocks);
  }
  add_row("allocator: allocate+free, 64k-block pool", pair.median, "ns/block", "<= 50 ns",
          pair.median <= 50.0);
  add_row("allocator: allocate only", median(alloc_ns), "ns/block");
  add_row("allocator: free (free_chain) only", median(free_ns), "ns/block");

  // Allocation that evicts cached content: every block registered, then freed
  // (cached), then allocated again. Only the allocation pass is timed.
  std::vector<uint64_t> hashes(kBlocks);
  std::mt19937_64 rng64(kSeed);
  for (uint64_t& h : hashes) h = rng64();
  std::vector<TokenId> block_tokens(kBlockSize, 7);
  for (int32_t i = 0; i < kBlocks; ++i) ids[i] = alloc.allocate();
  const Summary evict = repeat(1, quick ? 5 : 15, [&] {
    for (int32_t i = 0; i < kBlocks; ++i) {
      alloc.register_block(ids[i], hashes[i], block_tokens.data(), 0, kRootEpoch);
    }
    alloc.free_chain(ids.data(), kBlocks);
    BENCH_REQUIRE(alloc.num_cached_free_blocks() == kBlocks, "%d cached, expected %d",
                  alloc.num_cached_free_blocks(), kBlocks);
    const int64_t t0 = now_ns();
    for (int32_t i = 0; i < kBlocks; ++i) ids[i] = alloc.allocate();
    const int64_t t1 = now_ns();
    BENCH_REQUIRE(alloc.num_registered_blocks() == 0, "%d still registered after eviction",
                  alloc.num_registered_blocks());
    return double(t1 - t0) / kBlocks;
  });
  alloc.free_chain(ids.data(), kBlocks);
  add_row("allocator: allocate evicting a cached block", evict.median, "ns/block");
}

// ---- 2. fork + copy-on-write ----------------------------------------------------------

void bench_fork_cow(bool quick) {
  constexpr int32_t kBlockSize = 16;
  constexpr int32_t kParentTokens = 129;  // 8 full blocks + 1 token in a 9th
  constexpr int32_t kChildren = 1024;     // forks per run
  constexpr int32_t kMaxBlocks = 64;
  const int warmup = quick ? 2 : 5;
  const int runs = quick ? 9 : 41;
  const int32_t parent_blocks = (kParentTokens + kBlockSize - 1) / kBlockSize;
  std::printf("[fork+cow] parent of %d tokens (%d blocks, last one partial), %d forks per run; "
              "%d runs\n",
              kParentTokens, parent_blocks, kChildren, runs);

  KVCacheManager kv(parent_blocks + kChildren + 16, 0, kBlockSize, /*prefix caching=*/true, 0);
  std::mt19937 rng(kSeed + 1);
  const std::vector<TokenId> tokens = random_tokens(rng, kParentTokens);
  std::vector<BlockPair> copies;
  copies.reserve(kChildren);

  SeqBlocks parent;
  parent.reserve(kMaxBlocks);
  kv.allocate_slots(parent, 0, kParentTokens, copies);
  kv.register_full_blocks(parent, tokens.data(), kParentTokens, 0);
  BENCH_REQUIRE(static_cast<int32_t>(parent.block_table.size()) == parent_blocks && copies.empty(),
                "parent has %zu blocks", parent.block_table.size());
  BENCH_REQUIRE(parent.num_chained == kParentTokens / kBlockSize, "parent chained %d blocks",
                parent.num_chained);
  const BlockId shared_partial = parent.block_table.back();

  std::vector<SeqBlocks> children(kChildren);
  for (SeqBlocks& c : children) c.reserve(kMaxBlocks);
  std::vector<double> free_ns;

  const Summary fork_cow = repeat(warmup, runs, [&] {
    copies.clear();
    const int64_t t0 = now_ns();
    for (SeqBlocks& c : children) {
      kv.fork(parent, c);
      // The child writes position 129, in the partial block it shares with the
      // parent: copy-on-write gives it a private copy.
      kv.allocate_slots(c, kParentTokens, 1, copies);
    }
    const int64_t t1 = now_ns();
    BENCH_REQUIRE(static_cast<int32_t>(copies.size()) == kChildren, "%zu copy pairs for %d forks",
                  copies.size(), kChildren);
    BENCH_REQUIRE(copies.front().src == shared_partial && copies.back().src == shared_partial &&
                      children.back().block_table.back() == copies.back().dst &&
                      children.back().block_table.back() != shared_partial,
                  "copy-on-write did not replace the shared partial block");
    BENCH_REQUIRE(kv.gpu().ref_count(parent.block_table.front()) == 1 + kChildren,
                  "first block has ref count %d", kv.gpu().ref_count(parent.block_table.front()));
    const int64_t t2 = now_ns();
    for (SeqBlocks& c : children) kv.free(c);
    const int64_t t3 = now_ns();
    BENCH_REQUIRE(kv.gpu().ref_count(parent.block_table.front()) == 1 &&
                      kv.gpu().ref_count(shared_partial) == 1,
                  "children's references not dropped");
    free_ns.push_back(double(t3 - t2) / kChildren);
    return double(t1 - t0) / kChildren;
  });
  add_row("fork+cow: fork 129 tok + 1-token cow", fork_cow.median, "ns/fork");
  add_row("fork+cow: free of the forked child", median(free_ns), "ns/child");
}

// ---- 3. prefix lookup -----------------------------------------------------------------

void bench_prefix_lookup(bool quick) {
  constexpr int32_t kBlockSize = 16;
  constexpr int32_t kPromptTokens = 2048;
  constexpr int32_t kLookups = 200;  // per run
  const int warmup = quick ? 2 : 5;
  const int runs = quick ? 9 : 41;
  const int32_t max_hits = (kPromptTokens - 1) / kBlockSize;  // never covers the last token
  std::printf("[prefix lookup] cached prompt of %d tokens (%d blocks), %d lookups per run; "
              "%d runs\n",
              kPromptTokens, kPromptTokens / kBlockSize, kLookups, runs);

  KVCacheManager kv(4096, 0, kBlockSize, /*prefix caching=*/true, 0);
  std::mt19937 rng(kSeed + 2);
  const std::vector<TokenId> prompt = random_tokens(rng, kPromptTokens);
  std::vector<BlockPair> copies;

  // Populate the cache: compute the prompt once, register its blocks, free it.
  SeqBlocks owner;
  owner.reserve(kPromptTokens / kBlockSize + 1);
  kv.allocate_slots(owner, 0, kPromptTokens, copies);
  kv.register_full_blocks(owner, prompt.data(), kPromptTokens, 0);
  kv.free(owner);
  BENCH_REQUIRE(kv.gpu().num_cached_free_blocks() == kPromptTokens / kBlockSize,
                "%d cached blocks", kv.gpu().num_cached_free_blocks());

  SeqBlocks probe;
  probe.reserve(kPromptTokens / kBlockSize + 1);
  auto lookup_run = [&](bool rehash) {
    int32_t revived = 0;
    const int64_t t0 = now_ns();
    for (int i = 0; i < kLookups; ++i) {
      if (rehash) {  // a request seen for the first time: no hash chain yet
        probe.block_hashes.clear();
        probe.block_epochs.clear();
        probe.num_chained = 0;
      }
      const int32_t hits = kv.lookup_prefix(probe, prompt.data(), kPromptTokens, 0, &revived);
      BENCH_REQUIRE(hits == max_hits && revived == max_hits, "%d hits (%d revived), expected %d",
                    hits, revived, max_hits);
    }
    const int64_t t1 = now_ns();
    return double(t1 - t0) / (double(kLookups) * max_hits);
  };
  const Summary cold = repeat(warmup, runs, [&] { return lookup_run(true); });
  const Summary warm = repeat(warmup, runs, [&] { return lookup_run(false); });
  add_row("prefix lookup: hash + lookup (new request)", cold.median, "ns/block");
  add_row("prefix lookup: lookup, hashes known", warm.median, "ns/block");

  // Commit of the 127 hits (revival of cached blocks) plus the free that caches
  // them again: what an admitted request with a full prefix hit costs.
  const Summary commit = repeat(warmup, runs, [&] {
    int64_t total = 0;
    for (int i = 0; i < kLookups; ++i) {
      int32_t revived = 0;
      const int32_t hits = kv.lookup_prefix(probe, prompt.data(), kPromptTokens, 0, &revived);
      const int64_t t0 = now_ns();
      kv.commit_prefix(probe, hits);
      kv.free(probe);
      total += now_ns() - t0;
    }
    BENCH_REQUIRE(kv.gpu().num_cached_free_blocks() == kPromptTokens / kBlockSize,
                  "cache lost blocks: %d", kv.gpu().num_cached_free_blocks());
    return double(total) / (double(kLookups) * max_hits);
  });
  add_row("prefix lookup: commit (revive) + free", commit.median, "ns/block");
}

// ---- 4. engine step -------------------------------------------------------------------

struct StepCase {
  int32_t running;
  int32_t waiting;
  int32_t prompt_len;
};

struct StepNumbers {
  double step_us;        // median of schedule()+update()
  double p90_us;
  double schedule_us;    // median of schedule() alone
  double update_us;      // median of update() alone
  int32_t ctx_first;     // context length of the first / last measured step
  int32_t ctx_last;
  double waiting_kib;    // heap growth per waiting request, KiB
};

StepNumbers bench_step(const StepCase& sc, int warmup_steps, int measured_steps) {
  const int32_t R = sc.running;
  constexpr int32_t kBlockSize = 16;
  EngineConfig config;
  config.block_size = kBlockSize;
  config.max_num_seqs = R;  // every seat taken: the waiting requests never get in
  config.max_num_batched_tokens = 8192;
  // Room for the prompt, the prefill steps, the warm-up and the measured steps,
  // so that nothing reaches max_tokens / max_model_len. The first sequences to
  // finish their prompt decode while the others prefill, taking one token of
  // each step's budget each.
  const int64_t prefill_budget = std::max(1, config.max_num_batched_tokens - R);
  const int32_t prefill_steps = static_cast<int32_t>(
      (int64_t{R} * sc.prompt_len + prefill_budget - 1) / prefill_budget) + 2;
  const int32_t total_steps = warmup_steps + measured_steps + prefill_steps + 64;
  config.max_model_len = sc.prompt_len + total_steps + 64;
  const int32_t max_tokens = config.max_model_len - sc.prompt_len;
  // Every running sequence can grow to max_model_len without preemption.
  config.num_blocks = R * config.max_blocks_per_seq() + 64;
  config.enable_prefix_caching = true;
  Engine engine(config);

  std::mt19937 rng(kSeed + 1000u * static_cast<uint32_t>(R) + static_cast<uint32_t>(sc.waiting));
  RequestParams params;
  params.max_tokens = max_tokens;
  params.ignore_eos = true;
  for (int32_t i = 0; i < R; ++i) {
    engine.add_request("run-" + std::to_string(i), random_tokens(rng, sc.prompt_len), params);
  }

  // Sampled tokens: a fixed pool, a different slice each step.
  constexpr int kPoolSteps = 61;
  const std::vector<TokenId> pool = random_tokens(rng, static_cast<size_t>(R) * kPoolSteps);
  int64_t step_no = 0;
  auto sampled = [&]() { return pool.data() + (step_no++ % kPoolSteps) * R; };

  // Prefill until every sequence decodes.
  for (int guard = 0;; ++guard) {
    BENCH_REQUIRE(guard < prefill_steps + 16, "prefill did not finish in %d steps", guard);
    const StepBatch& b = engine.schedule();
    const bool all_decode = b.num_seqs == R && b.num_decode_seqs == R;
    engine.update(sampled(), b.num_samples);
    if (all_decode) break;
  }
  EngineStats st = engine.stats();
  BENCH_REQUIRE(st.num_running_seqs == R && st.num_waiting_seqs == 0 && st.num_preemptions == 0,
                "after prefill: %d running, %d waiting, %" PRId64 " preemptions",
                st.num_running_seqs, st.num_waiting_seqs, st.num_preemptions);

  // The waiting requests: same kind of prompt; they stay queued throughout.
  const double heap_before = heap_kib();
  for (int32_t i = 0; i < sc.waiting; ++i) {
    engine.add_request("wait-" + std::to_string(i), random_tokens(rng, sc.prompt_len), params);
  }
  const double heap_after = heap_kib();

  auto check_batch = [&](const StepBatch& b) {
    BENCH_REQUIRE(b.num_seqs == R && b.num_decode_seqs == R && b.num_tokens == R &&
                      b.num_samples == R && b.num_block_copies == 0 && b.num_swap_in == 0 &&
                      b.num_swap_out == 0,
                  "step batch: %d seqs (%d decode), %d tokens, %d samples, %d copies; "
                  "expected %d decode rows",
                  b.num_seqs, b.num_decode_seqs, b.num_tokens, b.num_samples,
                  b.num_block_copies, R);
  };
  auto check_result = [&](const StepResult& r) {
    BENCH_REQUIRE(r.num_outputs == R && r.finished_request_ids.empty(),
                  "update: %d outputs, %zu requests finished", r.num_outputs,
                  r.finished_request_ids.size());
  };

  for (int i = 0; i < warmup_steps; ++i) {
    const StepBatch& b = engine.schedule();
    check_batch(b);
    check_result(engine.update(sampled(), b.num_samples));
  }

  std::vector<double> step_us, sched_us, upd_us;
  step_us.reserve(measured_steps);
  sched_us.reserve(measured_steps);
  upd_us.reserve(measured_steps);
  int32_t ctx_first = 0, ctx_last = 0;
  for (int i = 0; i < measured_steps; ++i) {
    const TokenId* tokens = sampled();
    const int64_t t0 = now_ns();
    const StepBatch& b = engine.schedule();
    const int64_t t1 = now_ns();
    const StepResult& r = engine.update(tokens, b.num_samples);
    const int64_t t2 = now_ns();
    // Checked outside the timed region; the batch's buffers stay valid until
    // the next schedule().
    check_batch(b);
    check_result(r);
    if (i == 0) ctx_first = b.seq_lens[0];
    ctx_last = b.seq_lens[0];
    step_us.push_back((t2 - t0) / 1e3);
    sched_us.push_back((t1 - t0) / 1e3);
    upd_us.push_back((t2 - t1) / 1e3);
  }
  st = engine.stats();
  BENCH_REQUIRE(st.num_running_seqs == R && st.num_waiting_seqs == sc.waiting &&
                    st.num_preemptions == 0 && st.num_requests == R + sc.waiting,
                "after measuring: %d running, %d waiting, %" PRId64 " preemptions",
                st.num_running_seqs, st.num_waiting_seqs, st.num_preemptions);

  StepNumbers out;
  out.step_us = median(step_us);
  out.p90_us = percentile(step_us, 0.9);
  out.schedule_us = median(sched_us);
  out.update_us = median(upd_us);
  out.ctx_first = ctx_first;
  out.ctx_last = ctx_last;
  out.waiting_kib = sc.waiting > 0 ? (heap_after - heap_before) / sc.waiting : 0.0;
  return out;
}

// bench_step() `reps` times, each on a fresh engine (same seeds): the
// repetition with the median step time. A burst of noise from another process
// on this machine spoils one repetition, not the result.
StepNumbers bench_step_reps(const StepCase& sc, int warmup_steps, int measured_steps, int reps) {
  std::vector<StepNumbers> all;
  for (int i = 0; i < reps; ++i) all.push_back(bench_step(sc, warmup_steps, measured_steps));
  std::sort(all.begin(), all.end(),
            [](const StepNumbers& a, const StepNumbers& b) { return a.step_us < b.step_us; });
  return all[all.size() / 2];
}

void bench_steps(bool quick) {
  const int warmup = quick ? 20 : 100;
  const int measured = quick ? 100 : 600;
  const int reps = quick ? 1 : 5;
  std::printf("[engine step] block_size 16, 128-token prompts, prefix caching on, max_num_seqs = "
              "running; %d warm-up + %d timed steps per case; median step of each repetition, "
              "median of %d repetitions\n",
              warmup, measured, reps);
  const int32_t kRunning[] = {64, 256, 1024};
  const int32_t kWaiting[] = {0, 10000};
  double at[3][2] = {};
  std::printf("  %8s %8s %10s %10s %10s %10s %12s %14s\n", "running", "waiting", "step us",
              "p90 us", "sched us", "update us", "ns/seq", "context");
  for (int ri = 0; ri < 3; ++ri) {
    for (int wi = 0; wi < 2; ++wi) {
      const StepCase sc{kRunning[ri], kWaiting[wi], 128};
      const StepNumbers n = bench_step_reps(sc, warmup, measured, reps);
      at[ri][wi] = n.step_us;
      std::printf("  %8d %8d %10.2f %10.2f %10.2f %10.2f %12.1f %7d..%-6d\n", sc.running,
                  sc.waiting, n.step_us, n.p90_us, n.schedule_us, n.update_us,
                  n.step_us * 1e3 / sc.running, n.ctx_first, n.ctx_last);
      if (sc.waiting > 0) {
        std::printf("  %8s %8s (heap +%.1f KiB per waiting request)\n", "", "", n.waiting_kib);
      }
      const std::string name = "step: " + std::to_string(sc.running) + " running, " +
                               std::to_string(sc.waiting) + " waiting";
      if (sc.running == 256) {
        add_row(name, n.step_us, "us/step", "<= 30 us", n.step_us <= 30.0);
      } else {
        add_row(name, n.step_us, "us/step");
      }
    }
  }
  // Linear at most in running sequences: 4x the sequences may cost at most 4x
  // the time, with 50% slack. The slack is for the memory hierarchy, not the
  // algorithm: the instructions per sequence and step are the same at 64, 256
  // and 1024 running (callgrind), but 1024 sequences' state no longer stays in
  // the near caches, so each costs ~20-30% more time. Quadratic work (4x ->
  // 16x) would fail by far.
  for (int wi = 0; wi < 2; ++wi) {
    for (int ri = 1; ri < 3; ++ri) {
      const double ratio = at[ri][wi] / at[ri - 1][wi];
      const double limit = 1.5 * kRunning[ri] / kRunning[ri - 1];
      add_row("scaling: " + std::to_string(kRunning[ri]) + "/" + std::to_string(kRunning[ri - 1]) +
                  " running, " + std::to_string(kWaiting[wi]) + " waiting",
              ratio, "x", "<= " + fmt("%.1f", limit) + "x (linear)", ratio <= limit);
    }
  }
  // Flat in waiting requests: 10k waiting may cost at most 15% (+0.5 us) more.
  for (int ri = 0; ri < 3; ++ri) {
    const double ratio = at[ri][1] / at[ri][0];
    const bool ok = at[ri][1] <= 1.15 * at[ri][0] + 0.5;
    add_row("waiting 10000 vs 0 at " + std::to_string(kRunning[ri]) + " running", ratio, "x",
            "<= 1.15x + 0.5us", ok);
  }

  // Informational: the step cost also grows with context, through the copy of
  // every row's whole block table in Engine::fill_batch (one entry per 16
  // tokens per row, every step). The 30 us target is for 128-token prompts.
  for (const int32_t prompt_len : {1024, 4096, 16384}) {
    const StepNumbers n = bench_step_reps({256, 0, prompt_len}, warmup / 2, measured / 4, reps);
    add_row("step: 256 running, " + std::to_string(prompt_len) + "-token prompts", n.step_us,
            "us/step", "", true,
            "context " + std::to_string(n.ctx_first) + ".." + std::to_string(n.ctx_last) +
                (n.step_us > 30.0 ? "; over the 30 us of the 128-token case" : ""));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int32_t only_running = 0, only_waiting = 0, only_steps = 600, only_warmup = 100;
  int32_t prompt_len = 128;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--step") == 0 && i + 2 < argc) {
      only_running = std::atoi(argv[++i]);
      only_waiting = std::atoi(argv[++i]);
      if (i + 1 < argc && argv[i + 1][0] != '-') only_steps = std::atoi(argv[++i]);
      if (i + 1 < argc && argv[i + 1][0] != '-') only_warmup = std::atoi(argv[++i]);
      if (only_running < 1 || only_waiting < 0 || only_steps < 1 || only_warmup < 0) {
        std::fprintf(stderr, "--step needs RUNNING >= 1, WAITING >= 0, STEPS >= 1, WARMUP >= 0\n");
        return 2;
      }
    } else if (std::strcmp(argv[i], "--prompt-len") == 0 && i + 1 < argc) {
      prompt_len = std::atoi(argv[++i]);
      if (prompt_len < 1) {
        std::fprintf(stderr, "--prompt-len needs N >= 1\n");
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--step RUNNING WAITING [STEPS [WARMUP]] "
                   "[--prompt-len N]]\n",
                   argv[0]);
      return 2;
    }
  }
  if (only_running > 0) {
    const StepNumbers n = bench_step({only_running, only_waiting, prompt_len}, only_warmup, only_steps);
    std::printf("step: %d running, %d waiting: median %.2f us (p90 %.2f; schedule %.2f, update "
                "%.2f), context %d..%d\n",
                only_running, only_waiting, n.step_us, n.p90_us, n.schedule_us, n.update_us,
                n.ctx_first, n.ctx_last);
    return 0;
  }
  std::printf("bench_core: pagedcore %s, build type %s%s%s%s\n", PAGEDCORE_VERSION_STRING,
              BENCH_BUILD_TYPE,
#ifdef NDEBUG
              "",
#else
              " (assertions on)",
#endif
#ifdef BENCH_CORE_DEBUG_CHECKS
              " (PAGEDCORE_DEBUG_CHECKS: numbers not representative)",
#else
              "",
#endif
#ifdef BENCH_CORE_SANITIZE
              " (sanitizers: numbers not representative)"
#else
              ""
#endif
  );
  // A preemption in a step case fails its checks; keep any warning visible.
  bench_allocator(quick);
  bench_fork_cow(quick);
  bench_prefix_lookup(quick);
  bench_steps(quick);
  print_table();
  for (const Row& r : g_rows) {
    if (!r.target.empty() && !r.pass) return 1;
  }
  return 0;
}
