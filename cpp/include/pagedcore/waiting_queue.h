// Waiting sequences ordered by runs_before(): a binary min-heap that records each
// sequence's position in it (Sequence::heap_index), so that removing any
// sequence (abort) is O(log n), and looking at the head is O(1) whatever the
// queue's length.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedcore/sequence.h"

namespace pagedcore {

class WaitingQueue {
 public:
  bool empty() const { return heap_.empty(); }
  int32_t size() const { return static_cast<int32_t>(heap_.size()); }
  // Precondition: !empty().
  Sequence* top() const { return heap_.front(); }
  // Precondition: seq->heap_index == -1.
  void push(Sequence* seq);
  // Precondition: !empty().
  Sequence* pop();
  // Precondition: seq is in this queue.
  void remove(Sequence* seq);
  void reserve(size_t n) { heap_.reserve(n); }
  const std::vector<Sequence*>& items() const { return heap_; }  // heap order
  // Throws InternalError when the heap order or the recorded indices are off.
  void check_consistency() const;

 private:
  void place(size_t i, Sequence* seq);
  void sift_up(size_t i);
  void sift_down(size_t i);

  std::vector<Sequence*> heap_;
};

}  // namespace pagedcore
