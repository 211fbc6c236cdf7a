// pagedcore._C: registration of the core's types and functions. No logic here:
// every behaviour lives in the core; lambdas only adapt arguments.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>

#include "grammar.h"
#include "numpy_views.h"
#include "ops.h"
#include "pagedcore/engine.h"
#include "pagedcore/errors.h"
#include "pagedcore/log.h"
#include "pagedcore/version.h"
#ifdef PAGEDCORE_WITH_CUDA
#include "pagedcore/cuda/device_info.h"
#endif

namespace py = pybind11;
using namespace pybind11::literals;
using pagedcore::bindings::view;

namespace pagedcore {
namespace {

template <typename>
struct member_owner;
template <typename C, typename M>
struct member_owner<M C::*> {
  using type = C;
};

// View of the pointer member Data with Count rows (and Cols columns when > 0).
template <auto Data, auto Count, py::ssize_t Cols = 0>
py::array field_view(py::object self) {
  using Owner = typename member_owner<decltype(Data)>::type;
  const Owner& o = self.cast<const Owner&>();
  if constexpr (Cols == 0) {
    return view(o.*Data, {o.*Count}, self);
  } else {
    return view(o.*Data, {o.*Count, Cols}, self);
  }
}

EngineConfig make_config(int32_t num_blocks, int32_t block_size, int32_t max_num_seqs,
                         int32_t max_num_batched_tokens, int32_t max_model_len,
                         bool enable_prefix_caching, const std::string& preemption_mode,
                         const std::string& scheduling_policy, int32_t num_cpu_blocks,
                         std::optional<int32_t> sliding_window, int32_t vocab_size,
                         int32_t prefix_hash_bits, bool reserve_max_model_len,
                         int32_t max_num_mixed_prefill_tokens, int32_t mixed_prefill_waiting_per_cap,
                         int32_t mixed_prefill_max_waiting, int32_t mixed_prefill_lift_tokens,
                         int32_t mixed_prefill_lift_max_waiting) {
  EngineConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = max_model_len;
  c.enable_prefix_caching = enable_prefix_caching;
  c.preemption_mode = parse_preemption_mode(preemption_mode);
  c.scheduling_policy = parse_scheduling_policy(scheduling_policy);
  c.num_cpu_blocks = num_cpu_blocks;
  c.sliding_window = sliding_window.value_or(0);
  c.vocab_size = vocab_size;
  c.prefix_hash_bits = prefix_hash_bits;
  c.reserve_max_model_len = reserve_max_model_len;
  c.max_num_mixed_prefill_tokens = max_num_mixed_prefill_tokens;
  c.mixed_prefill_waiting_per_cap = mixed_prefill_waiting_per_cap;
  c.mixed_prefill_max_waiting = mixed_prefill_max_waiting;
  c.mixed_prefill_lift_tokens = mixed_prefill_lift_tokens;
  c.mixed_prefill_lift_max_waiting = mixed_prefill_lift_max_waiting;
  c.validate();
  return c;
}

RequestParams make_params(int32_t n, int32_t max_tokens, int32_t min_tokens, bool ignore_eos,
                          const std::vector<int64_t>& eos_token_ids,
                          const std::vector<int64_t>& stop_token_ids, int32_t priority,
                          uint64_t cache_salt, bool prompt_logprobs) {
  RequestParams p;
  p.n = n;
  p.max_tokens = max_tokens;
  p.min_tokens = min_tokens;
  p.ignore_eos = ignore_eos;
  p.eos_token_ids = to_token_ids(eos_token_ids.data(), eos_token_ids.size(), "eos_token_ids");
  p.stop_token_ids = to_token_ids(stop_token_ids.data(), stop_token_ids.size(), "stop_token_ids");
  p.priority = priority;
  p.cache_salt = cache_salt;
  p.prompt_logprobs = prompt_logprobs;
  return p;
}

py::dict cuda_info() {
#ifdef PAGEDCORE_WITH_CUDA
  const cuda::DeviceInfo info = cuda::query_devices();
  return py::dict("compiled"_a = true, "device_count"_a = info.device_count,
                  "runtime_version"_a = info.runtime_version,
                  "driver_version"_a = info.driver_version);
#else
  return py::dict("compiled"_a = false, "device_count"_a = 0, "runtime_version"_a = 0,
                  "driver_version"_a = 0);
#endif
}

void cuda_smoke_test() {
#ifdef PAGEDCORE_WITH_CUDA
  const std::string error = cuda::smoke_test();
  if (!error.empty()) throw std::runtime_error("CUDA smoke test failed: " + error);
#else
  throw std::runtime_error("pagedcore was built without CUDA (PAGEDCORE_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace
}  // namespace pagedcore

PYBIND11_MODULE(_C, m) {
  using namespace pagedcore;
  m.doc() = "pagedcore core: block allocator, KV cache manager, scheduler and engine";
  m.attr("__version__") = PAGEDCORE_VERSION_STRING;

  py::register_exception<InvalidArgument>(m, "InvalidArgumentError", PyExc_ValueError);
  py::register_exception<NotFound>(m, "NotFoundError", PyExc_KeyError);
  py::register_exception<InvalidState>(m, "InvalidStateError", PyExc_RuntimeError);
  py::register_exception<InternalError>(m, "InternalError", PyExc_RuntimeError);

  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("STOP", FinishReason::kStop)
      .value("LENGTH", FinishReason::kLength)
      .value("ABORT", FinishReason::kAbort);

  py::enum_<LogLevel>(m, "LogLevel")
      .value("DEBUG", LogLevel::kDebug)
      .value("INFO", LogLevel::kInfo)
      .value("WARNING", LogLevel::kWarning)
      .value("ERROR", LogLevel::kError);
  m.def("set_log_sink", &set_log_sink, "sink"_a,
        "Route the core's log messages to sink(level: LogLevel, message: str); None restores "
        "the default (stderr).");

  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init(&make_config), py::kw_only(), "num_blocks"_a = 1024, "block_size"_a = 16,
           "max_num_seqs"_a = 256, "max_num_batched_tokens"_a = 2048, "max_model_len"_a = 2048,
           "enable_prefix_caching"_a = true, "preemption_mode"_a = "recompute",
           "scheduling_policy"_a = "fcfs", "num_cpu_blocks"_a = 0, "sliding_window"_a = py::none(),
           "vocab_size"_a = 0, "prefix_hash_bits"_a = 64,
           "reserve_max_model_len"_a = false, "max_num_mixed_prefill_tokens"_a = 0,
           "mixed_prefill_waiting_per_cap"_a = 0, "mixed_prefill_max_waiting"_a = 8,
           "mixed_prefill_lift_tokens"_a = 0, "mixed_prefill_lift_max_waiting"_a = 64)
      .def_readonly("num_blocks", &EngineConfig::num_blocks)
      .def_readonly("block_size", &EngineConfig::block_size)
      .def_readonly("max_num_seqs", &EngineConfig::max_num_seqs)
      .def_readonly("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readonly("max_model_len", &EngineConfig::max_model_len)
      .def_readonly("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_property_readonly("preemption_mode",
                             [](const EngineConfig& c) { return to_string(c.preemption_mode); })
      .def_property_readonly("scheduling_policy",
                             [](const EngineConfig& c) { return to_string(c.scheduling_policy); })
      .def_readonly("num_cpu_blocks", &EngineConfig::num_cpu_blocks)
      .def_readonly("sliding_window", &EngineConfig::sliding_window)
      .def_readonly("vocab_size", &EngineConfig::vocab_size)
      .def_readonly("prefix_hash_bits", &EngineConfig::prefix_hash_bits)
      .def_readonly("reserve_max_model_len", &EngineConfig::reserve_max_model_len)
      .def_readonly("max_num_mixed_prefill_tokens", &EngineConfig::max_num_mixed_prefill_tokens)
      .def_readonly("mixed_prefill_waiting_per_cap", &EngineConfig::mixed_prefill_waiting_per_cap)
      .def_readonly("mixed_prefill_max_waiting", &EngineConfig::mixed_prefill_max_waiting)
      .def_readonly("mixed_prefill_lift_tokens", &EngineConfig::mixed_prefill_lift_tokens)
      .def_readonly("mixed_prefill_lift_max_waiting", &EngineConfig::mixed_prefill_lift_max_waiting)
      .def_property_readonly("max_blocks_per_seq", &EngineConfig::max_blocks_per_seq);

  py::class_<RequestParams>(m, "RequestParams")
      .def(py::init(&make_params), py::kw_only(), "n"_a = 1, "max_tokens"_a = 16,
           "min_tokens"_a = 0, "ignore_eos"_a = false,
           "eos_token_ids"_a = std::vector<int64_t>{}, "stop_token_ids"_a = std::vector<int64_t>{},
           "priority"_a = 0, "cache_salt"_a = 0, "prompt_logprobs"_a = false)
      .def_readonly("n", &RequestParams::n)
      .def_readonly("max_tokens", &RequestParams::max_tokens)
      .def_readonly("min_tokens", &RequestParams::min_tokens)
      .def_readonly("ignore_eos", &RequestParams::ignore_eos)
      .def_readonly("eos_token_ids", &RequestParams::eos_token_ids)
      .def_readonly("stop_token_ids", &RequestParams::stop_token_ids)
      .def_readonly("priority", &RequestParams::priority)
      .def_readonly("cache_salt", &RequestParams::cache_salt)
      .def_readonly("prompt_logprobs", &RequestParams::prompt_logprobs);

  py::class_<StepBatch>(m, "StepBatch",
                        "One step's inputs as read-only numpy views into the engine's buffers, "
                        "valid until the next schedule().")
      .def_readonly("num_tokens", &StepBatch::num_tokens)
      .def_readonly("num_seqs", &StepBatch::num_seqs)
      .def_readonly("num_decode_seqs", &StepBatch::num_decode_seqs)
      .def_readonly("num_samples", &StepBatch::num_samples)
      .def_readonly("num_block_copies", &StepBatch::num_block_copies)
      .def_readonly("num_swap_out", &StepBatch::num_swap_out)
      .def_readonly("num_swap_in", &StepBatch::num_swap_in)
      .def_readonly("num_prompt_logprob_tokens", &StepBatch::num_prompt_logprob_tokens)
      .def_readonly("num_prompt_logprob_seqs", &StepBatch::num_prompt_logprob_seqs)
      .def_readonly("block_size", &StepBatch::block_size)
      .def_readonly("max_blocks_per_seq", &StepBatch::max_blocks_per_seq)
      .def_property_readonly("input_ids", &field_view<&StepBatch::input_ids, &StepBatch::num_tokens>)
      .def_property_readonly("positions", &field_view<&StepBatch::positions, &StepBatch::num_tokens>)
      .def_property_readonly("slot_mapping",
                             &field_view<&StepBatch::slot_mapping, &StepBatch::num_tokens>)
      .def_property_readonly("seq_ids", &field_view<&StepBatch::seq_ids, &StepBatch::num_seqs>)
      .def_property_readonly("query_start_loc",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBatch&>();
                               return view(b.query_start_loc, {b.num_seqs + 1}, self);
                             })
      .def_property_readonly(
          "num_computed_tokens",
          &field_view<&StepBatch::num_computed_tokens, &StepBatch::num_seqs>)
      .def_property_readonly("seq_lens", &field_view<&StepBatch::seq_lens, &StepBatch::num_seqs>)
      .def_property_readonly("block_tables",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBatch&>();
                               return view(b.block_tables, {b.num_seqs, b.max_blocks_per_seq},
                                           self);
                             })
      .def_property_readonly("sample_indices",
                             &field_view<&StepBatch::sample_indices, &StepBatch::num_samples>)
      .def_property_readonly("sample_seq_ids",
                             &field_view<&StepBatch::sample_seq_ids, &StepBatch::num_samples>)
      .def_property_readonly("sample_slots",
                             &field_view<&StepBatch::sample_slots, &StepBatch::num_samples>)
      .def_property_readonly(
          "sample_num_outputs",
          &field_view<&StepBatch::sample_num_outputs, &StepBatch::num_samples>)
      .def_property_readonly("prompt_logprob_indices",
                             &field_view<&StepBatch::prompt_logprob_indices,
                                         &StepBatch::num_prompt_logprob_tokens>)
      .def_property_readonly("prompt_logprob_token_ids",
                             &field_view<&StepBatch::prompt_logprob_token_ids,
                                         &StepBatch::num_prompt_logprob_tokens>)
      .def_property_readonly("prompt_logprob_seq_ids",
                             &field_view<&StepBatch::prompt_logprob_seq_ids,
                                         &StepBatch::num_prompt_logprob_seqs>)
      .def_property_readonly("prompt_logprob_start_loc",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBatch&>();
                               return view(b.prompt_logprob_start_loc,
                                           {b.num_prompt_logprob_seqs + 1}, self);
                             })
      .def_property_readonly("prompt_logprob_first_positions",
                             &field_view<&StepBatch::prompt_logprob_first_positions,
                                         &StepBatch::num_prompt_logprob_seqs>)
      .def_readonly("num_deferred_inputs", &StepBatch::num_deferred_inputs)
      .def_property_readonly("deferred_input_indices",
                             &field_view<&StepBatch::deferred_input_indices,
                                         &StepBatch::num_deferred_inputs>)
      .def_property_readonly("deferred_input_samples",
                             &field_view<&StepBatch::deferred_input_samples,
                                         &StepBatch::num_deferred_inputs>)
      .def_property_readonly(
          "block_copies", &field_view<&StepBatch::block_copies, &StepBatch::num_block_copies, 2>)
      .def_property_readonly("swap_out",
                             &field_view<&StepBatch::swap_out, &StepBatch::num_swap_out, 2>)
      .def_property_readonly("swap_in",
                             &field_view<&StepBatch::swap_in, &StepBatch::num_swap_in, 2>);

