// CPU kernels of pagedcore.ops: paged attention over the block-structured KV cache, the
// cache operations around it (write, copy-on-write block copy, swap), the decoder
// layer's fused elementwise ops (RMSNorm, rotary embedding, SiLU-and-multiply) and the
// linear layers of decode steps (float32 products of a few rows). Framework-free:
// plain structs of pointers, sizes and strides; no torch, no pybind11.
//
// Three layers (STYLE.md item 3):
//   1. launchers on plain structs (first half of this header);
//   2. entry points by address (second half): they take the addresses of the buffers as
//      integers, as a foreign caller holds them (pagedcore/ops.py passes
//      tensor.data_ptr()), build the struct and call the launcher;
//   3. registration (cpp/bindings/ops.cc).
//
// Layout. A KV cache of one layer is two contiguous arrays K and V of shape
// [num_blocks, block_size, num_kv_heads, head_dim]: token slot s = block * block_size +
// offset holds num_kv_heads * head_dim contiguous values. Element types: DType below;
// computation is always fp32 (16-bit values are widened on load, outputs are rounded to
// nearest even).
//
// Errors. Every launcher validates all of its input before writing anything: bad input
// throws InvalidArgument naming the field and the value (an unsupported head_dim reads
// "unsupported head_dim: N"), and a launcher that throws has written nothing. Checks that
// cost O(num_tokens + num_seqs + blocks read) are done here; per-call shape and dtype
// agreement between the buffers cannot be seen through raw pointers and is the caller's
// to check (ops.py does).
//
// Threads. The launchers split their work over a persistent pool of std::threads owned by
// the core (not OpenMP: torch ships its own runtime). The calling thread works too and the
// call returns when everything is written. Concurrent calls from several threads are safe;
// while one call uses the pool, another runs on its caller's thread alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedcore/errors.h"

namespace pagedcore::cpu {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

// ---- 1. launchers -----------------------------------------------------------------------

// reshape_and_cache: K[slot_mapping[t]] = key[t], V[slot_mapping[t]] = value[t] for every
// token t with slot_mapping[t] >= 0 (negative slots are padding and skipped).
// key / value: heads dense, tokens key_stride / value_stride elements apart; caches
// contiguous. Preconditions: the slots that are >= 0 are distinct (else which token wins
// is undefined); the caches do not overlap key / value.
struct ReshapeAndCacheArgs {
  const void* key = nullptr;           // [num_tokens, num_kv_heads, head_dim], see key_stride
  const void* value = nullptr;         // [num_tokens, num_kv_heads, head_dim], see value_stride
  void* key_cache = nullptr;           // [num_blocks, block_size, num_kv_heads, head_dim]
  void* value_cache = nullptr;         // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* slot_mapping = nullptr;  // [num_tokens], int32 or int64 (slot_mapping_type)
  IndexType slot_mapping_type = IndexType::kInt64;
  DType dtype = DType::kFloat32;  // of key, value and both caches
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t key_stride = 0;    // elements between consecutive tokens, >= num_kv_heads * head_dim
  int64_t value_stride = 0;  // same for value
};
void reshape_and_cache(const ReshapeAndCacheArgs& args);

// paged_attention: causal attention of each row's queries over the row's cached keys and
// values, for a batch that mixes decode rows, prefill rows and chunked-prefill rows.
//
// Row r owns queries query_start_loc[r] .. query_start_loc[r + 1] - 1 (q_len of them);
// they are the LAST q_len positions of a sequence of seq_lens[r] tokens, so query i of the
// row sits at position p = seq_lens[r] - q_len + i, and sees keys j with
// max(0, p - sliding_window + 1) <= j <= p (all j <= p when sliding_window == 0). Key j
// lives at slot block_tables[r][j / block_size] * block_size + j % block_size. Query head
// h uses kv head h / (num_heads / num_kv_heads).
//   score = (q . k) * scale;  if softcap > 0: score = softcap * tanh(score / softcap)
//   out   = softmax(scores) @ V   (fp32, written in dtype)
// Only the visible keys are read: table entries and cache slots that no query of a row
// sees (the null block, slots before the window, unwritten slots) may hold anything.
// Layout: query heads dense, tokens query_stride elements apart; out and both caches
// contiguous; block_tables rows block_tables_stride elements apart.
// Preconditions: the caller has written this step's keys/values (reshape_and_cache);
// out does not overlap the inputs. Tokens after query_start_loc[num_seqs] are left as
// they are in out.
struct PagedAttentionArgs {
  void* out = nullptr;                       // [num_tokens, num_heads, head_dim]
  const void* query = nullptr;               // [num_tokens, num_heads, head_dim], see query_stride
  const void* key_cache = nullptr;           // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache = nullptr;         // [num_blocks, block_size, num_kv_heads, head_dim]
  const int32_t* block_tables = nullptr;     // [num_seqs, max_blocks_per_seq], rows strided
  const int32_t* seq_lens = nullptr;         // [num_seqs]
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1], non-decreasing
  DType dtype = DType::kFloat32;    // of out, query and both caches
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;         // divides num_heads
  int64_t head_dim = 0;             // one of 32, 64, 80, 96, 128, 256
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_seqs = 0;
  int64_t max_blocks_per_seq = 0;
  int64_t query_stride = 0;         // elements between tokens, >= num_heads * head_dim
  int64_t block_tables_stride = 0;  // elements between rows, >= max_blocks_per_seq
  float scale = 1.0f;
  int32_t sliding_window = 0;       // 0: no window
  float softcap = 0.0f;             // 0: no softcap
};
void paged_attention(const PagedAttentionArgs& args);

