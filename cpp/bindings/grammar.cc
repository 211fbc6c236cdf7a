// Registration of the grammar worker: LlgLibrary (llguidance's C API, loaded at run
// time) and LlgWorker. The lambdas check the numpy arrays and pass their pointers;
// step releases the GIL for the whole step.
#include "grammar.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>

#include "../grammar/llg_worker.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace pagedcore::bindings {
namespace {

using grammar::LlgLibrary;
using grammar::LlgWorker;

// The data of `array` after checking that it is a C-contiguous (writable when
// `writable`) numpy array of T with `shape`; TypeError / ValueError name the field.
template <typename T>
T* checked(const py::handle& object, const char* field, std::initializer_list<py::ssize_t> shape,
           bool writable) {
  if (!py::isinstance<py::array>(object)) {
    throw py::type_error(std::string("LlgWorker.step: ") + field + " must be a numpy array, got " +
                         std::string(py::str(py::type::of(object))));
  }
  auto array = py::reinterpret_borrow<py::array>(object);
  if (!py::isinstance<py::array_t<T>>(array)) {  // (numpy's equivalence of dtypes, not identity)
    throw py::type_error(std::string("LlgWorker.step: ") + field + " must be of dtype " +
                         std::string(py::str(py::dtype::of<T>())) + ", got " + std::string(py::str(array.dtype())));
  }
  bool shape_ok = array.ndim() == static_cast<py::ssize_t>(shape.size());
  for (size_t d = 0; shape_ok && d < shape.size(); ++d) shape_ok = array.shape(d) == shape.begin()[d];
  if (!shape_ok) {
    std::string want, got;
    for (py::ssize_t s : shape) want += std::to_string(s) + ",";
    for (py::ssize_t d = 0; d < array.ndim(); ++d) got += std::to_string(array.shape(d)) + ",";
    throw py::value_error(std::string("LlgWorker.step: ") + field + " must have shape (" + want + "), got (" +
                          got + ")");
  }
  if (!(array.flags() & py::array::c_style)) {
    throw py::value_error(std::string("LlgWorker.step: ") + field + " must be C-contiguous");
  }
  if (writable && !array.writeable()) {
    throw py::value_error(std::string("LlgWorker.step: ") + field + " must be writable");
  }
  return static_cast<T*>(const_cast<void*>(array.data()));
}

struct StepArgs {
  const int64_t* handles;
  const int32_t* tokens;
  py::ssize_t rows;
  int32_t* masks;
  uint8_t* status;
  uint8_t* stopped;
  uint32_t* flag;
};

StepArgs step_args(const LlgWorker& w, const py::object& handles, const py::object& tokens,
                   const py::object& masks, const py::object& status, const py::object& stopped,
                   const py::object& ready_flag) {
  py::ssize_t rows = py::isinstance<py::array>(handles) ? py::reinterpret_borrow<py::array>(handles).size() : 0;
  StepArgs a{};
  a.rows = rows;
  a.handles = checked<int64_t>(handles, "handles", {rows}, false);
  a.tokens = checked<int32_t>(tokens, "tokens", {rows}, false);
  a.masks = checked<int32_t>(masks, "masks", {rows, w.num_words()}, true);
  a.status = checked<uint8_t>(status, "status", {rows}, true);
  a.stopped = checked<uint8_t>(stopped, "stopped", {rows}, true);
  if (!ready_flag.is_none()) {
    if (py::isinstance<py::array_t<int32_t>>(ready_flag)) {
      a.flag = reinterpret_cast<uint32_t*>(checked<int32_t>(ready_flag, "ready_flag", {1}, true));
    } else {
      a.flag = checked<uint32_t>(ready_flag, "ready_flag", {1}, true);
    }
  }
  return a;
}

// NOTE: the worker's destructor waits for a step in flight, which may need the GIL
// (its tokenize callback): it runs with the GIL released.
struct ReleasingDelete {
  void operator()(LlgWorker* w) const {
    py::gil_scoped_release release;
    delete w;
  }
};
using WorkerHolder = std::unique_ptr<LlgWorker, ReleasingDelete>;

}  // namespace

