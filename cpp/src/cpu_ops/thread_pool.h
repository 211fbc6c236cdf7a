// The CPU kernels' persistent thread pool (internal; not installed).
//
// std::threads owned by the core, started at the first parallel launch and kept: a
// kernel launch must not pay thread creation, and OpenMP is out because torch ships its
// own runtime and the two would fight over the cores. Idle workers spin briefly (for
// back-to-back launches) and then sleep on a condition variable, so an idle engine costs
// no CPU.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace pagedcore::cpu {

// Threads used by parallel_for, the caller included (>= 1). set_pool_threads stops the
// current workers (waiting for a running launch to finish); new ones start lazily.
void set_pool_threads(int32_t n);
int32_t pool_threads();

namespace pool_internal {
using TaskFn = void (*)(void* ctx, int64_t index);
void run_parallel(int64_t n, TaskFn fn, void* ctx);
}  // namespace pool_internal

// Calls fn(i) once for every i in [0, n) on the pool's threads and the calling thread,
// and returns when all calls have returned. Indices are handed out one at a time in
// increasing order (dynamic scheduling), so put the expensive items first.
// Runs everything on the calling thread when n == 1, when the pool has one thread, when
// another launch holds the pool, or when called from inside a task (no nesting).
// If calls throw, the first exception is rethrown after all items have been run.
template <typename Fn>
void parallel_for(int64_t n, Fn&& fn) {
  using F = std::remove_reference_t<Fn>;
  pool_internal::run_parallel(
      n, [](void* ctx, int64_t i) { (*static_cast<F*>(ctx))(i); },
      const_cast<void*>(static_cast<const void*>(&fn)));
}

}  // namespace pagedcore::cpu
