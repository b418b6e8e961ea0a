// The update guard and dynamic loss scaling in a real training run (the serial engine), and the
// actor engine's refusal of what it does not run yet.
#include <cmath>
#include <fstream>
#include <string>

#include "tests/actors/actor_test_util.hpp"

using namespace troupe::actors::test;
using troupe::engine::recipe;

TEST_CASE("dynamic loss scaling by a power of two leaves the losses bitwise unchanged",
          "[actors][guard]") {
  temp_dir dir;
  recipe r = tiny_recipe(dir);
  r.steps = 8;
  r.batch.grad_accum = 2;
  const auto plain = serial_steps(r);
  r.precision.loss_scale = "dynamic";
  r.precision.init_scale = 65536;
  r.precision.growth_interval = 3;  // the scale grows twice within the run
  const auto scaled = serial_steps(r);
  REQUIRE(scaled.size() == plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(scaled[i].loss == plain[i].loss);
    CHECK(scaled[i].grad_norm == plain[i].grad_norm);
    CHECK(scaled[i].skipped.empty());
  }
  CHECK(scaled[0].loss_scale == 65536.0);
  CHECK(scaled[3].loss_scale == 131072.0);
  CHECK(scaled[6].loss_scale == 262144.0);
  CHECK_FALSE(plain[0].loss_scale.has_value());
}

TEST_CASE("an overflowing loss scale skips updates and backs off until training proceeds",
          "[actors][guard]") {
  temp_dir dir;
  recipe r = tiny_recipe(dir);
  r.steps = 24;
  r.precision.loss_scale = "dynamic";
  // Past fp32's range (3.4e38): the scaled backward overflows until the scale backs off into it.
  r.precision.init_scale = 1e40;
  r.guard.max_skips = 0;
  const auto steps = serial_steps(r);
  REQUIRE(steps.size() == 24);
  std::size_t skipped = 0;
  while (skipped < steps.size() && !steps[skipped].skipped.empty()) ++skipped;
  INFO("first applied update at step " << skipped + 1);
  CHECK(skipped >= 5);  // 1e40 / 2^5 is the first scale inside fp32's range
  CHECK(skipped < 20);
  for (std::size_t i = 0; i < skipped; ++i) {
    CHECK_THAT(steps[i].skipped, Catch::StartsWith("non-finite gradient norm"));
    CHECK(*steps[i].loss_scale == 1e40 * std::pow(0.5, double(i)));
  }
  for (std::size_t i = skipped; i < steps.size(); ++i) CHECK(steps[i].skipped.empty());
  // Skipped updates left the weights alone: the loss only falls once updates apply.
  CHECK(steps.back().loss < steps[skipped].loss - 0.3);
  // metrics.jsonl records why and the scale.
  std::ifstream metrics(r.metrics_path());
  std::string first;
  std::getline(metrics, first);
  CHECK_THAT(first, Catch::Contains("\"skipped\":\"non-finite gradient norm"));
  CHECK_THAT(first, Catch::Contains("\"loss_scale\":1e+40"));
}

TEST_CASE("the guard stops a run after max_skips skipped updates in a row", "[actors][guard]") {
  temp_dir dir;
  recipe r = tiny_recipe(dir);
  r.precision.loss_scale = "dynamic";
  r.precision.init_scale = 1e40;
  r.guard.max_skips = 2;
  CHECK_THROWS_WITH(serial_steps(r),
                    Catch::Contains("step 2: 2 updates skipped in a row (guard.max_skips; last: "
                                    "non-finite gradient norm"));
}

TEST_CASE("gradient-norm spikes past the threshold are skipped, the others applied",
          "[actors][guard]") {
  temp_dir dir;
  recipe r = tiny_recipe(dir);
  r.steps = 20;
  r.guard.window = 4;
  r.guard.grad_norm_zscore = 0.5;  // low enough that some steps of a real run cross it
  const auto steps = serial_steps(r);
  int skipped = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].skipped.empty()) continue;
    ++skipped;
    CHECK(i >= 4);  // never before the window is full
    CHECK_THAT(steps[i].skipped, Catch::StartsWith("gradient-norm spike: z-score"));
  }
  CHECK(skipped > 0);
  CHECK(skipped < 16);
}

TEST_CASE("the actor engine refuses the guard's thresholds and loss scaling by key",
          "[actors][guard]") {
  temp_dir dir;
  recipe r = tiny_recipe(dir);
  r.guard.loss_zscore = 5;
  CHECK_THROWS_WITH(run_actors(r), Catch::Contains("key guard.loss_zscore"));
  r.guard.loss_zscore = 0;
  r.precision.loss_scale = "dynamic";
  CHECK_THROWS_WITH(run_actors(r), Catch::Contains("key precision.loss_scale"));
}
