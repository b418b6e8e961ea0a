// CUDA device discovery when the build has no CUDA: no devices.
#include "kernels/cuda/device_info.hpp"

namespace troupe::kernels {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { return ""; }
std::string cuda_device_bus_id(int) { return ""; }

}  // namespace troupe::kernels
