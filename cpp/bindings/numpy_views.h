// Read-only numpy views over engine-owned buffers (no copy).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>

namespace pagedcore::bindings {

// A C-contiguous, read-only array over `data` that keeps `owner` alive.
template <typename T>
pybind11::array view(const T* data, std::initializer_list<pybind11::ssize_t> shape,
                     pybind11::handle owner);

extern template pybind11::array view(const int32_t*, std::initializer_list<pybind11::ssize_t>,
                                     pybind11::handle);
extern template pybind11::array view(const int64_t*, std::initializer_list<pybind11::ssize_t>,
                                     pybind11::handle);
extern template pybind11::array view(const uint8_t*, std::initializer_list<pybind11::ssize_t>,
                                     pybind11::handle);

}  // namespace pagedcore::bindings
