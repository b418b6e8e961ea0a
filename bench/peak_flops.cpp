// FP32 FMA peak measurement. See peak_flops.hpp. Kernels are compiled per ISA with target
// attributes so the binary stays portable (no -march=native).
#include "bench/peak_flops.hpp"

#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>

namespace troupe::bench {
namespace {

constexpr int chains = 12;  // independent accumulators: enough to cover FMA latency x ports

__attribute__((target("avx512f"))) float fma_loop_avx512(std::int64_t iters) {
  __m512 acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = _mm512_set1_ps(float(c) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int c = 0; c < chains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 s = acc[0];
  for (int c = 1; c < chains; ++c) s = _mm512_add_ps(s, acc[c]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0] + out[15];
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(std::int64_t iters) {
  __m256 acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = _mm256_set1_ps(float(c) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int c = 0; c < chains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  float out[8];
  __m256 s = acc[0];
  for (int c = 1; c < chains; ++c) s = _mm256_add_ps(s, acc[c]);
  _mm256_storeu_ps(out, s);
  return out[0] + out[7];
}

float mul_add_loop_sse(std::int64_t iters) {
  __m128 acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = _mm_set1_ps(float(c) * 1e-3f);
  const __m128 a = _mm_set1_ps(0.999999f), b = _mm_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int c = 0; c < chains; ++c) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], a), b);
  }
  float out[4];
  _mm_storeu_ps(out, acc[0]);
  return out[0];
}

}  // namespace

peak_result measure_fp32_peak(double seconds) {
  peak_result r;
  int lanes = 4;
  float (*loop)(std::int64_t) = mul_add_loop_sse;
  r.isa = "sse2";
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    loop = fma_loop_avx512;
    lanes = 16;
    r.isa = "avx512f";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    loop = fma_loop_avx2;
    lanes = 8;
    r.isa = "avx2+fma";
  }
  // Calibrate the iteration count on one thread, then run on all threads together.
  std::int64_t iters = 1 << 16;
  volatile float sink = 0;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = sink + loop(iters);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 4) break;
    iters *= 2;
  }
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    int threads = 1;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
      const float v = loop(iters);
#pragma omp critical
      sink = sink + v;
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double flops = 2.0 * lanes * chains * double(iters) * threads / dt;
    if (flops > best) {
      best = flops;
      r.threads = threads;
    }
  }
  r.flops_per_s = best;
  return r;
}

}  // namespace troupe::bench
