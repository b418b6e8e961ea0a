// cuDNN loaded on first use (cudnn_loader.hpp). dlopen, called from the executable, searches as
// the loader does for a NEEDED library (LD_LIBRARY_PATH, RUNPATH, the loader's cache).
#include "kernels/cuda/cudnn_loader.hpp"

#include <dlfcn.h>

#include <string>

#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
namespace {

struct loaded {
  cudnn_api api{};
  std::string error;  // why the library cannot be used; empty when it can
};

template <class Fn>
bool resolve(void* handle, const char* name, Fn*& fn, std::string& error) {
  fn = reinterpret_cast<Fn*>(::dlsym(handle, name));
  if (!fn && error.empty()) error = cudnn_library() + " has no function " + name;
  return fn != nullptr;
}

// Loaded once per process (a function-local static: thread-safe), never closed.
const loaded& library() {
  static const loaded lib = [] {
    loaded l;
    const std::string name = cudnn_library();
    ::dlerror();
    void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* why = ::dlerror();
      l.error = "cannot load " + name + ": " + (why ? why : "unknown error") +
                " (kernels.attention = \"cudnn\" needs cuDNN 9 on the loader's path, e.g. "
                "LD_LIBRARY_PATH)";
      return l;
    }
    cudnn_api& a = l.api;
#define TROUPE_CUDNN_RESOLVE(fn) resolve(handle, #fn, a.fn, l.error)
    TROUPE_CUDNN_RESOLVE(cudnnGetVersion);
    TROUPE_CUDNN_RESOLVE(cudnnGetErrorString);
    TROUPE_CUDNN_RESOLVE(cudnnGetLastErrorString);
    TROUPE_CUDNN_RESOLVE(cudnnCreate);
    TROUPE_CUDNN_RESOLVE(cudnnDestroy);
    TROUPE_CUDNN_RESOLVE(cudnnSetStream);
    TROUPE_CUDNN_RESOLVE(cudnnBackendCreateDescriptor);
    TROUPE_CUDNN_RESOLVE(cudnnBackendDestroyDescriptor);
    TROUPE_CUDNN_RESOLVE(cudnnBackendFinalize);
    TROUPE_CUDNN_RESOLVE(cudnnBackendSetAttribute);
    TROUPE_CUDNN_RESOLVE(cudnnBackendGetAttribute);
    TROUPE_CUDNN_RESOLVE(cudnnBackendExecute);
#undef TROUPE_CUDNN_RESOLVE
    if (l.error.empty()) {
      const std::size_t version = a.cudnnGetVersion();
      if (version < kCudnnMinimumVersion)
        l.error = name + " is cuDNN " + std::to_string(version) + "; the attention needs " +
                  std::to_string(kCudnnMinimumVersion) + " or newer";
    }
    return l;
  }();
  return lib;
}

}  // namespace

std::string cudnn_library() { return "libcudnn.so." + std::to_string(CUDNN_MAJOR); }

const cudnn_api& require_cudnn() {
  const loaded& l = library();
  if (!l.error.empty()) throw cuda_error(l.error);
  return l.api;
}

}  // namespace troupe::kernels::cuda
