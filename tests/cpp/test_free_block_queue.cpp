#include "pagedcore/free_block_queue.h"

#include <gtest/gtest.h>

#include <vector>

#include "pagedcore/errors.h"

namespace pagedcore {
namespace {

std::vector<BlockId> contents(const FreeBlockQueue& q) {
  std::vector<BlockId> out;
  for (BlockId b = q.front(); b != kNoBlock; b = q.next(b)) out.push_back(b);
  return out;
}

TEST(FreeBlockQueue, PushPopOrder) {
  FreeBlockQueue q(8);
  EXPECT_TRUE(q.empty());
  q.push_back(3);
  q.push_back(5);
  q.push_front(1);
  EXPECT_EQ(contents(q), (std::vector<BlockId>{1, 3, 5}));
  EXPECT_EQ(q.size(), 3);
  EXPECT_EQ(q.pop_front(), 1);
  EXPECT_EQ(q.pop_front(), 3);
  EXPECT_EQ(q.pop_front(), 5);
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.front(), kNoBlock);
}

TEST(FreeBlockQueue, RemoveFromHeadMiddleTail) {
  FreeBlockQueue q(10);
  for (BlockId b : {2, 4, 6, 8, 9}) q.push_back(b);
  q.remove(6);
  EXPECT_EQ(contents(q), (std::vector<BlockId>{2, 4, 8, 9}));
  q.remove(2);
  EXPECT_EQ(contents(q), (std::vector<BlockId>{4, 8, 9}));
  q.remove(9);
  EXPECT_EQ(contents(q), (std::vector<BlockId>{4, 8}));
  EXPECT_FALSE(q.contains(9));
  EXPECT_TRUE(q.contains(8));
  // A removed block can be queued again.
  q.push_front(9);
  EXPECT_EQ(contents(q), (std::vector<BlockId>{9, 4, 8}));
  EXPECT_EQ(q.size(), 3);
}

TEST(FreeBlockQueue, MisuseIsAnInternalError) {
  FreeBlockQueue q(4);
  q.push_back(1);
  EXPECT_THROW(q.push_back(1), InternalError);
  EXPECT_THROW(q.remove(2), InternalError);
  EXPECT_THROW(q.push_back(4), InternalError);
  q.pop_front();
  EXPECT_THROW(q.pop_front(), InternalError);
}

}  // namespace
}  // namespace pagedcore
