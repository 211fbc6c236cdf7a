#include "pagedcore/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "pagedcore/errors.h"

namespace pagedcore {
namespace {

constexpr int32_t kPool = 64;

std::vector<BlockId> iota_blocks(BlockId first, int32_t n) {
  std::vector<BlockId> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<TokenId> tokens_upto(int32_t n, TokenId base = 100) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), base);
  return t;
}

struct CowCase {
  int32_t block_size;
  int32_t length;
};

class CopyOnWrite : public ::testing::TestWithParam<CowCase> {};

// Parent of `length` computed tokens forks; the child appends first, then the
// parent. A shared partial block is copied exactly once, by the first writer.
TEST_P(CopyOnWrite, ChildWritesFirst) {
  const auto [bs, len] = GetParam();
  KVCacheManager kv(kPool, 0, bs, /*prefix caching=*/false, /*sliding_window=*/0);
  const int32_t k = (len + bs - 1) / bs;
  const bool partial = len % bs != 0;
  SeqBlocks parent, child;
  std::vector<BlockPair> copies;
  kv.allocate_slots(parent, 0, len, copies);
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(parent.block_table, iota_blocks(1, k));
  EXPECT_EQ(kv.gpu().num_free_blocks(), kPool - k);

  kv.fork(parent, child);
  EXPECT_EQ(child.block_table, parent.block_table);
  for (BlockId b : parent.block_table) EXPECT_EQ(kv.gpu().ref_count(b), 2);
  EXPECT_EQ(kv.gpu().num_free_blocks(), kPool - k);

  // Child appends one token.
  EXPECT_EQ(kv.num_blocks_to_allocate(child, len, 1), 1);
  kv.allocate_slots(child, len, 1, copies);
  if (partial) {
    ASSERT_EQ(copies.size(), 1u);
    EXPECT_EQ(copies[0], (BlockPair{k, k + 1}));
    std::vector<BlockId> expect = iota_blocks(1, k);
    expect.back() = k + 1;
    EXPECT_EQ(child.block_table, expect);
    EXPECT_EQ(kv.gpu().ref_count(k), 1);  // the parent's alone now
  } else {
    EXPECT_TRUE(copies.empty());
    std::vector<BlockId> expect = iota_blocks(1, k);
    expect.push_back(k + 1);
    EXPECT_EQ(child.block_table, expect);
  }
  EXPECT_EQ(kv.gpu().num_free_blocks(), kPool - k - 1);

  // Parent appends one token: no copy either way.
  copies.clear();
  EXPECT_EQ(kv.num_blocks_to_allocate(parent, len, 1), partial ? 0 : 1);
  kv.allocate_slots(parent, len, 1, copies);
  EXPECT_TRUE(copies.empty());
  if (partial) {
    EXPECT_EQ(parent.block_table, iota_blocks(1, k));
    EXPECT_EQ(kv.gpu().num_free_blocks(), kPool - k - 1);
  } else {
    std::vector<BlockId> expect = iota_blocks(1, k);
    expect.push_back(k + 2);
    EXPECT_EQ(parent.block_table, expect);
    EXPECT_EQ(kv.gpu().num_free_blocks(), kPool - k - 2);
  }
  // Full blocks stay shared.
  for (int32_t i = 0; i < len / bs; ++i) EXPECT_EQ(kv.gpu().ref_count(i + 1), 2);

  kv.free(child);
  kv.free(parent);
  EXPECT_EQ(kv.gpu().num_free_blocks(), kPool);
  kv.gpu().check_consistency();
}

