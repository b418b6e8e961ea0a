// Shared helpers for the kernel tests: seeded random fills, double/float conversion, a
// relative error measure (max abs difference over the reference's max magnitude) and a
// central-difference gradient checker that perturbs a float buffer in place.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace troupe::kernels::test {

inline std::vector<float> random_vec(std::size_t n, std::mt19937& rng, float lo = -1.0f,
                                     float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// max_i |a_i - b_i| / max_i |b_i| (b is the reference); absolute when the reference is all 0.
template <class A, class B>
double max_rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  double diff = 0.0;
  double mag = 0.0;
  const std::size_t n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    mag = std::max(mag, std::abs(static_cast<double>(b[i])));
  }
  if (a.size() != b.size()) return INFINITY;
  return mag > 0.0 ? diff / mag : diff;
}

// sum_i out_i * w_i in double: the scalar loss used by the finite-difference checks.
inline double weighted_sum(const float* out, const std::vector<float>& w) {
  double s = 0.0;
  for (std::size_t i = 0; i < w.size(); ++i) s += static_cast<double>(out[i]) * w[i];
  return s;
}

// Central differences of loss() w.r.t. every element of x (perturbed in place, restored).
inline std::vector<double> finite_difference(const std::function<double()>& loss, float* x,
                                             std::size_t n, float step = 1e-3f) {
  std::vector<double> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float orig = x[i];
    x[i] = orig + step;
    const double lp = loss();
    x[i] = orig - step;
    const double lm = loss();
    x[i] = orig;
    // Use the perturbation actually representable in float.
    const double h = (static_cast<double>(orig + step) - static_cast<double>(orig - step));
    g[i] = (lp - lm) / h;
  }
  return g;
}

}  // namespace troupe::kernels::test
