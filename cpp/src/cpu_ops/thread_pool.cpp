#include "thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "../check.h"
#include "pagedcore/cpu_ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedcore::cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker polls for the next launch before it sleeps: long enough to
// catch back-to-back launches (a layer's cache write then its attention, the split-KV
// merge), short enough not to steal the cores from torch's own threads between layers,
// where the model's matmuls run for far longer. A sleeping worker costs a futex wake-up
// (a few microseconds) at the next launch.
constexpr auto kSpinTime = std::chrono::microseconds(50);

// The job ticket packs (job id << 32 | next index). Claiming an item is one CAS on it, so
// a worker that is late for a job can never take an item of the next one.
constexpr uint32_t kClosed = 0xFFFFFFFFu;
constexpr uint64_t make_ticket(uint32_t job, uint32_t index) {
  return (uint64_t{job} << 32) | index;
}
constexpr uint32_t job_of(uint64_t t) { return static_cast<uint32_t>(t >> 32); }
constexpr uint32_t index_of(uint64_t t) { return static_cast<uint32_t>(t); }

thread_local bool t_inside_task = false;

class Pool {
 public:
  explicit Pool(int32_t num_threads) : num_threads_(num_threads) {}

  int32_t num_threads() const { return num_threads_.load(); }

  void set_num_threads(int32_t n) {
    std::lock_guard<std::mutex> dispatch(dispatch_mu_);
    stop_workers();
    num_threads_.store(n);
  }

  void run(int64_t n, pool_internal::TaskFn fn, void* ctx) {
    if (n <= 0) return;
    PAGEDCORE_CHECK(n < int64_t{kClosed}, "too many parallel items: ", n);
    std::unique_lock<std::mutex> dispatch(dispatch_mu_, std::defer_lock);
    if (n == 1 || num_threads_.load() <= 1 || t_inside_task || !dispatch.try_lock()) {
      run_inline(n, fn, ctx);
      return;
    }
    start_workers();
    // NOTE: the job fields may only change while no worker is between "inflight++" and
    // "inflight--": a worker reads them after checking the ticket, so close the ticket
    // first, then wait for the stragglers of the previous job to leave.
    const uint32_t job = ++job_id_;
    ticket_.store(make_ticket(job, kClosed));
    while (inflight_.load() != 0) cpu_relax();
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    done_.store(0);
    error_ = nullptr;
    ticket_.store(make_ticket(job, 0));
    if (sleepers_.load() > 0) {
      // Taking the mutex orders this notify after a sleeper's predicate check.
      { std::lock_guard<std::mutex> lock(sleep_mu_); }
      sleep_cv_.notify_all();
    }
    t_inside_task = true;
    work_on(job);
    t_inside_task = false;
    // Items claimed by workers may still run; ctx must outlive them.
    for (uint32_t spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run_inline(int64_t n, pool_internal::TaskFn fn, void* ctx) {
    const bool was_inside = t_inside_task;
    t_inside_task = true;
    std::exception_ptr error;
    for (int64_t i = 0; i < n; ++i) {
      try {
        fn(ctx, i);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    t_inside_task = was_inside;
    if (error) std::rethrow_exception(error);
  }

  // Claims and runs items of `job` until none is left. Caller: inside the job (inflight
  // counted, or the dispatcher itself).
  void work_on(uint32_t job) {
    const pool_internal::TaskFn fn = fn_;
    void* const ctx = ctx_;
    const int64_t n = n_;
    uint64_t t = ticket_.load();
    while (job_of(t) == job && int64_t{index_of(t)} < n) {
      if (!ticket_.compare_exchange_weak(t, t + 1)) continue;
      try {
        fn(ctx, index_of(t));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load();
    }
  }

  bool has_new_job(uint32_t last_job) const {
    const uint64_t t = ticket_.load();
    return job_of(t) != last_job && index_of(t) != kClosed;
  }

  void worker_loop() {
    t_inside_task = true;  // a task that launches runs inline, never waits on the pool
    uint32_t last_job = job_of(ticket_.load());
    auto idle_since = std::chrono::steady_clock::now();
    for (uint32_t polls = 0;; ++polls) {
      if (stop_.load()) return;
      if (!has_new_job(last_job)) {
        if ((polls & 63) != 0 || std::chrono::steady_clock::now() - idle_since < kSpinTime) {
          cpu_relax();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1);
        sleep_cv_.wait(lock, [&] { return stop_.load() || has_new_job(last_job); });
        sleepers_.fetch_sub(1);
        idle_since = std::chrono::steady_clock::now();
        continue;
      }
      inflight_.fetch_add(1);
      const uint64_t t = ticket_.load();
      if (job_of(t) != last_job && index_of(t) != kClosed) {
        last_job = job_of(t);
        work_on(last_job);
      }
      inflight_.fetch_sub(1);
      idle_since = std::chrono::steady_clock::now();
    }
  }

  // Callers hold dispatch_mu_.
  void start_workers() {
    if (started_) return;
    const int32_t count = num_threads_.load() - 1;
    workers_.reserve(static_cast<size_t>(count));
    for (int32_t i = 0; i < count; ++i) workers_.emplace_back([this] { worker_loop(); });
    started_ = true;
  }

  void stop_workers() {
    if (!started_) return;
    stop_.store(true);
    { std::lock_guard<std::mutex> lock(sleep_mu_); }
    sleep_cv_.notify_all();
    for (std::thread& w : workers_) w.join();
    workers_.clear();
    stop_.store(false);
    started_ = false;
  }

  std::atomic<int32_t> num_threads_;
  std::mutex dispatch_mu_;  // one parallel launch at a time; guards workers_, started_
  std::vector<std::thread> workers_;
  bool started_ = false;
  uint32_t job_id_ = 0;

  // The current job: written by the dispatcher only while the ticket is closed and no
  // worker is inflight.
  pool_internal::TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  std::exception_ptr error_;
  std::mutex error_mu_;

  std::atomic<uint64_t> ticket_{make_ticket(0, kClosed)};
  std::atomic<int64_t> done_{0};
  std::atomic<int32_t> inflight_{0};
  std::atomic<int32_t> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
};

int32_t default_num_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int32_t>(n);
}

// NOTE: the pool is created once and never destroyed. Destroying it at exit would join
// workers from a static destructor, after the interpreter may be gone; leaking it lets
// exit() end the sleeping workers. After fork() the child has none of the parent's
// threads, so it gets a fresh pool (the old one, with its thread handles, is leaked).
std::atomic<Pool*> g_pool{nullptr};

Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_pool.store(new Pool(default_num_threads()));
    pthread_atfork(nullptr, nullptr,
                   [] { g_pool.store(new Pool(g_pool.load()->num_threads())); });
  });
  return *g_pool.load();
}

}  // namespace

void set_pool_threads(int32_t n) {
  PAGEDCORE_CHECK(n >= 1, "pool threads must be >= 1, got ", n);
  pool().set_num_threads(n);
}

int32_t pool_threads() { return pool().num_threads(); }

namespace pool_internal {
void run_parallel(int64_t n, TaskFn fn, void* ctx) { pool().run(n, fn, ctx); }
}  // namespace pool_internal

void set_num_threads(int32_t n) {
  if (n < 1) throw InvalidArgument(detail::concat("num_threads must be >= 1, got ", n));
  set_pool_threads(n);
}

int32_t get_num_threads() { return pool_threads(); }

}  // namespace pagedcore::cpu
