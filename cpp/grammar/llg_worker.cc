#include "llg_worker.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace pagedcore::grammar {

LlgWorker::LlgWorker(std::shared_ptr<const LlgLibrary> lib, const std::string& tokenizer_json,
                     int32_t vocab_size, const std::vector<int64_t>& eos_token_ids,
                     int32_t num_threads, TokenizeFn tokenize)
    : tokenize_(std::move(tokenize)), lib_(std::move(lib)), vocab_size_(vocab_size) {
  if (!lib_) throw std::invalid_argument("LlgWorker: lib must be a loaded llguidance library");
  if (vocab_size <= 0) {
    throw std::invalid_argument("LlgWorker: vocab_size must be positive, got " + std::to_string(vocab_size));
  }
  if (num_threads < 1 || num_threads > 256) {
    throw std::invalid_argument("LlgWorker: num_threads must be in [1, 256], got " +
                                std::to_string(num_threads));
  }
  if (eos_token_ids.empty()) throw std::invalid_argument("LlgWorker: eos_token_ids must not be empty");
  std::vector<uint32_t> extra_eos;
  for (size_t i = 0; i < eos_token_ids.size(); ++i) {
    int64_t id = eos_token_ids[i];
    if (id < 0 || id >= vocab_size) {
      throw std::invalid_argument("LlgWorker: eos_token_ids holds " + std::to_string(id) +
                                  ", outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
    if (i > 0) extra_eos.push_back(static_cast<uint32_t>(id));
  }
  num_words_ = (vocab_size + 31) / 32;
  for (int64_t id : eos_token_ids) eos_token_ids_.push_back(static_cast<uint32_t>(id));

  LlgTokenizerInitV2 init;
  std::memset(&init, 0, sizeof(init));  // (fields llguidance may add later read as zero)
  init.struct_size = sizeof(init);
  init.vocab_size = static_cast<uint32_t>(vocab_size);
  init.tok_eos = static_cast<uint32_t>(eos_token_ids.front());
  init.tokenizer_json = tokenizer_json.c_str();
  if (tokenize_) {
    init.tokenize_fn = &LlgWorker::tokenize_trampoline;
    init.tokenize_user_data = this;
  } else {
    init.use_approximate_greedy_tokenize_fn = true;  // (see the header's NOTE)
  }
  init.tok_eos_extra = extra_eos.empty() ? nullptr : extra_eos.data();
  init.tok_eos_extra_count = static_cast<uint32_t>(extra_eos.size());
  char error[1024] = {0};
  tokenizer_ = lib_->new_tokenizer_v2(&init, error, sizeof(error));
  if (tokenizer_ == nullptr) {
    throw std::invalid_argument(std::string("LlgWorker: llguidance refused the tokenizer: ") + error);
  }
  step_next_.reset(new std::atomic<int64_t>[num_threads]);
  threads_.reserve(num_threads - 1);
  for (int32_t i = 0; i + 1 < num_threads; ++i) threads_.emplace_back(&LlgWorker::pool_thread, this, i);
}

LlgWorker::~LlgWorker() {
  {
    std::lock_guard<std::mutex> lock(dispatch_mutex_);
    dispatch_stopping_ = true;  // (a step started is still run first)
  }
  dispatch_cv_.notify_one();
  if (dispatcher_.joinable()) dispatcher_.join();
  {
    std::lock_guard<std::mutex> lock(pool_mutex_);
    stopping_ = true;
  }
  pool_start_.notify_all();
  for (std::thread& t : threads_) t.join();
  for (Matcher& m : matchers_) lib_->free_matcher(m.ptr);  // (null for free handles: a no-op)
  lib_->free_tokenizer(tokenizer_);  // NOTE: after the matchers, which use it
}

LlgMatcher* LlgWorker::live(int64_t handle) const {
  if (handle < 0 || handle >= static_cast<int64_t>(matchers_.size()) || matchers_[handle].ptr == nullptr) {
    throw std::invalid_argument("LlgWorker: no live matcher has handle " + std::to_string(handle));
  }
  return matchers_[handle].ptr;
}

int64_t LlgWorker::add(LlgMatcher* ptr, int32_t lane) {
  int64_t handle;
  if (free_handles_.empty()) {
    handle = static_cast<int64_t>(matchers_.size());
    matchers_.push_back({ptr, lane});
  } else {
    handle = free_handles_.back();
    free_handles_.pop_back();
    matchers_[handle] = {ptr, lane};
  }
  return handle;
}

int64_t LlgWorker::new_matcher(const std::string& constraint_type, const std::string& grammar,
                               int32_t lane) {
  if (lane < 0) throw std::invalid_argument("LlgWorker: lane must be >= 0, got " + std::to_string(lane));
  LlgConstraintInit init;
  std::memset(&init, 0, sizeof(init));
  lib_->constraint_init_set_defaults(&init, tokenizer_);
  init.log_stderr_level = 0;  // (errors reach the caller as exceptions, not on stderr)
  init.log_buffer_level = 0;
  LlgMatcher* ptr = lib_->new_matcher(&init, constraint_type.c_str(), grammar.c_str());
  if (const char* error = lib_->matcher_get_error(ptr)) {
    std::string message = std::string("grammar refused by llguidance: ") + error;
    lib_->free_matcher(ptr);
    throw std::invalid_argument(message);
  }
  if (lib_->matcher_get_mask_byte_size(ptr) != static_cast<size_t>(num_words_) * 4) {
    size_t bytes = lib_->matcher_get_mask_byte_size(ptr);
    lib_->free_matcher(ptr);
    throw std::runtime_error("LlgWorker: internal error: llguidance's mask has " + std::to_string(bytes) +
                             " bytes, expected " + std::to_string(num_words_ * 4));
  }
  std::unique_lock<std::mutex> lock = lock_idle();
  return add(ptr, lane);
}

int64_t LlgWorker::clone_matcher(int64_t handle) {
  std::unique_lock<std::mutex> lock = lock_idle();
  LlgMatcher* source = live(handle);
  return add(lib_->clone_matcher(source), matchers_[handle].lane);
}

void LlgWorker::free_matcher(int64_t handle) {
  std::unique_lock<std::mutex> lock = lock_idle();
  LlgMatcher* ptr = live(handle);
  lib_->free_matcher(ptr);
  matchers_[handle] = {};
  free_handles_.push_back(handle);
}

std::string LlgWorker::error(int64_t handle) {
  std::unique_lock<std::mutex> lock = lock_idle();
  const char* error = lib_->matcher_get_error(live(handle));
  return error ? error : "";
}

bool LlgWorker::is_stopped(int64_t handle) {
  std::unique_lock<std::mutex> lock = lock_idle();
  return lib_->matcher_is_stopped(live(handle));
}

bool LlgWorker::is_accepting(int64_t handle) {
  std::unique_lock<std::mutex> lock = lock_idle();
  return lib_->matcher_is_accepting(live(handle));
}

int64_t LlgWorker::num_matchers() {
  std::unique_lock<std::mutex> lock = lock_idle();
  return static_cast<int64_t>(matchers_.size() - free_handles_.size());
}

int64_t LlgWorker::tokenize_calls() {
  std::lock_guard<std::mutex> lock(tokenize_mutex_);
  return tokenize_calls_;
}

size_t LlgWorker::tokenize_trampoline(const void* user_data, const uint8_t* bytes, size_t bytes_len,
                                      uint32_t* output_tokens, size_t output_tokens_len) {
  auto* self = static_cast<LlgWorker*>(const_cast<void*>(user_data));
  std::string key(reinterpret_cast<const char*>(bytes), bytes_len);
  std::vector<uint32_t> tokens;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(self->tokenize_mutex_);
    auto it = self->tokenize_cache_.find(key);
    if (it != self->tokenize_cache_.end()) {
      tokens = it->second;
      cached = true;
    } else {
      ++self->tokenize_calls_;
    }
  }
  if (!cached) {
    // NOTE: outside the cache's lock: the callback may wait for Python's lock, which
    // a thread that holds it may need ours to release (through another step).
    try {
      tokens = self->tokenize_(key);
    } catch (...) {
      tokens.clear();  // (nothing may unwind through llguidance's Rust frames)
    }
    std::lock_guard<std::mutex> lock(self->tokenize_mutex_);
    // NOTE: forced strings come from the grammars' literals: a bounded set in practice;
    // the cap only keeps an adversarial stream of grammars from growing it forever.
    if (self->tokenize_cache_.size() >= 65536) self->tokenize_cache_.clear();
    self->tokenize_cache_.emplace(std::move(key), tokens);
  }
  std::copy_n(tokens.begin(), std::min(tokens.size(), output_tokens_len), output_tokens);
  return tokens.size();
}

void LlgWorker::run_row(int64_t row) {
  LlgMatcher* m = step_matcher_[row];
  uint8_t verdict = kRowOk;
  int32_t token = step_tokens_[row];  // (< 0: none)
  if (token >= 0 && lib_->matcher_consume_token(m, static_cast<uint32_t>(token)) != 0) verdict = kRowRefused;
  uint32_t* mask = step_masks_ == nullptr ? nullptr  // (consume(): tokens only)
                                           : reinterpret_cast<uint32_t*>(step_masks_ + row * static_cast<int64_t>(num_words_));
  if (mask != nullptr && lib_->matcher_compute_mask_into(m, mask, static_cast<size_t>(num_words_) * 4) != 0) {
    // NOTE: the C API leaves the mask of a matcher in error unwritten; the PyO3 one
    // allows the end-of-sequence tokens only, which the sampler needs (a row with no
    // token allowed has nothing to sample): the same here.
    std::fill_n(mask, num_words_, 0u);
    for (uint32_t id : eos_token_ids_) mask[id / 32] |= 1u << (id % 32);
    if (verdict == kRowOk) verdict = kRowMaskError;
  }
  step_status_[row] = verdict;
  step_stopped_[row] = lib_->matcher_is_stopped(m) ? 1 : 0;
}

std::unique_lock<std::mutex> LlgWorker::lock_idle() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return !in_flight_; });
  return lock;
}

