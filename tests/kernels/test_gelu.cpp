// GELU (tanh approximation) against a double-precision reference with an analytic derivative,
// finite differences and the accumulate (+=) convention.
#include <catch2/catch.hpp>

#include <numbers>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {
const double kS = std::sqrt(2.0 / std::numbers::pi);
double gelu_ref(double x) { return 0.5 * x * (1.0 + std::tanh(kS * (x + 0.044715 * x * x * x))); }
double gelu_grad_ref(double x) {
  const double u = kS * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kS * (1.0 + 3.0 * 0.044715 * x * x);
}
}  // namespace

TEST_CASE("gelu matches the reference", "[gelu]") {
  const int n = 1000;
  std::mt19937 rng(5);
  auto inp = random_vec(n, rng, -6.0f, 6.0f);
  inp[0] = 0.0f;
  inp[1] = -20.0f;
  inp[2] = 20.0f;
  auto dout = random_vec(n, rng);
  std::vector<float> out(n);
  gelu_forward(out.data(), inp.data(), n);
  for (int i = 0; i < n; ++i) {
    INFO("x = " << inp[i]);
    CHECK(out[i] == Approx(gelu_ref(inp[i])).epsilon(1e-5).margin(1e-6));
  }
  std::vector<float> dinp(n, 0.0f);
  gelu_backward(dinp.data(), inp.data(), dout.data(), n);
  for (int i = 0; i < n; ++i) {
    INFO("x = " << inp[i]);
    CHECK(dinp[i] == Approx(dout[i] * gelu_grad_ref(inp[i])).epsilon(1e-5).margin(1e-6));
  }
  const auto once = dinp;
  gelu_backward(dinp.data(), inp.data(), dout.data(), n);
  for (int i = 0; i < n; ++i) CHECK(dinp[i] == 2 * once[i]);
}

TEST_CASE("gelu gradient matches finite differences", "[gelu]") {
  const int n = 40;
  std::mt19937 rng(6);
  auto inp = random_vec(n, rng, -4.0f, 4.0f);
  const auto w = random_vec(n, rng);
  std::vector<float> out(n);
  auto loss = [&] {
    gelu_forward(out.data(), inp.data(), n);
    return weighted_sum(out.data(), w);
  };
  std::vector<float> dinp(n, 0.0f);
  gelu_backward(dinp.data(), inp.data(), w.data(), n);
  CHECK(max_rel_error(dinp, finite_difference(loss, inp.data(), inp.size())) < 1e-2);
}
