// cuBLASLt is loaded on first GPU use, not at process start (kernels/cuda/cublaslt_loader.hpp).
// Needs no GPU: loading the library and its host-side descriptors work without one.
#include <cublasLt.h>
#include <dlfcn.h>

#include <catch2/catch.hpp>

#include "kernels/cuda/cublaslt_loader.hpp"

namespace kc = troupe::kernels::cuda;

namespace {
bool loaded() {  // is the library mapped in this process? (RTLD_NOLOAD never loads it)
  void* h = ::dlopen(kc::cublaslt_library().c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h) ::dlclose(h);  // drops only the reference RTLD_NOLOAD took
  return h != nullptr;
}
}  // namespace

TEST_CASE("cuBLASLt is loaded on first use and its functions forward to the library") {
  REQUIRE(kc::cublaslt_library() == "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
  // Nothing of cuBLASLt ran when this process started: it is not a NEEDED library.
  REQUIRE_FALSE(loaded());

  kc::require_cublaslt();  // loads it and finds every function the ops call
  REQUIRE(loaded());
  kc::require_cublaslt();  // once per process: a second call finds it loaded

  // Host-side descriptors through the forwarding functions, as cuda_ops.cu makes them.
  cublasLtMatrixLayout_t layout = nullptr;
  REQUIRE(cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 64, 32, 64) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(layout != nullptr);
  // Read back with the library's own getter (not one the ops call, so not forwarded).
  void* lib = ::dlopen(kc::cublaslt_library().c_str(), RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(lib != nullptr);
  auto* get = reinterpret_cast<decltype(&cublasLtMatrixLayoutGetAttribute)>(
      ::dlsym(lib, "cublasLtMatrixLayoutGetAttribute"));
  REQUIRE(get != nullptr);
  std::uint64_t rows = 0;
  std::size_t written = 0;
  REQUIRE(get(layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows, &written) ==
          CUBLAS_STATUS_SUCCESS);
  CHECK(rows == 64);
  ::dlclose(lib);
  CHECK(cublasLtMatrixLayoutDestroy(layout) == CUBLAS_STATUS_SUCCESS);

  cublasLtMatmulDesc_t desc = nullptr;
  REQUIRE(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
  const cublasOperation_t transpose = CUBLAS_OP_T;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                       sizeof transpose) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasLtMatmulDescDestroy(desc) == CUBLAS_STATUS_SUCCESS);

  cublasLtMatmulPreference_t pref = nullptr;
  REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
  const std::size_t workspace = std::size_t{1} << 20;
  CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace,
                                             sizeof workspace) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasLtMatmulPreferenceDestroy(pref) == CUBLAS_STATUS_SUCCESS);
}
