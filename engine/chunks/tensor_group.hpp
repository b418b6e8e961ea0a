// Tensor parallelism (Megatron-LM style): a stage's transformer blocks, embedding and head
// split over t tensor shards. QKV and MLP-up are column-parallel (each shard holds heads/t
// heads and 4C/t hidden units), attention-out and MLP-down row-parallel (their outputs are
// partial sums the group all-reduces before the bias and the residual), the embedding and the
// tied LM head vocab-parallel (each shard holds Vp/t rows of wte; the cross-entropy is computed
// from all-reduced row maxima, exponential sums and target logits). Layernorms, position
// embeddings and the row-parallel biases are replicated: every shard computes them from the same
// all-reduced inputs, so their gradients agree on every shard without a collective.
//
// Invariants:
//  - A shard's parameters are named as the whole model's and hold a slice of each whole tensor
//    (parameter_info::split); the slices of all shards tile it. Initialisation and loading slice
//    the whole tensor, so every shard count starts from the serial model's weights.
//  - Every member of a group calls the same collectives in the same order (the shards of a
//    stage run the same plan). A collective returns the same bits on every member: the sum is
//    taken in member order.
//  - No wait is unbounded: a member that does not arrive within the group's deadline, or an
//    abort() by any member (a shard that failed), makes every waiting member throw
//    tensor_group_error naming the group and the member it waited for.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::engine {

// Which of t shards a gpt_chunk holds.
struct tensor_shard {
  int rank = 0;
  int size = 1;
  bool split() const { return size > 1; }
};

class tensor_group_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What every kind of group member has (host groups here, device groups in gpu_chunk.hpp): its
// place, and a way to stop the others waiting in a collective.
class group_member {
 public:
  virtual ~group_member() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Makes every member's current and later collectives throw with `why` (tensor_group_error
  // for host groups).
  virtual void abort(const std::string& why) = 0;
};

// One member's handle on a tensor-parallel group of host buffers.
class tensor_group : public group_member {
 public:
  // In place: data becomes the element-wise sum (max) over the members' data, in member order.
  virtual void all_reduce_sum(std::span<float> data) = 0;
  virtual void all_reduce_sum(std::span<double> data) = 0;
  virtual void all_reduce_max(std::span<float> data) = 0;
};

// The members of one in-process group (threads of one process: the stage actors of a TP group),
// handle i for member i. name appears in errors ("tp group of stage 1 · dp 0").
std::vector<std::shared_ptr<tensor_group>> make_local_tensor_group(
    int size, std::string name, std::chrono::milliseconds deadline = std::chrono::seconds(120));

}  // namespace troupe::engine
