// Global gradient norm over several spans (including an empty one and one spanning several
// internal blocks) and clip_grad_norm: active, inactive, and disabled by max_norm <= 0.
#include <catch2/catch.hpp>

#include <vector>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

struct grads {
  std::mt19937 rng{13};
  std::vector<float> a = random_vec(3, rng);
  std::vector<float> b = random_vec(1000, rng);
  std::vector<float> c = random_vec(70000, rng, -0.01f, 0.01f);
  std::vector<gradient_span> spans{
      {a.data(), 3}, {nullptr, 0}, {b.data(), 1000}, {c.data(), 70000}};

  double reference_norm() const {
    double s = 0;
    for (const auto* v : {&a, &b, &c}) {
      for (float x : *v) s += static_cast<double>(x) * x;
    }
    return std::sqrt(s);
  }
};

}  // namespace

TEST_CASE("global_grad_norm matches the reference", "[grad_norm]") {
  grads g;
  CHECK(global_grad_norm(g.spans) == Approx(g.reference_norm()).epsilon(1e-12));
  CHECK(global_grad_norm({}) == 0.0);
}

TEST_CASE("clip_grad_norm scales only when the norm exceeds max_norm", "[grad_norm]") {
  grads g;
  const double norm = g.reference_norm();
  const auto a0 = g.a, b0 = g.b, c0 = g.c;

  SECTION("active") {
    const double max_norm = norm / 4;
    CHECK(clip_grad_norm(g.spans, max_norm) == Approx(norm).epsilon(1e-12));
    const float coef = static_cast<float>(max_norm / (norm + 1e-6));
    for (std::size_t i = 0; i < a0.size(); ++i) CHECK(g.a[i] == a0[i] * coef);
    for (std::size_t i = 0; i < b0.size(); ++i) CHECK(g.b[i] == b0[i] * coef);
    bool all_c = true;
    for (std::size_t i = 0; i < c0.size(); ++i) all_c = all_c && g.c[i] == c0[i] * coef;
    CHECK(all_c);
    CHECK(global_grad_norm(g.spans) == Approx(max_norm).epsilon(1e-5));
  }
  SECTION("inactive") {
    CHECK(clip_grad_norm(g.spans, norm * 2) == Approx(norm).epsilon(1e-12));
    CHECK(g.a == a0);
    CHECK(g.b == b0);
    CHECK(g.c == c0);
  }
  SECTION("disabled by max_norm <= 0") {
    const double max_norm = GENERATE(0.0, -1.0);
    CHECK(clip_grad_norm(g.spans, max_norm) == Approx(norm).epsilon(1e-12));
    CHECK(g.a == a0);
    CHECK(g.b == b0);
    CHECK(g.c == c0);
  }
}
