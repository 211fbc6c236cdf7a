// A step's grammar work for a batch of llguidance matchers, in C++ with no Python:
// feed each row's sampled token, record its verdict, compute its token bitmask, on a
// few threads, then raise the "masks ready" flag that the CUDA sampler polls.
//
// NOTE (why, issue 15): through llguidance's PyO3 binding a mask thread must take the
// GIL back after every call, which the engine's thread, running Python, hands over only
// every 5 ms; the device then waits for masks that are long computed. Here one call
// (step) does a whole step's work outside the GIL.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "llg_library.h"

namespace pagedcore::grammar {

// Verdict of one row of LlgWorker::step.
enum RowStatus : uint8_t {
  kRowOk = 0,
  // The row's token was refused: the matcher is in error (error() says why) and its
  // mask allows the end-of-sequence tokens only, as the PyO3 matcher's.
  kRowRefused = 1,
  // The mask's computation failed (error() says why); the mask allows the
  // end-of-sequence tokens only.
  kRowMaskError = 2,
};

// Owns an llguidance tokenizer, the matchers made from it (by handle) and a pool of
// threads. Thread-safe: the matcher calls and a step's start wait until no step is in
// flight, so that a matcher is never freed or cloned while a step uses it.
class LlgWorker {
 public:
  // `tokenizer_json`: a Hugging Face tokenizer.json (what a fast tokenizer's
  // backend_tokenizer.to_str() returns); `vocab_size`: the model's vocabulary (logits
  // columns, may exceed the tokenizer's); `eos_token_ids`: at least one, the tokens
  // the grammar allows once complete; `num_threads` >= 1 (the caller's included).
  // Throws std::invalid_argument naming the field for a bad value, or with
  // llguidance's message when it refuses the tokenizer.
  //
  //
  // `tokenize`: the model tokenizer's encoding of a byte string (no special tokens
  // added); empty: llguidance tokenizes greedily over the vocabulary.
  // NOTE: it decides the masks, not only fast-forward tokens: with a tokenizer that it
  // may call canonical, llguidance allows, where the grammar forces bytes (" not" of a
  // choice "maybe not"), only the tokens of their canonical tokenization, so a greedy
  // worker's masks differ from the PyO3 matchers' (measured: " no" allowed after
  // "maybe"). llguidance calls it from the step's threads, for forced byte strings,
  // which repeat: answers are cached (tokenize_calls() counts the misses), so that a
  // callback that needs a lock (Python's) is rarely called once the grammars warmed up.
  // It must be thread-safe and must not throw (a throw reads as no tokens).
  using TokenizeFn = std::function<std::vector<uint32_t>(const std::string& bytes)>;
  LlgWorker(std::shared_ptr<const LlgLibrary> lib, const std::string& tokenizer_json,
            int32_t vocab_size, const std::vector<int64_t>& eos_token_ids, int32_t num_threads,
            TokenizeFn tokenize = {});
  ~LlgWorker();
  LlgWorker(const LlgWorker&) = delete;
  LlgWorker& operator=(const LlgWorker&) = delete;

  // Words (int32) of one row's bitmask: ceil(vocab_size / 32).
  int32_t num_words() const { return num_words_; }
  int32_t num_threads() const { return static_cast<int32_t>(threads_.size()) + 1; }

  // Compiles a grammar: `constraint_type` as llg_new_matcher takes it ("llguidance"
  // for the grammar text StructuredOutputManager compiles, "regex", "lark", "json").
  // `lane`: matchers cloned from one compiled grammar share its lexer behind a lock,
  // so step() gives rows of one lane to one thread where it can (clones inherit the
  // lane). Returns the matcher's handle; throws std::invalid_argument with
  // llguidance's error for a grammar it refuses (nothing is kept then).
  int64_t new_matcher(const std::string& constraint_type, const std::string& grammar, int32_t lane);
  // A copy of `handle`'s matcher in its current state; a new handle.
  int64_t clone_matcher(int64_t handle);
  // Frees the matcher; its handle may be handed out again.
  void free_matcher(int64_t handle);
  // llguidance's error for the matcher, "" when none.
  std::string error(int64_t handle);
  bool is_stopped(int64_t handle);
  bool is_accepting(int64_t handle);
  // Live matchers (for leak checks).
  int64_t num_matchers();
  // Calls of `tokenize` so far (the cache's misses).
  int64_t tokenize_calls();

