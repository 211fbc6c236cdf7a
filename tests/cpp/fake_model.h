// A fake model over a simulated paged KV cache, for the engine tests.
//
// The model owns a GPU pool (num_physical_blocks x block_size slots) and a CPU
// swap pool; each slot holds the token id and the position written there. It
// is driven only by the step batch, the way the model runner drives the real
// cache (python/pagedcore/model_runner.py): swap_out pairs, then swap_in pairs,
// then block_copies, then every scheduled token is written to its
// slot_mapping slot. Then every row's context is read back through its
// block-table row and must hold exactly the sequence's tokens at their
// positions (with a sliding window, only the positions the row's queries can
// see). The next token of a sample hashes the history read from the cache, so
// a corrupted history also changes the output.
//
// NOTE: a wrong swap or copy pair, a slot off by one, a stale block-table entry
// or a block released too early all pass a test that reads histories from
// Engine::seq_token_ids; they fail here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedcore/engine.h"

namespace pagedcore::testing {

// The next token of a history: a pure function of the history and of the
// sequence id (so the n samples of a request differ). Outputs therefore never
// depend on batching, chunking, preemption or caching.
inline TokenId fake_next_token(const std::vector<TokenId>& history, SeqId seq_id,
                               int32_t vocab = 1000) {
  uint64_t h = 1469598103934665603ULL ^ static_cast<uint64_t>(seq_id) * 0x9E3779B97F4A7C15ULL;
  for (TokenId t : history) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ULL;
  h ^= h >> 29;
  return static_cast<TokenId>(h % static_cast<uint64_t>(vocab));
}

// Index of the row (sequence) holding token `token_index` of the batch.
inline int32_t row_of_token(const StepBatch& b, int32_t token_index) {
  int32_t row = 0;
  while (b.query_start_loc[row + 1] <= token_index) ++row;
  return row;
}

// What the simulated cache found wrong; the message names the sequence, the
// position, the block and what the slot held.
class KVCacheMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class FakeModel {
 public:
  // What the runs exercised, so that a test can show it covered a path.
  struct Counts {
    int64_t steps = 0;
    int64_t swap_out = 0;      // pairs
    int64_t swap_in = 0;       // pairs
    int64_t copies = 0;        // block copies
    int64_t checked = 0;       // cached slots read back and found exact
    int64_t null_entries = 0;  // null block-table entries before a window
  };

  // The engine must outlive the model, and every batch it schedules from now
  // on must go through run() (the model has seen nothing before).
  explicit FakeModel(const Engine& engine)
      : engine_(engine),
        bs_(engine.config().block_size),
        window_(engine.config().sliding_window),
        vocab_(engine.config().vocab_size > 0 ? engine.config().vocab_size : 1000),
        gpu_(static_cast<size_t>(engine.num_physical_blocks()) * bs_),
        cpu_(static_cast<size_t>(engine.num_physical_cpu_blocks()) * bs_) {}

