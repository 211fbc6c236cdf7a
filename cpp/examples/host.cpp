// A C++ host that embeds the pagedcore engine with a fake, deterministic model.
//
// The "model" keeps a fake KV cache (one int64 per slot: position and token)
// and really performs every swap, copy and slot write the engine asks for. It
// samples from the history it reads back through the block tables, so a wrong
// block table, a missed copy-on-write or a bad swap changes the output. The
// same workload runs under a roomy cache (no preemption) and cramped ones
// (recompute / swap preemption); every completed request must produce exactly
// the same tokens in every run: outputs must not depend on paging.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedcore/pagedcore.h"

using namespace pagedcore;

namespace {

constexpr TokenId kEos = 0;
constexpr int32_t kVocab = 1000;
constexpr int64_t kUnwritten = -1;

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

// The model: a pure function of the token history and the completion index
// (a per-sample seed, so that the n samples of a request diverge). Hashing the
// whole history makes any corrupted KV slot visible. EOS comes out about once
// in 50 tokens, on purpose: requests then stop at different lengths.
TokenId fake_model(const std::vector<TokenId>& history, int32_t sample_index) {
  uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t(sample_index) * 0x9e3779b97f4a7c15ull);
  for (TokenId t : history) h = (h ^ uint64_t(t)) * 0x100000001b3ull;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  if (h % 50 == 0) return kEos;
  return TokenId(1 + h % (kVocab - 1));
}

struct RequestSpec {
  std::string id;
  std::vector<TokenId> prompt;
  RequestParams params;
  int64_t arrive_at_step;  // added before this step (0: at the start)
};

std::vector<RequestSpec> workload() {
  auto tokens = [](int32_t n, int32_t seed) {
    std::vector<TokenId> v;
    for (int32_t i = 0; i < n; ++i) v.push_back(1 + (seed * 131 + i * 17) % (kVocab - 1));
    return v;
  };
  auto params = [](int32_t n, int32_t max_tokens) {
    RequestParams p;
    p.n = n, p.max_tokens = max_tokens, p.min_tokens = 2, p.eos_token_ids = {kEos};
    return p;
  };
  // Two prompts share a 20-token "system prompt": prefix-cache hits.
  std::vector<TokenId> sys = tokens(20, 1), a = sys, b = sys;
  const std::vector<TokenId> ta = tokens(5, 2), tb = tokens(9, 3);
  a.insert(a.end(), ta.begin(), ta.end());
  b.insert(b.end(), tb.begin(), tb.end());
  std::vector<RequestSpec> w = {
      {"sys-a", a, params(1, 40), 0},
      {"sys-b", b, params(2, 32), 0},          // n=2 over a shared prefix
      {"par", tokens(13, 4), params(3, 24), 0},  // n=3, prompt ends mid-block: CoW
      {"long", tokens(70, 5), params(1, 30), 0}, // chunked prefill in cramped runs
      {"abort-me", tokens(10, 6), params(2, 40), 0},
      {"late-1", tokens(17, 7), params(2, 20), 6},  // arrive mid-run
      {"late-2", sys, params(1, 25), 9},
  };
  w[4].params.ignore_eos = true;  // it must live until we abort it
  return w;
}

struct RunConfig {
  const char* name;
  EngineConfig engine;
  bool expect_preemption;
};

struct RunResult {
  // request id -> per completion index, the generated tokens
  std::map<std::string, std::vector<std::vector<TokenId>>> outputs;
  std::set<std::string> completed;
  EngineStats stats;
  int64_t block_copies = 0, swap_outs = 0, swap_ins = 0;
};

class FakeRunner {
 public:
  explicit FakeRunner(const Engine& e)
      : bs_(e.config().block_size),
        gpu_(size_t(e.num_physical_blocks()) * bs_, kUnwritten),
        cpu_(size_t(e.num_physical_cpu_blocks()) * bs_, kUnwritten) {}

