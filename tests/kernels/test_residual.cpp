// Residual add: forward against a double reference, backward accumulates (+=) into both
// branches, nullptr branches are skipped, gradients match finite differences.
#include <catch2/catch.hpp>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

TEST_CASE("residual forward and backward", "[residual]") {
  const int n = 2 * 5 * 8;
  std::mt19937 rng(11);
  auto a = random_vec(n, rng), b = random_vec(n, rng), dout = random_vec(n, rng);
  std::vector<float> out(n);
  residual_forward(out.data(), a.data(), b.data(), n);
  std::vector<double> ref(n);
  for (int i = 0; i < n; ++i) ref[i] = static_cast<double>(a[i]) + b[i];
  CHECK(max_rel_error(out, ref) < 1e-6);

  auto da0 = random_vec(n, rng), db0 = random_vec(n, rng);
  auto da = da0, db = db0;
  residual_backward(da.data(), db.data(), dout.data(), n);
  for (int i = 0; i < n; ++i) {
    CHECK(da[i] == da0[i] + dout[i]);
    CHECK(db[i] == db0[i] + dout[i]);
  }

  std::vector<float> ga(n, 0.0f), gb(n, 0.0f);
  residual_backward(ga.data(), gb.data(), dout.data(), n);
  residual_backward(ga.data(), nullptr, dout.data(), n);
  for (int i = 0; i < n; ++i) {
    CHECK(ga[i] == 2 * dout[i]);
    CHECK(gb[i] == dout[i]);
  }

  const auto w = random_vec(n, rng);
  auto loss = [&] {
    residual_forward(out.data(), a.data(), b.data(), n);
    return weighted_sum(out.data(), w);
  };
  std::vector<float> fa(n, 0.0f), fb(n, 0.0f);
  residual_backward(fa.data(), fb.data(), w.data(), n);
  CHECK(max_rel_error(fa, finite_difference(loss, a.data(), a.size())) < 1e-2);
  CHECK(max_rel_error(fb, finite_difference(loss, b.data(), b.size())) < 1e-2);
}
