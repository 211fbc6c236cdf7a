// Basic vocabulary shared by every part of the core.
#pragma once

#include <cstdint>

namespace pagedcore {

// Physical KV-cache block index. Block 0 of every pool is the null block: it is
// never handed out, block tables use it for entries that hold nothing (blocks
// released by a sliding window), and a kernel that reads it reads valid memory.
using BlockId = int32_t;
using TokenId = int32_t;
// Sequence ids are unique over the engine's lifetime; a request with n samples
// owns n consecutive ids starting at the id add_request returns.
using SeqId = int64_t;

inline constexpr BlockId kNullBlock = 0;
inline constexpr BlockId kNoBlock = -1;
// The value a sequence holds for a sampled token that is not known yet (async
// scheduling: Engine::append_placeholders). Never a valid token id.
inline constexpr TokenId kPlaceholderToken = -1;

// Why a sequence stopped. Values are stable: Python sees them as integers.
enum class FinishReason : uint8_t {
  kNone = 0,    // still running
  kStop = 1,    // EOS, a stop token, or a stop decided by the caller (stop string)
  kLength = 2,  // max_tokens reached, or max_model_len reached
  kAbort = 3,   // aborted by the caller
};

const char* to_string(FinishReason reason);

enum class PreemptionMode : uint8_t {
  kRecompute = 0,  // drop the victim's KV; it is recomputed when it resumes
  kSwap = 1,       // copy the victim's blocks to the CPU pool and back later
};

enum class SchedulingPolicy : uint8_t {
  kFcfs = 0,      // first come, first served
  kPriority = 1,  // lower `priority` value first, then arrival order
};

}  // namespace pagedcore
