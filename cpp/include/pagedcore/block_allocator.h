// Fixed pool of KV-cache blocks with reference counts and a prefix cache.
//
// Block 0 is the null block; ids 1..num_blocks are handed out. A block is in
// exactly one of two states:
//   free   ref count 0, linked in the free queue (possibly still cached);
//   owned  ref count >= 1, referenced by that many block-table entries.
//
// A full block whose KV has been computed can be registered under its content
// hash. When its last owner lets go it stays in the free queue, still
// registered ("cached"), until allocate() evicts it; a prefix-cache hit revives
// it instead. The free queue is ordered for eviction:
//   head: blocks with no content, then cached blocks, least recently freed first;
//   tail: most recently freed cached blocks.
// Callers free a sequence's blocks last block first (free_chain), so a chain's
// tail is evicted before its head: the head is what other prompts share.
//
// Registration is exact, not just by hash: each registration gets a unique
// epoch, and a block stores its tokens, the cache salt and its parent's epoch.
// A lookup matches only when all of them agree, so a hash collision is never
// served and a hit on block i implies the whole prefix up to i matches.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedcore/free_block_queue.h"
#include "pagedcore/prefix_hash_table.h"
#include "pagedcore/types.h"

namespace pagedcore {

// Epoch of "no parent" (the first block of a sequence).
inline constexpr uint64_t kRootEpoch = 0;
// Epoch of a block whose content could not be registered (hash collision);
// nothing chains after it.
inline constexpr uint64_t kNoEpoch = ~uint64_t{0};

class BlockAllocator {
 public:
  // hash_bits: how many low bits of the content hash to keep (64 in production).
  BlockAllocator(int32_t num_blocks, int32_t block_size, bool enable_caching,
                 int32_t hash_bits = 64);

  int32_t num_blocks() const { return num_blocks_; }              // usable blocks
  int32_t num_physical_blocks() const { return num_blocks_ + 1; }  // incl. the null block
  int32_t block_size() const { return block_size_; }
  bool caching_enabled() const { return enable_caching_; }
  // Free blocks, cached ones included (they are evicted on demand).
  int32_t num_free_blocks() const { return free_.size(); }
  // Free blocks that still hold registered content.
  int32_t num_cached_free_blocks() const { return num_cached_free_; }
  int32_t num_registered_blocks() const { return table_.size(); }

  // Takes the block at the head of the free queue (evicting its cached content,
  // if any) and returns it with ref count 1. Precondition: num_free_blocks() > 0.
  BlockId allocate();
  // Adds an owner. A free cached block is revived (unlinked from the free queue).
  // The null block is ignored.
  void incref(BlockId id);
  // Drops an owner. At zero the block joins the free queue: at the tail when it
  // holds registered content, at the head otherwise. The null block is ignored.
  void decref(BlockId id);
  // decref() on ids[n-1], ..., ids[0]: the order that evicts a chain tail first.
  void free_chain(const BlockId* ids, int32_t n);

  int32_t ref_count(BlockId id) const { return ref_[id]; }
  bool is_free(BlockId id) const { return free_.contains(id); }
  bool is_registered(BlockId id) const { return epoch_[id] != kRootEpoch; }
  const FreeBlockQueue& free_queue() const { return free_; }

  // Content hash of a block, truncated to hash_bits.
  uint64_t hash_block(uint64_t parent_hash, const TokenId* tokens, uint64_t extra_key) const;

  // The registered block holding exactly (tokens, extra_key) after the block of
  // parent_epoch, or kNoBlock. Does not change any state.
  BlockId lookup(uint64_t hash, const TokenId* tokens, uint64_t extra_key,
                 uint64_t parent_epoch) const;
  uint64_t epoch(BlockId id) const { return epoch_[id]; }

  // Registers owned, full, computed block `id` under `hash`, and returns the
  // epoch that identifies this content for the blocks that follow it:
  //   - the new epoch when the hash was free;
  //   - the epoch of the block already registered with identical content
  //     (a duplicate: `id` stays unregistered);
  //   - kNoEpoch on a hash collision with different content, or when
  //     parent_epoch is kNoEpoch (`id` stays unregistered).
  // Precondition: ref_count(id) >= 1 and !is_registered(id).
  uint64_t register_block(BlockId id, uint64_t hash, const TokenId* tokens, uint64_t extra_key,
                          uint64_t parent_epoch);

  // Walks every block and throws InternalError when the free queue, the ref
  // counts, the cached count and the hash table disagree. O(num_blocks).
  void check_consistency() const;

 private:
  bool content_matches(BlockId id, const TokenId* tokens, uint64_t extra_key,
                       uint64_t parent_epoch) const;
  void evict(BlockId id);

  int32_t num_blocks_;
  int32_t block_size_;
  bool enable_caching_;
  uint64_t hash_mask_;
  uint64_t next_epoch_ = 1;
  int32_t num_cached_free_ = 0;

  FreeBlockQueue free_;
  PrefixHashTable table_;
  // Per physical block.
  std::vector<int32_t> ref_;
  std::vector<uint64_t> hash_;
  std::vector<uint64_t> epoch_;         // kRootEpoch (0) when not registered
  std::vector<uint64_t> parent_epoch_;
  std::vector<uint64_t> extra_key_;
  std::vector<TokenId> tokens_;         // [num_physical_blocks, block_size]
};

}  // namespace pagedcore
