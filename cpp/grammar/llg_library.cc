#include "llg_library.h"

#include <dlfcn.h>

#include <stdexcept>

namespace pagedcore::grammar {

namespace {

template <typename Fn>
void bind(void* handle, const std::string& path, const char* name, Fn& slot) {
  dlerror();  // (clears a stale error: dlsym's null alone does not mean failure)
  void* symbol = dlsym(handle, name);
  const char* error = dlerror();
  if (error != nullptr || symbol == nullptr) {
    throw std::invalid_argument("llguidance library " + path + " lacks the symbol " + name +
                                (error ? std::string(": ") + error : std::string()));
  }
  slot = reinterpret_cast<Fn>(symbol);
}

}  // namespace

std::shared_ptr<const LlgLibrary> LlgLibrary::open(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    throw std::invalid_argument("cannot load the llguidance library " + path + ": " +
                                (error ? error : "unknown error"));
  }
  std::shared_ptr<LlgLibrary> lib(new LlgLibrary());
  lib->handle_ = handle;
  try {
    bind(handle, path, "llg_new_tokenizer_v2", lib->new_tokenizer_v2);
    bind(handle, path, "llg_free_tokenizer", lib->free_tokenizer);
    bind(handle, path, "llg_constraint_init_set_defaults", lib->constraint_init_set_defaults);
    bind(handle, path, "llg_new_matcher", lib->new_matcher);
    bind(handle, path, "llg_clone_matcher", lib->clone_matcher);
    bind(handle, path, "llg_free_matcher", lib->free_matcher);
    bind(handle, path, "llg_matcher_get_error", lib->matcher_get_error);
    bind(handle, path, "llg_matcher_get_mask_byte_size", lib->matcher_get_mask_byte_size);
    bind(handle, path, "llg_matcher_compute_mask_into", lib->matcher_compute_mask_into);
    bind(handle, path, "llg_matcher_consume_token", lib->matcher_consume_token);
    bind(handle, path, "llg_matcher_is_stopped", lib->matcher_is_stopped);
    bind(handle, path, "llg_matcher_is_accepting", lib->matcher_is_accepting);
  } catch (...) {
    dlclose(handle);  // (nothing of it ran yet)
    throw;
  }
  return lib;
}

LlgLibrary::~LlgLibrary() {
  // NOTE: a Rust library's thread-local destructors may still be registered; closing
  // it could unmap code they run at thread exit. The handle is therefore kept open
  // (the wheel is usually loaded by Python's llguidance module in the same process
  // anyway, so dlclose would only drop a reference count).
  (void)handle_;
}

}  // namespace pagedcore::grammar