TEST_P(CopyOnWrite, ParentWritesFirst) {
  const auto [bs, len] = GetParam();
  KVCacheManager kv(kPool, 0, bs, false, 0);
  const int32_t k = (len + bs - 1) / bs;
  const bool partial = len % bs != 0;
  SeqBlocks parent, child;
  std::vector<BlockPair> copies;
  kv.allocate_slots(parent, 0, len, copies);
  kv.fork(parent, child);
  kv.allocate_slots(parent, len, 1, copies);
  if (partial) {
    ASSERT_EQ(copies.size(), 1u);
    EXPECT_EQ(copies[0], (BlockPair{k, k + 1}));
    EXPECT_EQ(parent.block_table.back(), k + 1);
    EXPECT_EQ(child.block_table.back(), k);
  } else {
    EXPECT_TRUE(copies.empty());
    EXPECT_EQ(parent.block_table.back(), k + 1);
  }
  copies.clear();
  kv.allocate_slots(child, len, 1, copies);
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(child.block_table.back(), partial ? k : k + 2);
  EXPECT_EQ(kv.gpu().num_free_blocks(), kPool - k - (partial ? 1 : 2));
  kv.free(parent);
  kv.free(child);
  EXPECT_EQ(kv.gpu().num_free_blocks(), kPool);
}

std::vector<CowCase> cow_cases() {
  std::vector<CowCase> cases;
  for (int32_t bs : {8, 16, 32}) {
    for (int32_t len : {1, 15, 16, 17, 129}) cases.push_back({bs, len});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Lengths, CopyOnWrite, ::testing::ValuesIn(cow_cases()),
                         [](const auto& info) {
                           return "bs" + std::to_string(info.param.block_size) + "_len" +
                                  std::to_string(info.param.length);
                         });

TEST(KVCacheManager, ThreeWaySharingCopiesTwice) {
  KVCacheManager kv(16, 0, 8, false, 0);
  SeqBlocks a, b, c;
  std::vector<BlockPair> copies;
  kv.allocate_slots(a, 0, 12, copies);  // blocks 1, 2 (2 partial)
  kv.fork(a, b);
  kv.fork(a, c);
  EXPECT_EQ(kv.gpu().ref_count(2), 3);
  kv.allocate_slots(b, 12, 1, copies);
  kv.allocate_slots(c, 12, 1, copies);
  kv.allocate_slots(a, 12, 1, copies);
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0], (BlockPair{2, 3}));
  EXPECT_EQ(copies[1], (BlockPair{2, 4}));
  EXPECT_EQ(a.block_table, (std::vector<BlockId>{1, 2}));
  EXPECT_EQ(b.block_table, (std::vector<BlockId>{1, 3}));
  EXPECT_EQ(c.block_table, (std::vector<BlockId>{1, 4}));
  EXPECT_EQ(kv.gpu().ref_count(1), 3);
}

TEST(KVCacheManager, AllocateSlotsChecksItsPreconditions) {
  KVCacheManager kv(2, 0, 8, false, 0);
  SeqBlocks s;
  std::vector<BlockPair> copies;
  EXPECT_FALSE(kv.can_allocate(s, 0, 17));
  EXPECT_THROW(kv.allocate_slots(s, 0, 17, copies), InternalError);
  EXPECT_THROW(kv.allocate_slots(s, 8, 1, copies), InternalError);  // table too short
  kv.allocate_slots(s, 0, 16, copies);
  EXPECT_EQ(kv.gpu().num_free_blocks(), 0);
}

