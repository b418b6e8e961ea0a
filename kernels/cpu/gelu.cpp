// GELU, tanh approximation (GPT-2 "gelu_new", torch gelu(approximate='tanh')):
// y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as y = x * s with
// s = sigmoid(2u) = 1 / (1 + e), e = exp(-2u) — the same function without tanh's cancellation,
// and vectorisable. Backward accumulates (+=) into dinp:
// dy/dx = s + x * 2 s (1 - s) du/dx, with 1 - s = e * s.
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/vector_math.hpp"
#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

namespace {
constexpr float kBeta = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kKappa = 0.044715f;
constexpr std::int64_t kChunk = 4096;

TROUPE_VECTOR_CLONES
void gelu_forward_chunk(float* out, const float* inp, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kBeta * (x + kKappa * (x * x * x));
    const float e = fast_expf(-2.0f * u);
    out[i] = x / (1.0f + e);
  }
}

TROUPE_VECTOR_CLONES
void gelu_backward_chunk(float* dinp, const float* inp, const float* dout, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float x_sq = x * x;
    const float u = kBeta * (x + kKappa * (x_sq * x));
    const float e = fast_expf(-2.0f * u);
    const float s = 1.0f / (1.0f + e);
    const float du = kBeta * (1.0f + 3.0f * kKappa * x_sq);
    dinp[i] += dout[i] * (s + 2.0f * x * s * (e * s) * du);
  }
}
}  // namespace

void gelu_forward(float* out, const float* inp, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < n; c += kChunk) {
    gelu_forward_chunk(out + c, inp + c, std::min(kChunk, n - c));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < n; c += kChunk) {
    gelu_backward_chunk(dinp + c, inp + c, dout + c, std::min(kChunk, n - c));
  }
}

}  // namespace troupe::kernels
