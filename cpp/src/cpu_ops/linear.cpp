// Linear layers of a few tokens on the CPU (contract: pagedcore/cpu_ops.h).
//
// A decode step multiplies one activation row per sequence by every weight matrix of the
// model: the time is the time to read the weights (float32 SmolLM2-135M: 540 MB per
// token). On the AMD EPYC (Zen 4) of the 2-core test machine torch's float32 GEMM (MKL)
// took 3x as long for the 121 one-row products of a SmolLM2 step as a plain streaming
// read of the same bytes (torch.sum); this kernel takes 1.6x, and a batch-1 decode step
// went from 56 to 35 ms (fastest of many steps, bench/RESULTS.md). So the decoder sends
// its few-row float32 products here: every weight row is streamed once through vector
// fused multiply-adds, the output rows are split over the core's thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "../check.h"
#include "isa.h"
#include "pagedcore/cpu_ops.h"
#include "thread_pool.h"

#if !defined(__clang__)
// Vector types never cross a call between target regions (see simd.h).
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define PAGEDCORE_INLINE inline __attribute__((always_inline))

namespace pagedcore::cpu {
namespace {

// Weight bytes per parallel item: large enough that a claim (one atomic) is noise, small
// enough that two threads finish together on the smallest matrices of a model.
constexpr int64_t kItemBytes = int64_t{64} << 10;
// Below this many weight bytes a call runs on the calling thread: waking workers costs
// more than it saves.
constexpr int64_t kParallelBytes = int64_t{256} << 10;

#define PAGEDCORE_ISA_KERNELS "linear_kernels.h"
#include "per_isa.h"

using RowsFn = void (*)(const LinearArgs&, int64_t, int64_t);

RowsFn rows_fn(Isa isa) {
#if PAGEDCORE_HAVE_X86_TARGETS
  if (isa == Isa::kAvx512) return &isa_avx512::linear_rows;
  if (isa == Isa::kAvx2) return &isa_avx2::linear_rows;
#endif
  return &isa_generic::linear_rows;
}

void validate(const LinearArgs& a) {
  const char* op = "linear";
  auto fail = [&](const char* field, int64_t value, const char* want) {
    throw InvalidArgument(detail::concat(op, ": ", field, " must be ", want, ", got ", value));
  };
  if (a.num_tokens < 0) fail("num_tokens", a.num_tokens, ">= 0");
  if (a.in_features < 1) fail("in_features", a.in_features, ">= 1");
  if (a.out_features < 1) fail("out_features", a.out_features, ">= 1");
  if (a.num_tokens > 1 && a.input_stride < a.in_features) {
    fail("input_stride", a.input_stride, ">= in_features");
  }
  if (a.num_tokens > 1 && a.out_stride < a.out_features) {
    fail("out_stride", a.out_stride, ">= out_features");
  }
  if (a.num_tokens > 0 && (a.out == nullptr || a.input == nullptr || a.weight == nullptr)) {
    throw InvalidArgument(detail::concat(op, ": out, input and weight must not be null"));
  }
}

}  // namespace

void linear(const LinearArgs& args) {
  validate(args);
  if (args.num_tokens == 0) return;
  const RowsFn fn = rows_fn(current_isa().load());
  const int64_t row_bytes = args.in_features * static_cast<int64_t>(sizeof(float));
  if (args.out_features * row_bytes < kParallelBytes || pool_threads() == 1) {
    fn(args, 0, args.out_features);
    return;
  }
  // Items of about kItemBytes of weights each.
  const int64_t rows = std::max<int64_t>(1, kItemBytes / row_bytes);
  const int64_t items = (args.out_features + rows - 1) / rows;
  parallel_for(items, [&](int64_t i) {
    fn(args, i * rows, std::min(args.out_features, (i + 1) * rows));
  });
}

void linear_at(std::uintptr_t out, std::uintptr_t input, std::uintptr_t weight, std::uintptr_t bias,
               int64_t num_tokens, int64_t in_features, int64_t out_features, int64_t input_stride,
               int64_t out_stride) {
  LinearArgs a;
  a.out = reinterpret_cast<float*>(out);
  a.input = reinterpret_cast<const float*>(input);
  a.weight = reinterpret_cast<const float*>(weight);
  a.bias = reinterpret_cast<const float*>(bias);
  a.num_tokens = num_tokens;
  a.in_features = in_features;
  a.out_features = out_features;
  a.input_stride = input_stride;
  a.out_stride = out_stride;
  linear(a);
}

}  // namespace pagedcore::cpu
