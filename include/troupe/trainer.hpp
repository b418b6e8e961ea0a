// Troupe's embedding API (docs/embedding.md): a trainer actor in the caller's own
// caf::actor_system, driven by typed messages. The job's actors (stages, loaders, coordinator,
// checkpoint writer, ...) are spawned into the same system; the trainer is their client.
//
// clang-format off
//   auto trainer = troupe::spawn_trainer(system, "recipe.toml", {{"steps=100"}});
//   if (!trainer) ...;  // bad input: an error value, nothing written
//   self->request(*trainer, infinite, troupe::train_steps{10});  // -> trainer_status, 10 steps on
//   self->request(*trainer, infinite, troupe::take_checkpoint{}); // -> checkpoint_result
//   self->request(*trainer, infinite, troupe::stop_training{});   // -> trainer_status, finished
// clang-format on
//
// Guarantees:
//  - The trainer starts paused, before the first step. A step, once begun, always completes:
//    pause_training, take_checkpoint and stop_training take effect between steps, so no
//    micro-batch is ever dropped half-way and the numbers are those of an uninterrupted run.
//  - train_steps is answered when its steps are done (the trainer paused again), or at once
//    with the run's end or failure; pause_training once no step is in flight.
//  - take_checkpoint commits a checkpoint of the steps done (docs/checkpoints.md) and answers
//    with its directory; `troupe train --resume` and spawn_trainer's `resume` load it.
//  - stop_training ends the run between steps: the final weights are written (output.weights),
//    every checkpoint begun is committed, the job's actors stop; then the trainer stops.
//  - Errors are values: a failed run answers every request with phase::failed and a one-line
//    error naming the actor, key or file at fault; no exception crosses an actor boundary.
//  - subscribe_steps: the subscriber receives a step_event after every step, in step order.
#pragma once

#include <caf/all.hpp>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace troupe {

// The memory one pipeline rank of one replica holds at the end of a step, in bytes, as the
// actors holding it measure it (the `memory` entries of the metrics file, docs/train.md).
struct rank_memory {
  int replica = 0, rank = 0;
  std::int64_t parameters = 0;   // parameter buffers
  std::int64_t gradients = 0;    // gradients kept across the step (full, or a ZeRO shard)
  std::int64_t optimizer = 0;    // AdamW moments
  std::int64_t buffers = 0;      // temporary: gradient-accumulation pages, collective chunks
  std::int64_t pooled = 0;       // freed pages kept for reuse
  std::int64_t activations = 0;  // micro-batch activations (in flight or pooled), scratch
};

// One step's metrics (the fields of the metrics file, docs/train.md).
struct step_event {
  int step = 0, total_steps = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, step_ms = 0;
  std::optional<double> val_loss;
  std::int64_t tokens = 0;
  std::string skipped;              // why the update guard skipped the update; empty when applied
  std::vector<rank_memory> memory;  // every (replica, rank), replica-major
};

struct trainer_status {
  enum class phase { paused, running, finished, failed };
  phase state = phase::paused;
  int step = 0;  // steps done
  int total_steps = 0;
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  std::string error;  // phase::failed: what went wrong, one line
};

// Requests.
struct train_steps {  // run `steps` more (up to the recipe's steps) -> trainer_status
  int steps = 1;
};
struct pause_training {};   // -> trainer_status, once no step is in flight
struct query_status {};     // -> trainer_status
struct take_checkpoint {};  // -> checkpoint_result (pauses first)
struct checkpoint_result {
  bool ok = false;
  std::string path;  // the committed checkpoint's directory
  std::string error;
};
struct subscribe_steps {  // -> trainer_status; `subscriber` gets a step_event per step
  caf::actor subscriber;
};
struct use_schedule {  // swap the pipeline schedule from the next step -> schedule_result
  std::string name;
};
struct schedule_result {
  bool ok = false;
  std::string message;
};
struct stop_training {};  // -> trainer_status (finished or failed); the trainer then stops

using trainer_actor = caf::typed_actor<caf::replies_to<train_steps>::with<trainer_status>,
                                       caf::replies_to<pause_training>::with<trainer_status>,
                                       caf::replies_to<query_status>::with<trainer_status>,
                                       caf::replies_to<take_checkpoint>::with<checkpoint_result>,
                                       caf::replies_to<subscribe_steps>::with<trainer_status>,
                                       caf::replies_to<use_schedule>::with<schedule_result>,
                                       caf::replies_to<stop_training>::with<trainer_status>>;

struct trainer_options {
  std::vector<std::string> overrides;  // recipe keys, "key=value" (as troupe train --set)
  std::string resume;  // a checkpoint (step directory or checkpoint.dir) to continue from
  int threads = 0;     // compute threads per stage; 0: the cores / the stages
};

// Builds the job of the recipe file (one process) and spawns its trainer, paused, into
// `system`. Bad input (a recipe key, the data, a checkpoint) is an error naming it, and nothing
// is written.
caf::expected<trainer_actor> spawn_trainer(caf::actor_system& system,
                                           const std::string& recipe_path,
                                           const trainer_options& options = {});

// A recipe as TOML text instead of a file (built by the program, received by a service); the
// keys and their checks are the recipe file's (docs/recipe.md), `source` names it in errors.
struct recipe_text {
  std::string toml;
  std::string source = "recipe";
};
caf::expected<trainer_actor> spawn_trainer(caf::actor_system& system, const recipe_text& recipe,
                                           const trainer_options& options = {});

}  // namespace troupe

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::step_event)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::trainer_status)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::train_steps)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::pause_training)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::query_status)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::take_checkpoint)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::checkpoint_result)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::subscribe_steps)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::use_schedule)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::schedule_result)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::stop_training)
