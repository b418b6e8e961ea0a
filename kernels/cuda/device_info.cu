// CUDA device discovery. "driver version is insufficient" or "no device" both mean 0 GPUs.
#include "kernels/cuda/device_info.hpp"

#include <cuda_runtime.h>

namespace troupe::kernels {

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  return count;
}

std::string cuda_device_name(int index) {
  cudaDeviceProp prop{};
  if (index < 0 || index >= cuda_device_count() ||
      cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    return "";
  }
  return prop.name;
}

std::string cuda_device_bus_id(int index) {
  char id[32] = {};
  if (index < 0 || index >= cuda_device_count() ||
      cudaDeviceGetPCIBusId(id, sizeof id, index) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return id;
}

}  // namespace troupe::kernels