  // Runs one step: the data movement in the order StepBatch prescribes, the
  // KV writes, then one token per sample. first_ids maps a request's first
  // sequence id to its id (to recover the completion index of a sample).
  std::vector<TokenId> run(const Engine& engine, const StepBatch& batch,
                           const std::map<SeqId, std::string>& first_ids) {
    move(batch.swap_out, batch.num_swap_out, gpu_, cpu_);
    move(batch.swap_in, batch.num_swap_in, cpu_, gpu_);
    move(batch.block_copies, batch.num_block_copies, gpu_, gpu_);
    for (int32_t i = 0; i < batch.num_tokens; ++i) {
      gpu_[batch.slot_mapping[i]] = (int64_t(batch.positions[i]) << 32) | batch.input_ids[i];
    }
    std::vector<TokenId> sampled(batch.num_samples);
    for (int32_t k = 0; k < batch.num_samples; ++k) {
      // The sample's history is that of the row holding its token: for samples
      // 1..n-1 of a parent's first step, the parent (the children don't exist yet).
      const int32_t idx = batch.sample_indices[k];
      const int32_t* qsl = batch.query_start_loc;
      const int32_t r = int32_t(std::upper_bound(qsl, qsl + batch.num_seqs + 1, idx) - qsl) - 1;
      if (idx != qsl[r + 1] - 1) fail("sample index is not the last token of its row");
      const std::vector<TokenId> history = read_kv(batch, r);
      if (history != engine.seq_token_ids(batch.seq_ids[r])) {
        fail("KV read through block table of seq " + std::to_string(batch.seq_ids[r]) +
             " differs from its tokens: paging bug");
      }
      const SeqId sid = batch.sample_seq_ids[k];
      auto it = std::prev(first_ids.upper_bound(sid));
      sampled[k] = fake_model(history, int32_t(sid - it->first));
    }
    return sampled;
  }

 private:
  void move(const int32_t* pairs, int32_t n, const std::vector<int64_t>& from,
            std::vector<int64_t>& to) {
    for (int32_t i = 0; i < n; ++i) {
      std::copy_n(from.begin() + size_t(pairs[2 * i]) * bs_, bs_,
                  to.begin() + size_t(pairs[2 * i + 1]) * bs_);
    }
  }
  // Tokens 0 .. seq_lens[r]-1 of row r, read through its block table.
  std::vector<TokenId> read_kv(const StepBatch& batch, int32_t r) const {
    std::vector<TokenId> out;
    const int32_t* table = batch.block_tables + size_t(r) * batch.max_blocks_per_seq;
    for (int32_t p = 0; p < batch.seq_lens[r]; ++p) {
      const int64_t v = gpu_[size_t(table[p / bs_]) * bs_ + p % bs_];
      if (v == kUnwritten || (v >> 32) != p) {
        fail("slot of position " + std::to_string(p) + " of seq " +
             std::to_string(batch.seq_ids[r]) + " holds stale KV");
      }
      out.push_back(TokenId(v & 0xffffffff));
    }
    return out;
  }

  int32_t bs_;
  std::vector<int64_t> gpu_, cpu_;
};

// Aborts a request and checks that every block reference it held is released.
void abort_and_check(Engine& engine, const std::string& id, SeqId first, int32_t n) {
  std::map<BlockId, int32_t> refs;  // block -> references held by this request
  for (SeqId s = first; s < first + n; ++s) {
    try {
      for (BlockId b : engine.seq_block_table(s)) ++refs[b];
    } catch (const NotFound&) {  // finished already (or never forked)
    }
  }
  // Blocks only this request references must become free; shared ones
  // (prefix-cache hits) just lose this request's references.
  std::map<BlockId, int32_t> before;
  int32_t expect_freed = 0;
  for (auto [b, r] : refs) expect_freed += (before[b] = engine.kv().gpu().ref_count(b)) == r;
  const int32_t free_before = engine.stats().num_free_blocks;
  engine.abort(id);
  for (auto [b, r] : refs) {
    if (engine.kv().gpu().ref_count(b) != before[b] - r) fail("abort left a reference on a block");
  }
  if (engine.stats().num_free_blocks != free_before + expect_freed) {
    fail("abort freed " + std::to_string(engine.stats().num_free_blocks - free_before) +
         " blocks, expected " + std::to_string(expect_freed));
  }
}