void register_grammar(py::module_& m) {
  py::class_<LlgLibrary, std::shared_ptr<LlgLibrary>>(m, "LlgLibrary",
                                                      "llguidance's C API, loaded from its shared library.")
      .def_static(
          "open",
          [](const std::string& path) { return std::const_pointer_cast<LlgLibrary>(LlgLibrary::open(path)); },
          "path"_a, py::call_guard<py::gil_scoped_release>());

  py::class_<LlgWorker, WorkerHolder>(m, "LlgWorker", py::dynamic_attr(),
                                      "A step's grammar work for a batch of llguidance matchers, without the GIL.")
      .def(py::init([](const std::shared_ptr<LlgLibrary>& lib, const std::string& tokenizer_json,
                       int32_t vocab_size, const std::vector<int64_t>& eos_token_ids, int32_t num_threads,
                       const py::object& tokenize) {
             LlgWorker::TokenizeFn fn;
             if (!tokenize.is_none()) {
               if (!PyCallable_Check(tokenize.ptr())) {
                 throw py::type_error("LlgWorker: tokenize must be callable (bytes -> list of int) or None");
               }
               // NOTE: a borrowed pointer, kept alive by keep_alive below: the worker's
               // threads copy no Python reference without the GIL.
               PyObject* callable = tokenize.ptr();
               fn = [callable](const std::string& bytes) {
                 py::gil_scoped_acquire gil;
                 try {
                   return py::handle(callable)(py::bytes(bytes)).cast<std::vector<uint32_t>>();
                 } catch (py::error_already_set& e) {
                   e.discard_as_unraisable("pagedcore LlgWorker tokenize");
                   return std::vector<uint32_t>();
                 }
               };
             }
             py::gil_scoped_release release;
             return WorkerHolder(new LlgWorker(lib, tokenizer_json, vocab_size, eos_token_ids, num_threads,
                                               std::move(fn)));
           }),
           "lib"_a, "tokenizer_json"_a, "vocab_size"_a, "eos_token_ids"_a, "num_threads"_a,
           "tokenize"_a = py::none(), py::keep_alive<1, 7>())
      .def_property_readonly("num_words", &LlgWorker::num_words)
      .def_property_readonly("num_threads", &LlgWorker::num_threads)
      .def("new_matcher", &LlgWorker::new_matcher, "constraint_type"_a, "grammar"_a, "lane"_a = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("clone_matcher", &LlgWorker::clone_matcher, "handle"_a, py::call_guard<py::gil_scoped_release>())
      .def("free_matcher", &LlgWorker::free_matcher, "handle"_a, py::call_guard<py::gil_scoped_release>())
      .def("error", &LlgWorker::error, "handle"_a, py::call_guard<py::gil_scoped_release>())
      .def("is_stopped", &LlgWorker::is_stopped, "handle"_a, py::call_guard<py::gil_scoped_release>())
      .def("is_accepting", &LlgWorker::is_accepting, "handle"_a, py::call_guard<py::gil_scoped_release>())
      // NOTE: every call that takes the worker's lock leaves the GIL first: a step in
      // flight may need the GIL (tokenize) before it lets the lock go.
      .def("num_matchers", &LlgWorker::num_matchers, py::call_guard<py::gil_scoped_release>())
      .def("tokenize_calls", &LlgWorker::tokenize_calls, py::call_guard<py::gil_scoped_release>())
      .def(
          "step",
          [](LlgWorker& w, const py::object& handles, const py::object& tokens, const py::object& masks,
             const py::object& status, const py::object& stopped, const py::object& ready_flag,
             uint32_t ready_value) {
            StepArgs a = step_args(w, handles, tokens, masks, status, stopped, ready_flag);
            py::gil_scoped_release release;
            w.step(a.handles, a.tokens, a.rows, a.masks, a.status, a.stopped, a.flag, ready_value);
          },
          "handles"_a, "tokens"_a, "masks"_a, "status"_a, "stopped"_a, "ready_flag"_a = py::none(),
          "ready_value"_a = 0,
          "One step (see llg_worker.h): feeds tokens[i] (int32, < 0: none) to matcher handles[i] (int64),\n"
          "writes its bitmask into masks[i] ([rows, num_words] int32), its verdict into status[i] (uint8:\n"
          "0 ok, 1 token refused, 2 mask error) and stopped[i] (uint8); then stores ready_value into\n"
          "ready_flag (a 1-element int32/uint32 array), if given. Releases the GIL throughout.")
      .def(
          "consume",
          [](LlgWorker& w, const py::object& handles, const py::object& tokens, const py::object& status,
             const py::object& stopped) {
            py::ssize_t rows =
                py::isinstance<py::array>(handles) ? py::reinterpret_borrow<py::array>(handles).size() : 0;
            const int64_t* h = checked<int64_t>(handles, "handles", {rows}, false);
            const int32_t* t = checked<int32_t>(tokens, "tokens", {rows}, false);
            uint8_t* st = checked<uint8_t>(status, "status", {rows}, true);
            uint8_t* sp = checked<uint8_t>(stopped, "stopped", {rows}, true);
            py::gil_scoped_release release;
            w.consume(h, t, rows, st, sp);
          },
          "handles"_a, "tokens"_a, "status"_a, "stopped"_a,
          "step() without masks: feeds tokens[i] to matcher handles[i], writes status[i] and stopped[i].")
      .def(
          "start_step",
          [](py::object self, const py::object& handles, const py::object& tokens, const py::object& masks,
             const py::object& status, const py::object& stopped, const py::object& ready_flag,
             uint32_t ready_value) {
            LlgWorker& w = self.cast<LlgWorker&>();
            StepArgs a = step_args(w, handles, tokens, masks, status, stopped, ready_flag);
            {
              py::gil_scoped_release release;
              w.start_step(a.handles, a.tokens, a.rows, a.masks, a.status, a.stopped, a.flag, ready_value);
            }
            // NOTE: the outputs stay referenced until the next start (which waits for
            // this step first), so that the worker's threads never write freed memory.
            self.attr("_step_outputs") = py::make_tuple(masks, status, stopped, ready_flag);
          },
          "handles"_a, "tokens"_a, "masks"_a, "status"_a, "stopped"_a, "ready_flag"_a = py::none(),
          "ready_value"_a = 0,
          "step() on the worker's own thread: returns once the arguments are checked; the outputs are\n"
          "written (and ready_flag stored) later: wait_step() or step_done() say when.")
      .def("wait_step", &LlgWorker::wait_step, py::call_guard<py::gil_scoped_release>())
      .def("step_done", &LlgWorker::step_done, py::call_guard<py::gil_scoped_release>());
}

}  // namespace pagedcore::bindings
