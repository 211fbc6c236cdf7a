#include "numpy_views.h"

#include <vector>

namespace py = pybind11;

namespace pagedcore::bindings {

template <typename T>
py::array view(const T* data, std::initializer_list<py::ssize_t> shape, py::handle owner) {
  py::array_t<T> array(std::vector<py::ssize_t>(shape), data, owner);
  // NOTE: the memory belongs to the engine and is rewritten by the next step;
  // a write through the view would corrupt the engine's state.
  py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return array;
}

template py::array view(const int32_t*, std::initializer_list<py::ssize_t>, py::handle);
template py::array view(const int64_t*, std::initializer_list<py::ssize_t>, py::handle);
template py::array view(const uint8_t*, std::initializer_list<py::ssize_t>, py::handle);

}  // namespace pagedcore::bindings
