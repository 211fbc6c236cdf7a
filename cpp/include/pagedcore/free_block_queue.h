// Intrusive doubly linked list of free block ids with head and tail sentinels.
//
// Every operation is O(1), removal from the middle included: a prefix-cache hit
// revives a cached block wherever it sits in the queue. The links live in two
// arrays indexed by block id, allocated once; nothing is allocated afterwards.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedcore/types.h"

namespace pagedcore {

class FreeBlockQueue {
 public:
  // Ids 0 .. capacity-1 may be queued; the queue starts empty.
  explicit FreeBlockQueue(int32_t capacity);

  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool contains(BlockId id) const { return prev_[id] != kUnlinked; }

  // Precondition for the three below: !contains(id).
  void push_back(BlockId id);
  void push_front(BlockId id);
  // Precondition: !empty(). Returns the id at the head and unlinks it.
  BlockId pop_front();
  // Precondition: contains(id).
  void remove(BlockId id);

  // Iteration, head to tail: for (b = front(); b != kNoBlock; b = next(b)).
  BlockId front() const { return as_id(next_[head()]); }
  BlockId next(BlockId id) const { return as_id(next_[id]); }

 private:
  static constexpr int32_t kUnlinked = -1;
  int32_t head() const { return capacity_; }
  int32_t tail() const { return capacity_ + 1; }
  BlockId as_id(int32_t link) const { return link >= capacity_ ? kNoBlock : link; }
  void link_after(int32_t pos, BlockId id);

  int32_t capacity_;
  int32_t size_ = 0;
  // Indexed by block id; capacity_ is the head sentinel, capacity_ + 1 the tail.
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
};

}  // namespace pagedcore
