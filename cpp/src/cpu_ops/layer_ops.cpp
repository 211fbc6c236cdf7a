// The decoder layer's fused elementwise ops on the CPU: RMSNorm (plain, over strided
// heads, and fused with the residual add), rotary embedding from a cos/sin table, and
// SiLU-and-multiply (contract: pagedcore/cpu_ops.h).
//
// NOTE: every intermediate is rounded to the activation dtype exactly where Hugging
// Face's modules round it (they compute in that dtype op by op), so that bf16 / fp16
// results equal the unfused torch arithmetic and float32 results equal it up to the
// order of the variance sum. This file is compiled with -ffp-contract=off: an FMA would
// skip a rounding that torch performs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../check.h"
#include "pagedcore/cpu_ops.h"
#include "thread_pool.h"

namespace pagedcore::cpu {
namespace {

// Below this many elements an op runs on the calling thread: waking workers costs more.
constexpr int64_t kParallelElements = int64_t{1} << 16;

// ---- element types ---------------------------------------------------------------------

struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
};

struct BF16 {
  using T = uint16_t;
  static float load(uint16_t v) {
    const uint32_t u = uint32_t{v} << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  // Round to nearest even; NaN stays (quiet) NaN.
  static uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

struct F16 {
  using T = uint16_t;
  // Exact, subnormals, inf and NaN included: move the exponent, renormalize subnormals.
  static float load(uint16_t h) {
    const uint32_t sign = uint32_t{h & 0x8000u} << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
      u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
      u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {
      float f = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
      std::memcpy(&u, &f, sizeof u);
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  // Round to nearest even; overflow -> inf; NaN stays NaN.
  static uint16_t store(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    uint32_t h;
    if (x >= 0x7f800000u) {
      h = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x >= 0x477ff000u) {  // >= 65520: rounds to inf
      h = 0x7c00u;
    } else if (x < 0x38800000u) {  // below 2^-14: subnormal; let the FPU round the sum
      float a;
      std::memcpy(&a, &x, sizeof a);
      a += 0.5f;  // the bits of a - 0.5 are the half's mantissa, rounded to nearest even
      uint32_t u;
      std::memcpy(&u, &a, sizeof u);
      h = u - 0x3f000000u;
    } else {
      x += (uint32_t(15 - 127) << 23) + 0xfffu + ((x >> 13) & 1u);
      h = x >> 13;
    }
    return static_cast<uint16_t>(h | sign);
  }
};

template <typename E>
inline float round_to(float f) {
  return E::load(E::store(f));
}

// Calls fn(E{}) with the element type of dtype.
template <typename Fn>
void dispatch(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(F32{}); return;
    case DType::kBFloat16: fn(BF16{}); return;
    case DType::kFloat16: fn(F16{}); return;
  }
  throw InvalidArgument(detail::concat(op, ": unsupported dtype: ", static_cast<int>(dtype)));
}

// fn(begin, end) over [0, n) rows: on the pool when the total work is large.
template <typename Fn>
void for_rows(int64_t n, int64_t row_elements, Fn&& fn) {
  if (n <= 0) return;
  if (n == 1 || n * row_elements < kParallelElements || pool_threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t pieces = std::min<int64_t>(n, 4 * int64_t{pool_threads()});
  const int64_t step = (n + pieces - 1) / pieces;
  parallel_for(pieces, [&](int64_t i) {
    const int64_t begin = i * step;
    if (begin < n) fn(begin, std::min(n, begin + step));
  });
}

void check_positive(const char* op, const char* field, int64_t v) {
  if (v <= 0) throw InvalidArgument(detail::concat(op, ": ", field, " must be > 0, got ", v));
}

void check_stride(const char* op, const char* field, int64_t stride, int64_t minimum) {
  if (stride < minimum) {
    throw InvalidArgument(detail::concat(op, ": ", field, " ", stride, " is below the row size ", minimum));
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------

// Sum of squares with 8 independent partial sums (which the compiler can vectorize), in
// double: the rounding of a long float sum would cost rows of 8k elements a few ulps.
template <typename E>
float sum_squares(const typename E::T* x, int64_t n) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const double v = E::load(x[i + l]);
      acc[l] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = E::load(x[i]);
    acc[0] += v * v;
  }
  return static_cast<float>(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
}

template <typename E>
void rms_norm_rows(const RmsNormArgs& a, int64_t begin, int64_t end) {
  using T = typename E::T;
  const int64_t n = a.hidden_size;
  const auto* w = static_cast<const T*>(a.weight);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t t = row / a.num_heads, h = row % a.num_heads;
    const T* in = static_cast<const T*>(a.input) + t * a.input_stride + h * n;
    T* out = static_cast<T*>(a.out) + t * a.out_stride + h * n;
    const T* x = in;
    if (a.residual != nullptr) {
      // HF: hidden = residual + hidden, in the activation dtype.
      T* res = static_cast<T*>(a.residual) + t * a.residual_stride;
      for (int64_t i = 0; i < n; ++i) res[i] = E::store(E::load(res[i]) + E::load(in[i]));
      x = res;
    }
    const float variance = sum_squares<E>(x, n) / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(variance + a.eps);
    for (int64_t i = 0; i < n; ++i) {
      out[i] = E::store(E::load(w[i]) * round_to<E>(E::load(x[i]) * inv));
    }
  }
}

// ---- rotary ----------------------------------------------------------------------------

template <typename E>
void rotate_heads(typename E::T* base, int64_t heads, int64_t head_dim, const float* cos_sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    typename E::T* x = base + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float c = round_to<E>(cos_sin[i]), s = round_to<E>(cos_sin[half + i]);
      const float x1 = E::load(x[i]), x2 = E::load(x[half + i]);
      // HF: x * cos + rotate_half(x) * sin, each product and the sum in the dtype.
      x[i] = E::store(round_to<E>(x1 * c) - round_to<E>(x2 * s));
      x[half + i] = E::store(round_to<E>(x2 * c) + round_to<E>(x1 * s));
    }
  }
}

int64_t index_at(const void* data, IndexType type, int64_t i) {
  return type == IndexType::kInt32 ? int64_t{static_cast<const int32_t*>(data)[i]}
                                   : static_cast<const int64_t*>(data)[i];
}

int64_t position_at(const RotaryEmbeddingArgs& a, int64_t t) { return index_at(a.positions, a.positions_type, t); }

void check_index_type(const char* op, const char* field, IndexType type) {
  if (type != IndexType::kInt32 && type != IndexType::kInt64) {
    throw InvalidArgument(detail::concat(op, ": unsupported ", field, " index type: ", static_cast<int>(type)));
  }
}

// ---- SiLU and multiply -----------------------------------------------------------------

template <typename E>
void silu_and_mul_rows(const SiluAndMulArgs& a, int64_t begin, int64_t end) {
  using T = typename E::T;
  const int64_t n = a.intermediate_size;
  for (int64_t t = begin; t < end; ++t) {
    const T* gate = static_cast<const T*>(a.input) + t * a.input_stride;
    const T* up = gate + n;
    T* out = static_cast<T*>(a.out) + t * a.out_stride;
    for (int64_t i = 0; i < n; ++i) {
      const float g = E::load(gate[i]);
      // HF: act_fn(gate) * up: silu rounded to the dtype, then the product.
      const float silu = round_to<E>(g / (1.0f + std::exp(-g)));
      out[i] = E::store(silu * E::load(up[i]));
    }
  }
}

}  // namespace

void rms_norm(const RmsNormArgs& a) {
  const char* op = a.residual != nullptr ? "fused_add_rms_norm" : "rms_norm";
  if (a.num_tokens < 0) {
    throw InvalidArgument(detail::concat(op, ": num_tokens must be >= 0, got ", a.num_tokens));
  }
  check_positive(op, "num_heads", a.num_heads);
  check_positive(op, "hidden_size", a.hidden_size);
  if (a.residual != nullptr && a.num_heads != 1) {
    throw InvalidArgument(detail::concat(op, ": a residual needs num_heads == 1, got ", a.num_heads));
  }
  if (!(std::isfinite(a.eps) && a.eps >= 0.0f)) {
    throw InvalidArgument(detail::concat(op, ": eps must be finite and >= 0, got ", a.eps));
  }
  const int64_t row = a.num_heads * a.hidden_size;
  if (a.num_tokens > 1) {
    check_stride(op, "input_stride", a.input_stride, row);
    check_stride(op, "out_stride", a.out_stride, row);
    if (a.residual != nullptr) check_stride(op, "residual_stride", a.residual_stride, row);
  }
  dispatch(a.dtype, op, [&](auto e) {
    using E = decltype(e);
    for_rows(a.num_tokens * a.num_heads, a.hidden_size,
             [&](int64_t begin, int64_t end) { rms_norm_rows<E>(a, begin, end); });
  });
}

void rotary_embedding(const RotaryEmbeddingArgs& a) {
  const char* op = "rotary_embedding";
  if (a.num_tokens < 0) {
    throw InvalidArgument(detail::concat(op, ": num_tokens must be >= 0, got ", a.num_tokens));
  }
  check_positive(op, "num_heads", a.num_heads);
  check_positive(op, "num_kv_heads", a.num_kv_heads);
  if (a.head_dim <= 0 || a.head_dim % 2 != 0) {
    throw InvalidArgument(detail::concat(op, ": head_dim must be even and > 0, got ", a.head_dim));
  }
  check_index_type(op, "positions", a.positions_type);
  const int64_t kv_row = a.num_kv_heads * a.head_dim;
  if (a.num_tokens > 1) {
    check_stride(op, "query_stride", a.query_stride, a.num_heads * a.head_dim);
    check_stride(op, "key_stride", a.key_stride, kv_row);
  }
  const bool write_cache = a.key_cache != nullptr;
  if (write_cache) {
    check_index_type(op, "slot_mapping", a.slot_mapping_type);
    if (a.block_size <= 0 || a.num_blocks < 0) {
      throw InvalidArgument(detail::concat(op, ": bad cache shape [", a.num_blocks, ", ", a.block_size, "]"));
    }
    if (a.num_tokens > 1) check_stride(op, "value_stride", a.value_stride, kv_row);
    const int64_t num_slots = a.num_blocks * a.block_size;
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const int64_t slot = index_at(a.slot_mapping, a.slot_mapping_type, t);
      if (slot >= num_slots) {
        throw InvalidArgument(detail::concat(op, ": slot_mapping[", t, "] = ", slot, " out of range [0, ",
                                             num_slots, ") (negative slots are skipped)"));
      }
    }
  }
  for (int64_t t = 0; t < a.num_tokens; ++t) {  // everything checked before anything is written
    const int64_t p = position_at(a, t);
    if (p < 0 || p >= a.max_position) {
      throw InvalidArgument(detail::concat(op, ": positions[", t, "] = ", p, " outside the cos/sin table [0, ",
                                           a.max_position, ")"));
    }
  }
  dispatch(a.dtype, op, [&](auto e) {
    using E = decltype(e);
    using T = typename E::T;
    for_rows(a.num_tokens, (a.num_heads + a.num_kv_heads) * a.head_dim, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos_sin = a.cos_sin_cache + position_at(a, t) * a.head_dim;
        rotate_heads<E>(static_cast<T*>(a.query) + t * a.query_stride, a.num_heads, a.head_dim, cos_sin);
        T* key = static_cast<T*>(a.key) + t * a.key_stride;
        rotate_heads<E>(key, a.num_kv_heads, a.head_dim, cos_sin);
        if (!write_cache) continue;
        const int64_t slot = index_at(a.slot_mapping, a.slot_mapping_type, t);
        if (slot < 0) continue;  // padding
        std::memcpy(static_cast<T*>(a.key_cache) + slot * kv_row, key, kv_row * sizeof(T));
        std::memcpy(static_cast<T*>(a.value_cache) + slot * kv_row,
                    static_cast<const T*>(a.value) + t * a.value_stride, kv_row * sizeof(T));
      }
    });
  });
}