void LlgWorker::prepare(const int64_t* handles, const int32_t* tokens, int64_t rows, int32_t* masks,
                        uint8_t* status, uint8_t* stopped, uint32_t* ready_flag, uint32_t ready_value) {
  if (rows < 0) throw std::invalid_argument("LlgWorker.step: rows must be >= 0, got " + std::to_string(rows));
  // (called with lock_idle() held: no step in flight)
  // NOTE: a handle twice would have two threads drive one matcher at once: refused,
  // with every handle, before any matcher moves.
  std::vector<uint8_t> seen(matchers_.size(), 0);
  for (int64_t row = 0; row < rows; ++row) {
    live(handles[row]);
    if (seen[handles[row]]++) {
      throw std::invalid_argument("LlgWorker.step: handle " + std::to_string(handles[row]) +
                                  " appears twice in one step");
    }
  }
  step_matcher_.resize(rows);
  step_tokens_.assign(tokens, tokens + rows);  // (copied: the caller may reuse its array)
  step_order_.resize(rows);
  std::vector<int32_t> lanes(rows);
  for (int64_t row = 0; row < rows; ++row) {
    step_matcher_[row] = matchers_[handles[row]].ptr;
    lanes[row] = matchers_[handles[row]].lane;
    step_order_[row] = row;
  }
  // Rows grouped by lane, cut into one region per thread: a thread mostly holds its
  // own lanes' locks.
  std::stable_sort(step_order_.begin(), step_order_.end(), [&](int64_t a, int64_t b) { return lanes[a] < lanes[b]; });
  step_masks_ = masks;
  step_status_ = status;
  step_stopped_ = stopped;
  step_flag_ = ready_flag;
  step_flag_value_ = ready_value;
  in_flight_ = true;
}

