// Token + position embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
// Backward scatters dout into dwte/dwpe (+=). Tokens may repeat, so the backward pass is
// parallel over channel blocks (not rows): race-free and deterministic for any thread count.
// Token ids are not range-checked here (the vocabulary size is not part of the signature).
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu_ops.hpp"

namespace troupe::kernels {

void embedding_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                       int B, int T, int C) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t t = n % T;
    const float* te = wte + static_cast<std::int64_t>(tokens[n]) * C;
    const float* pe = wpe + t * C;
    float* o = out + n * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = te[c] + pe[c];
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int B, int T, int C) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
  if (N <= 0 || C <= 0) return;
#pragma omp parallel
  {
    const channel_block block = thread_channel_block(C);
    const int c0 = block.begin;
    const int c1 = block.end;
    for (std::int64_t n = 0; n < N && c0 < c1; ++n) {
      const float* d = dout + n * C;
      if (dwte) {
        float* g = dwte + static_cast<std::int64_t>(tokens[n]) * C;
#pragma omp simd
        for (int c = c0; c < c1; ++c) g[c] += d[c];
      }
      if (dwpe) {
        float* g = dwpe + (n % T) * C;
#pragma omp simd
        for (int c = c0; c < c1; ++c) g[c] += d[c];
      }
    }
  }
}

void embedding_rows_forward(float* out, const std::int32_t* tokens, const float* wte, int first_row,
                            int rows, std::int64_t N, int C) {
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t row = std::int64_t{tokens[n]} - first_row;
    float* o = out + n * C;
    if (row < 0 || row >= rows) {
      std::fill(o, o + C, 0.0f);
      continue;
    }
    const float* te = wte + row * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = te[c];
  }
}

void embedding_rows_backward(float* dwte, const float* dout, const std::int32_t* tokens,
                             int first_row, int rows, std::int64_t N, int C) {
  if (N <= 0 || C <= 0) return;
#pragma omp parallel
  {
    const channel_block block = thread_channel_block(C);
    const int c0 = block.begin;
    const int c1 = block.end;
    for (std::int64_t n = 0; n < N && c0 < c1; ++n) {
      const std::int64_t row = std::int64_t{tokens[n]} - first_row;
      if (row < 0 || row >= rows) continue;
      const float* d = dout + n * C;
      float* g = dwte + row * C;
#pragma omp simd
      for (int c = c0; c < c1; ++c) g[c] += d[c];
    }
  }
}

void add_positions(float* out, const float* wpe, int B, int T, int C) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* pe = wpe + (n % T) * C;
    float* o = out + n * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] += pe[c];
  }
}

}  // namespace troupe::kernels
