// AdamW, as torch.optim.AdamW (foreach=False): decoupled decay p *= 1 - lr*wd (when decay),
// m = lerp(m, g, 1-b1), v = b2*v + (1-b2)*g*g, p -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps).
// Bias corrections are computed in double, elementwise math in float. step is 1-based.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "kernels/cpu/vector_math.hpp"
#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {
namespace {

struct adamw_coefficients {
  float step_size, bc2_sqrt, w1, beta2, w2, eps, keep;
  bool apply_decay;
};

TROUPE_VECTOR_CLONES
void adamw_chunk(float* param, const float* grad, float* m, float* v, std::int64_t n,
                 const adamw_coefficients& c) {
  const float step_size = c.step_size, bc2_sqrt = c.bc2_sqrt, w1 = c.w1, beta2 = c.beta2;
  const float w2 = c.w2, eps = c.eps, keep = c.apply_decay ? c.keep : 1.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float p = param[i] * keep;
    const float mi = m[i] + w1 * (g - m[i]);  // torch lerp_ form (weight < 0.5)
    const float vi = v[i] * beta2 + w2 * g * g;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    param[i] = p - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

constexpr std::int64_t kChunk = 8192;

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t n,
                  const adamw_hparams& hp, int step, bool decay) {
  if (step < 1) throw std::invalid_argument("adamw_update: step is 1-based");
  const double b1 = hp.beta1;
  const double b2 = hp.beta2;
  const double bc1 = 1.0 - std::pow(b1, step);
  const double bc2 = 1.0 - std::pow(b2, step);
  adamw_coefficients c;
  c.step_size = static_cast<float>(static_cast<double>(hp.lr) / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.w1 = static_cast<float>(1.0 - b1);  // lerp weight
  c.beta2 = hp.beta2;
  c.w2 = static_cast<float>(1.0 - b2);
  c.eps = hp.eps;
  c.apply_decay = decay && hp.weight_decay != 0.0f;
  c.keep =
      static_cast<float>(1.0 - static_cast<double>(hp.lr) * static_cast<double>(hp.weight_decay));
#pragma omp parallel for schedule(static) if (n > kChunk)
  for (std::int64_t i = 0; i < n; i += kChunk) {
    adamw_chunk(param + i, grad + i, m + i, v + i, std::min(kChunk, n - i), c);
  }
}

}  // namespace troupe::kernels
