// fast_expf against std::exp: relative error within a few float ulps over the clamped range,
// exact clamping behaviour outside it.
#include <catch2/catch.hpp>
#include <cmath>

#include "kernels/cpu/vector_math.hpp"

using troupe::kernels::fast_expf;

TEST_CASE("fast_expf matches std::exp within 3 ulp-equivalents on [-87, 88]",
          "[unit][vector_math]") {
  double worst = 0;
  for (double x = -87.0; x <= 88.0; x += 0.001953125) {
    const double got = fast_expf(static_cast<float>(x));
    // Compare with the exact exp of the float input, not of the double x.
    const double exact = std::exp(static_cast<double>(static_cast<float>(x)));
    worst = std::max(worst, std::fabs(got - exact) / exact);
  }
  CHECK(worst < 3.6e-7);
}

TEST_CASE("fast_expf clamps instead of overflowing", "[unit][vector_math]") {
  CHECK(std::isfinite(fast_expf(1000.0f)));
  CHECK(fast_expf(1000.0f) == fast_expf(88.0f));
  CHECK(fast_expf(-1000.0f) == fast_expf(-87.0f));
  CHECK(fast_expf(-1000.0f) > 0.0f);
  CHECK(fast_expf(0.0f) == 1.0f);
}
