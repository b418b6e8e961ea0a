// The device pipeline stage actor: one pipeline rank of one replica whose chunks live on a
// device (engine::device_chunk: a GPU, or the host for tests). It follows the same plans, under
// the same link credits, as the CPU stage (pipeline_stage.hpp) and speaks the same protocol to
// the coordinator, loaders and its peers, except that an activation or gradient moves through
// the pair's chunk_link (NCCL, or a device copy) while its link_message carries the typed header
// only (no data). Data-parallel replicas send their gradient buckets, on the device, to the
// rank's reducer with an event, as the CPU stage sends them in host memory (D4 in the .cpp).
// docs/gpu.md gives the message sequence.
//
// With tensor parallelism it is one shard's actor, as the CPU stage is (pipeline_stage.hpp): its
// chunks hold the shard's slices and meet the other shards' in collectives on their devices.
//
// Not built yet on devices (pipeline_run refuses them with the reason): ZeRO, split-backward
// (zero-bubble) schedules, variable sequence lengths, several processes.
#pragma once

#include <map>
#include <memory>

#include "actors/pipeline_stage.hpp"
#include "engine/device_chunk.hpp"

namespace troupe::actors {

struct device_stage_config {
  stage_config stage;  // rank, replica, model, layout, seed, init, optimizer, steps, credits, trace
  int B = 0, T = 0;    // every micro-batch's shape
  int slots = 1;       // micro-batches in flight per chunk (saved activations)
  std::shared_ptr<const engine::chunk_factory> chunks;
  // This rank's ends of its links, by peer rank (this rank itself for chunk-to-chunk hops).
  std::map<int, std::shared_ptr<engine::chunk_link>> send_links, receive_links;
  // A rank with one copy of the tied wte (the embedding's or the head's, the other on another
  // rank): the links that carry its gradient to the other copy's rank and back.
  std::shared_ptr<engine::chunk_link> tied_send, tied_receive;
  // Tensor parallelism (stage.tp > 1): this shard's member of its (replica, rank) tensor group
  // (chunk_factory::make_tensor_group's), handed to its chunks and aborted when the actor stops.
  std::shared_ptr<engine::group_member> tp_member;
};

messages::stage_actor spawn_device_stage(caf::actor_system& system, device_stage_config config);

}  // namespace troupe::actors
