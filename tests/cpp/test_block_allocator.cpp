#include "pagedcore/block_allocator.h"

#include <gtest/gtest.h>

#include <vector>

#include "pagedcore/errors.h"

namespace pagedcore {
namespace {

std::vector<BlockId> free_order(const BlockAllocator& a) {
  std::vector<BlockId> out;
  for (BlockId b = a.free_queue().front(); b != kNoBlock; b = a.free_queue().next(b)) {
    out.push_back(b);
  }
  return out;
}

// Registers `id` as block i of a chain over `tokens` (block size 4).
uint64_t reg(BlockAllocator& a, BlockId id, const std::vector<TokenId>& tokens, uint64_t parent_hash,
             uint64_t parent_epoch, uint64_t* hash_out = nullptr, uint64_t salt = 0) {
  const uint64_t h = a.hash_block(parent_hash, tokens.data(), salt);
  if (hash_out) *hash_out = h;
  return a.register_block(id, h, tokens.data(), salt, parent_epoch);
}

TEST(BlockAllocator, HandsOutIdsInOrderAndNeverTheNullBlock) {
  BlockAllocator a(4, 4, true);
  EXPECT_EQ(a.num_blocks(), 4);
  EXPECT_EQ(a.num_physical_blocks(), 5);
  EXPECT_EQ(a.num_free_blocks(), 4);
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{1, 2, 3, 4}));
  std::vector<BlockId> got;
  for (int i = 0; i < 4; ++i) got.push_back(a.allocate());
  EXPECT_EQ(got, (std::vector<BlockId>{1, 2, 3, 4}));
  EXPECT_EQ(a.num_free_blocks(), 0);
  EXPECT_THROW(a.allocate(), InternalError);
  for (BlockId b : got) EXPECT_EQ(a.ref_count(b), 1);
  a.check_consistency();
}

TEST(BlockAllocator, RefCountsAndNullBlock) {
  BlockAllocator a(3, 4, true);
  const BlockId b = a.allocate();
  a.incref(b);
  a.incref(b);
  EXPECT_EQ(a.ref_count(b), 3);
  a.decref(b);
  a.decref(b);
  EXPECT_EQ(a.ref_count(b), 1);
  EXPECT_FALSE(a.is_free(b));
  a.decref(b);
  EXPECT_EQ(a.ref_count(b), 0);
  EXPECT_TRUE(a.is_free(b));
  EXPECT_THROW(a.decref(b), InternalError);
  // The null block is outside the game: incref/decref ignore it.
  a.incref(kNullBlock);
  a.decref(kNullBlock);
  a.decref(kNullBlock);
  EXPECT_EQ(a.ref_count(kNullBlock), 1);
  EXPECT_FALSE(a.is_free(kNullBlock));
  EXPECT_EQ(a.num_free_blocks(), 3);
  a.check_consistency();
}

TEST(BlockAllocator, UncachedFreedBlocksAreReusedFirst) {
  BlockAllocator a(4, 4, true);
  const BlockId b1 = a.allocate(), b2 = a.allocate(), b3 = a.allocate();
  EXPECT_EQ(b3, 3);
  a.decref(b2);
  // Block 2 holds nothing: it goes to the head, before never-used block 4.
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{2, 4}));
  EXPECT_EQ(a.allocate(), 2);
  a.decref(b1);
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{1, 4}));
  a.check_consistency();
}

TEST(BlockAllocator, CachedChainIsEvictedTailFirstAfterUncachedBlocks) {
  BlockAllocator a(4, 4, true);
  const std::vector<TokenId> t0 = {1, 2, 3, 4}, t1 = {5, 6, 7, 8}, t2 = {9, 10, 11, 12};
  const BlockId b0 = a.allocate(), b1 = a.allocate(), b2 = a.allocate();
  uint64_t h0, h1, h2;
  const uint64_t e0 = reg(a, b0, t0, kRootBlockHash, kRootEpoch, &h0);
  const uint64_t e1 = reg(a, b1, t1, h0, e0, &h1);
  const uint64_t e2 = reg(a, b2, t2, h1, e1, &h2);
  EXPECT_EQ(e0, 1u);
  EXPECT_EQ(e1, 2u);
  EXPECT_EQ(e2, 3u);
  EXPECT_EQ(a.num_registered_blocks(), 3);
  const std::vector<BlockId> chain = {b0, b1, b2};
  a.free_chain(chain.data(), 3);
  // Never-used block 4 first, then the chain from its tail to its head.
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{4, 3, 2, 1}));
  EXPECT_EQ(a.num_free_blocks(), 4);
  EXPECT_EQ(a.num_cached_free_blocks(), 3);
  a.check_consistency();

  EXPECT_EQ(a.allocate(), 4);  // no eviction
  EXPECT_EQ(a.num_registered_blocks(), 3);
  EXPECT_EQ(a.allocate(), 3);  // evicts the chain's tail
  EXPECT_EQ(a.num_registered_blocks(), 2);
  EXPECT_FALSE(a.is_registered(3));
  EXPECT_EQ(a.lookup(h2, t2.data(), 0, e1), kNoBlock);
  // The head of the chain is still there.
  EXPECT_EQ(a.lookup(h0, t0.data(), 0, kRootEpoch), b0);
  EXPECT_EQ(a.lookup(h1, t1.data(), 0, e0), b1);
  EXPECT_EQ(a.num_cached_free_blocks(), 2);
  a.check_consistency();
}