void silu_and_mul(const SiluAndMulArgs& a) {
  const char* op = "silu_and_mul";
  if (a.num_tokens < 0) {
    throw InvalidArgument(detail::concat(op, ": num_tokens must be >= 0, got ", a.num_tokens));
  }
  check_positive(op, "intermediate_size", a.intermediate_size);
  if (a.num_tokens > 1) {
    check_stride(op, "input_stride", a.input_stride, 2 * a.intermediate_size);
    check_stride(op, "out_stride", a.out_stride, a.intermediate_size);
  }
  dispatch(a.dtype, op, [&](auto e) {
    using E = decltype(e);
    for_rows(a.num_tokens, 3 * a.intermediate_size,
             [&](int64_t begin, int64_t end) { silu_and_mul_rows<E>(a, begin, end); });
  });
}

void rms_norm_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t residual,
                 std::uintptr_t weight, DType dtype, int64_t num_tokens, int64_t num_heads,
                 int64_t hidden_size, int64_t input_stride, int64_t out_stride,
                 int64_t residual_stride, float eps) {
  RmsNormArgs a;
  a.out = reinterpret_cast<void*>(out);
  a.input = reinterpret_cast<const void*>(input);
  a.residual = reinterpret_cast<void*>(residual);
  a.weight = reinterpret_cast<const void*>(weight);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.num_heads = num_heads;
  a.hidden_size = hidden_size;
  a.input_stride = input_stride;
  a.out_stride = out_stride;
  a.residual_stride = residual_stride;
  a.eps = eps;
  rms_norm(a);
}

