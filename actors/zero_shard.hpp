// A ZeRO optimizer shard: one per (replica, pipeline rank), next to its stage. It owns what the
// replica owns of every gradient bucket (engine/parallel/zero.hpp): the AdamW moments of those
// floats (ZeRO-1), and their reduced gradients (ZeRO-2). It serves the stage's grad_bucket protocol
// with a ring reduce-scatter over ring_chunk messages to the next replica's shard (local, or a
// gateway proxy of a remote one), updates its floats when the stage forwards the coordinator's
// update, and all-gathers the new parameters to every replica.
//
//   stage --zero_layout--> shard                                     (once, before step 0)
//   stage --grad_bucket(b)--> shard r --ring_chunk(phase 0)--> shard r+1 ...  d-1 chunks in/out
//   shard --grad_bucket_reduced(b, square_sum of its chunk)--> stage   (ZeRO-2: stage releases b)
//   stage --zero_update(grad_norm)--> shard: AdamW on its chunks (clipped by the global norm)
//   shard r --ring_chunk(phase 1, its chunk of the new parameters)--> shard r+1 ... d-1 in/out
//   shard --zero_update_done(lr, memory)--> stage --update_done--> coordinator
//
// The reduce-scatter is the first half of the DDP ring all-reduce, so each owned chunk holds
// bitwise the DDP gradient; only the order of the global norm's sum differs from DDP.
#pragma once

#include "engine/parallel/zero.hpp"
#include "engine/trace/trace_recorder.hpp"
#include "engine/training/optimizer.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct zero_shard_config {
  int rank = 0;  // pipeline rank
  int replica = 0;
  int replicas = 1;
  engine::zero_stage zero = engine::zero_stage::optimizer;
  engine::optimizer_config optimizer;
  int total_steps = 1;
  engine::trace::recorder trace;
};

messages::zero_shard_actor spawn_zero_shard(caf::actor_system& system, zero_shard_config config);

}  // namespace troupe::actors