  // One step for `rows` matchers, all outside any Python lock:
  //   handles   [rows]             distinct live handles
  //   tokens    [rows]             the token each row sampled last step; < 0: none (a
  //                                row's first step)
  //   masks     [rows, num_words]  out: row i's bitmask (bit t % 32 of word t / 32 set
  //                                iff token t is allowed next)
  //   status    [rows]             out: RowStatus
  //   stopped   [rows]             out: 1 when the matcher admits nothing more (the
  //                                sequence ends), else 0
  //   ready_flag                   null, or a word that receives ready_value (a store
  //                                with release semantics) once every row is written,
  //                                whatever the verdicts
  // Throws std::invalid_argument (before touching any matcher or output) for a handle
  // that is not live or appears twice.
  void step(const int64_t* handles, const int32_t* tokens, int64_t rows, int32_t* masks,
            uint8_t* status, uint8_t* stopped, uint32_t* ready_flag, uint32_t ready_value);
  // step() without the masks: feeds the tokens, writes status and stopped (for a
  // step's verdicts before the next step's rows, whose masks start_step computes with
  // no tokens, are known).
  void consume(const int64_t* handles, const int32_t* tokens, int64_t rows, uint8_t* status, uint8_t* stopped);
  // step() on the worker's own thread: checks the arguments and copies handles and
  // tokens, then returns at once; masks, status, stopped and ready_flag must stay
  // valid until wait_step() returns (or step_done() is true). The other calls (the
  // matchers', step's) wait for it to finish first.
  void start_step(const int64_t* handles, const int32_t* tokens, int64_t rows, int32_t* masks,
                  uint8_t* status, uint8_t* stopped, uint32_t* ready_flag, uint32_t ready_value);
  // Returns once no step is in flight.
  void wait_step();
  bool step_done();

 private:
  struct Matcher {
    LlgMatcher* ptr = nullptr;
    int32_t lane = 0;
  };
  LlgMatcher* live(int64_t handle) const;  // throws for a handle not live
  std::unique_lock<std::mutex> lock_idle();  // mutex_, once no step is in flight
  void prepare(const int64_t* handles, const int32_t* tokens, int64_t rows, int32_t* masks,
               uint8_t* status, uint8_t* stopped, uint32_t* ready_flag, uint32_t ready_value);
  void execute();
  void dispatch_loop();
  int64_t add(LlgMatcher* ptr, int32_t lane);
  void run_row(int64_t row);
  void run_step(int64_t regions);
  void claim_rows(int64_t first_region);
  static constexpr int64_t kRowsPerClaim = 4;
  void pool_thread(int32_t index);
  static size_t tokenize_trampoline(const void* user_data, const uint8_t* bytes, size_t bytes_len,
                                    uint32_t* output_tokens, size_t output_tokens_len);

  TokenizeFn tokenize_;
  std::mutex tokenize_mutex_;  // the cache and the count
  std::unordered_map<std::string, std::vector<uint32_t>> tokenize_cache_;
  int64_t tokenize_calls_ = 0;

  std::shared_ptr<const LlgLibrary> lib_;
  LlgTokenizer* tokenizer_ = nullptr;
  int32_t vocab_size_ = 0;
  int32_t num_words_ = 0;
  std::vector<uint32_t> eos_token_ids_;

  std::mutex mutex_;  // matchers_, free_handles_, in_flight_
  std::condition_variable idle_;
  bool in_flight_ = false;  // a step prepared and not finished: its matchers are in use
  std::vector<Matcher> matchers_;
  std::vector<int64_t> free_handles_;

  // The step in flight (written by prepare, under mutex_, with no step in flight).
  std::vector<int32_t> step_tokens_;
  int32_t* step_masks_ = nullptr;
  uint8_t* step_status_ = nullptr;
  uint8_t* step_stopped_ = nullptr;
  uint32_t* step_flag_ = nullptr;
  uint32_t step_flag_value_ = 0;
  std::vector<int64_t> step_order_;       // rows grouped by lane
  std::vector<LlgMatcher*> step_matcher_;  // per row
  std::vector<int64_t> step_bounds_;      // region r: step_order_[bounds[r], bounds[r + 1])
  std::unique_ptr<std::atomic<int64_t>[]> step_next_;  // per region: its next unclaimed row
  int64_t step_regions_ = 0;

  // The pool: threads_[i] starts on region i + 1 of a step (the caller on region 0).
  std::vector<std::thread> threads_;
  std::mutex pool_mutex_;
  std::condition_variable pool_start_;
  std::condition_variable pool_done_;
  uint64_t generation_ = 0;  // bumped per step
  bool accepting_ = false;   // whether pool threads may join the step in progress
  int64_t active_ = 0;       // pool threads that joined it and have not left
  bool stopping_ = false;

  // start_step's thread (started on first use).
  std::thread dispatcher_;
  std::mutex dispatch_mutex_;
  std::condition_variable dispatch_cv_;
  bool dispatch_pending_ = false;
  bool dispatch_stopping_ = false;
};

}  // namespace pagedcore::grammar