  py::class_<StepResult>(m, "StepResult",
                         "What update() or resolve() did with each sample, as read-only numpy "
                         "views valid until the next update() or resolve().")
      .def_readonly("num_outputs", &StepResult::num_outputs)
      .def_property_readonly("seq_ids", &field_view<&StepResult::seq_ids, &StepResult::num_outputs>)
      .def_property_readonly("token_ids",
                             &field_view<&StepResult::token_ids, &StepResult::num_outputs>)
      .def_property_readonly("finish_reasons",
                             &field_view<&StepResult::finish_reasons, &StepResult::num_outputs>)
      .def_property_readonly("stop_reasons",
                             &field_view<&StepResult::stop_reasons, &StepResult::num_outputs>)
      .def_readonly("finished_request_ids", &StepResult::finished_request_ids);

  py::class_<EngineStats>(m, "EngineStats")
      .def_readonly("num_blocks", &EngineStats::num_blocks)
      .def_readonly("num_free_blocks", &EngineStats::num_free_blocks)
      .def_readonly("num_cached_blocks", &EngineStats::num_cached_blocks)
      .def_readonly("num_used_blocks", &EngineStats::num_used_blocks)
      .def_readonly("num_cpu_blocks", &EngineStats::num_cpu_blocks)
      .def_readonly("num_free_cpu_blocks", &EngineStats::num_free_cpu_blocks)
      .def_readonly("num_requests", &EngineStats::num_requests)
      .def_readonly("num_running_seqs", &EngineStats::num_running_seqs)
      .def_readonly("num_waiting_seqs", &EngineStats::num_waiting_seqs)
      .def_readonly("num_swapped_seqs", &EngineStats::num_swapped_seqs)
      .def_readonly("num_steps", &EngineStats::num_steps)
      .def_readonly("num_preemptions", &EngineStats::num_preemptions)
      .def_readonly("num_recompute_preemptions", &EngineStats::num_recompute_preemptions)
      .def_readonly("num_swap_preemptions", &EngineStats::num_swap_preemptions)
      .def_readonly("prefix_cache_queries", &EngineStats::prefix_cache_queries)
      .def_readonly("prefix_cache_hits", &EngineStats::prefix_cache_hits)
      .def_readonly("prefix_cache_hit_rate", &EngineStats::prefix_cache_hit_rate)
      .def_readonly("num_prompt_tokens", &EngineStats::num_prompt_tokens)
      .def_readonly("num_generation_tokens", &EngineStats::num_generation_tokens)
      .def_readonly("num_kv_tokens", &EngineStats::num_kv_tokens)
      .def_readonly("num_reserved_blocks", &EngineStats::num_reserved_blocks);