void LlgWorker::execute() {
  // NOTE: runs without mutex_: the matcher calls wait (lock_idle) until in_flight_ is
  // false again, so nothing frees or clones a matcher of the step meanwhile.
  int64_t rows = static_cast<int64_t>(step_matcher_.size());
  // NOTE: one region per thread, in units of a few rows that any thread may claim: a
  // thread takes its own region's units first, then the others'. The caller never
  // waits for a pool thread that has not woken yet (on a loaded host that takes
  // milliseconds): it claims that thread's units itself.
  int64_t regions = std::min<int64_t>(num_threads(), rows);
  step_bounds_.assign(regions + 1, 0);
  for (int64_t r = 0; r <= regions; ++r) step_bounds_[r] = regions ? rows * r / regions : 0;
  for (int64_t r = 0; r < regions; ++r) step_next_[r].store(step_bounds_[r], std::memory_order_relaxed);
  step_regions_ = regions;
  run_step(regions);
  if (step_flag_ != nullptr) __atomic_store_n(step_flag_, step_flag_value_, __ATOMIC_RELEASE);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_ = false;
  }
  idle_.notify_all();
}

void LlgWorker::step(const int64_t* handles, const int32_t* tokens, int64_t rows, int32_t* masks,
                     uint8_t* status, uint8_t* stopped, uint32_t* ready_flag, uint32_t ready_value) {
  {
    std::unique_lock<std::mutex> lock = lock_idle();
    prepare(handles, tokens, rows, masks, status, stopped, ready_flag, ready_value);
  }
  execute();
}

