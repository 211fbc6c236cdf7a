// Registration of the grammar worker (cpp/grammar/llg_worker.h).
#pragma once

#include <pybind11/pybind11.h>

namespace pagedcore::bindings {

void register_grammar(pybind11::module_& m);

}  // namespace pagedcore::bindings
