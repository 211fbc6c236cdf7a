#include "ops.h"

namespace pagedcore::bindings {

void register_ops(pybind11::module_& m) { (void)m; }

}  // namespace pagedcore::bindings
