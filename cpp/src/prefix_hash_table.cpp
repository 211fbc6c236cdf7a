#include "pagedcore/prefix_hash_table.h"

#include <cstring>

#include "check.h"

namespace pagedcore {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// A strong 64-bit finalizer (xor-shift / multiply rounds).
inline uint64_t avalanche(uint64_t x) {
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  return x;
}

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

}  // namespace

uint64_t hash_block_tokens(uint64_t parent_hash, const TokenId* tokens, int32_t num_tokens,
                           uint64_t extra_key) {
  uint64_t h = avalanche(parent_hash ^ kGolden);
  h = avalanche(h ^ (extra_key + kGolden * 3));
  int32_t i = 0;
  // Two tokens per 64-bit lane.
  for (; i + 1 < num_tokens; i += 2) {
    uint64_t lane = static_cast<uint32_t>(tokens[i]) |
                    (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = rotl(h ^ (lane * kGolden), 27) * 0xC2B2AE3D27D4EB4FULL + 0x165667B19E3779F9ULL;
  }
  if (i < num_tokens) {
    uint64_t lane = static_cast<uint32_t>(tokens[i]) | (uint64_t{1} << 63);
    h = rotl(h ^ (lane * kGolden), 27) * 0xC2B2AE3D27D4EB4FULL + 0x165667B19E3779F9ULL;
  }
  return avalanche(h ^ static_cast<uint64_t>(num_tokens));
}

PrefixHashTable::PrefixHashTable(int32_t max_entries) : max_entries_(max_entries) {
  PAGEDCORE_CHECK(max_entries >= 0, "max_entries ", max_entries);
  size_t slots = 16;
  while (slots < 2 * static_cast<size_t>(max_entries)) slots *= 2;
  keys_.assign(slots, 0);
  values_.assign(slots, kNoBlock);
  mask_ = slots - 1;
}

size_t PrefixHashTable::slot_of(uint64_t hash) const {
  // The hash may have been truncated to few bits (tests force collisions that
  // way); spread it before taking the low bits.
  return static_cast<size_t>(avalanche(hash)) & mask_;
}

BlockId PrefixHashTable::find(uint64_t hash) const {
  for (size_t s = slot_of(hash);; s = (s + 1) & mask_) {
    if (values_[s] == kNoBlock) return kNoBlock;
    if (keys_[s] == hash) return values_[s];
  }
}

void PrefixHashTable::insert(uint64_t hash, BlockId block) {
  PAGEDCORE_CHECK(size_ < max_entries_, "prefix hash table full (", size_, " entries)");
  PAGEDCORE_CHECK(block >= 0, "invalid block ", block);
  size_t s = slot_of(hash);
  for (; values_[s] != kNoBlock; s = (s + 1) & mask_) {
    PAGEDCORE_CHECK(keys_[s] != hash, "hash already present (block ", values_[s], ")");
  }
  keys_[s] = hash;
  values_[s] = block;
  ++size_;
}

void PrefixHashTable::erase(uint64_t hash, BlockId block) {
  size_t s = slot_of(hash);
  while (true) {
    PAGEDCORE_CHECK(values_[s] != kNoBlock, "erase of a hash that is not present");
    if (keys_[s] == hash) break;
    s = (s + 1) & mask_;
  }
  PAGEDCORE_CHECK(values_[s] == block, "hash maps to block ", values_[s], ", not ", block);
  // Backward-shift deletion: pull later entries of the probe run into the hole
  // when their home slot does not lie strictly between the hole and them.
  size_t hole = s;
  for (size_t j = (hole + 1) & mask_; values_[j] != kNoBlock; j = (j + 1) & mask_) {
    const size_t home = slot_of(keys_[j]);
    const bool home_in_gap = ((j - home) & mask_) < ((j - hole) & mask_);
    if (!home_in_gap) {
      keys_[hole] = keys_[j];
      values_[hole] = values_[j];
      hole = j;
    }
  }
  values_[hole] = kNoBlock;
  keys_[hole] = 0;
  --size_;
}

}  // namespace pagedcore
