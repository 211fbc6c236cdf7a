// Registration of the kernel launchers (pagedcore.ops calls them).
#pragma once

#include <pybind11/pybind11.h>

namespace pagedcore::bindings {

void register_ops(pybind11::module_& m);

}  // namespace pagedcore::bindings
