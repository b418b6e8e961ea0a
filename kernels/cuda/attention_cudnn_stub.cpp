// The cuDNN attention in a CUDA build without cuDNN's headers (kernels/meson.build): every entry
// says so, and kernels.attention = "auto" takes the materialized route instead.
#include <string>

#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
namespace {
const char* const kNoCudnn =
    "cuDNN attention: this build has no cuDNN headers (cudnn_graph.h was not found); use "
    "kernels.attention = \"materialized\"";
}  // namespace

template <class T>
void attention_cudnn_forward(const context&, T*, float*, const T*, int, int, int, int) {
  throw cuda_error(kNoCudnn);
}
template <class T>
void attention_cudnn_backward(const context&, T*, const T*, const T*, const T*, const float*, int,
                              int, int, int) {
  throw cuda_error(kNoCudnn);
}
std::size_t attention_cudnn_workspace_bytes(const context&) { return 0; }
int attention_cudnn_graph_operations(bool, int, int, int, int, bool, bool) {
  throw cuda_error(kNoCudnn);
}
bool cudnn_attention_available(std::string* why) {
  if (why) *why = kNoCudnn;
  return false;
}

#define TROUPE_CUDNN_ATTENTION(T)                                                               \
  template void attention_cudnn_forward<T>(const context&, T*, float*, const T*, int, int, int, \
                                           int);                                                \
  template void attention_cudnn_backward<T>(const context&, T*, const T*, const T*, const T*,   \
                                            const float*, int, int, int, int);
TROUPE_CUDNN_ATTENTION(float)
TROUPE_CUDNN_ATTENTION(bf16)
TROUPE_CUDNN_ATTENTION(fp16)
#undef TROUPE_CUDNN_ATTENTION

}  // namespace troupe::kernels::cuda