void rotary_embedding_at(std::uintptr_t positions, IndexType positions_type, std::uintptr_t query,
                         std::uintptr_t key, std::uintptr_t cos_sin_cache, DType dtype,
                         int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t query_stride, int64_t key_stride,
                         int64_t max_position, std::uintptr_t value, std::uintptr_t key_cache,
                         std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                         IndexType slot_mapping_type, int64_t num_blocks, int64_t block_size,
                         int64_t value_stride) {
  RotaryEmbeddingArgs a;
  a.value = reinterpret_cast<const void*>(value);
  a.key_cache = reinterpret_cast<void*>(key_cache);
  a.value_cache = reinterpret_cast<void*>(value_cache);
  a.slot_mapping = reinterpret_cast<const void*>(slot_mapping);
  a.slot_mapping_type = slot_mapping_type;
  a.num_blocks = num_blocks;
  a.block_size = block_size;
  a.value_stride = value_stride;
  a.positions = reinterpret_cast<const void*>(positions);
  a.positions_type = positions_type;
  a.query = reinterpret_cast<void*>(query);
  a.key = reinterpret_cast<void*>(key);
  a.cos_sin_cache = reinterpret_cast<const float*>(cos_sin_cache);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.query_stride = query_stride;
  a.key_stride = key_stride;
  a.max_position = max_position;
  rotary_embedding(a);
}

void silu_and_mul_at(std::uintptr_t out, std::uintptr_t input, DType dtype, int64_t num_tokens,
                     int64_t intermediate_size, int64_t input_stride, int64_t out_stride) {
  SiluAndMulArgs a;
  a.out = reinterpret_cast<void*>(out);
  a.input = reinterpret_cast<const void*>(input);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.intermediate_size = intermediate_size;
  a.input_stride = input_stride;
  a.out_stride = out_stride;
  silu_and_mul(a);
}

}  // namespace pagedcore::cpu
