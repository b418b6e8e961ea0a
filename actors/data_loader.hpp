// The data loader actor of one data-parallel replica: streams micro-batches in step order,
// inputs to the stage holding virtual stage 0 and targets to the one holding the last, keeping
// at most `prefetch` of each part unconsumed (the stages return a batch_credit per consumed
// micro-batch). Its position in the stream is its state: micro-batch (round r, index j) of
// step s is sampler index s*N + replica*R*m + r*m + j with N = R*m*d, the same micro-batch the
// serial run reads as its (replica*R*m + r*m + j)-th accumulation step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/data/sampler.hpp"
#include "engine/trace/trace_recorder.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct loader_config {
  int replica = 0, replicas = 1;
  int rounds = 1, micro_batches = 1, steps = 1;
  // A resumed run: its first step, and the training micro-batches (all replicas) consumed
  // before it; the sampler's stream goes on from there.
  int start_step = 0;
  std::int64_t start_micro_batches = 0;
  int prefetch = 2;
  int B = 1;
  // Sequence length of micro-batch (r, j): seq_lens[(r*m + j) % size]; one sampler per length.
  std::vector<int> seq_lens;
  std::vector<std::shared_ptr<const engine::data::batch_sampler>> train;  // parallel to seq_lens
  std::shared_ptr<const engine::data::batch_sampler> val;                 // may be null
  engine::trace::recorder trace;
};

messages::loader_actor spawn_data_loader(caf::actor_system& system, loader_config config);

}  // namespace troupe::actors
