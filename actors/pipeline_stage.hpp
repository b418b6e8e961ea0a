// The pipeline stage actor: one pipeline rank of one data-parallel replica. It owns the
// rank's model chunks and their optimizer state, executes the plan it receives each step
// (stashing messages that arrive early: the plan, not arrival order, decides what runs),
// sends activations and gradients under link credits, hands final gradient buckets to the
// data-parallel reducer while backward continues, and applies the coordinator's update.
// With tensor parallelism (tp > 1) it is one of the tp tensor-shard actors of its rank: it
// holds its shard of every chunk and calls its group's collectives inside the passes; its
// pipeline neighbours are the same shard of the neighbouring ranks (a "lane" of shards), so the
// tp shards act as one stage towards the pipeline (docs/tensor_parallel.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/optimizer.hpp"
#include "engine/pipeline_layout.hpp"
#include "engine/tensor_group.hpp"
#include "engine/trace_recorder.hpp"
#include "engine/zero.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct stage_config {
  int rank = 0;
  int replica = 0;
  int replicas = 1;
  // Tensor parallelism: this actor's shard and its group's member (null when tp == 1). Its
  // reports to the coordinator name lane replica * tp + tp_rank.
  int tp_rank = 0;
  int tp = 1;
  std::shared_ptr<engine::tensor_group> tp_group;
  engine::gpt_config model;
  engine::pipeline_layout layout;
  std::uint64_t seed = 0;
  std::string init;  // Hugging Face safetensors; empty: GPT-2 init from seed
  engine::optimizer_config optimizer;
  int total_steps = 1;
  int link_credits = 1;
  int bucket_layers = 1;
  // ZeRO >= 1: the optimizer state lives in a zero shard actor (wiring.reducer), gradients are
  // reduce-scattered to it, and (ZeRO-2) a bucket's gradients are released once reduced.
  engine::zero_stage zero = engine::zero_stage::none;
  int zero_prefetch = 1;  // ZeRO-3: parameter uses gathered ahead of the one being computed
  int compute_threads = 1;
  bool recompute = false;  // activation checkpointing of every block (engine::block_scratch)
  engine::trace::recorder trace;
};

messages::stage_actor spawn_pipeline_stage(caf::actor_system& system, stage_config config);

}  // namespace troupe::actors