  py::class_<Engine>(m, "Engine")
      .def(py::init<const EngineConfig&>(), "config"_a)
      .def_property_readonly("config", &Engine::config)
      .def_property_readonly("num_physical_blocks", &Engine::num_physical_blocks)
      .def_property_readonly("num_physical_cpu_blocks", &Engine::num_physical_cpu_blocks)
      .def_property_readonly("has_pending_step", &Engine::has_pending_step)
      .def_property_readonly("num_unfinished_requests", &Engine::num_unfinished_requests)
      .def("has_unfinished_requests", &Engine::has_unfinished_requests)
      .def(
          "add_request",
          [](Engine& e, const std::string& request_id, const std::vector<int64_t>& prompt,
             const RequestParams& params) {
            return e.add_request(request_id,
                                 to_token_ids(prompt.data(), prompt.size(), "prompt_token_ids"),
                                 params);
          },
          "request_id"_a, "prompt_token_ids"_a, "params"_a = RequestParams())
      .def("abort", &Engine::abort, "request_id"_a)
      .def("schedule", &Engine::schedule, py::return_value_policy::reference_internal)
      // int32 arrays go through without a copy; int64 arrays and lists are
      // range-checked by the core. No unsafe cast: floats are a TypeError.
      .def(
          "update",
          [](Engine& e, py::array_t<TokenId, py::array::c_style> sampled) -> const StepResult& {
            return e.update(sampled.data(), static_cast<int32_t>(sampled.size()));
          },
          "sampled_token_ids"_a, py::return_value_policy::reference_internal)
      .def(
          "update",
          [](Engine& e, py::array_t<int64_t, py::array::c_style> sampled) -> const StepResult& {
            return e.update(sampled.data(), static_cast<int32_t>(sampled.size()));
          },
          "sampled_token_ids"_a, py::return_value_policy::reference_internal)
      .def("append_placeholders", &Engine::append_placeholders)
      .def(
          "resolve",
          [](Engine& e, py::array_t<TokenId, py::array::c_style> sampled) -> const StepResult& {
            return e.resolve(sampled.data(), static_cast<int32_t>(sampled.size()));
          },
          "sampled_token_ids"_a, py::return_value_policy::reference_internal)
      .def(
          "resolve",
          [](Engine& e, py::array_t<int64_t, py::array::c_style> sampled) -> const StepResult& {
            return e.resolve(sampled.data(), static_cast<int32_t>(sampled.size()));
          },
          "sampled_token_ids"_a, py::return_value_policy::reference_internal)
      .def_property_readonly("num_unresolved_steps", &Engine::num_unresolved_steps)
      .def_property_readonly("num_unresolved_samples", &Engine::num_unresolved_samples)
      .def("finish", &Engine::finish, "seq_id"_a, "reason"_a = FinishReason::kStop)
      .def("fork", &Engine::fork, "seq_id"_a)
      .def("set_last_token", &Engine::set_last_token, "seq_id"_a, "token"_a)
      .def("request_slot", &Engine::request_slot, "request_id"_a)
      .def_property_readonly("max_request_slots", &Engine::max_request_slots)
      .def("stats", &Engine::stats)
      .def("seq_token_ids", &Engine::seq_token_ids, "seq_id"_a)
      .def("seq_block_table", &Engine::seq_block_table, "seq_id"_a)
      .def("check_invariants", &Engine::check_invariants);