TEST(KVCacheManager, PrefixLookupNeverCoversTheLastToken) {
  const int32_t bs = 4;
  KVCacheManager kv(16, 0, bs, true, 0);
  const std::vector<TokenId> prompt = tokens_upto(8);  // exactly two blocks
  SeqBlocks first;
  std::vector<BlockPair> copies;
  int32_t revived = -1;
  EXPECT_EQ(kv.lookup_prefix(first, prompt.data(), 8, 0, &revived), 0);
  kv.commit_prefix(first, 0);
  kv.allocate_slots(first, 0, 8, copies);
  kv.register_full_blocks(first, prompt.data(), 8, 0);
  EXPECT_EQ(kv.gpu().num_registered_blocks(), 2);
  kv.free(first);
  EXPECT_EQ(kv.gpu().num_cached_free_blocks(), 2);

  // Same 8 tokens: only the first block may hit; the second must be computed
  // again because it holds the last token.
  SeqBlocks second;
  EXPECT_EQ(kv.lookup_prefix(second, prompt.data(), 8, 0, &revived), 1);
  EXPECT_EQ(revived, 1);
  EXPECT_EQ(kv.hits(), (std::vector<BlockId>{1}));
  // Nine tokens: both blocks hit.
  std::vector<TokenId> longer = prompt;
  longer.push_back(7);
  SeqBlocks third;
  EXPECT_EQ(kv.lookup_prefix(third, longer.data(), 9, 0, &revived), 2);
  EXPECT_EQ(revived, 2);
  kv.commit_prefix(third, 2);
  EXPECT_EQ(third.block_table, (std::vector<BlockId>{1, 2}));
  EXPECT_EQ(kv.gpu().ref_count(1), 1);
  EXPECT_EQ(kv.gpu().num_cached_free_blocks(), 0);
  // Other salt: no hit.
  SeqBlocks salted;
  EXPECT_EQ(kv.lookup_prefix(salted, longer.data(), 9, /*salt=*/5, &revived), 0);
  kv.free(third);
  kv.gpu().check_consistency();
}

TEST(KVCacheManager, PrefixChainStopsAtTheFirstDifferentBlock) {
  const int32_t bs = 4;
  KVCacheManager kv(16, 0, bs, true, 0);
  const std::vector<TokenId> a = tokens_upto(13);
  SeqBlocks s;
  std::vector<BlockPair> copies;
  kv.allocate_slots(s, 0, 13, copies);
  kv.register_full_blocks(s, a.data(), 13, 0);
  EXPECT_EQ(kv.gpu().num_registered_blocks(), 3);
  std::vector<TokenId> b = a;
  b[5] = 999;  // second block differs
  SeqBlocks t;
  int32_t revived;
  EXPECT_EQ(kv.lookup_prefix(t, b.data(), 13, 0, &revived), 1);
  EXPECT_EQ(revived, 0);  // block 1 is owned by s
  // The third block of b equals a's, but its prefix differs: no hit past block 0.
  EXPECT_EQ(kv.hits(), (std::vector<BlockId>{1}));
}

TEST(KVCacheManager, SlidingWindowReleasesWholeBlocksBeforeTheWindow) {
  // Window 8, block size 4: a query at position p sees keys from p - 7 on.
  KVCacheManager kv(16, 0, 4, false, /*sliding_window=*/8);
  SeqBlocks s;
  std::vector<BlockPair> copies;
  kv.allocate_slots(s, 0, 20, copies);  // blocks 1..5, positions 0..19
  EXPECT_EQ(kv.release_out_of_window(s, 10), 0);  // sees 3..: block 0 (0..3) still needed
  EXPECT_EQ(kv.release_out_of_window(s, 11), 1);  // sees 4..: block 0 dead
  EXPECT_EQ(s.block_table, (std::vector<BlockId>{kNullBlock, 2, 3, 4, 5}));
  EXPECT_EQ(kv.release_out_of_window(s, 12), 0);  // sees 5..: block 1 (4..7) still needed
  EXPECT_EQ(kv.release_out_of_window(s, 20), 2);  // sees 13..: blocks 1, 2 dead
  EXPECT_EQ(s.block_table, (std::vector<BlockId>{kNullBlock, kNullBlock, kNullBlock, 4, 5}));
  EXPECT_EQ(s.num_released, 3);
  EXPECT_EQ(kv.gpu().num_free_blocks(), 16 - 2);
  // Fork copies the released entries; free ignores them.
  SeqBlocks c;
  kv.fork(s, c);
  EXPECT_EQ(c.block_table, s.block_table);
  EXPECT_EQ(kv.gpu().ref_count(4), 2);
  kv.free(c);
  kv.free(s);
  EXPECT_EQ(kv.gpu().num_free_blocks(), 16);
  kv.gpu().check_consistency();
}

