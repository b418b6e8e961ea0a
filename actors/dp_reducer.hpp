// The in-process data-parallel reducer of one pipeline rank: collects the same gradient bucket
// from all d replicas and replaces each with the mean (topology::ring_order_mean, the order of a
// ring all-reduce), then tells every replica. It runs on its own thread, so reductions overlap the
// stages' backward. The stages see only the grad_bucket / grad_bucket_reduced protocol: a UCX or
// NCCL reducer serves the same messages.
#pragma once

#include "engine/trace_recorder.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct reducer_config {
  int rank = 0;
  int replicas = 1;
  engine::trace::recorder trace;
};

// stages: the stage actors of this rank, by replica (they receive grad_bucket_reduced).
messages::reducer_actor spawn_dp_reducer(caf::actor_system& system, reducer_config config,
                                         caf::actor tracer, std::vector<caf::actor> stages);

}  // namespace troupe::actors
