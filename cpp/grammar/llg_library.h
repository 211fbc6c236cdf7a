// llguidance's C API (parser/llguidance.h of llguidance 1.9.1), loaded at run time.
//
// NOTE: pagedcore does not link llguidance: CPU installs without it must still build
// and import. The Python wheel of llguidance exports its C functions from
// `llguidance/_lib.abi3.so`; LlgLibrary::open dlopens that file (RTLD_NOW) and looks
// every function up by name. The structures below mirror the header's of that version
// field by field; a wheel of another major version may lay them out differently
// (structured_outputs pins llguidance>=1.9,<2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace pagedcore::grammar {

// Opaque llguidance handles.
struct LlgTokenizer;
struct LlgMatcher;

// LlgParserLimits: zero fields take llguidance's defaults.
struct LlgParserLimits {
  size_t max_items_in_row;
  uint64_t initial_lexer_fuel;
  uint64_t step_lexer_fuel;
  size_t step_max_items;
  size_t max_lexer_states;
  size_t max_grammar_size;
  bool precompute_large_lexemes;
  bool verbose_errors;
};

// LlgConstraintInit: filled by llg_constraint_init_set_defaults.
struct LlgConstraintInit {
  const LlgTokenizer* tokenizer;
  uint32_t log_buffer_level;
  uint32_t log_stderr_level;
  bool ff_tokens_ok;
  bool backtrack_ok;
  LlgParserLimits limits;
};

using LlgTokenizeFn = size_t (*)(const void* user_data, const uint8_t* bytes, size_t bytes_len,
                                 uint32_t* output_tokens, size_t output_tokens_len);

// LlgTokenizerInitV2 (several end-of-sequence tokens); struct_size = sizeof(it).
struct LlgTokenizerInitV2 {
  size_t struct_size;
  uint32_t vocab_size;
  uint32_t tok_eos;
  const uint32_t* token_lens;
  const uint8_t* token_bytes;
  const char* tokenizer_json;  // a Hugging Face tokenizer.json, instead of lens/bytes
  bool tokenize_assumes_string;
  LlgTokenizeFn tokenize_fn;
  bool use_approximate_greedy_tokenize_fn;
  const void* tokenize_user_data;
  const char* const* slices;  // null: llguidance's default slices
  const uint32_t* tok_eos_extra;
  uint32_t tok_eos_extra_count;
};

// The functions the worker calls, looked up in the library. Immutable once open()
// returns; shared by every worker made from it (the library stays loaded until the
// last one is gone).
class LlgLibrary {
 public:
  // Loads the shared library at `path` (RTLD_NOW | RTLD_LOCAL). Throws
  // std::invalid_argument naming the path and dlerror() when it does not load, and
  // naming the symbol when one of the functions below is missing.
  static std::shared_ptr<const LlgLibrary> open(const std::string& path);
  ~LlgLibrary();
  LlgLibrary(const LlgLibrary&) = delete;
  LlgLibrary& operator=(const LlgLibrary&) = delete;

  // Returns null on error, with the message written into error_string.
  LlgTokenizer* (*new_tokenizer_v2)(const LlgTokenizerInitV2* init, char* error_string,
                                    size_t error_string_len) = nullptr;
  void (*free_tokenizer)(LlgTokenizer* tok) = nullptr;
  void (*constraint_init_set_defaults)(LlgConstraintInit* init, const LlgTokenizer* tok) = nullptr;
  // Never null; llg_matcher_get_error says whether the grammar compiled.
  LlgMatcher* (*new_matcher)(const LlgConstraintInit* init, const char* constraint_type,
                             const char* data) = nullptr;
  LlgMatcher* (*clone_matcher)(const LlgMatcher* matcher) = nullptr;
  void (*free_matcher)(LlgMatcher* matcher) = nullptr;
  // Null while the matcher has no error.
  const char* (*matcher_get_error)(LlgMatcher* matcher) = nullptr;
  size_t (*matcher_get_mask_byte_size)(const LlgMatcher* matcher) = nullptr;
  // 0 on success, -1 on error (then matcher_get_error says why).
  int32_t (*matcher_compute_mask_into)(LlgMatcher* matcher, uint32_t* mask_dest,
                                       size_t mask_byte_len) = nullptr;
  int32_t (*matcher_consume_token)(LlgMatcher* matcher, uint32_t token) = nullptr;
  bool (*matcher_is_stopped)(const LlgMatcher* matcher) = nullptr;
  bool (*matcher_is_accepting)(LlgMatcher* matcher) = nullptr;

 private:
  LlgLibrary() = default;
  void* handle_ = nullptr;
};

}  // namespace pagedcore::grammar