void LlgWorker::consume(const int64_t* handles, const int32_t* tokens, int64_t rows, uint8_t* status,
                        uint8_t* stopped) {
  {
    std::unique_lock<std::mutex> lock = lock_idle();
    prepare(handles, tokens, rows, nullptr, status, stopped, nullptr, 0);
  }
  execute();
}

void LlgWorker::start_step(const int64_t* handles, const int32_t* tokens, int64_t rows, int32_t* masks,
                           uint8_t* status, uint8_t* stopped, uint32_t* ready_flag, uint32_t ready_value) {
  {
    std::unique_lock<std::mutex> lock = lock_idle();
    prepare(handles, tokens, rows, masks, status, stopped, ready_flag, ready_value);
  }
  {
    std::lock_guard<std::mutex> lock(dispatch_mutex_);
    dispatch_pending_ = true;
    if (!dispatcher_.joinable()) dispatcher_ = std::thread(&LlgWorker::dispatch_loop, this);
  }
  dispatch_cv_.notify_one();
}

void LlgWorker::wait_step() { lock_idle(); }

bool LlgWorker::step_done() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !in_flight_;
}

void LlgWorker::dispatch_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(dispatch_mutex_);
      dispatch_cv_.wait(lock, [&] { return dispatch_pending_ || dispatch_stopping_; });
      if (!dispatch_pending_) return;  // (stopping, and no step left to run)
      dispatch_pending_ = false;
    }
    execute();
  }
}

void LlgWorker::claim_rows(int64_t first_region) {
  for (int64_t k = 0; k < step_regions_; ++k) {
    int64_t r = (first_region + k) % step_regions_;
    for (;;) {
      int64_t begin = step_next_[r].fetch_add(kRowsPerClaim, std::memory_order_relaxed);
      if (begin >= step_bounds_[r + 1]) break;
      int64_t end = std::min(begin + kRowsPerClaim, step_bounds_[r + 1]);
      for (int64_t i = begin; i < end; ++i) run_row(step_order_[i]);
    }
  }
}

void LlgWorker::run_step(int64_t regions) {
  if (regions > 1) {
    {
      std::lock_guard<std::mutex> lock(pool_mutex_);
      accepting_ = true;
      ++generation_;
    }
    pool_start_.notify_all();
  }
  if (regions > 0) claim_rows(0);
  if (regions > 1) {
    // Every unit is claimed now; wait for those still running on pool threads. A
    // thread that wakes after this sees accepting_ false and claims nothing.
    std::unique_lock<std::mutex> lock(pool_mutex_);
    accepting_ = false;
    pool_done_.wait(lock, [&] { return active_ == 0; });
  }
}

void LlgWorker::pool_thread(int32_t index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(pool_mutex_);
      pool_start_.wait(lock, [&] { return stopping_ || (accepting_ && generation_ != seen); });
      if (stopping_) return;
      seen = generation_;
      ++active_;
    }
    // (the step's fields were written before accepting_ was set, under the same lock)
    if (index + 1 < step_regions_) claim_rows(index + 1);
    {
      std::lock_guard<std::mutex> lock(pool_mutex_);
      if (--active_ == 0) pool_done_.notify_one();
    }
  }
}

}  // namespace pagedcore::grammar