TEST(BlockAllocator, HitRevivesCachedBlockFromTheMiddleOfTheQueue) {
  BlockAllocator a(4, 4, true);
  const std::vector<TokenId> t0 = {1, 2, 3, 4}, t1 = {5, 6, 7, 8};
  const BlockId b0 = a.allocate(), b1 = a.allocate();
  uint64_t h0, h1;
  const uint64_t e0 = reg(a, b0, t0, kRootBlockHash, kRootEpoch, &h0);
  reg(a, b1, t1, h0, e0, &h1);
  const std::vector<BlockId> chain = {b0, b1};
  a.free_chain(chain.data(), 2);
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{3, 4, 2, 1}));
  const BlockId hit = a.lookup(h0, t0.data(), 0, kRootEpoch);
  ASSERT_EQ(hit, 1);
  a.incref(hit);  // revive
  EXPECT_EQ(a.ref_count(1), 1);
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{3, 4, 2}));
  EXPECT_EQ(a.num_cached_free_blocks(), 1);
  EXPECT_TRUE(a.is_registered(1));
  // Freed again: back to the tail, still registered.
  a.decref(hit);
  EXPECT_EQ(free_order(a), (std::vector<BlockId>{3, 4, 2, 1}));
  a.check_consistency();
}

TEST(BlockAllocator, MissesOnOtherTokensParentOrSalt) {
  BlockAllocator a(4, 4, true);
  const std::vector<TokenId> t0 = {1, 2, 3, 4}, t1 = {5, 6, 7, 8};
  const BlockId b0 = a.allocate(), b1 = a.allocate();
  uint64_t h0, h1;
  const uint64_t e0 = reg(a, b0, t0, kRootBlockHash, kRootEpoch, &h0);
  reg(a, b1, t1, h0, e0, &h1, /*salt=*/0);
  EXPECT_EQ(a.lookup(h1, t1.data(), 0, e0), b1);
  EXPECT_EQ(a.lookup(h1, t1.data(), 0, e0 + 100), kNoBlock);  // other parent
  EXPECT_EQ(a.lookup(h1, t1.data(), 9, e0), kNoBlock);        // other salt
  EXPECT_EQ(a.lookup(h1, t0.data(), 0, e0), kNoBlock);        // other tokens
  EXPECT_EQ(a.lookup(h1, t1.data(), 0, kNoEpoch), kNoBlock);  // broken chain
  EXPECT_EQ(a.lookup(h1 ^ 1, t1.data(), 0, e0), kNoBlock);    // other hash
}

TEST(BlockAllocator, ForcedHashCollisionIsNeverServed) {
  // hash_bits = 0: every block hashes to 0.
  BlockAllocator a(4, 4, true, /*hash_bits=*/0);
  const std::vector<TokenId> t0 = {1, 2, 3, 4}, other = {1, 2, 3, 5};
  const BlockId b0 = a.allocate(), b1 = a.allocate();
  uint64_t h0, h_other;
  const uint64_t e0 = reg(a, b0, t0, kRootBlockHash, kRootEpoch, &h0);
  EXPECT_EQ(h0, 0u);
  EXPECT_EQ(a.hash_block(kRootBlockHash, other.data(), 0), 0u);
  // Same hash, other tokens: a miss, never block b0.
  EXPECT_EQ(a.lookup(0, other.data(), 0, kRootEpoch), kNoBlock);
  // Registering the colliding content is refused: it stays unregistered and
  // nothing can chain after it.
  EXPECT_EQ(reg(a, b1, other, kRootBlockHash, kRootEpoch, &h_other), kNoEpoch);
  EXPECT_FALSE(a.is_registered(b1));
  EXPECT_EQ(a.lookup(0, t0.data(), 0, kRootEpoch), b0);
  EXPECT_EQ(e0, a.epoch(b0));
  a.check_consistency();
}

TEST(BlockAllocator, DuplicateContentKeepsTheFirstBlock) {
  BlockAllocator a(4, 4, true);
  const std::vector<TokenId> t0 = {1, 2, 3, 4};
  const BlockId b0 = a.allocate(), b1 = a.allocate();
  const uint64_t e0 = reg(a, b0, t0, kRootBlockHash, kRootEpoch);
  // Another sequence computed the same block independently: it learns the
  // canonical epoch, its own copy stays unregistered.
  EXPECT_EQ(reg(a, b1, t0, kRootBlockHash, kRootEpoch), e0);
  EXPECT_FALSE(a.is_registered(b1));
  EXPECT_EQ(a.num_registered_blocks(), 1);
  a.decref(b1);
  EXPECT_EQ(free_order(a).front(), b1);  // uncached: reused first
  a.check_consistency();
}

TEST(BlockAllocator, CachingDisabled) {
  BlockAllocator a(2, 4, false);
  const std::vector<TokenId> t0 = {1, 2, 3, 4};
  const BlockId b0 = a.allocate();
  EXPECT_THROW(a.register_block(b0, 1, t0.data(), 0, kRootEpoch), InternalError);
  EXPECT_EQ(a.lookup(1, t0.data(), 0, kRootEpoch), kNoBlock);
  a.decref(b0);
  EXPECT_EQ(a.num_cached_free_blocks(), 0);
}

}  // namespace
}  // namespace pagedcore
