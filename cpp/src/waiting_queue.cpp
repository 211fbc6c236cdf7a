#include "pagedcore/waiting_queue.h"

#include "check.h"

namespace pagedcore {

void WaitingQueue::place(size_t i, Sequence* seq) {
  heap_[i] = seq;
  seq->heap_index = static_cast<int32_t>(i);
}

void WaitingQueue::sift_up(size_t i) {
  Sequence* seq = heap_[i];
  while (i > 0) {
    const size_t parent = (i - 1) / 2;
    if (!runs_before(*seq, *heap_[parent])) break;
    place(i, heap_[parent]);
    i = parent;
  }
  place(i, seq);
}

void WaitingQueue::sift_down(size_t i) {
  Sequence* seq = heap_[i];
  const size_t n = heap_.size();
  while (true) {
    size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && runs_before(*heap_[child + 1], *heap_[child])) ++child;
    if (!runs_before(*heap_[child], *seq)) break;
    place(i, heap_[child]);
    i = child;
  }
  place(i, seq);
}

void WaitingQueue::push(Sequence* seq) {
  PAGEDCORE_CHECK(seq->heap_index == -1, "sequence ", seq->seq_id, " is already queued");
  heap_.push_back(seq);
  sift_up(heap_.size() - 1);
}

Sequence* WaitingQueue::pop() {
  PAGEDCORE_CHECK(!heap_.empty(), "pop from an empty waiting queue");
  Sequence* head = heap_.front();
  remove(head);
  return head;
}

void WaitingQueue::remove(Sequence* seq) {
  const int32_t i = seq->heap_index;
  PAGEDCORE_CHECK(i >= 0 && i < size() && heap_[i] == seq, "sequence ", seq->seq_id,
                  " is not in the waiting queue");
  Sequence* last = heap_.back();
  heap_.pop_back();
  seq->heap_index = -1;
  if (last == seq) return;
  place(i, last);
  // The moved element may belong above or below its new place.
  sift_up(i);
  sift_down(last->heap_index);
}

void WaitingQueue::check_consistency() const {
  for (size_t i = 0; i < heap_.size(); ++i) {
    PAGEDCORE_CHECK(heap_[i]->heap_index == static_cast<int32_t>(i), "heap index of sequence ",
                    heap_[i]->seq_id, " is ", heap_[i]->heap_index, ", not ", i);
    if (i > 0) {
      PAGEDCORE_CHECK(!runs_before(*heap_[i], *heap_[(i - 1) / 2]), "heap order broken at ", i);
    }
  }
}

}  // namespace pagedcore
