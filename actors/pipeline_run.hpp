// A whole training run on the actor engine, in one process: builds the actors of a recipe
// (tracer, schedule, coordinator, p x d stages, p reducers when d > 1, d data loaders), wires
// them, drives the run as the coordinator's client and tears everything down. `troupe train`
// calls this; tests call it with hooks.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/trainer.hpp"

namespace caf {
class actor;
class actor_system;
}  // namespace caf

namespace troupe::actors {

// The actors of a running job, for hooks (tests, embedding).
struct run_handles {
  const caf::actor& coordinator;
  const std::vector<std::vector<caf::actor>>& stages;  // [replica][rank]
};

struct run_options {
  std::string trace_path;       // write a Chrome trace-event file here ("" = no tracing)
  std::vector<int> seq_lens;    // per micro-batch sequence lengths, cycled; empty: batch.seq_len
  int compute_threads = 0;      // BLAS/OpenMP threads per stage; 0: cores / (pp * dp), >= 1
  bool check_replicas = false;  // compare every replica's final parameters bitwise
  // Test hook: the handle a stage uses to reach a peer stage; return a relay in front of it.
  std::function<caf::actor(caf::actor_system&, const caf::actor& target)> link_relay;
  // Called in the driving thread after every step (1-based), e.g. to swap the schedule.
  std::function<void(caf::actor_system&, const run_handles&, int step)> after_step;
};

struct run_result {
  engine::train_summary summary;
  std::vector<engine::step_metrics> steps;
  std::map<std::string, std::vector<float>> parameters;  // replica 0, by Hugging Face name
};

// Throws engine::recipe_error for bad input (nothing written) and std::runtime_error naming
// the actor that failed.
run_result run_training(const engine::recipe& recipe, const engine::train_callbacks& callbacks,
                        const run_options& options = {});

}  // namespace troupe::actors
