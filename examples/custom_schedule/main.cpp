// A user-defined pipeline schedule (include/troupe/schedule.hpp), registered by name and used
// from a recipe through the embedding API (docs/embedding.md).
//
//   custom_schedule RECIPE.toml [key=value ...]
//
// It registers "gpipe_lifo": GPipe's forwards, then the backwards in the reverse order of the
// micro-batches, so the newest micro-batch's activations are the first freed. It prints the
// plan the schedule makes for the recipe's pipeline, trains the recipe with
// parallel.schedule = "gpipe_lifo", and shows that a schedule the simulator refuses ("broken":
// rank 0 leaves out a backward) never reaches the actors. Exit code 0 on success, 2 for bad
// input, 1 if the run failed.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "troupe/schedule.hpp"
#include "troupe/trainer.hpp"

namespace {

// Rank r: "rF0 rF1 ... rF(m-1) rB(m-1) ... rB0" (one model chunk per rank).
std::vector<std::string> gpipe_lifo(const troupe::schedule_shape& s) {
  if (s.virtual_stages != 1)
    throw std::invalid_argument("gpipe_lifo takes one model chunk per rank (virtual_stages 1)");
  std::vector<std::string> ranks;
  for (int r = 0; r < s.ranks; ++r) {
    std::string line;
    for (int j = 0; j < s.micro_batches; ++j)
      line += std::to_string(r) + "F" + std::to_string(j) + " ";
    for (int j = s.micro_batches - 1; j >= 0; --j)
      line += std::to_string(r) + "B" + std::to_string(j) + " ";
    ranks.push_back(line);
  }
  return ranks;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: custom_schedule RECIPE.toml [key=value ...]\n");
    return 2;
  }
  troupe::register_schedule("gpipe_lifo", gpipe_lifo);
  troupe::register_schedule("broken", [](const troupe::schedule_shape& s) {
    auto ranks = gpipe_lifo(s);
    ranks[0].erase(ranks[0].rfind("0B0"));  // rank 0 never runs micro-batch 0's backward
    return ranks;
  });

  troupe::trainer_options options;
  for (int i = 2; i < argc; ++i) options.overrides.emplace_back(argv[i]);
  options.overrides.emplace_back("parallel.schedule=gpipe_lifo");

  try {
    std::printf("%s", troupe::format_schedule("gpipe_lifo", {2, 4, 1}).c_str());
    troupe::format_schedule("broken", {2, 4, 1});
    std::printf("broken: accepted\n");
  } catch (const std::invalid_argument& e) {
    std::printf("broken: refused: %s\n", e.what());
  }

  caf::actor_system_config cfg;
  // Idle CAF workers must not take cycles from the training's compute threads.
  cfg.set("scheduler.max-threads", 1);
  cfg.set("work-stealing.aggressive-poll-attempts", 0);
  cfg.set("work-stealing.moderate-poll-attempts", 0);
  caf::actor_system system{cfg};
  caf::scoped_actor self{system};
  auto trainer = troupe::spawn_trainer(system, argv[1], options);
  if (!trainer) {
    std::fprintf(stderr, "custom_schedule: %s\n", to_string(trainer.error()).c_str());
    return 2;
  }
  troupe::trainer_status status;
  bool ok = true;
  auto ask = [&](auto request) {
    self->request(*trainer, caf::infinite, request)
        .receive([&](troupe::trainer_status& s) { status = s; },
                 [&](caf::error& e) {
                   std::fprintf(stderr, "custom_schedule: %s\n", to_string(e).c_str());
                   ok = false;
                 });
    return ok;
  };
  if (!ask(troupe::train_steps{1 << 30}) || !ask(troupe::stop_training{})) return 1;
  if (status.state != troupe::trainer_status::phase::finished) {
    std::fprintf(stderr, "custom_schedule: the run failed: %s\n", status.error.c_str());
    return 1;
  }
  std::printf("finished: %d steps with gpipe_lifo, last loss %.6f\n", status.step,
              status.last_loss);
  return 0;
}
