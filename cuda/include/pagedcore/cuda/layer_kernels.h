// CUDA kernels of the decoder layer's elementwise ops: RMSNorm (plain, per head, and
// fused with the residual add), rotary embedding from a cos/sin table, SiLU-and-multiply.
//
// Framework-free launchers like kernels.h: a plain struct of device pointers, sizes and
// strides and the caller's stream; each returns the cudaError_t of the launch as an int.
// No allocation, no synchronisation: safe inside a CUDA-graph capture.
//
// Arithmetic: fp32, with every intermediate rounded to the activation dtype where Hugging
// Face's modules round it (they compute op by op in that dtype), so bf16 / fp16 results
// equal the unfused torch arithmetic and fp32 results equal it up to the order of the
// variance sum. Loads are 16-byte vectors where the rows are aligned, scalar otherwise.
#pragma once

#include <cstdint>

#include "pagedcore/cuda/kernels.h"

namespace pagedcore::cuda {

// For each row (token t, head h) of hidden_size elements:
//   x   = input row                                 (residual == nullptr)
//   x   = residual[t] = residual[t] + input[t]      (in dtype; needs num_heads == 1)
//   out = weight * dtype(x * rsqrt(mean(x^2) + eps))
// Head h of token t starts at t * stride + h * hidden_size, so the q or k part of a fused
// qkv output is normalised per head in place (Qwen3's q/k norm). out may equal input;
// residual overlaps neither.
struct RmsNormParams {
  void* out;             // [num_tokens, num_heads, hidden_size], token stride out_stride
  const void* input;     // [num_tokens, num_heads, hidden_size], token stride input_stride
  void* residual;        // optional: [num_tokens, hidden_size], token stride residual_stride
  const void* weight;    // [hidden_size]
  int32_t num_tokens;
  int32_t num_heads;
  int32_t hidden_size;   // up to 16384
  int64_t input_stride;  // elements
  int64_t out_stride;
  int64_t residual_stride;
  float eps;
  DType dtype;           // fp32, bf16 or fp16: out, input, residual and weight
};
int rms_norm(const RmsNormParams& p, void* stream);

// Rotate-half (GPT-NeoX) rotary embedding in place on every head of query and key:
// with p = positions[t], c = dtype(cos_sin_cache[p][i]), s = dtype(cos_sin_cache[p][d/2 +
// i]), x1 = x[i], x2 = x[d/2 + i]:  x[i] = x1 c - x2 s,  x[d/2 + i] = x2 c + x1 s (each
// product and sum rounded to dtype). Tokens whose position is outside [0, max_position)
// are left as they are.
// With key_cache set, the rotated key and the value of every token t with slot =
// slot_mapping[t] in [0, num_blocks * block_size) are also written to the paged caches
// (reshape_and_cache's semantics, fp8 e4m3 included: value / scale, saturated); other
// slots are skipped. The cache write of a decoder layer then costs no launch of its own.
struct RotaryEmbeddingParams {
  const void* positions;       // [num_tokens] int32 or int64
  bool positions_int64;
  void* query;                 // [num_tokens, num_heads, head_dim], token stride query_stride
  void* key;                   // [num_tokens, num_kv_heads, head_dim], token stride key_stride
  const float* cos_sin_cache;  // [max_position, head_dim]: cos | sin
  int32_t num_tokens;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;            // even, up to 1024
  int64_t query_stride;        // elements
  int64_t key_stride;
  int32_t max_position;
  DType dtype;                 // of query, key and value
  // Optional cache write (key_cache == nullptr: none).
  const void* value;           // [num_tokens, num_kv_heads, head_dim], token stride value_stride
  void* key_cache;             // [num_blocks, block_size, num_kv_heads, head_dim]
  void* value_cache;           // same
  const void* slot_mapping;    // [num_tokens] int32 or int64
  bool slot_mapping_int64;
  int32_t num_blocks;
  int32_t block_size;
  int64_t value_stride;
  DType cache_dtype;           // dtype, or kFloat8E4M3 (bf16/fp16 inputs)
  float k_scale;               // fp8: stored = value / scale
  float v_scale;
};
int rotary_embedding(const RotaryEmbeddingParams& p, void* stream);

// out[t][i] = dtype(silu(input[t][i])) * input[t][intermediate_size + i].
struct SiluAndMulParams {
  void* out;                   // [num_tokens, intermediate_size], token stride out_stride
  const void* input;           // [num_tokens, 2 * intermediate_size], token stride input_stride
  int32_t num_tokens;
  int32_t intermediate_size;
  int64_t input_stride;        // elements
  int64_t out_stride;
  DType dtype;
};
int silu_and_mul(const SiluAndMulParams& p, void* stream);

// out[m, :] = input[m, :] @ weight^T (+ bias) for the 1..kLinearMaxRows rows of a
// decode step: weight [out_features, in_features] contiguous, bf16 or fp16 (all
// four tensors of one dtype), float32 accumulation, out rounded once. Needs
// in_features % 8 == 0, input_stride % 8 == 0 and 16-byte aligned input and
// weight; cudaErrorInvalidValue otherwise.
constexpr int32_t kLinearMaxRows = 16;
struct LinearParams {
  void* out;             // [num_tokens, out_features], row stride out_stride
  const void* input;     // [num_tokens, in_features], row stride input_stride
  const void* weight;    // [out_features, in_features]
  const void* bias;      // [out_features] or nullptr
  int32_t num_tokens;
  int32_t in_features;
  int32_t out_features;
  int64_t input_stride;
  int64_t out_stride;
  DType dtype;
  // out[t, j] = silu(y[t, j]) * y[t, I + j] for j < I = out_features / 2, y the
  // product (+ bias) rounded to the dtype: Hugging Face's act_fn(gate) * up over a fused
  // gate_up weight, with silu_and_mul()'s arithmetic. out has I columns.
  bool silu_and_mul = false;
};
int linear(const LinearParams& p, void* stream);

// ---- entry points on integer addresses, for bindings (throw std::runtime_error) ----------

void rms_norm_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t residual,
                 std::uintptr_t weight, DType dtype, int32_t num_tokens, int32_t num_heads,
                 int32_t hidden_size, int64_t input_stride, int64_t out_stride,
                 int64_t residual_stride, float eps, std::uintptr_t stream);
void rotary_embedding_at(std::uintptr_t positions, bool positions_int64, std::uintptr_t query,
                         std::uintptr_t key, std::uintptr_t cos_sin_cache, DType dtype,
                         int32_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
                         int32_t head_dim, int64_t query_stride, int64_t key_stride,
                         int32_t max_position, std::uintptr_t value, std::uintptr_t key_cache,
                         std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                         bool slot_mapping_int64, int32_t num_blocks, int32_t block_size,
                         int64_t value_stride, DType cache_dtype, float k_scale, float v_scale,
                         std::uintptr_t stream);
void silu_and_mul_at(std::uintptr_t out, std::uintptr_t input, DType dtype, int32_t num_tokens,
                     int32_t intermediate_size, int64_t input_stride, int64_t out_stride,
                     std::uintptr_t stream);

void linear_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t weight, std::uintptr_t bias, DType dtype,
               int32_t num_tokens, int32_t in_features, int32_t out_features, int64_t input_stride,
               int64_t out_stride, std::uintptr_t stream, bool silu_and_mul = false);

}  // namespace pagedcore::cuda
