// cuDNN is loaded on first use of the cuDNN attention, and its attention graphs are accepted by
// the library descriptor by descriptor (kernels/cuda/attention_cudnn.cu). Needs no GPU: tensors,
// operations and operation graphs finalize without a device (the plans, which need one, are the
// gpu suite's). SKIP (exit 77) where cuDNN 9.14 or newer cannot be loaded.
#include <dlfcn.h>

#include <cstdio>
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/cudnn_loader.hpp"

namespace kc = troupe::kernels::cuda;

namespace {
bool loaded() {  // is the library mapped in this process? (RTLD_NOLOAD never loads it)
  void* h = ::dlopen(kc::cudnn_library().c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h) ::dlclose(h);
  return h != nullptr;
}
}  // namespace

TEST_CASE("the cuDNN attention graphs finalize operation by operation") {
  REQUIRE(kc::cudnn_library() == "libcudnn.so.9");
  REQUIRE(kc::require_cudnn().cudnnGetVersion() >= kc::kCudnnMinimumVersion);
  for (const bool bf16 : {true, false}) {
    INFO((bf16 ? "bf16" : "fp16"));
    // GPT-2 small's shape (head size 64, T = 1024), and a short odd one.
    CHECK(kc::attention_cudnn_graph_operations(bf16, 16, 1024, 12, 64, false, false) == 14);
    CHECK(kc::attention_cudnn_graph_operations(bf16, 16, 1024, 12, 64, true, false) == 21);
    CHECK(kc::attention_cudnn_graph_operations(bf16, 2, 100, 3, 16, true, true) == 27);
    CHECK(kc::attention_cudnn_graph_operations(bf16, 1, 200, 2, 128, false, false) == 14);
  }
}

int main(int argc, char** argv) {
  if (loaded()) {
    std::fprintf(stderr, "cuDNN was loaded before its first use\n");
    return 1;
  }
  std::string why;
  if (!kc::cudnn_attention_available(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
