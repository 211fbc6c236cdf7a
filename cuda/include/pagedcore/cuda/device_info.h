// CUDA device queries and a smoke-test kernel.
//
// Framework-free like every launcher of pagedcore: plain structs of pointers
// and sizes, the caller's stream as an opaque handle, and the cudaError_t
// value as an int (0 is success), so this header needs no CUDA headers.
#pragma once

#include <cstdint>
#include <string>

namespace pagedcore::cuda {

struct DeviceInfo {
  int device_count = 0;     // 0 when there is no driver or no GPU
  int runtime_version = 0;  // CUDA runtime linked in, e.g. 13000
  int driver_version = 0;   // 0 when there is no driver
};

// Never fails: on a machine without a GPU it reports device_count 0.
DeviceInfo query_devices();

struct AddScalarParams {
  const int32_t* in;  // [n] device memory
  int32_t* out;       // [n] device memory
  int64_t n;
  int32_t value;
};

// out[i] = in[i] + value on `stream` (a cudaStream_t; nullptr for the default
// stream). Returns the cudaError_t of the launch.
int launch_add_scalar(const AddScalarParams& params, void* stream);

// Runs launch_add_scalar on device 0 over a few thousand integers and checks
// the result on the host. Returns an empty string on success, else the error.
std::string smoke_test();

// The name of a cudaError_t value.
const char* error_string(int error);

}  // namespace pagedcore::cuda
