// Compiles the kernels header named by PAGEDCORE_ISA_KERNELS once per instruction set
// (internal; not installed): inside namespaces isa_avx512 (W = 16) and isa_avx2 (W = 8),
// each under its target region, on x86 builds, and isa_generic (W = 4) everywhere. Each
// copy sees simd.h's vector helpers for its width.
//
//   #define PAGEDCORE_ISA_KERNELS "attention_kernels.h"
//   #include "per_isa.h"
//
// NOTE: no include guard on purpose (one inclusion per kernels header); include isa.h
// first (PAGEDCORE_HAVE_X86_TARGETS).
#ifndef PAGEDCORE_ISA_KERNELS
#error "define PAGEDCORE_ISA_KERNELS (the kernels header) before including per_isa.h"
#endif

#if PAGEDCORE_HAVE_X86_TARGETS
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,fma")
#endif
namespace isa_avx512 {
constexpr int W = 16;
#include "simd.h"
#include PAGEDCORE_ISA_KERNELS
}  // namespace isa_avx512
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace isa_avx2 {
constexpr int W = 8;
#include "simd.h"
#include PAGEDCORE_ISA_KERNELS
}  // namespace isa_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // PAGEDCORE_HAVE_X86_TARGETS

namespace isa_generic {
constexpr int W = 4;
#include "simd.h"
#include PAGEDCORE_ISA_KERNELS
}  // namespace isa_generic

#undef PAGEDCORE_ISA_KERNELS
