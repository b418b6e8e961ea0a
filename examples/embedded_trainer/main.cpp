// A program that embeds a Troupe trainer (docs/embedding.md): its own CAF actor system, a
// trainer spawned into it, driven with typed messages.
//
//   embedded_trainer RECIPE.toml [key=value ...]
//
// It subscribes to every step's metrics, trains the first half of the recipe's steps, takes a
// checkpoint, swaps the schedule to GPipe, trains the rest and stops. Exit code 0 on success,
// 2 for bad input, 1 if the run failed.
#include <cstdio>
#include <string>
#include <vector>

#include "troupe/trainer.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: embedded_trainer RECIPE.toml [key=value ...]\n");
    return 2;
  }
  troupe::trainer_options options;
  for (int i = 2; i < argc; ++i) options.overrides.emplace_back(argv[i]);

  caf::actor_system_config cfg;
  // Idle CAF workers must not take cycles from the training's compute threads.
  cfg.set("scheduler.max-threads", 1);
  cfg.set("work-stealing.aggressive-poll-attempts", 0);
  cfg.set("work-stealing.moderate-poll-attempts", 0);
  caf::actor_system system{cfg};
  caf::scoped_actor self{system};
  auto trainer = troupe::spawn_trainer(system, argv[1], options);
  if (!trainer) {
    std::fprintf(stderr, "embedded_trainer: %s\n", to_string(trainer.error()).c_str());
    return 2;
  }
  // Every request is answered with a value; a trainer that is gone is an error.
  auto ask = [&](auto request, auto on_answer) {
    bool ok = true;
    self->request(*trainer, caf::infinite, request).receive(on_answer, [&](caf::error& e) {
      std::fprintf(stderr, "embedded_trainer: %s\n", to_string(e).c_str());
      ok = false;
    });
    return ok;
  };
  auto print_steps = [&] {  // the step events that arrived so far
    for (bool more = true; more;)
      self->receive(
          [](troupe::step_event& e) {
            std::printf("step %d/%d loss %.4f lr %.2e\n", e.step, e.total_steps, e.loss, e.lr);
          },
          caf::after(std::chrono::milliseconds(0)) >> [&] { more = false; });
  };

  troupe::trainer_status status;
  auto keep = [&](troupe::trainer_status& s) { status = s; };
  if (!ask(troupe::subscribe_steps{caf::actor_cast<caf::actor>(self)}, keep)) return 1;
  const int half = status.total_steps / 2;
  if (!ask(troupe::train_steps{half}, keep)) return 1;
  print_steps();
  std::printf("paused after step %d\n", status.step);

  troupe::checkpoint_result checkpoint;
  if (!ask(troupe::take_checkpoint{}, [&](troupe::checkpoint_result& c) { checkpoint = c; }))
    return 1;
  if (!checkpoint.ok) {
    std::fprintf(stderr, "embedded_trainer: checkpoint: %s\n", checkpoint.error.c_str());
    return 1;
  }
  std::printf("checkpoint %s\n", checkpoint.path.c_str());

  troupe::schedule_result swapped;
  if (!ask(troupe::use_schedule{"gpipe"}, [&](troupe::schedule_result& r) { swapped = r; }))
    return 1;
  std::printf("schedule gpipe: %s\n", swapped.ok ? "from the next step" : swapped.message.c_str());

  if (!ask(troupe::train_steps{status.total_steps}, keep)) return 1;  // to the last step
  print_steps();
  if (!ask(troupe::stop_training{}, keep)) return 1;
  if (status.state != troupe::trainer_status::phase::finished) {
    std::fprintf(stderr, "embedded_trainer: the run failed: %s\n", status.error.c_str());
    return 1;
  }
  std::printf("finished: %d steps, last loss %.4f\n", status.step, status.last_loss);
  return 0;
}
