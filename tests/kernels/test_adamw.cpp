// AdamW against a hand-written double-precision torch.optim.AdamW reference over 3 steps,
// with and without decoupled weight decay.
#include <catch2/catch.hpp>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

struct state {
  std::vector<double> p, m, v;
};

void adamw_reference(state& s, const std::vector<float>& g, const adamw_hparams& hp, int step,
                     bool decay) {
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  const double bc1 = 1.0 - std::pow(b1, step);
  const double bc2 = 1.0 - std::pow(b2, step);
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (decay) s.p[i] *= 1.0 - lr * wd;
    s.m[i] = b1 * s.m[i] + (1.0 - b1) * g[i];
    s.v[i] = b2 * s.v[i] + (1.0 - b2) * g[i] * g[i];
    const double denom = std::sqrt(s.v[i]) / std::sqrt(bc2) + eps;
    s.p[i] -= (lr / bc1) * s.m[i] / denom;
  }
}

}  // namespace

TEST_CASE("adamw matches the reference over 3 steps", "[adamw]") {
  const bool decay = GENERATE(false, true);
  const int n = 100;
  std::mt19937 rng(decay ? 3 : 4);
  adamw_hparams hp;
  hp.lr = 1e-2f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  auto p = random_vec(n, rng);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  state ref{to_double(p), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (int step = 1; step <= 3; ++step) {
    const auto g = random_vec(n, rng);
    const auto p_before = p;
    const auto ref_before = ref.p;
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp, step, decay);
    adamw_reference(ref, g, hp, step, decay);
    INFO("step " << step);
    CHECK(max_rel_error(p, ref.p) < 1e-6);
    CHECK(max_rel_error(m, ref.m) < 1e-5);
    CHECK(max_rel_error(v, ref.v) < 1e-5);
    // The update itself (much smaller than p) must match too.
    std::vector<double> dp(n), dp_ref(n);
    for (int i = 0; i < n; ++i) {
      dp[i] = static_cast<double>(p[i]) - p_before[i];
      dp_ref[i] = ref.p[i] - ref_before[i];
    }
    CHECK(max_rel_error(dp, dp_ref) < 1e-4);
  }
}

TEST_CASE("adamw weight decay only applies when asked", "[adamw]") {
  const int n = 32;
  std::mt19937 rng(8);
  const auto p0 = random_vec(n, rng);
  const auto g = random_vec(n, rng);
  adamw_hparams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  auto run = [&](const adamw_hparams& h, bool decay) {
    auto p = p0;
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, 1, decay);
    return p;
  };
  const auto no_decay = run(hp, false);
  const auto with_decay = run(hp, true);
  adamw_hparams hp0 = hp;
  hp0.weight_decay = 0.0f;
  CHECK(run(hp0, true) == no_decay);
  CHECK(with_decay != no_decay);
  for (int i = 0; i < n; ++i) {
    // Decoupled: the decayed run differs by exactly the shrink of the old parameter.
    CHECK(with_decay[i] - no_decay[i] == Approx(-1e-3 * p0[i]).margin(1e-6));
  }
}
