// Content hashing of full blocks and the table from hash to cached block.
//
// A block's hash covers its parent's hash (so it identifies the whole prefix),
// its tokens and an extra key (the request's cache salt). The table keeps at most
// one block per hash; it is open addressing with linear probing and
// backward-shift deletion, sized once for every block of the pool, so inserting
// and erasing never allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedcore/types.h"

namespace pagedcore {

// 64-bit hash of one block. `parent_hash` is the previous block's hash, or
// kRootBlockHash for the first block of a sequence.
uint64_t hash_block_tokens(uint64_t parent_hash, const TokenId* tokens, int32_t num_tokens,
                           uint64_t extra_key);

inline constexpr uint64_t kRootBlockHash = 0x243F6A8885A308D3ULL;  // digits of pi

class PrefixHashTable {
 public:
  // Room for max_entries entries; the slot array is a power of two >= 2x that.
  explicit PrefixHashTable(int32_t max_entries);

  // The block stored under `hash`, or kNoBlock.
  BlockId find(uint64_t hash) const;
  // Precondition: find(hash) == kNoBlock and size() < max_entries.
  void insert(uint64_t hash, BlockId block);
  // Precondition: find(hash) == block.
  void erase(uint64_t hash, BlockId block);
  int32_t size() const { return size_; }

 private:
  size_t slot_of(uint64_t hash) const;

  std::vector<uint64_t> keys_;
  std::vector<BlockId> values_;  // kNoBlock marks an empty slot
  size_t mask_;
  int32_t max_entries_;
  int32_t size_ = 0;
};

}  // namespace pagedcore
