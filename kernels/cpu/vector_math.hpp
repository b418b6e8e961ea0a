// Branch-free float math that compilers vectorise (libm's expf/tanhf do not), plus the
// attribute that builds a loop for AVX-512, AVX2 and baseline x86-64 with run-time dispatch
// (the binary stays portable: no -march=native).
// fast_expf: Cephes polynomial after Cody-Waite range reduction, within 2 ulp of expf on
// [-87, 88]; inputs are clamped to that range (no inf, no NaN from large magnitudes).
#pragma once

#include <bit>
#include <cstdint>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define TROUPE_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TROUPE_VECTOR_CLONES
#endif

namespace troupe::kernels {

inline float fast_expf(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // n = round(x / ln 2) with the 1.5 * 2^23 trick (no rounding-mode dependent intrinsics).
  const float shifter = 12582912.0f;
  const float t = x * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace troupe::kernels