// copy_blocks: for every layer l and pair i, copies block block_mapping[i][0] of
// key_caches[l] / value_caches[l] to block block_mapping[i][1] (copy-on-write).
// Caches and mapping contiguous. Preconditions: all layers share num_blocks, block_size,
// num_kv_heads, head_dim and dtype. Destinations must be distinct and no destination may
// be a source (checked).
struct CopyBlocksArgs {
  // [num_layers] pointers, each to [num_blocks, block_size, num_kv_heads, head_dim]
  void* const* key_caches = nullptr;
  void* const* value_caches = nullptr;  // same as key_caches
  const void* block_mapping = nullptr;  // [num_pairs, 2] (src, dst), block_mapping_type
  IndexType block_mapping_type = IndexType::kInt64;
  DType dtype = DType::kFloat32;
  int64_t num_layers = 0;
  int64_t num_pairs = 0;
  int64_t num_blocks = 0;
  int64_t block_numel = 0;  // block_size * num_kv_heads * head_dim
};
void copy_blocks(const CopyBlocksArgs& args);

// swap_blocks: copies block block_mapping[i][0] of src to block block_mapping[i][1] of
// dst, for every pair i (swap-out / swap-in between two pools; both in host memory here).
// Pools and mapping contiguous. Destinations must be distinct; when src and dst are the
// same array no destination may be a source (checked).
struct SwapBlocksArgs {
  const void* src = nullptr;            // [num_src_blocks, block_size, num_kv_heads, head_dim]
  void* dst = nullptr;                  // [num_dst_blocks, block_size, num_kv_heads, head_dim]
  const void* block_mapping = nullptr;  // [num_pairs, 2] (src, dst), block_mapping_type
  IndexType block_mapping_type = IndexType::kInt64;
  DType dtype = DType::kFloat32;
  int64_t num_pairs = 0;
  int64_t num_src_blocks = 0;
  int64_t num_dst_blocks = 0;
  int64_t block_numel = 0;  // block_size * num_kv_heads * head_dim
};
void swap_blocks(const SwapBlocksArgs& args);

// ---- layer ops (cpu_ops/layer_ops.cpp) ---------------------------------------------------
// Elementwise ops of a decoder layer, each one pass over its rows. Intermediates are
// rounded to dtype where Hugging Face's modules round them (they compute op by op in the
// activation dtype); products run in fp32, the sum of squares of RMSNorm in double.

