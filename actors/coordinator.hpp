// The coordinator: drives steps, gathers metrics, and supervises. Per step it sends
// begin_step (with the step's loss scale) to the schedule actor, collects grads_ready from every
// stage (summing the squared gradient norms into the global norm), lets the update guard decide,
// sends apply_update (apply or skip), collects update_done, runs an
// evaluation pass when due, and reports the step's metrics to the client. It monitors every
// actor of the run: if one stops before the run is over, it reports which one and why to the
// client (run_finished with ok = false) and stops.
#pragma once

#include <cstdint>
#include <optional>

#include "engine/trace/trace_recorder.hpp"
#include "engine/training/update_guard.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct coordinator_config {
  // replicas: stage actors per rank ("lanes": data-parallel replicas x tensor shards; lane
  // d * tp + j is shard j of replica d).
  int steps = 1, rounds = 1, ranks = 1, replicas = 1;
  int tp = 1;
  int eval_interval = 0, eval_batches = 0;  // eval_interval 0 or no validation data: none
  bool sharded_grads = false;  // ZeRO: each replica reports the squared norm of its own shard
  std::int64_t tokens_per_step = 0;
  double flops_per_token = 0;
  engine::trace::recorder trace;
  engine::guard_config guard;  // the update guard, which the coordinator runs (C4)
  engine::loss_scale_config scaling;
  // Checkpoints: every `checkpoint_every` steps (0: none) through wiring.checkpointer. A resumed
  // run starts after `start_step` steps, with the tokens, data position and guard state saved.
  int checkpoint_every = 0;
  int start_step = 0;
  std::int64_t start_tokens = 0;
  std::int64_t micro_batches_per_step = 0;  // training micro-batches of a step, all replicas
  std::int64_t start_micro_batches = 0;
  std::optional<engine::update_guard::state> guard_state;
  // Steps to run before pausing (run_until moves it); -1: every step, no pause.
  int step_limit = -1;
};

messages::coordinator_actor spawn_coordinator(caf::actor_system& system, coordinator_config config);

}  // namespace troupe::actors
