// Exceptions thrown by the core. All derive from standard exception types, so a
// C++ host can catch them as such; the Python module maps them to ValueError,
// KeyError and RuntimeError.
//
// Every call that throws one of these leaves the object it was called on exactly
// as it was before the call.
#pragma once

#include <stdexcept>
#include <string>

namespace pagedcore {

// Bad user input: a field out of range, an impossible request. Python: ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// An id that the engine does not know (request id, sequence id). Python: KeyError.
class NotFound : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// A call made at the wrong time (e.g. schedule() twice without update()).
// Python: RuntimeError.
class InvalidState : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// An internal invariant does not hold: a bug in pagedcore. Python: RuntimeError.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace pagedcore
