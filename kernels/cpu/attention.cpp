// Causal multi-head self-attention over qkv[B,T,3C] (q | k | v per row, head h at channels
// [h*hs, (h+1)*hs)). Per (batch, head): scores = q k^T / sqrt(hs) via sgemm, masked softmax
// with max subtraction (att above the diagonal is written as 0), out = att v via sgemm.
// Parallel over B*NH (OpenBLAS runs single-threaded inside the region); backward accumulates.
#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return;
  const int hs = C / NH;
  const int C3 = 3 * C;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const int BH = B * NH;
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < BH; ++bh) {
    const int b = bh / NH;
    const int h = bh % NH;
    const float* q =
        qkv + static_cast<std::int64_t>(b) * T * C3 + static_cast<std::int64_t>(h) * hs;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* a = att + static_cast<std::int64_t>(bh) * T * T;
    // a[T,T] = scale * q[T,hs] k[T,hs]^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, C3, k, C3, 0.0f, a, T);
    for (int t = 0; t < T; ++t) {
      float* row = a + static_cast<std::int64_t>(t) * T;
      float mx = row[0];
      for (int j = 1; j <= t; ++j) mx = row[j] > mx ? row[j] : mx;
      float sum = 0.0f;
      for (int j = 0; j <= t; ++j) {
        const float e = std::exp(row[j] - mx);
        row[j] = e;
        sum += e;
      }
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int j = 0; j <= t; ++j) row[j] *= inv;
      for (int j = t + 1; j < T; ++j) row[j] = 0.0f;
    }
    // out[T,hs] (row stride C) = a[T,T] v[T,hs]
    float* o = out + static_cast<std::int64_t>(b) * T * C + static_cast<std::int64_t>(h) * hs;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, v, C3, 0.0f, o, C);
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return;
  const int hs = C / NH;
  const int C3 = 3 * C;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const int BH = B * NH;
#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<std::size_t>(T) * static_cast<std::size_t>(T));
    float* ds = scratch.data();
#pragma omp for schedule(static)
    for (int bh = 0; bh < BH; ++bh) {
      const int b = bh / NH;
      const int h = bh % NH;
      const std::int64_t qoff =
          static_cast<std::int64_t>(b) * T * C3 + static_cast<std::int64_t>(h) * hs;
      const float* q = qkv + qoff;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + qoff;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* dO =
          dout + static_cast<std::int64_t>(b) * T * C + static_cast<std::int64_t>(h) * hs;
      const float* a = att + static_cast<std::int64_t>(bh) * T * T;
      // dv += a^T dO
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, dO, C, 1.0f, dv,
                  C3);
      // ds = dO v^T  (gradient w.r.t. the probabilities)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dO, C, v, C3, 0.0f, ds,
                  T);
      // softmax backward: ds = a * (ds - rowsum(ds * a)); masked entries are 0
      for (int t = 0; t < T; ++t) {
        float* drow = ds + static_cast<std::int64_t>(t) * T;
        const float* arow = a + static_cast<std::int64_t>(t) * T;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int j = 0; j <= t; ++j) s += drow[j] * arow[j];
#pragma omp simd
        for (int j = 0; j <= t; ++j) drow[j] = arow[j] * (drow[j] - s);
        for (int j = t + 1; j < T; ++j) drow[j] = 0.0f;
      }
      // dq += scale * ds k ; dk += scale * ds^T q
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale, ds, T, k, C3, 1.0f,
                  dq, C3);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale, ds, T, q, C3, 1.0f, dk,
                  C3);
    }
  }
}

}  // namespace troupe::kernels
