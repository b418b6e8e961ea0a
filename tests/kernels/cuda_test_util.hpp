// Helpers of the `gpu` suite's tests: device arrays filled from and read back as floats, values
// rounded to the dtype, and a closeness check whose tolerance is scaled by the dtype.
#pragma once

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_ops.hpp"

namespace cu = troupe::kernels::cuda;
namespace cpu = troupe::kernels;
using cu::bf16;
using cu::fp16;

namespace cuda_test {

template <class T>
T to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, fp16>) {
    return __float2half(x);
  } else {
    return __float2bfloat16(x);
  }
}
inline float from(float x) { return x; }
inline float from(bf16 x) { return __bfloat162float(x); }
inline float from(fp16 x) { return __half2float(x); }

// Values as the dtype holds them (bf16, fp16: rounded).
template <class T>
std::vector<float> rounded(std::vector<float> v) {
  for (auto& x : v) x = from(to<T>(x));
  return v;
}

inline std::vector<float> random_values(std::size_t n, std::uint32_t seed, float lo = -1,
                                        float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// A device array of T, filled from floats, read back as floats.
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n) : n_(n) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<std::size_t>(n, 1) * sizeof(T)) ==
            cudaSuccess);
  }
  explicit device_array(const std::vector<float>& host) : device_array(host.size()) {
    std::vector<T> t(host.size());
    for (std::size_t i = 0; i < host.size(); ++i) t[i] = to<T>(host[i]);
    REQUIRE(cudaMemcpy(p_, t.data(), n_ * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    // From pageable memory cudaMemcpy may return before the DMA lands, and the ops' streams are
    // non-blocking: wait for it.
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
  ~device_array() { cudaFree(p_); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  T* get() const { return p_; }
  std::vector<float> host() const {
    std::vector<T> t(n_);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemcpy(t.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    std::vector<float> out(n_);
    for (std::size_t i = 0; i < n_; ++i) out[i] = from(t[i]);
    return out;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

// max |got - want| <= tol * max |want|
template <class T>
void check_close(const std::vector<float>& got, const std::vector<float>& want, const char* what,
                 double fp32_tol = 1e-5) {
  // About five units in the last place of the 16-bit types (bf16 2^-8, fp16 2^-11).
  const double tol = std::is_same_v<T, float> ? fp32_tol : std::is_same_v<T, fp16> ? 5e-3 : 2e-2;
  REQUIRE(got.size() == want.size());
  double diff = 0, mag = 1e-30;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(double(got[i]) - double(want[i]));
    if (!(d <= diff)) {
      diff = d;
      worst = i;
    }
    mag = std::max(mag, std::abs(double(want[i])));
  }
  INFO(what << ": max difference " << diff << " at " << worst << " (" << got[worst] << " vs "
            << want[worst] << "), scale " << mag << ", tolerance " << tol);
  CHECK(diff <= tol * mag);
}

}  // namespace cuda_test
