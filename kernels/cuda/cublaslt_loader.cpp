// cuBLASLt loaded on first use (cublaslt_loader.hpp): this file defines the cuBLASLt functions
// that kernels/cuda/cuda_ops.cu calls. The executable does not link libcublasLt, so these are
// the definitions the linker finds; each looks the library's own up once, with dlsym on the
// handle dlopen returned (RTLD_LOCAL: the library's symbols stay out of the global scope).
// dlopen, called from the executable, searches as the loader did for a NEEDED library
// (LD_LIBRARY_PATH, the executable's RPATH or RUNPATH, the loader's cache), so cuBLASLt is
// found wherever it was found when it was linked.
#include "kernels/cuda/cublaslt_loader.hpp"

#include <cublasLt.h>
#include <dlfcn.h>

#include <string>

#include "kernels/cuda/cuda_ops.hpp"

// Every cuBLASLt function the ops call: name, the header's parameters, the call's arguments. It
// makes both require_cublaslt()'s list and the forwarding definitions at the end.
#define TROUPE_CUBLASLT_FUNCTIONS(X)                                                              \
  X(cublasLtCreate, (cublasLtHandle_t * handle), (handle))                                        \
  X(cublasLtDestroy, (cublasLtHandle_t handle), (handle))                                         \
  X(cublasLtMatmul,                                                                               \
    (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,        \
     cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta, \
     const void* C, cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,          \
     const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,                   \
     cudaStream_t stream),                                                                        \
    (handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,          \
     workspace_bytes, stream))                                                                    \
  X(cublasLtMatmulAlgoGetHeuristic,                                                               \
    (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,            \
     cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,    \
     cublasLtMatmulPreference_t preference, int requested,                                        \
     cublasLtMatmulHeuristicResult_t results[], int* returned),                                   \
    (handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requested, results, returned))         \
  X(cublasLtMatmulDescCreate,                                                                     \
    (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),             \
    (desc, compute, scale))                                                                       \
  X(cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))                               \
  X(cublasLtMatmulDescSetAttribute,                                                               \
    (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,             \
     size_t bytes),                                                                               \
    (desc, attr, buf, bytes))                                                                     \
  X(cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))                  \
  X(cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))                   \
  X(cublasLtMatmulPreferenceSetAttribute,                                                         \
    (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf, \
     size_t bytes),                                                                               \
    (pref, attr, buf, bytes))                                                                     \
  X(cublasLtMatrixLayoutCreate,                                                                   \
    (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols,            \
     int64_t ld),                                                                                 \
    (layout, type, rows, cols, ld))                                                               \
  X(cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout), (layout))                       \
  X(cublasLtMatrixLayoutSetAttribute,                                                             \
    (cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr, const void* buf,        \
     size_t bytes),                                                                               \
    (layout, attr, buf, bytes))

namespace troupe::kernels::cuda {
namespace {

#define TROUPE_CUBLASLT_NAME(name, params, args) #name,
constexpr const char* functions[] = {TROUPE_CUBLASLT_FUNCTIONS(TROUPE_CUBLASLT_NAME)};
#undef TROUPE_CUBLASLT_NAME

struct library {
  void* handle = nullptr;
  std::string error;  // why dlopen failed
};

// Loaded once per process (a function-local static: thread-safe), never closed.
const library& cublaslt() {
  static const library lib = [] {
    library l;
    const std::string name = cublaslt_library();
    ::dlerror();
    l.handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!l.handle) {
      const char* why = ::dlerror();
      l.error = "cannot load " + name + ": " + (why ? why : "unknown error") +
                " (the GPU ops need cuBLASLt on the loader's path, e.g. LD_LIBRARY_PATH)";
    }
    return l;
  }();
  return lib;
}

// The library's definition of `name`; nullptr if it cannot be had.
template <class Fn>
Fn* real(const char* name) {
  const library& l = cublaslt();
  return reinterpret_cast<Fn*>(l.handle ? ::dlsym(l.handle, name) : nullptr);
}

}  // namespace

std::string cublaslt_library() { return "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR); }

void require_cublaslt() {
  const library& l = cublaslt();
  if (!l.handle) throw cuda_error(l.error);
  for (const char* name : functions)
    if (!::dlsym(l.handle, name))
      throw cuda_error(cublaslt_library() + " has no function " + name + " (built against cuBLAS " +
                       std::to_string(CUBLAS_VER_MAJOR) + ")");
}

}  // namespace troupe::kernels::cuda

// The forwarding definitions: the header's prototypes, each calling the library's function.
#define TROUPE_CUBLASLT_FORWARD(name, params, args)                             \
  cublasStatus_t CUBLASWINAPI name params {                                     \
    static auto* const fn = troupe::kernels::cuda::real<decltype(name)>(#name); \
    return fn ? fn args : CUBLAS_STATUS_NOT_INITIALIZED;                        \
  }

extern "C" {
TROUPE_CUBLASLT_FUNCTIONS(TROUPE_CUBLASLT_FORWARD)
}  // extern "C"
