// GELU, tanh approximation (GPT-2 "gelu_new", torch gelu(approximate='tanh')):
// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Elementwise; backward accumulates (+=)
// into dinp. Operation order follows PyTorch's CPU kernel.
#include <cmath>
#include <cstdint>

#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

namespace {
constexpr float kBeta = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kKappa = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float inner = kBeta * (x + kKappa * (x * x * x));
    out[i] = 0.5f * x * (1.0f + std::tanh(inner));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float x_sq = x * x;
    const float inner = kBeta * (x + kKappa * (x_sq * x));
    const float th = std::tanh(inner);
    const float left = 0.5f * x;
    const float right = 1.0f + th;
    const float left_derivative = 0.5f * right;
    const float right_derivative = 1.0f - th * th;
    const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * x_sq);
    dinp[i] += dout[i] * (left_derivative + left * right_derivative * inner_derivative);
  }
}

}  // namespace troupe::kernels
