// Block tables of sequences over the GPU pool, with copy-on-write, prefix-cache
// lookup, sliding-window release and swapping to a CPU pool.
//
// The manager owns the two pools; each sequence owns a SeqBlocks (its block
// table and prefix-hash chain), which the manager reads and edits. Positions
// are token positions within the sequence; a sequence's KV for positions
// [0, num_computed) lives in blocks block_table[0 .. ceil(num_computed/bs)).
//
// Copy and swap instructions are appended to caller-provided lists; the caller
// (the model runner, through the engine's step batch) performs them before the
// forward pass of the step, in this order: swap out, swap in, copies.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedcore/block_allocator.h"
#include "pagedcore/types.h"

namespace pagedcore {

struct BlockPair {
  BlockId src;
  BlockId dst;
  friend bool operator==(const BlockPair& a, const BlockPair& b) {
    return a.src == b.src && a.dst == b.dst;
  }
};

// Per-sequence state the manager works on. Owned by the sequence.
struct SeqBlocks {
  // GPU blocks; kNullBlock where a block was released by the sliding window.
  std::vector<BlockId> block_table;
  // CPU blocks of a swapped-out sequence (same layout as block_table had);
  // block_table is empty while swapped.
  std::vector<BlockId> cpu_block_table;
  bool swapped = false;
  // Leading entries of block_table already released to the sliding window.
  int32_t num_released = 0;
  // Bumped by every change to block_table other than appending entries and
  // replacing the last one (copy-on-write): a copy of the table made at the
  // same version is still right except from its last entry on.
  uint32_t version = 0;
  // Prefix chain: hash and identity (epoch) of each full block seen so far.
  // They describe token content, so they stay valid across preemption.
  std::vector<uint64_t> block_hashes;
  std::vector<uint64_t> block_epochs;
  // Leading full blocks whose epoch has been set by a lookup or a registration.
  int32_t num_chained = 0;

  // Reserves room for max_blocks entries, so that allocating slots and
  // registering blocks never reallocate. (The CPU table is sized at swap-out:
  // preemption is not the steady state.)
  void reserve(int32_t max_blocks);
};

class KVCacheManager {
 public:
  // sliding_window: 0 for full attention.
  KVCacheManager(int32_t num_blocks, int32_t num_cpu_blocks, int32_t block_size,
                 bool enable_prefix_caching, int32_t sliding_window, int32_t hash_bits = 64);

  int32_t block_size() const { return block_size_; }
  BlockAllocator& gpu() { return gpu_; }
  const BlockAllocator& gpu() const { return gpu_; }
  const BlockAllocator& cpu() const { return cpu_; }

  // ---- allocation of slots ----------------------------------------------
  // Blocks allocate_slots(seq, num_computed, num_new) would take from the
  // free pool: new blocks plus one for copy-on-write of a shared partial block.
  int32_t num_blocks_to_allocate(const SeqBlocks& seq, int32_t num_computed,
                                 int32_t num_new) const;
  bool can_allocate(const SeqBlocks& seq, int32_t num_computed, int32_t num_new) const {
    return num_blocks_to_allocate(seq, num_computed, num_new) <= gpu_.num_free_blocks();
  }
  // Makes positions [num_computed, num_computed + num_new) writable by this
  // sequence alone. When the block holding position num_computed is shared
  // (ref > 1) and partially filled, it is replaced by a fresh copy and the pair
  // (shared, fresh) is appended to `copies` (copy-on-write).
  // Precondition: can_allocate(...) and block_table has exactly
  // ceil(num_computed / block_size) entries.
  void allocate_slots(SeqBlocks& seq, int32_t num_computed, int32_t num_new,
                      std::vector<BlockPair>& copies);

  // ---- sharing -------------------------------------------------------------
  // child gets every block of parent (ref++ each) and parent's prefix chain.
  // Precondition: child has no blocks.
  void fork(const SeqBlocks& parent, SeqBlocks& child);
  // Releases every GPU and CPU block of the sequence (last block first) and
  // clears its tables. The prefix chain is kept.
  void free(SeqBlocks& seq);

  // ---- prefix cache --------------------------------------------------------
  // Longest run of leading cached blocks that match tokens[0..), never covering
  // the last token (it is always computed, to produce logits). Hits are left in
  // hits() for commit_prefix(). Also fills seq's hash chain for the prompt.
  // Returns the number of hit blocks; *num_revived gets how many of them are
  // free (cached, ref 0) and would leave the free pool when committed: with a
  // sliding window, hits wholly before the window of the first computed token
  // are not taken (commit_prefix leaves them as null blocks), so they do not
  // count.
  // Precondition: seq has no blocks.
  int32_t lookup_prefix(SeqBlocks& seq, const TokenId* tokens, int32_t num_tokens,
                        uint64_t extra_key, int32_t* num_revived);
  // Takes the first num_hits blocks of the last lookup into seq's table (those
  // before the sliding window as kNullBlock, without a reference).
  void commit_prefix(SeqBlocks& seq, int32_t num_hits);
  const std::vector<BlockId>& hits() const { return hits_; }

  // Registers the full blocks of [0, num_computed) that are not chained yet.
  // Call after the KV of those tokens is (being) written. No-op without caching.
  void register_full_blocks(SeqBlocks& seq, const TokenId* tokens, int32_t num_computed,
                            uint64_t extra_key);

  // ---- sliding window ------------------------------------------------------
  // Releases blocks that lie wholly before the window of a query at position
  // num_computed (their entries become kNullBlock). Returns how many.
  int32_t release_out_of_window(SeqBlocks& seq, int32_t num_computed);

  // ---- swapping ------------------------------------------------------------
  int32_t num_owned_gpu_blocks(const SeqBlocks& seq) const;
  bool can_swap_out(const SeqBlocks& seq) const {
    return num_owned_gpu_blocks(seq) <= cpu_.num_free_blocks();
  }
  // Moves every GPU block of seq to a fresh CPU block; (gpu, cpu) pairs go to
  // `pairs`. The GPU blocks are released. Precondition: can_swap_out(seq).
  void swap_out(SeqBlocks& seq, std::vector<BlockPair>& pairs);
  // GPU blocks a swap-in of seq followed by allocate_slots(num_new) needs
  // (blocks that fell out of the sliding window are not brought back).
  int32_t num_blocks_to_swap_in(const SeqBlocks& seq, int32_t num_computed,
                                int32_t num_new) const;
  // Moves seq back to fresh GPU blocks; (cpu, gpu) pairs go to `pairs`. CPU
  // blocks wholly before the window of a query at num_computed are released
  // instead. Precondition: seq.swapped and enough free GPU blocks.
  void swap_in(SeqBlocks& seq, int32_t num_computed, std::vector<BlockPair>& pairs);

 private:
  // Leading blocks that no query at position >= num_computed can see.
  int32_t num_dead_blocks(int32_t num_computed) const;
  int32_t blocks_for(int32_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }
  // Extends the hash chain of seq to cover the first num_full full blocks.
  void ensure_hashes(SeqBlocks& seq, const TokenId* tokens, int32_t num_full,
                     uint64_t extra_key) const;

  int32_t block_size_;
  int32_t sliding_window_;
  BlockAllocator gpu_;
  BlockAllocator cpu_;
  std::vector<BlockId> hits_;  // scratch of the last lookup_prefix
};

}  // namespace pagedcore
