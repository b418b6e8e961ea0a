// Linear layer, weight stored [OC, C] (torch.nn.Linear): out = inp * weight^T (+ bias).
// GEMMs go through CBLAS sgemm; backward uses beta = 1 so dinp and dweight accumulate (+=).
// dbias is reduced over rows per output-channel block: deterministic for any thread count.
// bias / dinp / dweight / dbias may be nullptr.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int C, int OC) {
  if (N <= 0 || OC <= 0) return;
  float beta = 0.0f;
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      float* o = out + static_cast<std::int64_t>(n) * OC;
#pragma omp simd
      for (int j = 0; j < OC; ++j) o[j] = bias[j];
    }
    beta = 1.0f;
  }
  if (C <= 0) {
    if (!bias) std::fill(out, out + static_cast<std::int64_t>(N) * OC, 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out,
              OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int C, int OC) {
  if (N <= 0 || OC <= 0) return;
  if (C > 0) {
    // dinp[N,C] += dout[N,OC] * weight[OC,C]
    if (dinp) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                  1.0f, dinp, C);
    }
    // dweight[OC,C] += dout[N,OC]^T * inp[N,C]
    if (dweight) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
                  dweight, C);
    }
  }
  if (dbias) {
#pragma omp parallel
    {
      const channel_block block = thread_channel_block(OC);
      const int j0 = block.begin;
      const int j1 = block.end;
      const int len = j1 - j0;
      if (len > 0) {
        std::vector<double> acc(static_cast<std::size_t>(len), 0.0);
        double* a = acc.data();
        for (int n = 0; n < N; ++n) {
          const float* d = dout + static_cast<std::int64_t>(n) * OC + j0;
#pragma omp simd
          for (int j = 0; j < len; ++j) a[j] += d[j];
        }
        for (int j = 0; j < len; ++j) dbias[j0 + j] += static_cast<float>(a[j]);
      }
    }
  }
}

}  // namespace troupe::kernels
