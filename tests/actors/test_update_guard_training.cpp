// The update guard and dynamic loss scaling in real training runs: the serial engine, and the actor
// engine (the coordinator runs the guard; stages and ZeRO shards skip or apply) against it.
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

// The actor engine's pipeline and data-parallel configurations, ZeRO included, for the tests below.
const parallel_case actor_configs[] = {
    {"one stage", 1, 1, 0, 1, "1f1b"},
    {"PP=2 x DP=2 1F1B", 2, 2, 0, 2, "1f1b"},
    {"PP=2 x DP=2 ZeRO-2", 2, 2, 2, 2, "1f1b"},
    {"PP=2 x DP=2 ZeRO-3 ZB-H1", 2, 2, 3, 2, "zb_h1"},
};
recipe with(const recipe& r, const parallel_case& c) { return with_layout(r, c); }

// The layout on the actor engine and the serial loop over the same micro-batches per step: every
// step skips (or applies) in both, and the losses agree within 1e-5. Returns {actors, serial}.
std::pair<std::vector<troupe::engine::step_metrics>, std::vector<troupe::engine::step_metrics>>
same_skips_as_serial(const recipe& base, const parallel_case& c) {
  auto want = serial_steps(with(base, c));
  auto got = run_actors(with(base, c)).steps;
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("step " << i + 1 << ": " << got[i].loss << " (" << got[i].skipped << ") vs serial "
                 << want[i].loss << " (" << want[i].skipped << ")");
    CHECK(got[i].skipped.empty() == want[i].skipped.empty());
    CHECK(std::abs(got[i].loss - want[i].loss) <= 1e-5 * want[i].loss);
  }
  return {std::move(got), std::move(want)};
}

TEST_CASE("the actor engine's dynamic loss scaling leaves its losses bitwise unchanged",
          "[actors][guard]") {
  temp_dir dir;
  for (const auto& c : actor_configs) {
    DYNAMIC_SECTION(c.name) {
      recipe r = with(tiny_recipe(dir), c);
      r.steps = 6;
      const auto plain = run_actors(r).steps;
      r.precision.loss_scale = "dynamic";
      r.precision.init_scale = 65536;
      r.precision.growth_interval = 2;
      const auto scaled = run_actors(r).steps;
      REQUIRE(scaled.size() == plain.size());
      for (std::size_t i = 0; i < plain.size(); ++i) {
        INFO("step " << i + 1);
        CHECK(scaled[i].loss == plain[i].loss);
        CHECK(scaled[i].grad_norm == plain[i].grad_norm);
        CHECK(scaled[i].skipped.empty());
        CHECK(*scaled[i].loss_scale == 65536.0 * std::pow(2.0, double(i / 2)));
      }
    }
  }
}

TEST_CASE("the actor engine skips and backs off an overflowing scale as the serial engine does",
          "[actors][guard]") {
  temp_dir dir;
  recipe base = tiny_recipe(dir);
  base.steps = 10;
  base.precision.loss_scale = "dynamic";
  // Past fp32's range, then far inside it: the first step overflows in every configuration, the
  // next ones in none. (A scale close to FLT_MAX overflows in some configurations but not in
  // others: data-parallel and tied-weight sums add scaled gradients before they are averaged.)
  base.precision.init_scale = 1e40;
  base.precision.backoff_factor = 1e-4;
  base.guard.max_skips = 0;
  for (const auto& c : actor_configs) {
    DYNAMIC_SECTION(c.name) {
      const auto [got, want] = same_skips_as_serial(base, c);
      for (std::size_t i = 0; i < want.size(); ++i) {
        INFO("step " << i + 1);
        if (!want[i].skipped.empty())
          CHECK_THAT(got[i].skipped, Catch::StartsWith("non-finite gradient norm"));
        CHECK(*got[i].loss_scale == *want[i].loss_scale);
      }
      CHECK_FALSE(got[0].skipped.empty());
      CHECK(got[1].skipped.empty());
      CHECK(*got[1].loss_scale == 1e40 * 1e-4);
    }
  }
}

TEST_CASE("the actor engine skips the same gradient-norm spikes as the serial engine",
          "[actors][guard]") {
  temp_dir dir;
  recipe base = tiny_recipe(dir);
  base.steps = 16;
  base.guard.window = 4;
  base.guard.grad_norm_zscore = 0.5;
  for (const auto& c : actor_configs) {
    DYNAMIC_SECTION(c.name) {
      const auto [got, want] = same_skips_as_serial(base, c);
      int skipped = 0;
      for (const auto& m : want) skipped += !m.skipped.empty();
      REQUIRE(skipped > 0);
    }
  }
}

TEST_CASE("the actor engine stops after max_skips skipped updates in a row", "[actors][guard]") {
  temp_dir dir;
  recipe r = with(tiny_recipe(dir), actor_configs[2]);
  r.precision.loss_scale = "dynamic";
  r.precision.init_scale = 1e40;
  r.guard.max_skips = 3;
  CHECK_THROWS_WITH(run_actors(r),
                    Catch::Contains("step 3: 3 updates skipped in a row (guard.max_skips; last: "
                                    "non-finite gradient norm"));
}
