// Reports the CUDA devices this build can use. Exit 77 (SKIP) without CUDA in the build or
// without a GPU, so meson never counts an absent GPU as a pass.
#include <cstdio>

#include "kernels/cuda/device_info.hpp"

int main() {
  using namespace troupe::kernels;
  if (!cuda_compiled()) {
    std::printf("SKIP: this build has no CUDA (nvcc was not found at configure time)\n");
    return 77;
  }
  const int n = cuda_device_count();
  if (n == 0) {
    std::printf("SKIP: CUDA is built in but no GPU is usable here\n");
    return 77;
  }
  for (int i = 0; i < n; ++i) std::printf("GPU %d: %s\n", i, cuda_device_name(i).c_str());
  return cuda_device_name(0).empty() ? 1 : 0;
}
