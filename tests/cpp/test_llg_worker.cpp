// LlgWorker (cpp/grammar) over llguidance's C API, for the sanitizers: lifecycles
// (create, clone, free, a step in flight at free and at destruction), threads, and
// the masks of a digits regex against the tokenizer's own vocabulary.
// Needs $PAGEDCORE_LLG_LIB (llguidance's _lib.abi3.so) and $PAGEDCORE_LLG_TOKENIZER_JSON
// (a byte-level BPE tokenizer.json, e.g. SmolLM2's); skipped without them. The wheel's
// library refers to libpython's functions (its PyO3 half): outside a Python process,
// $PAGEDCORE_LLG_PYTHON_LIB names the libpython to load first (RTLD_GLOBAL).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../../cpp/grammar/llg_worker.h"

namespace pagedcore::grammar {
namespace {

struct Inputs {
  std::string lib_path;
  std::string tokenizer_json;
};

bool inputs(Inputs* out) {
  const char* lib = std::getenv("PAGEDCORE_LLG_LIB");
  const char* json = std::getenv("PAGEDCORE_LLG_TOKENIZER_JSON");
  if (lib == nullptr || json == nullptr) return false;
  if (const char* python = std::getenv("PAGEDCORE_LLG_PYTHON_LIB")) {
    if (dlopen(python, RTLD_NOW | RTLD_GLOBAL) == nullptr) return false;
  }
  std::ifstream file(json);
  std::stringstream text;
  text << file.rdbuf();
  out->lib_path = lib;
  out->tokenizer_json = text.str();
  return !out->tokenizer_json.empty();
}

// Ids of the vocabulary entries made of ASCII digits only: the "<digits>": <id> pairs
// of the JSON (only the vocabulary maps such strings to numbers).
std::set<int32_t> digit_tokens(const std::string& json) {
  std::set<int32_t> ids;
  for (size_t i = json.find('"'); i != std::string::npos; i = json.find('"', i + 1)) {
    size_t j = i + 1;
    while (j < json.size() && json[j] >= '0' && json[j] <= '9') ++j;
    if (j == i + 1 || json.compare(j, 3, "\": ") != 0) continue;
    ids.insert(std::atoi(json.c_str() + j + 3));
    i = j;
  }
  return ids;
}

std::set<int32_t> allowed(const std::vector<int32_t>& masks, int64_t row, int32_t words) {
  std::set<int32_t> ids;
  for (int32_t w = 0; w < words; ++w) {
    uint32_t bits = static_cast<uint32_t>(masks[row * words + w]);
    for (int b = 0; b < 32; ++b) {
      if (bits >> b & 1u) ids.insert(w * 32 + b);
    }
  }
  return ids;
}

constexpr int32_t kVocab = 49152;
constexpr int64_t kEos = 2;

TEST(LlgWorker, DigitsRegexMasksThreadsAndLifecycles) {
  Inputs in;
  if (!inputs(&in)) GTEST_SKIP() << "set PAGEDCORE_LLG_LIB and PAGEDCORE_LLG_TOKENIZER_JSON";
  auto lib = LlgLibrary::open(in.lib_path);
  std::set<int32_t> digits = digit_tokens(in.tokenizer_json);
  ASSERT_GE(digits.size(), 10u);
  std::set<int32_t> digits_eos = digits;
  digits_eos.insert(kEos);
  int32_t seven = -1, letter = -1;
  {
    // (the id of "7" and of a non-digit: the digit ids are consecutive in byte-level vocabularies)
    seven = *digits.begin() + 7;
    letter = *digits.begin() - 1;
  }
  LlgWorker worker(lib, in.tokenizer_json, kVocab, {kEos}, 3);
  const int32_t words = worker.num_words();
  int64_t lane0 = worker.new_matcher("regex", "[0-9]+", 0);
  int64_t lane1 = worker.new_matcher("regex", "[0-9]+", 1);
  constexpr int64_t kRows = 16;
  std::vector<int64_t> handles;
  for (int64_t r = 0; r < kRows; ++r) handles.push_back(worker.clone_matcher(r % 2 ? lane1 : lane0));
  std::vector<int32_t> masks(kRows * words, -1);
  std::vector<uint8_t> status(kRows, 9), stopped(kRows, 9);
  std::vector<int32_t> none(kRows, -1);
  uint32_t flag = 0;
  worker.step(handles.data(), none.data(), kRows, masks.data(), status.data(), stopped.data(), &flag, 7);
  EXPECT_EQ(flag, 7u);
  for (int64_t r = 0; r < kRows; ++r) {
    EXPECT_EQ(allowed(masks, r, words), digits) << r;
    EXPECT_EQ(status[r], kRowOk);
    EXPECT_EQ(stopped[r], 0);
  }
  std::vector<int32_t> tokens(kRows, seven);
  tokens[3] = letter;
  worker.start_step(handles.data(), tokens.data(), kRows, masks.data(), status.data(), stopped.data(), &flag, 8);
  worker.wait_step();
  EXPECT_EQ(flag, 8u);
  for (int64_t r = 0; r < kRows; ++r) {
    if (r == 3) {
      EXPECT_EQ(status[r], kRowRefused);
      EXPECT_EQ(allowed(masks, r, words), std::set<int32_t>{kEos});
      EXPECT_NE(worker.error(handles[r]).find("doesn't satisfy the grammar"), std::string::npos);
    } else {
      EXPECT_EQ(status[r], kRowOk) << r;
      EXPECT_EQ(allowed(masks, r, words), digits_eos) << r;
    }
  }
  // A step in flight when its matchers are freed: the frees wait for it.
  worker.start_step(handles.data(), none.data(), kRows, masks.data(), status.data(), stopped.data(), &flag, 9);
  for (int64_t h : handles) worker.free_matcher(h);
  EXPECT_EQ(flag, 9u);
  EXPECT_THROW(worker.free_matcher(handles[0]), std::invalid_argument);
  int64_t twice[2] = {lane0, lane0};
  EXPECT_THROW(worker.step(twice, none.data(), 2, masks.data(), status.data(), stopped.data(), nullptr, 0),
               std::invalid_argument);
  EXPECT_THROW(worker.new_matcher("regex", "[0-", 0), std::invalid_argument);
  for (int i = 0; i < 200; ++i) worker.free_matcher(worker.clone_matcher(lane0));
  EXPECT_EQ(worker.num_matchers(), 2);
  // Destroyed with a step in flight: the destructor runs it to the end first.
  LlgWorker* other = new LlgWorker(lib, in.tokenizer_json, kVocab, {kEos}, 2);
  int64_t m = other->new_matcher("regex", "[0-9]+", 0);
  other->start_step(&m, none.data(), 1, masks.data(), status.data(), stopped.data(), &flag, 10);
  delete other;
  EXPECT_EQ(flag, 10u);
  EXPECT_THROW(LlgLibrary::open("libm.so.6"), std::invalid_argument);
}

}  // namespace
}  // namespace pagedcore::grammar
