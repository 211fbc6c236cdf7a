#include "pagedcore/config.h"

#include <cstdio>

#include "check.h"

namespace pagedcore {

namespace detail {

void fail_check(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(concat("pagedcore internal error at ", file, ":", line, ": check `", cond,
                             "` failed", msg.empty() ? "" : ": ", msg));
}

}  // namespace detail

namespace {

void require(bool ok, const char* field, int64_t value, const char* rule) {
  if (!ok) {
    throw InvalidArgument(detail::concat(field, " must be ", rule, ", got ", value));
  }
}

}  // namespace

std::vector<TokenId> to_token_ids(const int64_t* ids, size_t n, const char* field) {
  std::vector<TokenId> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] > INT32_MAX) {
      throw InvalidArgument(detail::concat(field, "[", i, "] = ", ids[i], " is not a token id"));
    }
    out[i] = static_cast<TokenId>(ids[i]);
  }
  return out;
}

const char* to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
  }
  return "?";
}

const char* to_string(PreemptionMode mode) {
  return mode == PreemptionMode::kSwap ? "swap" : "recompute";
}

const char* to_string(SchedulingPolicy policy) {
  return policy == SchedulingPolicy::kPriority ? "priority" : "fcfs";
}

PreemptionMode parse_preemption_mode(const std::string& name) {
  if (name == "recompute") return PreemptionMode::kRecompute;
  if (name == "swap") return PreemptionMode::kSwap;
  throw InvalidArgument("preemption_mode must be 'recompute' or 'swap', got '" + name + "'");
}

SchedulingPolicy parse_scheduling_policy(const std::string& name) {
  if (name == "fcfs") return SchedulingPolicy::kFcfs;
  if (name == "priority") return SchedulingPolicy::kPriority;
  throw InvalidArgument("scheduling_policy must be 'fcfs' or 'priority', got '" + name + "'");
}

void EngineConfig::validate() const {
  require(num_blocks >= 1, "num_blocks", num_blocks, ">= 1");
  require(block_size == 8 || block_size == 16 || block_size == 32 || block_size == 64 ||
              block_size == 128,
          "block_size", block_size, "one of 8, 16, 32, 64, 128");
  require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, ">= 1");
  require(max_num_batched_tokens >= 1, "max_num_batched_tokens", max_num_batched_tokens, ">= 1");
  require(max_num_mixed_prefill_tokens >= 0, "max_num_mixed_prefill_tokens",
          max_num_mixed_prefill_tokens, ">= 0 (0 disables the cap)");
  require(mixed_prefill_waiting_per_cap >= 0, "mixed_prefill_waiting_per_cap",
          mixed_prefill_waiting_per_cap, ">= 0 (0: no share for the queue)");
  require(mixed_prefill_max_waiting >= 0, "mixed_prefill_max_waiting", mixed_prefill_max_waiting,
          ">= 0");
  require(mixed_prefill_lift_tokens >= 0, "mixed_prefill_lift_tokens", mixed_prefill_lift_tokens,
          ">= 0 (0: a lifted cap takes the whole budget)");
  require(mixed_prefill_lift_max_waiting >= 0, "mixed_prefill_lift_max_waiting",
          mixed_prefill_lift_max_waiting, ">= 0");
  require(max_model_len >= 1, "max_model_len", max_model_len, ">= 1");
  require(num_cpu_blocks >= 0, "num_cpu_blocks", num_cpu_blocks, ">= 0");
  if (preemption_mode == PreemptionMode::kSwap && num_cpu_blocks == 0) {
    throw InvalidArgument(
        "num_cpu_blocks must be >= 1 when preemption_mode is 'swap', got 0");
  }
  require(sliding_window >= 0, "sliding_window", sliding_window, ">= 0 (0 disables it)");
  require(vocab_size >= 0, "vocab_size", vocab_size, ">= 0 (0 disables the check)");
  require(prefix_hash_bits >= 0 && prefix_hash_bits <= 64, "prefix_hash_bits", prefix_hash_bits,
          "in [0, 64]");
  // Keeps block-table rows and slot numbers inside int32.
  require(static_cast<int64_t>(num_blocks + 1) * block_size < (int64_t{1} << 31), "num_blocks",
          num_blocks, "small enough that (num_blocks + 1) * block_size < 2^31");
}

int32_t EngineConfig::max_blocks_per_seq() const {
  return (max_model_len + block_size - 1) / block_size;
}

}  // namespace pagedcore
