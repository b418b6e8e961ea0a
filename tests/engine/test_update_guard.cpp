// engine::update_guard: non-finite steps, loss and gradient-norm spikes, dynamic loss scaling.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "engine/training/update_guard.hpp"

using troupe::engine::guard_config;
using troupe::engine::loss_scale_config;
using troupe::engine::outlier_detector;
using troupe::engine::update_guard;

namespace {
const double infinity = std::numeric_limits<double>::infinity();
const double not_a_number = std::numeric_limits<double>::quiet_NaN();
}  // namespace

TEST_CASE("outlier_detector gives the z-score against the full window before the value", "[unit]") {
  outlier_detector d(4);
  CHECK(std::isnan(d.update(1)));  // not full yet
  CHECK(std::isnan(d.update(2)));
  CHECK(std::isnan(d.update(3)));
  CHECK(std::isnan(d.update(4)));
  // Window {1,2,3,4}: mean 2.5, population deviation sqrt(1.25).
  CHECK(d.update(7) == Approx((7 - 2.5) / std::sqrt(1.25)));
  // The spike entered the window, replacing the oldest: {7,2,3,4}, mean 4.
  CHECK(d.update(4) == Approx(0.0).margin(1e-12));
  // {7,4,3,4}: mean 4.5, deviation 1.5.
  CHECK(d.update(1) == Approx(-3.5 / 1.5));
  // A constant window has no deviation: no z-score.
  outlier_detector flat(3);
  for (int i = 0; i < 3; ++i) flat.update(5);
  CHECK(std::isnan(flat.update(100)));
}

TEST_CASE("update_guard skips loss and gradient-norm spikes once the window is full", "[unit]") {
  guard_config g;
  g.window = 8;
  g.loss_zscore = 4;
  g.grad_norm_zscore = 4;
  update_guard guard(g, {});
  CHECK(guard.loss_scale() == 1.0);
  // Losses wobble around 3, norms around 1.
  for (int i = 0; i < 8; ++i) {
    const auto d = guard.decide(3.0 + 0.01 * (i % 3), 1.0 + 0.02 * (i % 2));
    CHECK(d.apply);  // the window is not full: never a spike
    CHECK(d.skipped.empty());
  }
  auto d = guard.decide(3.01, 1.01);
  CHECK(d.apply);
  CHECK(std::abs(d.loss_zscore) < 4);
  d = guard.decide(9.0, 1.0);  // loss spike
  CHECK_FALSE(d.apply);
  CHECK_THAT(d.skipped, Catch::StartsWith("loss spike: z-score"));
  CHECK(d.loss_zscore > 4);
  CHECK(d.skips_in_a_row == 1);
  d = guard.decide(3.0, 1.0);
  CHECK(d.apply);
  CHECK(d.skips_in_a_row == 0);
  d = guard.decide(3.0, 50.0);  // gradient-norm spike
  CHECK_FALSE(d.apply);
  CHECK_THAT(d.skipped, Catch::StartsWith("gradient-norm spike: z-score"));
  CHECK_FALSE(d.stop);

  // Thresholds 0: spikes are applied (only the z-scores are reported).
  update_guard off(guard_config{0, 0, 8, 16}, {});
  for (int i = 0; i < 8; ++i) off.decide(3.0 + 0.01 * (i % 3), 1.0);
  d = off.decide(9.0, 50.0);
  CHECK(d.apply);
  CHECK(d.loss_zscore > 4);
}

TEST_CASE("update_guard skips non-finite steps and stops after max_skips in a row", "[unit]") {
  guard_config g;
  g.max_skips = 3;
  update_guard guard(g, {});
  auto d = guard.decide(not_a_number, 1.0);
  CHECK_FALSE(d.apply);
  CHECK_THAT(d.skipped, Catch::StartsWith("non-finite loss"));
  d = guard.decide(2.0, infinity);
  CHECK_FALSE(d.apply);
  CHECK_THAT(d.skipped, Catch::StartsWith("non-finite gradient norm (inf)"));
  CHECK_FALSE(d.stop);
  CHECK(d.skips_in_a_row == 2);
  d = guard.decide(2.0, 1.0);
  CHECK(d.apply);
  for (int i = 1; i <= 3; ++i) {
    d = guard.decide(2.0, not_a_number);
    CHECK(d.skips_in_a_row == i);
    CHECK(d.stop == (i == 3));
  }
  // Non-finite values never enter the windows: a full window of finite steps follows.
  update_guard spikes(guard_config{4, 0, 4, 0}, {});
  for (int i = 0; i < 4; ++i) spikes.decide(1.0 + 0.1 * i, 1.0);
  spikes.decide(infinity, 1.0);
  d = spikes.decide(1.15, 1.0);
  CHECK(std::isfinite(d.loss_zscore));
  CHECK(d.apply);
  // max_skips 0: never stop.
  update_guard forever(guard_config{0, 0, 4, 0}, {});
  for (int i = 0; i < 100; ++i) d = forever.decide(not_a_number, not_a_number);
  CHECK_FALSE(d.stop);
  CHECK(d.skips_in_a_row == 100);
}

TEST_CASE("dynamic loss scaling backs off on overflow and grows after a window", "[unit]") {
  loss_scale_config s;
  s.dynamic = true;
  s.init_scale = 1024;
  s.growth_interval = 3;
  update_guard guard({}, s);
  CHECK(guard.loss_scale() == 1024);
  auto d = guard.decide(2.0, infinity);  // the scaled gradients overflowed
  CHECK_FALSE(d.apply);
  CHECK(d.loss_scale == 1024);  // what this step carried
  CHECK(guard.loss_scale() == 512);
  d = guard.decide(2.0, not_a_number);
  CHECK(guard.loss_scale() == 256);
  for (int i = 0; i < 2; ++i) {
    d = guard.decide(2.0, 1.0);
    CHECK(d.apply);
    CHECK(guard.loss_scale() == 256);
  }
  d = guard.decide(2.0, 1.0);  // the third finite step in a row
  CHECK(guard.loss_scale() == 512);
  d = guard.decide(2.0, 1.0);
  d = guard.decide(2.0, infinity);  // an overflow resets the run of finite steps
  CHECK(guard.loss_scale() == 256);
  d = guard.decide(2.0, 1.0);
  d = guard.decide(2.0, 1.0);
  CHECK(guard.loss_scale() == 256);
  // Without dynamic scaling the scale stays 1 whatever happens.
  update_guard plain({}, {});
  plain.decide(2.0, infinity);
  CHECK(plain.loss_scale() == 1.0);
}
