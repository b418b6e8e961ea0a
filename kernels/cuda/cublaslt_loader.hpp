// cuBLASLt is loaded on first GPU use, not when a process starts (docs/gpu.md). Linked as a
// NEEDED library, its static initialisers ran in every troupe process, CPU jobs included: ~95 MB
// of anonymous memory and ~0.15 s before main. The cuBLASLt functions the GPU ops call are
// defined in cublaslt_loader.cpp, each forwarding to the library's own, resolved by dlopen and
// dlsym the first time one is called. Compiled only when nvcc exists (kernels/meson.build).
#pragma once

#include <string>

namespace troupe::kernels::cuda {

// The library's file name: libcublasLt.so.<major of the cuBLAS headers built against>.
std::string cublaslt_library();

// Loads cuBLASLt and resolves every function the ops use, once per process; throws cuda_error
// naming the library or the missing function. context::context() calls it before anything else
// of cuBLASLt; a forwarding function called without it returns CUBLAS_STATUS_NOT_INITIALIZED
// when the library cannot be loaded.
void require_cublaslt();

}  // namespace troupe::kernels::cuda
