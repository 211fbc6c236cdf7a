// Internal check macros (not installed).
//
// Three tiers:
//   user input           -> throw InvalidArgument / NotFound with the value (no macro)
//   internal invariants  -> PAGEDCORE_CHECK: always on, throws InternalError
//   expensive invariants -> PAGEDCORE_DCHECK: only with PAGEDCORE_DEBUG_CHECKS,
//                           which the test builds turn on
#pragma once

#include <sstream>
#include <string>

#include "pagedcore/errors.h"

namespace pagedcore::detail {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

[[noreturn]] void fail_check(const char* file, int line, const char* cond, const std::string& msg);

}  // namespace pagedcore::detail

// Usage: PAGEDCORE_CHECK(ref > 0, "block ", id, " has ref count ", ref);
// The message arguments are only evaluated when the check fails.
#define PAGEDCORE_CHECK(cond, ...)                                                              \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      ::pagedcore::detail::fail_check(__FILE__, __LINE__, #cond,                                \
                                      ::pagedcore::detail::concat(__VA_ARGS__));                \
    }                                                                                           \
  } while (0)

#ifdef PAGEDCORE_DEBUG_CHECKS
#define PAGEDCORE_DCHECK(cond, ...) PAGEDCORE_CHECK(cond, __VA_ARGS__)
namespace pagedcore::detail {
inline constexpr bool kDebugChecks = true;
}
#else
#define PAGEDCORE_DCHECK(cond, ...) \
  do {                              \
  } while (0)
namespace pagedcore::detail {
inline constexpr bool kDebugChecks = false;
}
#endif