// rms_norm: for each row (token t, head h) of hidden_size elements,
//   x   = input row                       (residual == nullptr)
//   x   = residual[t] = residual[t] + input[t]   (in dtype; residual != nullptr, num_heads == 1)
//   out = weight * dtype(x * 1 / sqrt(mean(x^2) + eps))
// Head h of token t starts at t * stride + h * hidden_size (a [num_tokens, num_heads,
// hidden_size] view with dense heads, e.g. the q or k part of a fused qkv output: Qwen3's
// per-head q/k norm). out may be input (in place); residual overlaps neither.
struct RmsNormArgs {
  void* out = nullptr;          // [num_tokens, num_heads, hidden_size], see out_stride
  const void* input = nullptr;  // [num_tokens, num_heads, hidden_size], see input_stride
  void* residual = nullptr;     // optional: [num_tokens, hidden_size], see residual_stride
  const void* weight = nullptr; // [hidden_size], contiguous
  DType dtype = DType::kFloat32;  // of out, input, residual and weight
  int64_t num_tokens = 0;
  int64_t num_heads = 1;
  int64_t hidden_size = 0;
  int64_t input_stride = 0;     // elements between tokens, >= num_heads * hidden_size
  int64_t out_stride = 0;
  int64_t residual_stride = 0;
  float eps = 1e-6f;            // finite, >= 0
};
void rms_norm(const RmsNormArgs& args);

// rotary_embedding: rotate-half (GPT-NeoX) rotary embedding, in place on every head of
// query and key. With p = positions[t], c = cos_sin_cache[p][i], s =
// cos_sin_cache[p][head_dim / 2 + i] (both rounded to dtype) and x1 = x[i], x2 = x[i +
// head_dim / 2] for i < head_dim / 2:
//   x[i] = x1 * c - x2 * s,   x[i + head_dim / 2] = x2 * c + x1 * s
// (each product and sum rounded to dtype). Positions must lie in [0, max_position)
// (checked before anything is written).
// With key_cache set, the rotated key and the value of every token t with slot =
// slot_mapping[t] >= 0 are also written to the paged caches (reshape_and_cache's
// semantics: slots < num_blocks * block_size, checked first; negative slots skipped).
struct RotaryEmbeddingArgs {
  const void* positions = nullptr;      // [num_tokens], positions_type
  IndexType positions_type = IndexType::kInt64;
  void* query = nullptr;                // [num_tokens, num_heads, head_dim], see query_stride
  void* key = nullptr;                  // [num_tokens, num_kv_heads, head_dim], see key_stride
  const float* cos_sin_cache = nullptr; // [max_position, head_dim]: cos | sin, contiguous
  DType dtype = DType::kFloat32;        // of query and key
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;                 // even
  int64_t query_stride = 0;             // elements between tokens, >= num_heads * head_dim
  int64_t key_stride = 0;               // >= num_kv_heads * head_dim
  int64_t max_position = 0;
  // Optional cache write (key_cache == nullptr: none).
  const void* value = nullptr;          // [num_tokens, num_kv_heads, head_dim], see value_stride
  void* key_cache = nullptr;            // [num_blocks, block_size, num_kv_heads, head_dim], dtype
  void* value_cache = nullptr;          // same
  const void* slot_mapping = nullptr;   // [num_tokens], slot_mapping_type
  IndexType slot_mapping_type = IndexType::kInt64;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t value_stride = 0;             // >= num_kv_heads * head_dim
};
void rotary_embedding(const RotaryEmbeddingArgs& args);

// silu_and_mul: out[t][i] = dtype(silu(input[t][i])) * input[t][intermediate_size + i]
// (the gate and up halves of a fused gate_up projection). out overlaps no input.
struct SiluAndMulArgs {
  void* out = nullptr;          // [num_tokens, intermediate_size], see out_stride
  const void* input = nullptr;  // [num_tokens, 2 * intermediate_size], see input_stride
  DType dtype = DType::kFloat32;
  int64_t num_tokens = 0;
  int64_t intermediate_size = 0;
  int64_t input_stride = 0;     // >= 2 * intermediate_size
  int64_t out_stride = 0;       // >= intermediate_size
};
void silu_and_mul(const SiluAndMulArgs& args);

