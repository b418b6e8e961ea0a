// Residual add: out = a + b. Backward accumulates (+=) dout into da and db (either may be
// nullptr). Elementwise, OpenMP-parallel, vectorised.
#include <cstdint>

#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

void residual_forward(float* out, const float* a, const float* b, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void residual_backward(float* da, float* db, const float* dout, std::int64_t n) {
  if (da) {
#pragma omp parallel for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) da[i] += dout[i];
  }
  if (db) {
#pragma omp parallel for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) db[i] += dout[i];
  }
}

}  // namespace troupe::kernels
