// The pipeline protocol under stress: adversarial delivery orders, tight link credits,
// micro-batches of different lengths, schedule swaps between steps, a user-registered schedule,
// and a stage that dies (docs/pipeline.md, invariants S1-S4 and C1-C3).
#include "engine/parallel/schedule.hpp"
#include "messages/protocols.hpp"
#include "tests/actors/actor_test_util.hpp"

namespace troupe::actors::test {
namespace {

engine::recipe pipelined(const temp_dir& dir, int pp, int v, int m, const char* schedule) {
  engine::recipe r = tiny_recipe(dir);
  r.steps = 6;
  r.parallel.pp = pp;
  r.parallel.virtual_stages = v;
  r.parallel.micro_batches = m;
  r.parallel.schedule = schedule;
  return r;
}

TEST_CASE("adversarial delivery orders give identical numbers", "[actors][protocol]") {
  temp_dir dir;
  struct cfg {
    int pp, v, m, credits;
    const char* schedule;
  };
  for (const cfg c :
       {cfg{2, 1, 4, 0, "1f1b"}, cfg{4, 2, 4, 2, "interleaved_1f1b"}, cfg{4, 1, 6, 1, "zb_h1"}}) {
    engine::recipe r = pipelined(dir, c.pp, c.v, c.m, c.schedule);
    r.parallel.link_credits = c.credits;
    const auto in_order = run_actors(r);
    for (delivery how : {delivery::reversed, delivery::delayed, delivery::interleaved}) {
      DYNAMIC_SECTION(c.schedule << " p=" << c.pp << " credits=" << c.credits << " delivery "
                                 << static_cast<int>(how)) {
        run_options o;
        o.link_relay = adversarial(how);
        const long before = relayed;
        const auto shuffled = run_actors(r, o);
        // Per micro-batch and link: an activation, a gradient and a credit for each.
        REQUIRE(relayed - before >= 4L * r.steps * c.m);
        // The plan, not arrival order, decides what runs: bitwise the same run.
        REQUIRE(losses_of(shuffled.steps) == losses_of(in_order.steps));
        REQUIRE(shuffled.parameters == in_order.parameters);
      }
    }
  }
}

TEST_CASE("micro-batches of different sequence lengths in one step", "[actors][protocol]") {
  temp_dir dir;
  engine::recipe r = pipelined(dir, 2, 1, 3, "1f1b");
  run_options o;
  o.seq_lens = {16, 5, 11};
  engine::recipe serial = r;
  serial.parallel.pp = 1;
  serial.parallel.micro_batches = 1;
  serial.batch.grad_accum = 3;  // the same three micro-batches, one stage
  const auto got = losses_of(run_actors(r, o).steps);
  const auto want = losses_of(run_actors(serial, o).steps);
  require_close(got, want, 1e-5);
  // And the lengths matter: the same run at one length differs.
  REQUIRE(got != losses_of(run_actors(r).steps));
}

TEST_CASE("the schedule can be swapped between steps", "[actors][protocol]") {
  temp_dir dir;
  engine::recipe r = pipelined(dir, 2, 1, 4, "1f1b");
  engine::register_schedule("test_reversed_gpipe", [](const engine::schedule_shape& s) {
    auto plan = engine::plan_gpipe(s);
    plan.name = "test_reversed_gpipe";
    return plan;
  });
  std::vector<std::string> replies;
  run_options o;
  o.after_step = [&](caf::actor_system& sys, const run_handles& h, int step) {
    const char* next[] = {
        "", "zb_h1", "gpipe", "no_such_schedule", "test_reversed_gpipe", "interleaved_1f1b"};
    if (step >= 6) return;
    caf::scoped_actor self{sys};
    self->request(caf::actor_cast<messages::coordinator_actor>(h.coordinator), caf::infinite,
                  messages::swap_schedule{next[step]})
        .receive(
            [&](messages::swap_result& res) {
              replies.push_back((res.ok ? "ok: " : "refused: ") + res.message);
            },
            [&](caf::error& e) { replies.push_back("error: " + to_string(e)); });
  };
  const auto got = losses_of(run_actors(r, o).steps);
  require_close(got, serial_losses(r), 1e-5);
  REQUIRE(replies.size() == 5);
  CHECK(replies[0].rfind("ok:", 0) == 0);
  CHECK(replies[1].rfind("ok:", 0) == 0);
  CHECK_THAT(replies[2], Catch::StartsWith("refused:") && Catch::Contains("no_such_schedule"));
  CHECK(replies[3].rfind("ok:", 0) == 0);
  // Interleaving needs v >= 2 chunks per rank; this pipeline has one.
  CHECK_THAT(replies[4], Catch::StartsWith("refused:"));
}

TEST_CASE("a stage that dies ends the run with a report naming it", "[actors][protocol]") {
  temp_dir dir;
  engine::recipe r = pipelined(dir, 2, 1, 2, "1f1b");
  r.steps = 50;
  run_options o;
  o.after_step = [](caf::actor_system&, const run_handles& h, int step) {
    if (step == 2) caf::anon_send_exit(h.stages.at(0).at(1), caf::exit_reason::kill);
  };
  REQUIRE_THROWS_WITH(run_actors(r, o), Catch::Contains("stage 1 · dp 0 stopped"));
}

}  // namespace
}  // namespace troupe::actors::test
