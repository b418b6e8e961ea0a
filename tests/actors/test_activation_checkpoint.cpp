// Activation checkpointing (activation_checkpoint.mode = "full") in real training runs: the
// serial engine and the actor engine's pipelines, ZeRO-3, a split-backward schedule and both
// together (W's recomputations gather their blocks again) give
// bitwise the losses of the same run without it; every rank's measured activation memory
// (metrics.jsonl's memory[].activations) is what --dry-run's plan says, with and without it.
#include "engine/parallel/memory_plan.hpp"
#include "tests/actors/actor_test_util.hpp"

using namespace troupe::actors::test;
using troupe::engine::recipe;

namespace {

const parallel_case configs[] = {
    {"PP=2 1F1B", 2, 1, 0, 4, "1f1b"},
    {"PP=3 GPipe", 3, 1, 0, 3, "gpipe"},
    {"PP=2 ZB-H1 (split backward)", 2, 1, 0, 4, "zb_h1"},
    {"PP=2 x DP=2 ZeRO-3 1F1B", 2, 2, 3, 2, "1f1b"},
    {"PP=2 x DP=2 ZeRO-3 ZB-H1 (W gathers what it recomputes)", 2, 2, 3, 4, "zb_h1"},
};

recipe with(recipe r, const parallel_case& c, bool full) {
  r = with_layout(r, c);
  r.steps = 4;
  r.activation_checkpoint.mode = full ? "full" : "none";
  return r;
}

}  // namespace

TEST_CASE("checkpointed training equals training without it, bitwise", "[actors][recompute]") {
  temp_dir dir;
  SECTION("serial engine") {
    recipe r = tiny_recipe(dir);
    r.steps = 6;
    const auto plain = serial_losses(r);
    r.activation_checkpoint.mode = "full";
    CHECK(serial_losses(r) == plain);
  }
  for (const auto& c : configs) {
    DYNAMIC_SECTION(c.name) {
      const auto plain = run_actors(with(tiny_recipe(dir), c, false)).steps;
      const auto ckpt = run_actors(with(tiny_recipe(dir), c, true)).steps;
      CHECK(losses_of(ckpt) == losses_of(plain));
      REQUIRE(ckpt.size() == plain.size());
      for (std::size_t i = 0; i < plain.size(); ++i) CHECK(ckpt[i].grad_norm == plain[i].grad_norm);
    }
  }
}

TEST_CASE("measured activation memory is the dry-run plan, and checkpointing shrinks it",
          "[actors][recompute]") {
  temp_dir dir;
  for (const auto& c : configs) {
    DYNAMIC_SECTION(c.name) {
      for (const bool full : {false, true}) {
        INFO((full ? "checkpointed" : "not checkpointed"));
        const recipe r = with(tiny_recipe(dir), c, full);
        const auto plan = troupe::engine::plan_memory(r);  // what --dry-run prints
        const auto steps = run_actors(r).steps;
        REQUIRE_FALSE(steps.empty());
        for (const auto& m : steps.back().memory) {
          const auto& p = plan.at(static_cast<std::size_t>(m.rank));
          INFO("replica " << m.replica << " rank " << m.rank << ": measured " << m.activations
                          << " bytes, planned " << p.activation_bytes() << " ("
                          << p.micro_batches_in_flight << " micro-batches in flight)");
          CHECK(m.activations == p.activation_bytes());
          if (full) {
            CHECK(p.activation_bytes() < p.activation_bytes_without_recompute);
          } else {
            CHECK(p.activation_bytes() == p.activation_bytes_without_recompute);
          }
        }
      }
    }
  }
}
