// The data-parallel reducer of one stage when replicas live in different processes: one per
// (replica, pipeline rank), next to its stage. It serves the same grad_bucket /
// grad_bucket_reduced protocol as the in-process dp_reducer, with a ring all-reduce
// (topology/collectives.hpp) over ring_chunk messages to the next replica's reducer — local, or a
// gateway proxy of a remote one. The ring order is the in-process reducer's order, so results are
// bitwise those of the in-process run.
//
//   stage --grad_bucket--> reducer r --ring_chunk(phase 0, chunk r)--> reducer r+1 ...
//   ... after 2(d-1) chunks in, 2(d-1) out: reducer r --grad_bucket_reduced--> stage
#pragma once

#include "engine/trace/trace_recorder.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct ring_reducer_config {
  int rank = 0;  // pipeline rank
  int replica = 0;
  int replicas = 1;
  engine::trace::recorder trace;
};

messages::ring_reducer_actor spawn_ring_reducer(caf::actor_system& system,
                                                ring_reducer_config config);

}  // namespace troupe::actors
