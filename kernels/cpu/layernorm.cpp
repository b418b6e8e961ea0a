// LayerNorm over the last dimension, as torch.nn.LayerNorm: eps 1e-5, biased variance.
// Forward saves mean[N], rstd[N] (row statistics accumulated in double); backward accumulates
// (+=) into dinp, dweight, dbias (each may be nullptr). Parameter gradients are reduced over
// rows per channel block, so they are deterministic for any thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

namespace {
constexpr double kEps = 1e-5;
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  if (N <= 0 || C <= 0) return;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* x = inp + static_cast<std::int64_t>(n) * C;
    float* y = out + static_cast<std::int64_t>(n) * C;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; ++c) s += x[c];
    const double md = s / C;
    double v = 0.0;
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; ++c) {
      const double d = x[c] - md;
      v += d * d;
    }
    const float m = static_cast<float>(md);
    const float rs = static_cast<float>(1.0 / std::sqrt(v / C + kEps));
#pragma omp simd
    for (int c = 0; c < C; ++c) y[c] = (x[c] - m) * rs * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = rs;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  if (N <= 0 || C <= 0) return;
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      const float* x = inp + static_cast<std::int64_t>(n) * C;
      const float* dy = dout + static_cast<std::int64_t>(n) * C;
      float* dx = dinp + static_cast<std::int64_t>(n) * C;
      const float m = mean[n];
      const float rs = rstd[n];
      double a = 0.0;  // sum of dnorm
      double b = 0.0;  // sum of dnorm * norm
#pragma omp simd reduction(+ : a, b)
      for (int c = 0; c < C; ++c) {
        const float norm = (x[c] - m) * rs;
        const float dnorm = weight[c] * dy[c];
        a += dnorm;
        b += static_cast<double>(dnorm) * norm;
      }
      const float dnorm_mean = static_cast<float>(a / C);
      const float dnorm_norm_mean = static_cast<float>(b / C);
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        const float norm = (x[c] - m) * rs;
        const float dnorm = weight[c] * dy[c];
        dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs;
      }
    }
  }
  if (dweight || dbias) {
#pragma omp parallel
    {
      const channel_block block = thread_channel_block(C);
      const int c0 = block.begin;
      const int c1 = block.end;
      const int len = c1 - c0;
      if (len > 0) {
        std::vector<double> acc_w(static_cast<std::size_t>(len), 0.0);
        std::vector<double> acc_b(static_cast<std::size_t>(len), 0.0);
        double* aw = acc_w.data();
        double* ab = acc_b.data();
        for (int n = 0; n < N; ++n) {
          const float* x = inp + static_cast<std::int64_t>(n) * C + c0;
          const float* dy = dout + static_cast<std::int64_t>(n) * C + c0;
          const float m = mean[n];
          const float rs = rstd[n];
#pragma omp simd
          for (int c = 0; c < len; ++c) {
            const float norm = (x[c] - m) * rs;
            aw[c] += static_cast<double>(norm) * dy[c];
            ab[c] += dy[c];
          }
        }
        if (dweight) {
          for (int c = 0; c < len; ++c) dweight[c0 + c] += static_cast<float>(aw[c]);
        }
        if (dbias) {
          for (int c = 0; c < len; ++c) dbias[c0 + c] += static_cast<float>(ab[c]);
        }
      }
    }
  }
}

}  // namespace troupe::kernels