RunResult run_workload(const RunConfig& rc) {
  RunResult res;
  // Each preemption logs a warning; here they are expected, so keep stderr quiet.
  set_log_sink([](LogLevel, const std::string&) {});
  Engine engine(rc.engine);
  FakeRunner runner(engine);
  const std::vector<RequestSpec> specs = workload();
  std::map<SeqId, std::string> first_ids;
  SeqId abort_first = -1;
  bool aborted = false;
  size_t next = 0;
  for (int64_t step = 0; next < specs.size() || engine.has_unfinished_requests(); ++step) {
    if (step > 10000) fail("no progress after 10000 steps");
    // Arrivals are keyed to the step count, which differs between runs: that is
    // fine, outputs must not depend on timing either.
    for (; next < specs.size() && specs[next].arrive_at_step <= step; ++next) {
      const RequestSpec& s = specs[next];
      const SeqId first = engine.add_request(s.id, s.prompt, s.params);
      first_ids[first] = s.id;
      if (s.id == "abort-me") abort_first = first;
      res.outputs[s.id].resize(s.params.n);
    }
    if (!engine.has_unfinished_requests()) continue;
    const StepBatch& batch = engine.schedule();
    res.block_copies += batch.num_block_copies;
    res.swap_outs += batch.num_swap_out;
    res.swap_ins += batch.num_swap_in;
    const std::vector<TokenId> sampled = runner.run(engine, batch, first_ids);
    const StepResult& out = engine.update(sampled.data(), int32_t(sampled.size()));
    for (int32_t j = 0; j < out.num_outputs; ++j) {
      auto it = std::prev(first_ids.upper_bound(out.seq_ids[j]));
      res.outputs[it->second][out.seq_ids[j] - it->first].push_back(out.token_ids[j]);
    }
    res.completed.insert(out.finished_request_ids.begin(), out.finished_request_ids.end());
    engine.check_invariants();
    // Abort mid-run, once it has generated a few tokens (it may be running,
    // waiting or swapped out by then, depending on the run).
    if (!aborted && res.outputs["abort-me"][0].size() >= 5) {
      abort_and_check(engine, "abort-me", abort_first, int32_t(res.outputs["abort-me"].size()));
      aborted = true;
      engine.check_invariants();
    }
  }
  set_log_sink({});
  res.stats = engine.stats();
  const EngineStats& st = res.stats;
  auto expect = [&rc](bool ok, const std::string& what) {
    if (!ok) fail(std::string(rc.name) + ": " + what);
  };
  expect(aborted, "abort-me was never aborted");
  expect(st.num_free_blocks == st.num_blocks, "blocks leaked: " +
         std::to_string(st.num_free_blocks) + " free of " + std::to_string(st.num_blocks));
  expect(st.num_free_cpu_blocks == st.num_cpu_blocks, "CPU blocks leaked");
  expect(st.num_requests == 0 && st.num_running_seqs == 0 && st.num_waiting_seqs == 0,
         "requests left over");
  expect(res.block_copies > 0, "no copy-on-write block copies with n > 1");
  expect((st.num_preemptions > 0) == rc.expect_preemption,
         "num_preemptions = " + std::to_string(st.num_preemptions));
  if (rc.expect_preemption) {
    const bool swap = rc.engine.preemption_mode == PreemptionMode::kSwap;
    expect(swap ? st.num_swap_preemptions > 0 && res.swap_outs > 0 && res.swap_ins > 0
                : st.num_recompute_preemptions > 0,
           std::string("no ") + to_string(rc.engine.preemption_mode) + " preemptions");
  }
  return res;
}

