#include "pagedcore/block_allocator.h"

#include <algorithm>

#include "check.h"

namespace pagedcore {

BlockAllocator::BlockAllocator(int32_t num_blocks, int32_t block_size, bool enable_caching,
                               int32_t hash_bits)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      enable_caching_(enable_caching),
      hash_mask_(hash_bits >= 64 ? ~uint64_t{0} : ((uint64_t{1} << hash_bits) - 1)),
      free_(num_blocks + 1),
      table_(enable_caching ? num_blocks : 0),
      ref_(num_blocks + 1, 0),
      hash_(num_blocks + 1, 0),
      epoch_(num_blocks + 1, kRootEpoch),
      parent_epoch_(num_blocks + 1, kRootEpoch),
      extra_key_(num_blocks + 1, 0),
      tokens_(enable_caching ? static_cast<size_t>(num_blocks + 1) * block_size : 0) {
  PAGEDCORE_CHECK(num_blocks >= 0 && block_size >= 1, "num_blocks ", num_blocks, " block_size ",
                  block_size);
  PAGEDCORE_CHECK(hash_bits >= 0 && hash_bits <= 64, "hash_bits ", hash_bits);
  // NOTE: the null block is owned forever and never queued, so nothing can
  // hand it out; its ref count stays at 1 and incref/decref ignore it.
  ref_[kNullBlock] = 1;
  for (BlockId id = 1; id <= num_blocks; ++id) free_.push_back(id);
}

void BlockAllocator::evict(BlockId id) {
  table_.erase(hash_[id], id);
  epoch_[id] = kRootEpoch;
  parent_epoch_[id] = kRootEpoch;
  --num_cached_free_;
}

BlockId BlockAllocator::allocate() {
  PAGEDCORE_CHECK(!free_.empty(), "allocate() with no free block");
  const BlockId id = free_.pop_front();
  if (is_registered(id)) evict(id);
  PAGEDCORE_DCHECK(ref_[id] == 0, "free block ", id, " has ref count ", ref_[id]);
  ref_[id] = 1;
  return id;
}

void BlockAllocator::incref(BlockId id) {
  if (id == kNullBlock) return;
  PAGEDCORE_CHECK(id > 0 && id <= num_blocks_, "block id ", id, " out of range");
  if (ref_[id] == 0) {
    // Revival of a cached block by a prefix hit.
    PAGEDCORE_CHECK(is_registered(id), "incref of free block ", id, " that holds no content");
    free_.remove(id);
    --num_cached_free_;
  }
  ++ref_[id];
}

void BlockAllocator::decref(BlockId id) {
  if (id == kNullBlock) return;
  PAGEDCORE_CHECK(id > 0 && id <= num_blocks_, "block id ", id, " out of range");
  PAGEDCORE_CHECK(ref_[id] > 0, "decref of free block ", id);
  if (--ref_[id] > 0) return;
  if (is_registered(id)) {
    free_.push_back(id);
    ++num_cached_free_;
  } else {
    free_.push_front(id);
  }
}

void BlockAllocator::free_chain(const BlockId* ids, int32_t n) {
  for (int32_t i = n - 1; i >= 0; --i) decref(ids[i]);
}

uint64_t BlockAllocator::hash_block(uint64_t parent_hash, const TokenId* tokens,
                                    uint64_t extra_key) const {
  return hash_block_tokens(parent_hash, tokens, block_size_, extra_key) & hash_mask_;
}

bool BlockAllocator::content_matches(BlockId id, const TokenId* tokens, uint64_t extra_key,
                                     uint64_t parent_epoch) const {
  if (parent_epoch_[id] != parent_epoch || extra_key_[id] != extra_key) return false;
  const TokenId* stored = tokens_.data() + static_cast<size_t>(id) * block_size_;
  return std::equal(stored, stored + block_size_, tokens);
}

BlockId BlockAllocator::lookup(uint64_t hash, const TokenId* tokens, uint64_t extra_key,
                               uint64_t parent_epoch) const {
  if (!enable_caching_ || parent_epoch == kNoEpoch) return kNoBlock;
  const BlockId id = table_.find(hash);
  if (id == kNoBlock || !content_matches(id, tokens, extra_key, parent_epoch)) return kNoBlock;
  return id;
}

uint64_t BlockAllocator::register_block(BlockId id, uint64_t hash, const TokenId* tokens,
                                        uint64_t extra_key, uint64_t parent_epoch) {
  PAGEDCORE_CHECK(enable_caching_, "register_block with prefix caching disabled");
  PAGEDCORE_CHECK(id > 0 && id <= num_blocks_ && ref_[id] >= 1, "register of block ", id,
                  " that is not owned");
  PAGEDCORE_CHECK(!is_registered(id), "block ", id, " is already registered");
  if (parent_epoch == kNoEpoch) return kNoEpoch;
  const BlockId existing = table_.find(hash);
  if (existing != kNoBlock) {
    return content_matches(existing, tokens, extra_key, parent_epoch) ? epoch_[existing]
                                                                       : kNoEpoch;
  }
  table_.insert(hash, id);
  hash_[id] = hash;
  epoch_[id] = next_epoch_++;
  parent_epoch_[id] = parent_epoch;
  extra_key_[id] = extra_key;
  std::copy(tokens, tokens + block_size_, tokens_.data() + static_cast<size_t>(id) * block_size_);
  return epoch_[id];
}

void BlockAllocator::check_consistency() const {
  PAGEDCORE_CHECK(ref_[kNullBlock] == 1 && !free_.contains(kNullBlock), "null block state");
  int32_t queued = 0;
  int32_t cached = 0;
  bool seen_cached = false;
  for (BlockId b = free_.front(); b != kNoBlock; b = free_.next(b)) {
    ++queued;
    PAGEDCORE_CHECK(queued <= num_blocks_, "free queue longer than the pool (cycle?)");
    PAGEDCORE_CHECK(ref_[b] == 0, "block ", b, " is free but has ref count ", ref_[b]);
    if (is_registered(b)) {
      ++cached;
      seen_cached = true;
    } else {
      // NOTE: blocks with no content sit before every cached block, so that
      // allocate() takes them before it evicts anything.
      PAGEDCORE_CHECK(!seen_cached, "uncached block ", b, " after a cached block in the queue");
    }
  }
  PAGEDCORE_CHECK(queued == free_.size(), "free queue size ", free_.size(), " but ", queued,
                  " linked");
  PAGEDCORE_CHECK(cached == num_cached_free_, "cached count ", num_cached_free_, " but ", cached,
                  " cached blocks queued");
  int32_t owned = 0;
  int32_t registered = 0;
  for (BlockId b = 1; b <= num_blocks_; ++b) {
    PAGEDCORE_CHECK(ref_[b] >= 0, "block ", b, " has negative ref count");
    if (ref_[b] > 0) {
      ++owned;
      PAGEDCORE_CHECK(!free_.contains(b), "block ", b, " is both owned and free");
    } else {
      PAGEDCORE_CHECK(free_.contains(b), "block ", b, " has ref count 0 but is not free");
    }
    if (is_registered(b)) {
      ++registered;
      PAGEDCORE_CHECK(table_.find(hash_[b]) == b, "registered block ", b,
                      " is not found under its hash");
    }
  }
  PAGEDCORE_CHECK(owned + queued == num_blocks_, "owned ", owned, " + free ", queued,
                  " != num_blocks ", num_blocks_);
  PAGEDCORE_CHECK(registered == table_.size(), "table has ", table_.size(),
                  " entries, blocks say ", registered);
}

}  // namespace pagedcore
