// The pipeline stage actor: one pipeline rank of one data-parallel replica, on any device. It
// owns the rank's model chunks (engine::rank_chunks: CPU chunks, or device chunks on a GPU)
// and their optimizer state, executes the plan it receives each step (stashing messages that
// arrive early: the plan, not arrival order, decides what runs), sends activations and
// gradients under link credits, hands final gradient buckets to the data-parallel reducer while
// backward continues, and applies the coordinator's update. With tensor parallelism (tp > 1)
// it is one of the tp tensor-shard actors of its rank: it holds its shard of every chunk and
// its chunks meet the other shards' in their group's collectives inside the passes; its
// pipeline neighbours are the same shard of the neighbouring ranks (a "lane" of shards), so the
// tp shards act as one stage towards the pipeline (docs/tensor_parallel.md).
//
// How a payload crosses a link is the chunks' kind's policy (docs/pipeline.md): CPU chunks'
// activations and gradients travel inside the link message (in the process, or through the
// gateway across processes); device chunks' move through the pair's chunk_link (NCCL, or a
// device copy) while the link message carries the typed header only, or, to a rank in another
// process, are staged through host memory and travel inside the message.
//
// What a device's kernels cannot run is refused before a job starts
// (engine/parallel/support.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/tensor_group.hpp"
#include "engine/parallel/pipeline_layout.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/trace/trace_recorder.hpp"
#include "engine/training/optimizer.hpp"
#include "engine/training/watchdog.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

// A stage's device chunks and their links (absent: CPU chunks).
struct device_chunks_config {
  std::shared_ptr<const engine::chunk_factory> factory;
  int B = 0, T = 0;  // every micro-batch's shape
  int slots = 1;     // micro-batches in flight per chunk to start with (more are added)
  // This rank's ends of its links, by peer rank (this rank itself for chunk-to-chunk hops).
  std::map<int, std::shared_ptr<engine::chunk_link>> send_links, receive_links;
  // A rank with one copy of the tied wte (the embedding's or the head's, the other on another
  // rank): the links that carry its gradient to the other copy's rank and back.
  std::shared_ptr<engine::chunk_link> tied_send, tied_receive;
  // A peer rank without a link (in another process): payloads and the tied wte copy are staged
  // through host memory and travel inside the messages. stage_buckets: the replicas' reducer
  // takes host ranges (a ring reducer across processes), so gradient buckets are staged too.
  bool stage_buckets = false;
  // ZeRO through the devices (parallel.zero_on_device): the data-parallel group of this
  // rank's tensor shard that reduce-scatters and all-gathers the chunks' buckets in device
  // memory (topology/device_zero.hpp); no zero shard actor then. Null: ZeRO's host shards.
  std::shared_ptr<engine::zero_group> zero_group;
};

struct stage_config {
  int rank = 0;
  int replica = 0;
  int replicas = 1;
  // Tensor parallelism: this actor's shard and its member of the (replica, rank) tensor group
  // (null when tp == 1), handed to its chunks and aborted when the actor stops. Its reports to
  // the coordinator name lane replica * tp + tp_rank.
  int tp_rank = 0;
  int tp = 1;
  std::shared_ptr<engine::group_member> tp_member;
  engine::gpt_config model;
  engine::pipeline_layout layout;
  std::uint64_t seed = 0;
  std::string init;  // Hugging Face safetensors; empty: GPT-2 init from seed
  // Resuming: the checkpoint directory whose weights and AdamW moments the chunks (or, ZeRO,
  // the shard) start from (in place of `init`).
  std::string resume;
  engine::optimizer_config optimizer;
  int total_steps = 1;
  int link_credits = 1;
  int bucket_layers = 1;
  // ZeRO >= 1: the optimizer state lives in a zero shard actor (wiring.reducer), gradients are
  // reduce-scattered to it, and (ZeRO-2) a bucket's gradients are released once reduced.
  engine::zero_stage zero = engine::zero_stage::none;
  int zero_prefetch = 1;  // ZeRO-3: parameter uses gathered ahead of the one being computed
  int compute_threads = 1;
  bool recompute = false;  // activation checkpointing of every block
  engine::trace::recorder trace;
  std::shared_ptr<const device_chunks_config> device;  // null: CPU chunks
  // The process's action watchdog (engine/training/watchdog.hpp); null: none.
  std::shared_ptr<engine::action_watchdog> watchdog;
  int test_stall_step = -1;       // testing: the first action of this step never ends
  int test_capture_delay_ms = 0;  // testing: a checkpoint's copy (S7) starts this much later
};

messages::stage_actor spawn_stage(caf::actor_system& system, stage_config config);

}  // namespace troupe::actors
