#include "pagedcore/kv_cache_manager.h"

#include <algorithm>

#include "check.h"

namespace pagedcore {

void SeqBlocks::reserve(int32_t max_blocks) {
  block_table.reserve(max_blocks);
  block_hashes.reserve(max_blocks);
  block_epochs.reserve(max_blocks);
}

KVCacheManager::KVCacheManager(int32_t num_blocks, int32_t num_cpu_blocks, int32_t block_size,
                               bool enable_prefix_caching, int32_t sliding_window,
                               int32_t hash_bits)
    : block_size_(block_size),
      sliding_window_(sliding_window),
      gpu_(num_blocks, block_size, enable_prefix_caching, hash_bits),
      cpu_(num_cpu_blocks, block_size, /*enable_caching=*/false) {
  hits_.reserve(num_blocks + 1);
}

int32_t KVCacheManager::num_blocks_to_allocate(const SeqBlocks& seq, int32_t num_computed,
                                               int32_t num_new) const {
  const int32_t have = static_cast<int32_t>(seq.block_table.size());
  int32_t needed = std::max(0, blocks_for(num_computed + num_new) - have);
  if (num_new > 0 && num_computed % block_size_ != 0) {
    const BlockId partial = seq.block_table[num_computed / block_size_];
    if (gpu_.ref_count(partial) > 1) ++needed;
  }
  return needed;
}

void KVCacheManager::allocate_slots(SeqBlocks& seq, int32_t num_computed, int32_t num_new,
                                    std::vector<BlockPair>& copies) {
  PAGEDCORE_CHECK(!seq.swapped, "allocate_slots on a swapped-out sequence");
  PAGEDCORE_CHECK(static_cast<int32_t>(seq.block_table.size()) == blocks_for(num_computed),
                  "block table has ", seq.block_table.size(), " entries for ", num_computed,
                  " computed tokens");
  // NOTE: a debug check only: the caller has just asked can_allocate(), and
  // allocate() itself refuses (always-on) to hand out a block it does not have.
  PAGEDCORE_DCHECK(can_allocate(seq, num_computed, num_new), "allocate_slots without room");
  if (num_new > 0 && num_computed % block_size_ != 0) {
    // NOTE: a partially filled block shared with another sequence (after a
    // fork) must not be written in place: the other sequence's next tokens go
    // to the same slots. The writer takes a private copy; the last remaining
    // owner finds ref == 1 and writes in place.
    BlockId& partial = seq.block_table[num_computed / block_size_];
    if (gpu_.ref_count(partial) > 1) {
      const BlockId fresh = gpu_.allocate();
      copies.push_back({partial, fresh});
      gpu_.decref(partial);
      partial = fresh;
    }
  }
  const int32_t target = blocks_for(num_computed + num_new);
  while (static_cast<int32_t>(seq.block_table.size()) < target) {
    seq.block_table.push_back(gpu_.allocate());
  }
}

void KVCacheManager::fork(const SeqBlocks& parent, SeqBlocks& child) {
  PAGEDCORE_CHECK(!parent.swapped, "fork of a swapped-out sequence");
  PAGEDCORE_CHECK(child.block_table.empty() && !child.swapped, "fork into a sequence with blocks");
  child.block_table.assign(parent.block_table.begin(), parent.block_table.end());
  ++child.version;
  for (BlockId b : child.block_table) gpu_.incref(b);
  child.num_released = parent.num_released;
  child.block_hashes.assign(parent.block_hashes.begin(), parent.block_hashes.end());
  child.block_epochs.assign(parent.block_epochs.begin(), parent.block_epochs.end());
  child.num_chained = parent.num_chained;
}

void KVCacheManager::free(SeqBlocks& seq) {
  gpu_.free_chain(seq.block_table.data(), static_cast<int32_t>(seq.block_table.size()));
  seq.block_table.clear();
  cpu_.free_chain(seq.cpu_block_table.data(), static_cast<int32_t>(seq.cpu_block_table.size()));
  seq.cpu_block_table.clear();
  seq.swapped = false;
  seq.num_released = 0;
  ++seq.version;
}

void KVCacheManager::ensure_hashes(SeqBlocks& seq, const TokenId* tokens, int32_t num_full,
                                   uint64_t extra_key) const {
  while (static_cast<int32_t>(seq.block_hashes.size()) < num_full) {
    const size_t i = seq.block_hashes.size();
    const uint64_t parent = i == 0 ? kRootBlockHash : seq.block_hashes[i - 1];
    seq.block_hashes.push_back(gpu_.hash_block(parent, tokens + i * block_size_, extra_key));
    seq.block_epochs.push_back(kNoEpoch);
  }
}

int32_t KVCacheManager::lookup_prefix(SeqBlocks& seq, const TokenId* tokens, int32_t num_tokens,
                                      uint64_t extra_key, int32_t* num_revived) {
  PAGEDCORE_CHECK(seq.block_table.empty() && !seq.swapped, "lookup_prefix on a sequence with blocks");
  hits_.clear();
  *num_revived = 0;
  if (!gpu_.caching_enabled() || num_tokens < 1) return 0;
  // NOTE: never the whole prompt: the last token must run through the model to
  // give the logits of the first sampled token.
  const int32_t max_hits = (num_tokens - 1) / block_size_;
  ensure_hashes(seq, tokens, max_hits, extra_key);
  uint64_t parent_epoch = kRootEpoch;
  for (int32_t i = 0; i < max_hits; ++i) {
    const BlockId b =
        gpu_.lookup(seq.block_hashes[i], tokens + i * block_size_, extra_key, parent_epoch);
    if (b == kNoBlock) break;
    hits_.push_back(b);
    parent_epoch = gpu_.epoch(b);
  }
  const int32_t num_hits = static_cast<int32_t>(hits_.size());
  // NOTE: hits that commit_prefix drops (before the window) must not count,
  // or a long cached prefix could look bigger than the whole pool and the
  // request would never be admitted.
  for (int32_t i = std::min(num_dead_blocks(num_hits * block_size_), num_hits); i < num_hits; ++i) {
    if (gpu_.ref_count(hits_[i]) == 0) ++*num_revived;
  }
  return num_hits;
}

void KVCacheManager::commit_prefix(SeqBlocks& seq, int32_t num_hits) {
  PAGEDCORE_CHECK(num_hits >= 0 && num_hits <= static_cast<int32_t>(hits_.size()),
                  "commit of ", num_hits, " hits, lookup found ", hits_.size());
  PAGEDCORE_CHECK(seq.block_table.empty(), "commit_prefix on a sequence with blocks");
  ++seq.version;
  const int32_t dead = std::min(num_dead_blocks(num_hits * block_size_), num_hits);
  for (int32_t i = 0; i < num_hits; ++i) {
    seq.block_epochs[i] = gpu_.epoch(hits_[i]);
    if (i < dead) {
      seq.block_table.push_back(kNullBlock);
    } else {
      gpu_.incref(hits_[i]);
      seq.block_table.push_back(hits_[i]);
    }
  }
  seq.num_chained = num_hits;
  seq.num_released = dead;
}

void KVCacheManager::register_full_blocks(SeqBlocks& seq, const TokenId* tokens,
                                          int32_t num_computed, uint64_t extra_key) {
  if (!gpu_.caching_enabled()) return;
  const int32_t num_full = num_computed / block_size_;
  if (seq.num_chained >= num_full) return;
  ensure_hashes(seq, tokens, num_full, extra_key);
  for (int32_t i = seq.num_chained; i < num_full; ++i) {
    const uint64_t parent_epoch = i == 0 ? kRootEpoch : seq.block_epochs[i - 1];
    const BlockId b = seq.block_table[i];
    uint64_t epoch;
    if (b == kNullBlock) {
      epoch = kNoEpoch;
    } else if (gpu_.is_registered(b)) {
      epoch = gpu_.epoch(b);
    } else {
      epoch = gpu_.register_block(b, seq.block_hashes[i], tokens + i * block_size_, extra_key,
                                  parent_epoch);
    }
    seq.block_epochs[i] = epoch;
  }
  seq.num_chained = num_full;
}

int32_t KVCacheManager::num_dead_blocks(int32_t num_computed) const {
  if (sliding_window_ <= 0) return 0;
  // The earliest query still to come sits at position num_computed and sees
  // keys from num_computed - sliding_window + 1 on; blocks wholly before are dead.
  const int32_t first_visible = num_computed - sliding_window_ + 1;
  return first_visible <= 0 ? 0 : first_visible / block_size_;
}

int32_t KVCacheManager::release_out_of_window(SeqBlocks& seq, int32_t num_computed) {
  const int32_t first_kept = std::min<int32_t>(num_dead_blocks(num_computed),
                                               static_cast<int32_t>(seq.block_table.size()));
  int32_t released = 0;
  for (int32_t i = seq.num_released; i < first_kept; ++i) {
    gpu_.decref(seq.block_table[i]);
    seq.block_table[i] = kNullBlock;
    ++released;
  }
  seq.num_released = std::max(seq.num_released, first_kept);
  if (released > 0) ++seq.version;
  return released;
}

int32_t KVCacheManager::num_owned_gpu_blocks(const SeqBlocks& seq) const {
  return static_cast<int32_t>(
      std::count_if(seq.block_table.begin(), seq.block_table.end(),
                    [](BlockId b) { return b != kNullBlock; }));
}

void KVCacheManager::swap_out(SeqBlocks& seq, std::vector<BlockPair>& pairs) {
  PAGEDCORE_CHECK(!seq.swapped && can_swap_out(seq), "swap_out without room or twice");
  seq.cpu_block_table.clear();
  for (BlockId b : seq.block_table) {
    if (b == kNullBlock) {
      seq.cpu_block_table.push_back(kNullBlock);
    } else {
      const BlockId c = cpu_.allocate();
      pairs.push_back({b, c});
      seq.cpu_block_table.push_back(c);
    }
  }
  gpu_.free_chain(seq.block_table.data(), static_cast<int32_t>(seq.block_table.size()));
  seq.block_table.clear();
  seq.swapped = true;
  ++seq.version;
}

int32_t KVCacheManager::num_blocks_to_swap_in(const SeqBlocks& seq, int32_t num_computed,
                                              int32_t num_new) const {
  const int32_t have = static_cast<int32_t>(seq.cpu_block_table.size());
  int32_t needed = std::max(0, blocks_for(num_computed + num_new) - have);
  for (int32_t i = std::min(num_dead_blocks(num_computed), have); i < have; ++i) {
    if (seq.cpu_block_table[i] != kNullBlock) ++needed;
  }
  return needed;
}

void KVCacheManager::swap_in(SeqBlocks& seq, int32_t num_computed, std::vector<BlockPair>& pairs) {
  PAGEDCORE_CHECK(seq.swapped && seq.block_table.empty(), "swap_in of a sequence not swapped out");
  const int32_t dead = num_dead_blocks(num_computed);
  for (size_t i = 0; i < seq.cpu_block_table.size(); ++i) {
    const BlockId c = seq.cpu_block_table[i];
    if (c == kNullBlock || static_cast<int32_t>(i) < dead) {
      seq.block_table.push_back(kNullBlock);
    } else {
      const BlockId g = gpu_.allocate();
      pairs.push_back({c, g});
      seq.block_table.push_back(g);
    }
  }
  seq.num_released = std::max(seq.num_released,
                              std::min(dead, static_cast<int32_t>(seq.block_table.size())));
  cpu_.free_chain(seq.cpu_block_table.data(), static_cast<int32_t>(seq.cpu_block_table.size()));
  seq.cpu_block_table.clear();
  seq.swapped = false;
  ++seq.version;
}

}  // namespace pagedcore