  // Runs the step b (just returned by the engine's schedule()) and returns one
  // next token per sample, in sample order. Throws KVCacheMismatch when a
  // block move, a slot or a block-table entry is out of range or when a cached
  // history is wrong.
  // Async scheduling: `previous` holds the samples of the step before (what a
  // runner keeps on the device); the deferred inputs of b take their ids from
  // it, as the model runner does, and the rows' histories are checked against
  // those ids where the engine still holds placeholders.
  std::vector<TokenId> run(const StepBatch& b, const std::vector<TokenId>* previous = nullptr) {
    if (b.block_size != bs_) fail("batch block_size " + std::to_string(b.block_size));
    move_blocks(b);
    deferred_.assign(b.num_tokens, kPlaceholderToken);
    for (int32_t j = 0; j < b.num_deferred_inputs; ++j) {
      const int32_t i = b.deferred_input_indices[j], k = b.deferred_input_samples[j];
      if (previous == nullptr || k < 0 || k >= static_cast<int32_t>(previous->size()) || i < 0 ||
          i >= b.num_tokens || b.input_ids[i] != 0) {
        fail("deferred input " + std::to_string(j) + " (token " + std::to_string(i) + ", sample " +
             std::to_string(k) + ") has no sampled id to take");
      }
      deferred_[i] = (*previous)[k];
    }
    write_tokens(b);
    for (int32_t r = 0; r < b.num_seqs; ++r) check_row(b, r);
    std::vector<TokenId> sampled(b.num_samples);
    std::vector<TokenId> history;
    for (int32_t k = 0; k < b.num_samples; ++k) {
      const int32_t r = row_of_token(b, b.sample_indices[k]);
      const int32_t last = b.positions[b.sample_indices[k]];
      if (last != b.seq_lens[r] - 1) fail("sample " + std::to_string(k) + " is not its row's last token");
      history.clear();
      for (int32_t q = first_visible(last); q <= last; ++q) history.push_back(slot(b, r, q).token);
      // A parent awaiting its fork stands for all its samples; each sample's
      // own id picks its token.
      sampled[k] = fake_next_token(history, b.sample_seq_ids[k], vocab_);
    }
    // NOTE: only now, after this step's reads: a block the schedule() freed may
    // still be the source of one of this step's swap-outs or copies.
    poison_free_blocks();
    ++counts_.steps;
    return sampled;
  }

  const Counts& counts() const { return counts_; }

 private:
  struct Slot {
    TokenId token = -1;
    int32_t pos = -1;
  };

  [[noreturn]] static void fail(const std::string& what) { throw KVCacheMismatch("KV cache: " + what); }

  int32_t first_visible(int32_t query_pos) const {
    return window_ > 0 ? std::max(0, query_pos - window_ + 1) : 0;
  }

  void move_block(std::vector<Slot>& from, int32_t src, std::vector<Slot>& to, int32_t dst) {
    std::copy_n(from.begin() + static_cast<std::ptrdiff_t>(src) * bs_, bs_,
                to.begin() + static_cast<std::ptrdiff_t>(dst) * bs_);
  }

  void check_block(int32_t block, int32_t num_blocks, const char* what) const {
    if (block < 1 || block > num_blocks) fail(std::string(what) + " block " + std::to_string(block));
  }

  void move_blocks(const StepBatch& b) {
    const int32_t nb = engine_.config().num_blocks, ncpu = engine_.config().num_cpu_blocks;
    for (int32_t i = 0; i < b.num_swap_out; ++i) {
      check_block(b.swap_out[2 * i], nb, "swap_out GPU");
      check_block(b.swap_out[2 * i + 1], ncpu, "swap_out CPU");
      move_block(gpu_, b.swap_out[2 * i], cpu_, b.swap_out[2 * i + 1]);
    }
    for (int32_t i = 0; i < b.num_swap_in; ++i) {
      check_block(b.swap_in[2 * i], ncpu, "swap_in CPU");
      check_block(b.swap_in[2 * i + 1], nb, "swap_in GPU");
      move_block(cpu_, b.swap_in[2 * i], gpu_, b.swap_in[2 * i + 1]);
    }
    for (int32_t i = 0; i < b.num_block_copies; ++i) {
      check_block(b.block_copies[2 * i], nb, "copy source");
      check_block(b.block_copies[2 * i + 1], nb, "copy destination");
      if (b.block_copies[2 * i] == b.block_copies[2 * i + 1]) fail("copy of a block onto itself");
      move_block(gpu_, b.block_copies[2 * i], gpu_, b.block_copies[2 * i + 1]);
    }
    counts_.swap_out += b.num_swap_out;
    counts_.swap_in += b.num_swap_in;
    counts_.copies += b.num_block_copies;
  }

  void write_tokens(const StepBatch& b) {
    const int64_t num_slots = static_cast<int64_t>(engine_.config().num_blocks + 1) * bs_;
    for (int32_t i = 0; i < b.num_tokens; ++i) {
      const int32_t s = b.slot_mapping[i];
      if (s < bs_ || s >= num_slots) fail("token " + std::to_string(i) + " maps to slot " + std::to_string(s));
      const TokenId id = deferred_[i] != kPlaceholderToken ? deferred_[i] : b.input_ids[i];
      gpu_[s] = {id, b.positions[i]};
    }
  }

