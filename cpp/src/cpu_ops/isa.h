// Instruction set of the CPU kernels that come in several builds (attention, linear):
// internal; not installed. The selection is process-wide: cpu_isa() / set_cpu_isa()
// (pagedcore/cpu_ops.h) read and change it, and each launch reads it once.
#pragma once

#include <atomic>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PAGEDCORE_HAVE_X86_TARGETS 1
#else
#define PAGEDCORE_HAVE_X86_TARGETS 0
#endif

namespace pagedcore::cpu {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// The best instruction set this CPU supports.
Isa best_isa();
// The one the kernels use now (best_isa() unless set_cpu_isa chose another).
std::atomic<Isa>& current_isa();

}  // namespace pagedcore::cpu
