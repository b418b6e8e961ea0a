// The trace sink: collects every actor's trace batches and writes the Chrome trace-event file
// when asked (engine/trace/trace.hpp), with the schedule's theoretical bubble for the measured
// F/B/W costs, replying with "" or the error.
#pragma once

#include "messages/protocols.hpp"

namespace troupe::actors {

messages::tracer_actor spawn_tracer(caf::actor_system& system);

}  // namespace troupe::actors
