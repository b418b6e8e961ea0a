// The schedule actor: hands every stage its plan for each step. The schedule is a recipe value
// and can be swapped between steps with a swap_schedule message; a new schedule is built and
// checked by the simulator before it is accepted, and takes effect at the next begin_step.
// For evaluation it hands out forward-only plans.
#pragma once

#include <string>

#include "engine/parallel/schedule.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct schedule_config {
  std::string name = "1f1b";
  engine::schedule_shape shape;
  int replicas = 1;
  // false: the stages cannot run a split backward (device chunks made without its buffers), and
  // a swap to a schedule with W actions is refused.
  bool split_backward_possible = true;
};

messages::schedule_actor spawn_schedule_actor(caf::actor_system& system, schedule_config config);

}  // namespace troupe::actors
