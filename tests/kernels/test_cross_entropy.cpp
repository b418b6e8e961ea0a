// Softmax cross-entropy against a double-precision reference: ignore_index rows (zero
// gradient, not counted), padded columns [V, Vp) (ignored, zero gradient), in-place aliasing
// of dlogits and logits, grad_scale, finite differences of the mean loss, invalid targets.
#include <catch2/catch.hpp>

#include <stdexcept>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

constexpr int N = 10, V = 7, Vp = 8, kIgnore = -100;

struct reference {
  std::vector<double> losses, dlogits;
  double loss_sum = 0;
  std::int64_t count = 0;
};

reference ce_reference(const std::vector<float>& logits, const std::vector<std::int32_t>& targets,
                       double grad_scale) {
  reference r;
  r.losses.assign(N, 0.0);
  r.dlogits.assign(N * Vp, 0.0);
  for (int n = 0; n < N; ++n) r.count += targets[n] != kIgnore;
  for (int n = 0; n < N; ++n) {
    if (targets[n] == kIgnore) continue;
    const float* x = &logits[n * Vp];
    double mx = x[0];
    for (int j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(x[j]));
    double sum = 0;
    for (int j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
    const double lse = mx + std::log(sum);
    r.losses[n] = lse - x[targets[n]];
    r.loss_sum += r.losses[n];
    for (int j = 0; j < V; ++j) {
      const double p = std::exp(x[j] - lse);
      r.dlogits[n * Vp + j] = (p - (j == targets[n] ? 1.0 : 0.0)) * grad_scale / r.count;
    }
  }
  return r;
}

struct fixture {
  std::mt19937 rng{77};
  std::vector<float> logits = random_vec(N * Vp, rng, -4.0f, 4.0f);
  std::vector<std::int32_t> targets{0, 6, kIgnore, 3, 3, 1, 5, kIgnore, 2, 4};
  fixture() {
    // Huge values in the padded column: they must not leak into the log-sum-exp.
    for (int n = 0; n < N; ++n) logits[n * Vp + V] = 50.0f;
  }
};

}  // namespace

TEST_CASE("cross-entropy forward matches the reference", "[cross_entropy]") {
  fixture f;
  const reference ref = ce_reference(f.logits, f.targets, 1.0);
  std::vector<float> losses(N, 99.0f);
  const auto r =
      cross_entropy_forward(losses.data(), f.logits.data(), f.targets.data(), N, V, Vp, kIgnore);
  CHECK(r.count == 8);
  CHECK(r.count == ref.count);
  CHECK(r.loss_sum == Approx(ref.loss_sum).epsilon(1e-6));
  CHECK(r.mean() == Approx(ref.loss_sum / 8).epsilon(1e-6));
  CHECK(max_rel_error(losses, ref.losses) < 1e-6);
  CHECK(losses[2] == 0.0f);
  CHECK(losses[7] == 0.0f);

  const auto r2 =
      cross_entropy_forward(nullptr, f.logits.data(), f.targets.data(), N, V, Vp, kIgnore);
  CHECK(r2.loss_sum == r.loss_sum);
  CHECK(r2.count == r.count);
}

TEST_CASE("cross-entropy backward matches the reference", "[cross_entropy]") {
  fixture f;
  const float grad_scale = GENERATE(1.0f, 0.5f, 3.0f);
  const reference ref = ce_reference(f.logits, f.targets, grad_scale);
  std::vector<float> dlogits(N * Vp, 42.0f);  // garbage: backward overwrites
  const auto r = softmax_cross_entropy_backward(dlogits.data(), f.logits.data(), f.targets.data(),
                                                N, V, Vp, kIgnore, grad_scale);
  CHECK(r.count == 8);
  CHECK(r.loss_sum == Approx(ref.loss_sum).epsilon(1e-6));
  CHECK(max_rel_error(dlogits, ref.dlogits) < 1e-5);
  for (int n = 0; n < N; ++n) {
    CHECK(dlogits[n * Vp + V] == 0.0f);  // padded column
    if (f.targets[n] == kIgnore) {
      for (int j = 0; j < Vp; ++j) CHECK(dlogits[n * Vp + j] == 0.0f);
    } else {
      double rowsum = 0;
      for (int j = 0; j < Vp; ++j) rowsum += dlogits[n * Vp + j];
      CHECK(rowsum == Approx(0.0).margin(1e-6));
    }
  }

  SECTION("in place (dlogits aliases logits) gives identical results") {
    auto buf = f.logits;
    const auto ri = softmax_cross_entropy_backward(buf.data(), buf.data(), f.targets.data(), N, V,
                                                   Vp, kIgnore, grad_scale);
    CHECK(ri.loss_sum == r.loss_sum);
    CHECK(ri.count == r.count);
    CHECK(buf == dlogits);
  }
}

TEST_CASE("cross-entropy gradient matches finite differences", "[cross_entropy]") {
  fixture f;
  const float grad_scale = 0.7f;
  std::vector<float> dlogits(N * Vp);
  softmax_cross_entropy_backward(dlogits.data(), f.logits.data(), f.targets.data(), N, V, Vp,
                                 kIgnore, grad_scale);
  auto loss = [&] {
    return grad_scale *
           cross_entropy_forward(nullptr, f.logits.data(), f.targets.data(), N, V, Vp, kIgnore)
               .mean();
  };
  CHECK(max_rel_error(dlogits, finite_difference(loss, f.logits.data(), f.logits.size())) < 1e-2);
}

TEST_CASE("cross-entropy with every row ignored", "[cross_entropy]") {
  fixture f;
  std::vector<std::int32_t> targets(N, kIgnore);
  std::vector<float> losses(N, 1.0f), dlogits(N * Vp, 1.0f);
  const auto r =
      cross_entropy_forward(losses.data(), f.logits.data(), targets.data(), N, V, Vp, kIgnore);
  CHECK(r.count == 0);
  CHECK(r.loss_sum == 0.0);
  CHECK(r.mean() == 0.0);
  for (float l : losses) CHECK(l == 0.0f);
  const auto rb = softmax_cross_entropy_backward(dlogits.data(), f.logits.data(), targets.data(), N,
                                                 V, Vp, kIgnore, 1.0f);
  CHECK(rb.mean() == 0.0);
  for (float d : dlogits) CHECK(d == 0.0f);
}

TEST_CASE("cross-entropy rejects out-of-range targets", "[cross_entropy]") {
  fixture f;
  f.targets[4] = V;  // a padded column is not a valid target
  CHECK_THROWS_AS(
      cross_entropy_forward(nullptr, f.logits.data(), f.targets.data(), N, V, Vp, kIgnore),
      std::out_of_range);
  std::vector<float> dlogits(N * Vp);
  CHECK_THROWS_AS(softmax_cross_entropy_backward(dlogits.data(), f.logits.data(), f.targets.data(),
                                                 N, V, Vp, kIgnore, 1.0f),
                  std::out_of_range);
}
