// cuDNN is loaded on first use of the cuDNN attention (kernels.attention = "cudnn"), never
// linked, as cuBLASLt is (cublaslt_loader.hpp): a process that does not use it pays nothing, and
// a machine without it fails with one line naming the library. Only the graph (backend) API is
// used, through the table below. Compiled only when nvcc exists (kernels/meson.build).
#pragma once

#include <cudnn_graph.h>

#include <cstddef>
#include <string>

namespace troupe::kernels::cuda {

// The cuDNN functions the attention calls, resolved from the loaded library.
struct cudnn_api {
  std::size_t (*cudnnGetVersion)();
  const char* (*cudnnGetErrorString)(cudnnStatus_t);
  void (*cudnnGetLastErrorString)(char*, std::size_t);
  cudnnStatus_t (*cudnnCreate)(cudnnHandle_t*);
  cudnnStatus_t (*cudnnDestroy)(cudnnHandle_t);
  cudnnStatus_t (*cudnnSetStream)(cudnnHandle_t, cudaStream_t);
  cudnnStatus_t (*cudnnBackendCreateDescriptor)(cudnnBackendDescriptorType_t,
                                                cudnnBackendDescriptor_t*);
  cudnnStatus_t (*cudnnBackendDestroyDescriptor)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*cudnnBackendFinalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*cudnnBackendSetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                            cudnnBackendAttributeType_t, std::int64_t, const void*);
  cudnnStatus_t (*cudnnBackendGetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                            cudnnBackendAttributeType_t, std::int64_t,
                                            std::int64_t*, void*);
  cudnnStatus_t (*cudnnBackendExecute)(cudnnHandle_t, cudnnBackendDescriptor_t,
                                       cudnnBackendDescriptor_t);
};

// The library's file name: libcudnn.so.<major of the cuDNN headers built against>.
std::string cudnn_library();

// The oldest cuDNN the attention graphs are written for (9.14: what the GPU machines have).
constexpr std::size_t kCudnnMinimumVersion = 91400;

// Loads cuDNN once per process and resolves the table; throws cuda_error naming the library,
// a missing function, or a version older than kCudnnMinimumVersion.
const cudnn_api& require_cudnn();

}  // namespace troupe::kernels::cuda
