#include "pagedcore/prefix_hash_table.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "pagedcore/errors.h"

namespace pagedcore {
namespace {

TEST(HashBlockTokens, DependsOnEveryInput) {
  const std::vector<TokenId> a = {1, 2, 3, 4};
  std::vector<TokenId> b = a;
  b[3] = 5;
  const uint64_t h = hash_block_tokens(kRootBlockHash, a.data(), 4, 0);
  EXPECT_EQ(h, hash_block_tokens(kRootBlockHash, a.data(), 4, 0));
  EXPECT_NE(h, hash_block_tokens(kRootBlockHash, b.data(), 4, 0));
  EXPECT_NE(h, hash_block_tokens(kRootBlockHash + 1, a.data(), 4, 0));
  EXPECT_NE(h, hash_block_tokens(kRootBlockHash, a.data(), 4, 7));
  EXPECT_NE(h, hash_block_tokens(kRootBlockHash, a.data(), 3, 0));
}

TEST(PrefixHashTable, InsertFindErase) {
  PrefixHashTable t(4);
  EXPECT_EQ(t.find(42), kNoBlock);
  t.insert(42, 1);
  t.insert(43, 2);
  EXPECT_EQ(t.find(42), 1);
  EXPECT_EQ(t.find(43), 2);
  EXPECT_EQ(t.size(), 2);
  EXPECT_THROW(t.insert(42, 3), InternalError);
  EXPECT_THROW(t.erase(42, 2), InternalError);  // maps to 1, not 2
  t.erase(42, 1);
  EXPECT_EQ(t.find(42), kNoBlock);
  EXPECT_EQ(t.find(43), 2);
  EXPECT_THROW(t.erase(42, 1), InternalError);
}

TEST(PrefixHashTable, FullTableRefusesInsert) {
  PrefixHashTable t(2);
  t.insert(1, 1);
  t.insert(2, 2);
  EXPECT_THROW(t.insert(3, 3), InternalError);
}

// Random inserts and erases against std::map, with keys drawn from a small
// range so probe runs collide and backward-shift deletion is exercised.
TEST(PrefixHashTable, MatchesReferenceMapUnderChurn) {
  const int32_t capacity = 300;
  PrefixHashTable t(capacity);
  std::map<uint64_t, BlockId> ref;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 20000; ++step) {
    const uint64_t key = rng() % 600;
    auto it = ref.find(key);
    if (it != ref.end() && (rng() % 2 == 0)) {
      t.erase(key, it->second);
      ref.erase(it);
    } else if (it == ref.end() && static_cast<int32_t>(ref.size()) < capacity) {
      const BlockId value = static_cast<BlockId>(rng() % 1000);
      t.insert(key, value);
      ref[key] = value;
    }
    if (step % 97 == 0) {
      for (uint64_t k = 0; k < 600; ++k) {
        auto r = ref.find(k);
        ASSERT_EQ(t.find(k), r == ref.end() ? kNoBlock : r->second) << "key " << k;
      }
    }
  }
  EXPECT_EQ(t.size(), static_cast<int32_t>(ref.size()));
}

}  // namespace
}  // namespace pagedcore
