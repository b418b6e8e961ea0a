// Counter-based random numbers: every value is a pure function of (seed, stream name, index),
// so initialisation does not depend on partitioning, thread count or call order.
#pragma once

#include <cstdint>
#include <string_view>

namespace troupe::engine {

constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr std::uint64_t fnv1a64(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// Uniform in (0, 1) from a 64-bit key: 53 random bits, never 0.
inline double uniform_open01(std::uint64_t key) {
  return (static_cast<double>(splitmix64(key) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// w[i] = mean + stddev * N(0,1), Box-Muller over counter-based uniforms keyed by (seed, name, i).
void fill_normal(float* w, std::int64_t n, float mean, float stddev, std::uint64_t seed,
                 std::string_view stream);

}  // namespace troupe::engine
