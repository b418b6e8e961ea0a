// The embedding API (include/troupe/trainer.hpp): a trainer in the test's own actor system,
// driven by its typed messages. It starts paused; train_steps runs steps and answers paused;
// take_checkpoint commits a checkpoint that verifies; a subscriber sees every step in order;
// the numbers and the final weights are bitwise those of `troupe train`'s run of the same
// recipe; stop_training ends a run early with its weights written; bad input is an error value.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/training/checkpoint.hpp"
#include "engine/training/metrics.hpp"
#include "tests/actors/actor_test_util.hpp"
#include "troupe/trainer.hpp"

namespace troupe::actors::test {
namespace {

namespace fs = std::filesystem;
using phase = trainer_status::phase;

std::string write_recipe(const temp_dir& dir) {
  const auto path = (dir / "recipe.toml").string();
  std::ofstream(path) << "seed = 3\nsteps = 6\neval_interval = 3\neval_batches = 2\n"
                      << "[model]\nvocab_size = 256\ncontext = 16\nlayers = 2\nheads = 2\n"
                      << "width = 16\n[data]\nformat = \"text\"\ntrain = \"" << write_corpus(dir)
                      << "\"\nval_fraction = 0.1\n[batch]\nmicro_batch = 2\nseq_len = 16\n"
                      << "[parallel]\npp = 2\nmicro_batches = 2\n";
  return path;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

template <class T, class Request>
T ask(caf::scoped_actor& self, const trainer_actor& t, Request r) {
  T out;
  self->request(t, std::chrono::seconds(120), std::move(r))
      .receive([&](T& v) { out = std::move(v); },
               [&](caf::error& e) { FAIL("request failed: " << to_string(e)); });
  return out;
}

TEST_CASE("a trainer in the caller's actor system, driven step by step", "[trainer]") {
  temp_dir dir;
  const auto recipe = write_recipe(dir);
  const auto out = dir / "embedded";
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto trainer = spawn_trainer(sys, recipe, {{"output.dir=\"" + out.string() + "\""}, "", 1});
  REQUIRE(trainer);
  auto status = ask<trainer_status>(self, *trainer, query_status{});
  CHECK(status.state == phase::paused);
  CHECK(status.step == 0);
  CHECK(status.total_steps == 6);
  ask<trainer_status>(self, *trainer, subscribe_steps{caf::actor_cast<caf::actor>(self)});

  status = ask<trainer_status>(self, *trainer, train_steps{3});
  CHECK(status.state == phase::paused);
  CHECK(status.step == 3);
  // Two at once: one checkpoint, both answered with it.
  auto first = self->request(*trainer, std::chrono::seconds(120), take_checkpoint{});
  const auto ckpt = ask<checkpoint_result>(self, *trainer, take_checkpoint{});
  first.receive([&](checkpoint_result& r) { CHECK(r.path == ckpt.path); },
                [&](caf::error& e) { FAIL(to_string(e)); });
  REQUIRE(ckpt.ok);
  CHECK(fs::path(ckpt.path).filename() == "step-00000003");
  CHECK(engine::verify_checkpoint(ckpt.path).empty());
  CHECK(ask<schedule_result>(self, *trainer, use_schedule{"no_such_schedule"}).ok == false);
  CHECK(ask<schedule_result>(self, *trainer, use_schedule{"gpipe"}).ok);

  status = ask<trainer_status>(self, *trainer, train_steps{100});  // to the recipe's last step
  CHECK(status.state == phase::finished);
  CHECK(status.step == 6);
  std::vector<int> seen;
  for (int i = 0; i < 6; ++i)
    self->receive([&](step_event& e) { seen.push_back(e.step); },
                  caf::after(std::chrono::seconds(10)) >> [&] { FAIL("a step event is missing"); });
  CHECK(seen == std::vector<int>{1, 2, 3, 4, 5, 6});
  status = ask<trainer_status>(self, *trainer, stop_training{});
  CHECK(status.state == phase::finished);

  // The same recipe through run_training: the same steps and weights, bitwise.
  engine::recipe r = engine::load_recipe(recipe, {"output.dir=\"" + (dir / "cli").string() + "\""});
  run_actors(r);
  const auto a = file_bytes(dir / "cli" / "metrics.jsonl"), b = file_bytes(out / "metrics.jsonl");
  auto losses = [](const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      out.push_back(line.substr(line.find("\"loss\":"), 30));
    return out;
  };
  CHECK(losses(a) == losses(b));
  CHECK(file_bytes(dir / "cli" / "final.safetensors") == file_bytes(out / "final.safetensors"));
}

TEST_CASE("stop_training ends a run early with its weights; bad input is an error value",
          "[trainer]") {
  temp_dir dir;
  const auto recipe = write_recipe(dir);
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto trainer =
      spawn_trainer(sys, recipe, {{"output.dir=\"" + (dir / "early").string() + "\""}, "", 1});
  REQUIRE(trainer);
  CHECK(ask<trainer_status>(self, *trainer, train_steps{2}).step == 2);
  const auto status = ask<trainer_status>(self, *trainer, stop_training{});
  CHECK(status.state == phase::finished);
  CHECK(status.step == 2);
  CHECK(fs::exists(dir / "early" / "final.safetensors"));

  const auto bad = spawn_trainer(sys, recipe, {{"optimizer.lr=-1"}, "", 1});
  REQUIRE_FALSE(bad);
  CHECK_THAT(to_string(bad.error()), Catch::Contains("optimizer.lr"));
  const auto missing = spawn_trainer(sys, (dir / "nowhere.toml").string());
  REQUIRE_FALSE(missing);
  CHECK_THAT(to_string(missing.error()), Catch::Contains("nowhere.toml"));
}

// Requests that cross: every one is answered (T2, T4). A checkpoint and a stop sent together:
// the checkpoint is committed and the run stops at the step it was taken; steps asked for while
// a checkpoint waits for the pause run after it; steps asked for once a stop waits run none.
TEST_CASE("a trainer answers crossing requests: checkpoint with stop, steps behind them",
          "[trainer]") {
  temp_dir dir;
  const auto recipe = write_recipe(dir);
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto trainer =
      spawn_trainer(sys, recipe, {{"output.dir=\"" + (dir / "x").string() + "\""}, "", 1});
  REQUIRE(trainer);
  CHECK(ask<trainer_status>(self, *trainer, train_steps{1}).step == 1);
  // Running: a checkpoint, then more steps, wait for the pause; the steps follow the checkpoint.
  self->send(*trainer, train_steps{1});
  auto checkpoint = self->request(*trainer, std::chrono::seconds(120), take_checkpoint{});
  auto more = self->request(*trainer, std::chrono::seconds(120), train_steps{2});
  checkpoint_result first;
  checkpoint.receive([&](checkpoint_result& c) { first = c; },
                     [&](caf::error& e) { FAIL(to_string(e)); });
  CHECK(first.ok);
  CHECK(fs::path(first.path).filename() == "step-00000002");  // not pushed back by the steps
  CHECK(engine::verify_checkpoint(first.path).empty());
  int after = 0;
  more.receive([&](trainer_status& s) { after = s.step; },
               [&](caf::error& e) { FAIL(to_string(e)); });
  CHECK(after == 4);  // the checkpoint's step (2), then 2 more
  // A checkpoint and a stop at once, then steps: all answered; the stop wins over the steps.
  auto second = self->request(*trainer, std::chrono::seconds(120), take_checkpoint{});
  auto stop = self->request(*trainer, std::chrono::seconds(120), stop_training{});
  auto late = self->request(*trainer, std::chrono::seconds(120), train_steps{2});
  second.receive([&](checkpoint_result& c) { CHECK(c.ok); },
                 [&](caf::error& e) { FAIL(to_string(e)); });
  // Answered without a step, or (the stop already done: the trainer gone) an error.
  late.receive([&](trainer_status& s) { CHECK(s.step == 4); },
               [&](caf::error& e) { CHECK(e == caf::sec::request_receiver_down); });
  stop.receive(
      [&](trainer_status& s) {
        CHECK(s.state == phase::finished);
        CHECK(s.step == 4);
      },
      [&](caf::error& e) { FAIL(to_string(e)); });
}

// A recipe as text (built by the program) trains as the same recipe read from its file does.
TEST_CASE("a trainer from recipe text is the trainer of the recipe file", "[trainer]") {
  temp_dir dir;
  const auto path = write_recipe(dir);
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  const recipe_text text{file_bytes(path), "built in the test"};
  auto from_text =
      spawn_trainer(sys, text, {{"output.dir=\"" + (dir / "text").string() + "\""}, "", 1});
  auto from_file =
      spawn_trainer(sys, path, {{"output.dir=\"" + (dir / "file").string() + "\""}, "", 1});
  REQUIRE(from_text);
  REQUIRE(from_file);
  for (const auto* t : {&*from_text, &*from_file}) {
    CHECK(ask<trainer_status>(self, *t, train_steps{6}).step == 6);
    CHECK(ask<trainer_status>(self, *t, stop_training{}).state == phase::finished);
  }
  CHECK(file_bytes(dir / "text" / "final.safetensors") ==
        file_bytes(dir / "file" / "final.safetensors"));
  const auto bad = spawn_trainer(sys, recipe_text{"steps = -1\n", "built in the test"});
  REQUIRE_FALSE(bad);
  CHECK_THAT(to_string(bad.error()), Catch::Contains("key steps"));
  const auto broken = spawn_trainer(sys, recipe_text{"steps = = 1\n", "built in the test"});
  REQUIRE_FALSE(broken);
  CHECK_THAT(to_string(broken.error()), Catch::Contains("built in the test"));
}

}  // namespace
}  // namespace troupe::actors::test
