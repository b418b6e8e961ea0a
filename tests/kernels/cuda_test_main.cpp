// Catch2 runner of the `gpu` suite: exit 77 (meson: SKIP) when no CUDA device is usable, so a
// machine without a GPU never reports these tests as passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "kernels/cuda/device_info.hpp"

int main(int argc, char** argv) {
  if (troupe::kernels::cuda_device_count() == 0) {
    std::printf("SKIP: no usable CUDA device (%s)\n",
                troupe::kernels::cuda_compiled() ? "none found" : "built without CUDA");
    return 77;
  }
  std::printf("device 0: %s\n", troupe::kernels::cuda_device_name(0).c_str());
  return Catch::Session().run(argc, argv);
}