  // The slot holding position q of row r, found through the row's block table.
  const Slot& slot(const StepBatch& b, int32_t r, int32_t q) const {
    const BlockId block = b.block_tables[static_cast<size_t>(r) * b.max_blocks_per_seq + q / bs_];
    if (block < 1 || block > engine_.config().num_blocks) {
      fail("seq " + std::to_string(b.seq_ids[r]) + " position " + std::to_string(q) +
           " reads block-table entry " + std::to_string(block));
    }
    return gpu_[static_cast<size_t>(block) * bs_ + q % bs_];
  }

  // Every position row r's queries can see holds the sequence's token there.
  void check_row(const StepBatch& b, int32_t r) {
    const SeqId seq = b.seq_ids[r];
    const std::vector<TokenId>& tokens = engine_.seq_token_ids(seq);
    const int32_t len = b.seq_lens[r];
    if (len > static_cast<int32_t>(tokens.size())) {
      fail("seq " + std::to_string(seq) + " seq_len " + std::to_string(len) + " beyond its " +
           std::to_string(tokens.size()) + " tokens");
    }
    // NOTE: the first query of the row, at num_computed_tokens, sees the
    // earliest positions; blocks wholly before its window may be released.
    const int32_t lo = first_visible(b.num_computed_tokens[r]);
    const BlockId* row = b.block_tables + static_cast<size_t>(r) * b.max_blocks_per_seq;
    for (int32_t i = 0; i < lo / bs_; ++i) counts_.null_entries += row[i] == kNullBlock;
    // A deferred input (the row's one token) is not known to the engine yet.
    const int32_t first = b.query_start_loc[r];
    const TokenId deferred = b.query_start_loc[r + 1] - first == 1 ? deferred_[first] : kPlaceholderToken;
    for (int32_t q = lo; q < len; ++q) {
      const Slot& s = slot(b, r, q);
      const TokenId expected = q == len - 1 && deferred != kPlaceholderToken ? deferred : tokens[q];
      if (expected == kPlaceholderToken) {
        fail("seq " + std::to_string(seq) + " position " + std::to_string(q) +
             " is computed as a placeholder (not a deferred input)");
      }
      if (s.token != expected || s.pos != q) {
        fail("seq " + std::to_string(seq) + " position " + std::to_string(q) + " (block " +
             std::to_string(row[q / bs_]) + ", offset " + std::to_string(q % bs_) + ") holds token " +
             std::to_string(s.token) + " of position " + std::to_string(s.pos) + ", expected token " +
             std::to_string(expected));
      }
    }
    counts_.checked += std::max(0, len - lo);
  }

  // Free blocks without registered content hold nothing anyone may read
  // again: fill them with garbage, so that reading one (a dropped swap-in, an
  // early release) cannot find the old content still there by luck.
  void poison_free_blocks() {
    const BlockAllocator& gpu = engine_.kv().gpu();
    for (BlockId id = 1; id <= gpu.num_blocks(); ++id) {
      if (gpu.ref_count(id) == 0 && !gpu.is_registered(id)) poison(gpu_, id);
    }
    const BlockAllocator& cpu = engine_.kv().cpu();
    for (BlockId id = 1; id <= cpu.num_blocks(); ++id) {
      if (cpu.ref_count(id) == 0 && !cpu.is_registered(id)) poison(cpu_, id);
    }
  }

  void poison(std::vector<Slot>& pool, BlockId id) {
    std::fill_n(pool.begin() + static_cast<std::ptrdiff_t>(id) * bs_, bs_, Slot{-7, -7});
  }

  const Engine& engine_;
  const int32_t bs_, window_, vocab_;
  std::vector<Slot> gpu_, cpu_;  // [num physical blocks * block_size] of each pool
  std::vector<TokenId> deferred_;  // [num_tokens] of the step: the id a deferred input took
  Counts counts_;
};

}  // namespace pagedcore::testing
