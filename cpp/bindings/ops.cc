// Registration of the CPU kernels (pagedcore/cpu_ops.h). pagedcore/ops.py checks the
// tensors and calls these with their data_ptr(), sizes and strides.
#include "ops.h"

#include <pybind11/stl.h>

#include "pagedcore/cpu_ops.h"
#ifdef PAGEDCORE_WITH_CUDA
#include "pagedcore/cuda/bitmask_kernels.h"
#include "pagedcore/cuda/kernels.h"
#include "pagedcore/cuda/layer_kernels.h"
#endif

namespace py = pybind11;
using namespace pybind11::literals;

namespace pagedcore::bindings {

void register_ops(pybind11::module_& m) {
  using cpu::DType;
  using cpu::IndexType;
  using release_gil = py::call_guard<py::gil_scoped_release>;

  py::enum_<DType>(m, "CpuDType")
      .value("FLOAT32", DType::kFloat32)
      .value("BFLOAT16", DType::kBFloat16)
      .value("FLOAT16", DType::kFloat16);
  py::enum_<IndexType>(m, "CpuIndexType")
      .value("INT32", IndexType::kInt32)
      .value("INT64", IndexType::kInt64);

  m.def("cpu_reshape_and_cache", &cpu::reshape_and_cache_at, release_gil(), "key"_a, "value"_a,
        "key_cache"_a, "value_cache"_a, "slot_mapping"_a, "slot_mapping_type"_a, "dtype"_a,
        "num_tokens"_a, "num_kv_heads"_a, "head_dim"_a, "num_blocks"_a, "block_size"_a,
        "key_stride"_a, "value_stride"_a);
  m.def("cpu_paged_attention", &cpu::paged_attention_at, release_gil(), "out"_a, "query"_a,
        "key_cache"_a, "value_cache"_a, "block_tables"_a, "seq_lens"_a, "query_start_loc"_a,
        "dtype"_a, "num_tokens"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "num_blocks"_a,
        "block_size"_a, "num_seqs"_a, "max_blocks_per_seq"_a, "query_stride"_a,
        "block_tables_stride"_a, "scale"_a, "sliding_window"_a, "softcap"_a);
  m.def("cpu_copy_blocks", &cpu::copy_blocks_at, release_gil(), "key_caches"_a,
        "value_caches"_a, "block_mapping"_a, "block_mapping_type"_a, "dtype"_a, "num_pairs"_a,
        "num_blocks"_a, "block_numel"_a);
  m.def("cpu_swap_blocks", &cpu::swap_blocks_at, release_gil(), "src"_a, "dst"_a,
        "block_mapping"_a, "block_mapping_type"_a, "dtype"_a, "num_pairs"_a, "num_src_blocks"_a,
        "num_dst_blocks"_a, "block_numel"_a);
  m.def("cpu_rms_norm", &cpu::rms_norm_at, release_gil(), "out"_a, "input"_a, "residual"_a,
        "weight"_a, "dtype"_a, "num_tokens"_a, "num_heads"_a, "hidden_size"_a, "input_stride"_a,
        "out_stride"_a, "residual_stride"_a, "eps"_a);
  m.def("cpu_rotary_embedding", &cpu::rotary_embedding_at, release_gil(), "positions"_a,
        "positions_type"_a, "query"_a, "key"_a, "cos_sin_cache"_a, "dtype"_a, "num_tokens"_a,
        "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "query_stride"_a, "key_stride"_a,
        "max_position"_a, "value"_a, "key_cache"_a, "value_cache"_a, "slot_mapping"_a,
        "slot_mapping_type"_a, "num_blocks"_a, "block_size"_a, "value_stride"_a);
  m.def("cpu_silu_and_mul", &cpu::silu_and_mul_at, release_gil(), "out"_a, "input"_a, "dtype"_a,
        "num_tokens"_a, "intermediate_size"_a, "input_stride"_a, "out_stride"_a);
  m.def("cpu_linear", &cpu::linear_at, release_gil(), "out"_a, "input"_a, "weight"_a, "bias"_a,
        "num_tokens"_a, "in_features"_a, "out_features"_a, "input_stride"_a, "out_stride"_a);
  m.def("cpu_set_num_threads", &cpu::set_num_threads, release_gil(), "n"_a);
  m.def("cpu_get_num_threads", &cpu::get_num_threads);
  m.def("cpu_isa", &cpu::cpu_isa);
  m.def("cpu_set_isa", &cpu::set_cpu_isa, "isa"_a);

#ifdef PAGEDCORE_WITH_CUDA
  // Launches are asynchronous on the given stream: the GIL is not worth releasing.
  py::enum_<cuda::DType>(m, "CudaDType")
      .value("FLOAT32", cuda::DType::kFloat32)
      .value("BFLOAT16", cuda::DType::kBFloat16)
      .value("FLOAT16", cuda::DType::kFloat16)
      .value("FLOAT8_E4M3", cuda::DType::kFloat8E4M3);
  m.def("cuda_attention_tile_vectors", &cuda::attention_tile_vectors, "element_bytes"_a);
  m.attr("cuda_attention_partial_vectors") = cuda::kAttentionPartialVectors;
  m.def("cuda_decode_supported", &cuda::decode_supported, "group"_a, "head_dim"_a, "element_bytes"_a);
  m.def("cuda_wgmma_prefill_available", &cuda::wgmma_prefill_available);
  m.def("cuda_wgmma_selftest", &cuda::wgmma_selftest_at);
  m.def("cuda_reshape_and_cache", &cuda::reshape_and_cache_at, "key"_a, "value"_a, "key_cache"_a,
        "value_cache"_a, "slot_mapping"_a, "slot_mapping_int64"_a, "dtype"_a, "num_tokens"_a,
        "num_kv_heads"_a, "head_dim"_a, "num_blocks"_a, "block_size"_a, "key_stride"_a,
        "value_stride"_a, "cache_dtype"_a, "k_scale"_a, "v_scale"_a, "stream"_a);
  m.def("cuda_copy_blocks", &cuda::copy_blocks_at, "cache_ptrs"_a, "block_mapping"_a,
        "num_caches"_a, "num_pairs"_a, "num_blocks"_a, "block_bytes"_a, "stream"_a);
  m.def("cuda_gather_blocks", &cuda::gather_blocks_at, "cache_ptrs"_a, "blocks"_a, "staging"_a,
        "num_caches"_a, "num_blocks_moved"_a, "num_blocks"_a, "block_bytes"_a, "to_staging"_a,
        "stream"_a);
  m.def("cuda_paged_attention", &cuda::paged_attention_at, "out"_a, "query"_a, "key_cache"_a,
        "value_cache"_a, "block_tables"_a, "seq_lens"_a, "query_start_loc"_a, "work_seq"_a,
        "work_q_start"_a, "partial_out"_a, "partial_lse"_a, "decode_seq"_a,
        "decode_partial_out"_a, "decode_partial_lse"_a, "split_counters"_a,
        "decode_split_counters"_a, "num_decode"_a, "decode_splits"_a,
        "num_work"_a, "num_splits"_a,
        "tile_tokens"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "block_size"_a,
        "num_blocks"_a, "query_stride"_a, "block_tables_stride"_a, "scale"_a, "softcap"_a,
        "sliding_window"_a, "dtype"_a, "kv_dtype"_a, "k_scale"_a, "v_scale"_a,
        "decode_cluster"_a, "decode_max_query_tokens"_a, "stream"_a);
  m.def("cuda_rms_norm", &cuda::rms_norm_at, "out"_a, "input"_a, "residual"_a, "weight"_a, "dtype"_a,
        "num_tokens"_a, "num_heads"_a, "hidden_size"_a, "input_stride"_a, "out_stride"_a,
        "residual_stride"_a, "eps"_a, "stream"_a);
  m.def("cuda_rotary_embedding", &cuda::rotary_embedding_at, "positions"_a, "positions_int64"_a,
        "query"_a, "key"_a, "cos_sin_cache"_a, "dtype"_a, "num_tokens"_a, "num_heads"_a,
        "num_kv_heads"_a, "head_dim"_a, "query_stride"_a, "key_stride"_a, "max_position"_a,
        "value"_a, "key_cache"_a, "value_cache"_a, "slot_mapping"_a, "slot_mapping_int64"_a,
        "num_blocks"_a, "block_size"_a, "value_stride"_a, "cache_dtype"_a, "k_scale"_a, "v_scale"_a,
        "stream"_a);
  m.def("cuda_silu_and_mul", &cuda::silu_and_mul_at, "out"_a, "input"_a, "dtype"_a, "num_tokens"_a,
        "intermediate_size"_a, "input_stride"_a, "out_stride"_a, "stream"_a);
  m.def("cuda_linear", &cuda::linear_at, "out"_a, "input"_a, "weight"_a, "bias"_a, "dtype"_a, "num_tokens"_a,
        "in_features"_a, "out_features"_a, "input_stride"_a, "out_stride"_a, "stream"_a, "silu_and_mul"_a = false);
  m.attr("CUDA_LINEAR_MAX_ROWS") = cuda::kLinearMaxRows;
  m.def("cuda_apply_token_bitmask", &cuda::apply_token_bitmask_at, "logits"_a, "bitmask"_a, "rows"_a,
        "rows_int64"_a, "status"_a, "num_masks"_a, "num_rows"_a, "vocab"_a, "num_words"_a,
        "logits_stride"_a, "dtype"_a, "stream"_a);
  m.def("cuda_wait_host_flag", &cuda::wait_host_flag_at, "flag"_a, "ticket"_a, "timeout_ns"_a, "status"_a,
        "stream"_a);
#endif
}

}  // namespace pagedcore::bindings
