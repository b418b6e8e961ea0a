// Counter-based normal initialisation. See random.hpp.
#include "engine/model/random.hpp"

#include <cmath>

namespace troupe::engine {

void fill_normal(float* w, std::int64_t n, float mean, float stddev, std::uint64_t seed,
                 std::string_view stream) {
  const std::uint64_t key = splitmix64(seed ^ fnv1a64(stream));
  constexpr double two_pi = 6.283185307179586476925286766559;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; i += 2) {
    const auto pair = static_cast<std::uint64_t>(i / 2);
    const double u1 = uniform_open01(key + 2 * pair);
    const double u2 = uniform_open01(key + 2 * pair + 1);
    const double r = std::sqrt(-2.0 * std::log(u1));
    w[i] = static_cast<float>(mean + stddev * r * std::cos(two_pi * u2));
    if (i + 1 < n) w[i + 1] = static_cast<float>(mean + stddev * r * std::sin(two_pi * u2));
  }
}

}  // namespace troupe::engine