  pagedcore::bindings::register_ops(m);
  pagedcore::bindings::register_grammar(m);

  // Tensor parallelism's shared-memory control channel (distributed/control_ring.py):
  // 64-bit words at raw addresses of a mapping that every rank shares, loaded and
  // stored sequentially consistent (the payload written before a release, read
  // after an acquire; the reader's sleep flag against the writer's sequence).
  m.def(
      "atomic_load_i64",
      [](std::uintptr_t address) { return __atomic_load_n(reinterpret_cast<const int64_t*>(address), __ATOMIC_SEQ_CST); },
      "address"_a, "The 8-byte-aligned int64 at `address`, loaded sequentially consistent.");
  m.def(
      "atomic_store_i64",
      [](std::uintptr_t address, int64_t value) {
        __atomic_store_n(reinterpret_cast<int64_t*>(address), value, __ATOMIC_SEQ_CST);
      },
      "address"_a, "value"_a, "Stores `value` into the 8-byte-aligned int64 at `address`, sequentially consistent.");

  m.def("cuda_info", &cuda_info,
        "Whether the CUDA kernels were compiled in, and the devices the driver reports.");
  m.def("cuda_smoke_test", &cuda_smoke_test, py::call_guard<py::gil_scoped_release>(),
        "Run a trivial kernel on device 0 and check its result; raises RuntimeError on failure.");
}
