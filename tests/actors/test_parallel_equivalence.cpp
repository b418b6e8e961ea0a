// Parallel equals serial (docs/pipeline.md): for every configuration, every step's loss equals
// the one-stage, one-replica serial loop over the same micro-batches within 1e-5 relative, also
// with gradient accumulation and with an uneven layer split.
#include "tests/actors/actor_test_util.hpp"

namespace troupe::actors::test {
namespace {

struct config {
  const char* name;
  int pp, dp, v, m;
  const char* schedule;
  std::vector<int> uneven;  // a deliberately uneven layer_split (9 layers)
};

const std::vector<config>& configs() {
  static const std::vector<config> all = {
      {"PP=2 1F1B", 2, 1, 1, 4, "1f1b", {7, 2}},
      {"PP=4 interleaved v=2", 4, 1, 2, 4, "interleaved_1f1b", {2, 1, 1, 1, 1, 1, 1, 1}},
      {"PP=2 x DP=2 1F1B", 2, 2, 1, 2, "1f1b", {1, 8}},
      {"PP=4 x DP=2 ZB-H1", 4, 2, 1, 4, "zb_h1", {3, 1, 4, 1}},
      {"DP=4", 1, 4, 1, 1, "1f1b", {}},
      {"PP=4 GPipe", 4, 1, 1, 3, "gpipe", {1, 1, 1, 6}},
  };
  return all;
}

engine::recipe with(engine::recipe r, const config& c) {
  r.parallel.pp = c.pp;
  r.parallel.dp = c.dp;
  r.parallel.virtual_stages = c.v;
  r.parallel.micro_batches = c.m;
  r.parallel.schedule = c.schedule;
  return r;
}

TEST_CASE("every parallel configuration matches the serial run step by step",
          "[actors][parallel]") {
  temp_dir dir;
  const engine::recipe base = tiny_recipe(dir);
  for (const auto& c : configs()) {
    for (int variant = 0; variant < 3; ++variant) {
      engine::recipe r = with(base, c);
      if (variant == 1) r.batch.grad_accum = 2;
      if (variant == 2 && c.uneven.empty()) continue;
      if (variant == 2) r.parallel.layer_split = c.uneven;
      DYNAMIC_SECTION(c.name << (variant == 1   ? ", grad_accum 2"
                                 : variant == 2 ? ", uneven"
                                                : "")) {
        run_options o;
        o.check_replicas = true;  // every replica ends with bitwise the same parameters
        const auto got = losses_of(run_actors(r, o).steps);
        require_close(got, serial_losses(r), 1e-5);
      }
    }
  }
}

TEST_CASE("the actor engine with one stage equals the serial loop bitwise", "[actors][parallel]") {
  temp_dir dir;
  engine::recipe r = tiny_recipe(dir);
  r.steps = 8;
  const auto got = losses_of(run_actors(r).steps);
  const auto want = serial_losses(r);
  REQUIRE(got == want);
}

TEST_CASE("the serial loop on a parallel layout runs the same step on one stage",
          "[actors][parallel]") {
  // `troupe train --engine serial` (and --device cuda) on a recipe written for PP x DP: every
  // step takes grad_accum x micro_batches x dp micro-batches, bitwise the one-stage recipe.
  temp_dir dir;
  engine::recipe r = with(tiny_recipe(dir), configs()[2]);  // PP=2 x DP=2, 2 micro-batches
  r.batch.grad_accum = 2;
  r.steps = 4;
  std::vector<double> got;
  engine::train_callbacks cb;
  cb.on_step = [&](const engine::step_metrics& m) { got.push_back(m.loss); };
  engine::train(r, cb);
  REQUIRE(got == serial_losses(r));
  require_close(losses_of(run_actors(r).steps), got, 1e-5);
}

}  // namespace
}  // namespace troupe::actors::test
