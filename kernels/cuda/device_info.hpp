// What CUDA devices this process can use. Built from device_info.cu when nvcc exists, from
// device_info_stub.cpp otherwise. Without a driver or GPU the count is 0, never an error.
#pragma once

#include <string>

namespace troupe::kernels {

bool cuda_compiled();                     // true when the build included CUDA
int cuda_device_count();                  // 0 when there is no usable GPU
std::string cuda_device_name(int index);  // "" when not available
// The device's PCI bus id ("0000:18:00.0"): what tells two processes' devices apart on one host;
// "" when not available.
std::string cuda_device_bus_id(int index);

}  // namespace troupe::kernels