// linear: out[t][n] = sum_k input[t][k] * weight[n][k] (+ bias[n]), float32, for the few
// token rows of a decode step (torch's GEMM stays the better choice for prefill-sized
// inputs). Each output is summed in one fixed order whatever num_tokens and the thread
// count (W-lane partial sums over k with fused multiply-adds, their sum, the tail, the
// bias), so a token's output does not depend on the other rows of the call. The order
// differs from torch's GEMM: results agree with it to float32 rounding, not bit for bit.
// out overlaps no input.
struct LinearArgs {
  float* out = nullptr;            // [num_tokens, out_features], see out_stride
  const float* input = nullptr;    // [num_tokens, in_features], see input_stride
  const float* weight = nullptr;   // [out_features, in_features], contiguous
  const float* bias = nullptr;     // [out_features], or nullptr for none
  int64_t num_tokens = 0;
  int64_t in_features = 0;         // >= 1
  int64_t out_features = 0;        // >= 1
  int64_t input_stride = 0;        // elements between tokens, >= in_features
  int64_t out_stride = 0;          // >= out_features
};
void linear(const LinearArgs& args);

// Threads used by the launchers, the calling thread included: n >= 1 (InvalidArgument
// otherwise). Default: std::thread::hardware_concurrency(). Takes effect for the next
// launch; safe to call at any time.
void set_num_threads(int32_t n);
int32_t get_num_threads();

// Instruction set of the attention kernels: "avx512", "avx2" or "generic" (portable
// vector code). The best one the CPU supports is picked at load; set_cpu_isa selects
// another (for tests and benchmarks) and throws InvalidArgument if the CPU lacks it.
std::string cpu_isa();
void set_cpu_isa(const std::string& isa);

// ---- 2. entry points by address ---------------------------------------------------------
// The same operations with every buffer passed as its address (std::uintptr_t) and every
// dtype as its DType / IndexType. Shapes are named as in the structs above.

void reshape_and_cache_at(std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache,
                          std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                          IndexType slot_mapping_type, DType dtype, int64_t num_tokens,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                          int64_t block_size, int64_t key_stride, int64_t value_stride);

void paged_attention_at(std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache,
                        std::uintptr_t value_cache, std::uintptr_t block_tables,
                        std::uintptr_t seq_lens, std::uintptr_t query_start_loc, DType dtype,
                        int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t num_blocks, int64_t block_size,
                        int64_t num_seqs, int64_t max_blocks_per_seq, int64_t query_stride,
                        int64_t block_tables_stride, float scale, int32_t sliding_window,
                        float softcap);

// key_caches / value_caches: one address per layer.
void copy_blocks_at(const std::vector<std::uintptr_t>& key_caches,
                    const std::vector<std::uintptr_t>& value_caches,
                    std::uintptr_t block_mapping, IndexType block_mapping_type, DType dtype,
                    int64_t num_pairs, int64_t num_blocks, int64_t block_numel);

void swap_blocks_at(std::uintptr_t src, std::uintptr_t dst, std::uintptr_t block_mapping,
                    IndexType block_mapping_type, DType dtype, int64_t num_pairs,
                    int64_t num_src_blocks, int64_t num_dst_blocks, int64_t block_numel);

// residual: 0 for a plain RMSNorm.
void rms_norm_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t residual,
                 std::uintptr_t weight, DType dtype, int64_t num_tokens, int64_t num_heads,
                 int64_t hidden_size, int64_t input_stride, int64_t out_stride,
                 int64_t residual_stride, float eps);

// key_cache 0: no cache write (value, value_cache, slot_mapping and the sizes after it unused).
void rotary_embedding_at(std::uintptr_t positions, IndexType positions_type, std::uintptr_t query,
                         std::uintptr_t key, std::uintptr_t cos_sin_cache, DType dtype,
                         int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t query_stride, int64_t key_stride,
                         int64_t max_position, std::uintptr_t value, std::uintptr_t key_cache,
                         std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                         IndexType slot_mapping_type, int64_t num_blocks, int64_t block_size,
                         int64_t value_stride);

void silu_and_mul_at(std::uintptr_t out, std::uintptr_t input, DType dtype, int64_t num_tokens,
                     int64_t intermediate_size, int64_t input_stride, int64_t out_stride);

// bias 0: none.
void linear_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t weight, std::uintptr_t bias,
               int64_t num_tokens, int64_t in_features, int64_t out_features, int64_t input_stride,
               int64_t out_stride);

}  // namespace pagedcore::cpu