TEST(KVCacheManager, SlidingWindowPrefixHitsBeforeTheWindowStayNull) {
  KVCacheManager kv(16, 0, 4, true, /*sliding_window=*/6);
  const std::vector<TokenId> prompt = tokens_upto(21);
  SeqBlocks first;
  std::vector<BlockPair> copies;
  kv.allocate_slots(first, 0, 20, copies);
  kv.register_full_blocks(first, prompt.data(), 20, 0);
  kv.free(first);
  EXPECT_EQ(kv.gpu().num_cached_free_blocks(), 5);
  SeqBlocks second;
  int32_t revived = -1;
  // Hits cover 0..19; a query at 20 sees 15..20: blocks 0-2 are dead.
  EXPECT_EQ(kv.lookup_prefix(second, prompt.data(), 21, 0, &revived), 5);
  EXPECT_EQ(revived, 2);
  kv.commit_prefix(second, 5);
  EXPECT_EQ(second.block_table, (std::vector<BlockId>{kNullBlock, kNullBlock, kNullBlock, 4, 5}));
  EXPECT_EQ(second.num_released, 3);
  EXPECT_EQ(kv.gpu().num_cached_free_blocks(), 3);
  EXPECT_EQ(kv.release_out_of_window(second, 20), 0);
  kv.free(second);
  kv.gpu().check_consistency();
}

TEST(KVCacheManager, SwapOutAndBackIn) {
  KVCacheManager kv(8, 4, 4, false, 0);
  SeqBlocks a, b;
  std::vector<BlockPair> copies, out, in;
  kv.allocate_slots(a, 0, 10, copies);  // GPU 1, 2, 3
  kv.fork(a, b);
  EXPECT_EQ(kv.num_owned_gpu_blocks(a), 3);
  ASSERT_TRUE(kv.can_swap_out(a));
  kv.swap_out(a, out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0], (BlockPair{1, 1}));
  EXPECT_EQ(out[1], (BlockPair{2, 2}));
  EXPECT_EQ(out[2], (BlockPair{3, 3}));
  EXPECT_TRUE(a.swapped);
  EXPECT_TRUE(a.block_table.empty());
  EXPECT_EQ(a.cpu_block_table, (std::vector<BlockId>{1, 2, 3}));
  // b still owns the GPU blocks.
  EXPECT_EQ(kv.gpu().ref_count(1), 1);
  EXPECT_EQ(kv.gpu().num_free_blocks(), 5);
  EXPECT_EQ(kv.cpu().num_free_blocks(), 1);
  EXPECT_FALSE(kv.can_swap_out(b));  // 3 blocks, 1 CPU block free
  // Back in, with one more token: 3 blocks for the KV + 0 new (10 -> 11 fits block 3).
  EXPECT_EQ(kv.num_blocks_to_swap_in(a, 10, 1), 3);
  EXPECT_EQ(kv.num_blocks_to_swap_in(a, 10, 3), 4);
  kv.swap_in(a, 10, in);
  ASSERT_EQ(in.size(), 3u);
  EXPECT_EQ(in[0], (BlockPair{1, 4}));
  EXPECT_EQ(in[1], (BlockPair{2, 5}));
  EXPECT_EQ(in[2], (BlockPair{3, 6}));
  EXPECT_EQ(a.block_table, (std::vector<BlockId>{4, 5, 6}));
  EXPECT_FALSE(a.swapped);
  EXPECT_EQ(kv.cpu().num_free_blocks(), 4);
  kv.free(a);
  kv.free(b);
  EXPECT_EQ(kv.gpu().num_free_blocks(), 8);
}

}  // namespace
}  // namespace pagedcore