std::string show(const std::vector<TokenId>& v, size_t max = 10) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < max; ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + (v.size() > max ? " ...] (" + std::to_string(v.size()) + " tokens)" : "]");
}

}  // namespace

int main() {
  // Roomy: plenty of blocks and no prefix caching (outputs must not depend on
  // caching either). Cramped: 16 blocks (the longest sequence alone needs 13),
  // prompts chunked by a 32-token budget, prefix caching on.
  auto config = [](int32_t num_blocks, PreemptionMode mode, int32_t num_cpu_blocks) {
    EngineConfig c;
    c.num_blocks = num_blocks, c.block_size = 8, c.max_num_seqs = 16, c.max_model_len = 128;
    c.vocab_size = kVocab, c.preemption_mode = mode, c.num_cpu_blocks = num_cpu_blocks;
    c.enable_prefix_caching = num_blocks < 1024;
    c.max_num_batched_tokens = num_blocks < 1024 ? 32 : 2048;
    return c;
  };
  const auto recompute = PreemptionMode::kRecompute, swap = PreemptionMode::kSwap;
  const std::vector<RunConfig> runs = {
      {"roomy", config(1024, recompute, 0), false},
      {"cramped-recompute", config(16, recompute, 0), true},
      {"cramped-swap", config(16, swap, 64), true},
      // A CPU pool too small at times: swap falls back to recompute.
      {"cramped-swap-tiny-cpu", config(16, swap, 6), true}};
  try {
    std::printf("pagedcore %s host example: %zu requests, fake model (vocab %d)\n",
                PAGEDCORE_VERSION_STRING, workload().size(), kVocab);
    std::vector<RunResult> results;
    for (const RunConfig& rc : runs) {
      results.push_back(run_workload(rc));
      const RunResult& r = results.back();
      std::printf("  %-22s blocks %4d  steps %3lld  preemptions %2lld (recompute %lld, swap %lld)"
                  "  CoW copies %lld  swap out/in %lld/%lld  prefix hits %.0f%%\n",
                  rc.name, r.stats.num_blocks, (long long)r.stats.num_steps,
                  (long long)r.stats.num_preemptions, (long long)r.stats.num_recompute_preemptions,
                  (long long)r.stats.num_swap_preemptions, (long long)r.block_copies,
                  (long long)r.swap_outs, (long long)r.swap_ins,
                  100 * r.stats.prefix_cache_hit_rate);
    }
    // Every run must complete the same requests with the same tokens.
    const RunResult& ref = results[0];
    for (size_t i = 1; i < results.size(); ++i) {
      if (results[i].completed != ref.completed) fail(std::string(runs[i].name) +
                                                      ": a different set of requests completed");
      for (const std::string& id : ref.completed) {
        const auto &want = ref.outputs.at(id), &got = results[i].outputs.at(id);
        for (size_t k = 0; k < want.size(); ++k) {
          if (got[k] != want[k]) fail(std::string(runs[i].name) + ": " + id + " sample " +
                                      std::to_string(k) + " gave " + show(got[k]) + ", not " +
                                      show(want[k]) + " as in the roomy run");
        }
      }
    }
    if (ref.completed.size() != workload().size() - 1 || ref.completed.count("abort-me")) {
      fail("expected every request but abort-me to complete");
    }
    std::printf("  %zu requests completed with identical outputs in all %zu runs; abort-me aborted\n",
                ref.completed.size(), runs.size());
    for (const char* id : {"par", "sys-b"}) {
      const auto& outs = ref.outputs.at(id);
      for (size_t k = 0; k < outs.size(); ++k) {
        std::printf("  %-6s sample %zu: %s\n", id, k, show(outs[k]).c_str());
      }
    }
    std::printf("OK\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
}
