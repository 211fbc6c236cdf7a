#include "pagedcore/free_block_queue.h"

#include "check.h"

namespace pagedcore {

FreeBlockQueue::FreeBlockQueue(int32_t capacity)
    : capacity_(capacity), prev_(capacity + 2, kUnlinked), next_(capacity + 2, kUnlinked) {
  PAGEDCORE_CHECK(capacity >= 0, "capacity ", capacity);
  next_[head()] = tail();
  prev_[tail()] = head();
}

void FreeBlockQueue::link_after(int32_t pos, BlockId id) {
  PAGEDCORE_CHECK(id >= 0 && id < capacity_, "block id ", id, " outside [0, ", capacity_, ")");
  PAGEDCORE_CHECK(!contains(id), "block ", id, " is already in the free queue");
  const int32_t after = next_[pos];
  prev_[id] = pos;
  next_[id] = after;
  next_[pos] = id;
  prev_[after] = id;
  ++size_;
}

void FreeBlockQueue::push_back(BlockId id) { link_after(prev_[tail()], id); }

void FreeBlockQueue::push_front(BlockId id) { link_after(head(), id); }

BlockId FreeBlockQueue::pop_front() {
  PAGEDCORE_CHECK(size_ > 0, "pop_front on an empty free queue");
  const BlockId id = next_[head()];
  remove(id);
  return id;
}

void FreeBlockQueue::remove(BlockId id) {
  PAGEDCORE_CHECK(id >= 0 && id < capacity_ && contains(id), "block ", id,
                  " is not in the free queue");
  next_[prev_[id]] = next_[id];
  prev_[next_[id]] = prev_[id];
  prev_[id] = kUnlinked;
  next_[id] = kUnlinked;
  --size_;
}

}  // namespace pagedcore
