// The in-process data-parallel reducer of one pipeline rank: collects the same gradient bucket
// from all d replicas and replaces each with the mean (topology::ring_order_mean, the order of a
// ring all-reduce), then tells every replica. It runs on its own thread, so reductions overlap the
// stages' backward. The stages see only the grad_bucket / grad_bucket_reduced protocol: a UCX or
// NCCL reducer serves the same messages. Device stages' buckets live on devices: a replica group
// (engine::replica_group: NCCL, or a mean kernel) enqueues their mean after each bucket's ready
// event, and each replica gets the event after which its copy holds the mean. Across processes,
// a reducer of one replica drives that process's rank of an NCCL group spanning them.
#pragma once

#include <memory>

#include "engine/trace/trace_recorder.hpp"
#include "messages/protocols.hpp"

namespace troupe::engine {
class replica_group;
}

namespace troupe::actors {

struct reducer_config {
  int rank = 0;
  int replicas = 1;  // served here: first_replica, first_replica + 1, ...
  engine::trace::recorder trace;
  // Device stages' buckets; unset: host memory, reduced here in ring order.
  std::shared_ptr<engine::replica_group> group{};
  // Not 0 for the reducer of one replica whose group spans processes (its other replicas
  // elsewhere, each with a reducer of its own).
  int first_replica = 0;
};

// stages: the stage actors served, by replica (they receive grad_bucket_reduced).
messages::reducer_actor spawn_dp_reducer(caf::actor_system& system, reducer_config config,
                                         caf::actor tracer, std::vector<caf::actor> stages);

}  // namespace troupe::actors
