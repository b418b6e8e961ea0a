// The arithmetic of one pipeline rank: its model chunks (one gpt_chunk + AdamW state each)
// and the saved activations of every micro-batch in flight. A pipeline stage actor owns one
// and calls it; this file knows nothing of messages or actors.
//
// Invariants:
//  - A micro-batch is identified per chunk by (round, micro_batch); forward creates its slot,
//    release frees it (its buffers go back to a pool keyed by the micro-batch's shape, so a
//    steady pipeline allocates nothing).
//  - Buffers the caller hands in (tokens, input) are kept alive by the slot through `hold`.
//  - A head chunk computes the loss in forward and turns its logits into the loss gradient
//    (scaled by loss_scale), so its backward needs no incoming gradient.
//  - With recompute (activation checkpointing), every chunk's micro-batches of one shape share
//    one block_scratch: the rank runs one pass at a time.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "engine/training/optimizer.hpp"

namespace troupe::engine {

struct micro_batch_id {
  int round = 0;
  int micro_batch = 0;
  friend auto operator<=>(const micro_batch_id&, const micro_batch_id&) = default;
};

class cpu_chunks {
 public:
  // optimizer_state false: no AdamW moments here (ZeRO: a shard actor holds them).
  // recompute: activation checkpointing of every transformer block (block_scratch).
  // shard, group: the rank's tensor shard and its group (engine/chunks/tensor_group.hpp); every
  // chunk uses the one group, one pass at a time.
  cpu_chunks(const gpt_config& model, const std::vector<chunk_range>& chunks,
             bool optimizer_state = true, bool recompute = false, tensor_shard shard = {},
             std::shared_ptr<tensor_group> group = nullptr);

  int chunk_count() const { return static_cast<int>(chunks_.size()); }
  gpt_chunk& chunk(int c) { return *chunks_.at(static_cast<std::size_t>(c)).model; }
  const gpt_chunk& chunk(int c) const { return *chunks_.at(static_cast<std::size_t>(c)).model; }
  adamw_optimizer& optimizer(int c);  // throws std::logic_error without optimizer state
  std::int64_t optimizer_bytes() const;
  // What the rank's activations take: every gpt_activations it allocated (in flight or pooled
  // for reuse) and the checkpointing scratch.
  std::int64_t activation_bytes() const;
  void zero_grad();

  struct forward_args {
    int B = 0, T = 0;
    const std::int32_t* tokens = nullptr;           // embedding chunk
    const float* input = nullptr;                   // other chunks: [B, T, width]
    const std::int32_t* targets = nullptr;          // head chunk
    float loss_scale = 1;                           // head chunk, training
    bool train = true;                              // false: loss only, no gradient (evaluation)
    std::vector<std::shared_ptr<const void>> hold;  // kept alive until release
  };
  // The passes run block by block (engine/model/block_pass.hpp): the caller drives them, and keeps
  // doutput and dinput valid until the pass is done. Forward creates the micro-batch's slot
  // when it starts.
  block_pass forward(int c, micro_batch_id id, forward_args args);
  // After forward: the mean loss of the micro-batch for a head chunk, NaN otherwise.
  double loss(int c, micro_batch_id id) const;
  // The chunk's output hidden state [B, T, width] (not for a head chunk).
  const float* output(int c, micro_batch_id id) const;
  // (B, T) of a micro-batch in flight.
  std::pair<int, int> shape(int c, micro_batch_id id) const;
  block_pass backward(int c, micro_batch_id id, const float* doutput, float* dinput,
                      grad_block_fn on_block_done = {});
  block_pass backward_input(int c, micro_batch_id id, const float* doutput, float* dinput);
  block_pass backward_weight(int c, micro_batch_id id, grad_block_fn on_block_done = {});
  void release(int c, micro_batch_id id);
  // The stops of chunk c's passes of `kind` (pass_stops with this rank's checkpointing).
  std::vector<std::vector<int>> stops(int c, pass_kind kind) const {
    return pass_stops(chunk(c), kind, recompute_);
  }

 private:
  struct slot {
    std::unique_ptr<gpt_activations> acts;
    std::vector<std::shared_ptr<const void>> hold;
    double loss = std::numeric_limits<double>::quiet_NaN();
  };
  struct chunk_state {
    std::unique_ptr<gpt_chunk> model;
    std::unique_ptr<adamw_optimizer> opt;
    std::map<micro_batch_id, slot> live;
    std::multimap<std::pair<int, int>, std::unique_ptr<gpt_activations>> pool;  // (B, T)
  };
  static block_pass forward_pass(const gpt_chunk& st, slot& s, forward_args args);
  slot& live_slot(int c, micro_batch_id id);
  const slot& live_slot(int c, micro_batch_id id) const;
  std::vector<chunk_state> chunks_;
  bool recompute_ = false;
  int tp_ = 1;
  std::map<std::pair<int, int>, std::shared_ptr<block_scratch>> scratch_;  // (B, T)
};

}  // namespace troupe::engine
