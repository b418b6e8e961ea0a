// Data-parallel gradient buckets of one pipeline rank: consecutive gradient blocks of a chunk
// (engine::chunk_grad_blocks: head, layers from last to first, embedding) grouped so that a
// bucket is complete as soon as its last block's gradient is final. Backward reports blocks as
// they finish; a complete bucket can be reduced while backward continues on earlier layers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/chunks/rank_chunks.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/parallel/zero.hpp"

namespace troupe::topology {

struct grad_bucket_info {
  int chunk = 0;
  std::string name;  // e.g. "h.3-h.2"
  std::vector<std::pair<float*, std::int64_t>> ranges;
  std::vector<int> blocks;  // block indices within the chunk
};

class grad_buckets {
 public:
  // layers_per_bucket: "h.N" blocks per bucket; head and embedding blocks are buckets of
  // their own.
  void build(const std::vector<engine::gpt_chunk*>& chunks, int layers_per_bucket);
  // The buckets of a rank's chunks, over their gradients (device memory for device chunks).
  // ZeRO's side (param_ranges, shard_grad_ranges, shards, views): none; the chunks' flat
  // buffers in host memory (host: rank_chunks::host_parameters / host_gradients); or device
  // chunks' own master weights and gradients (device: ZeRO through a zero_group).
  enum class zero_side { none, host, device };
  void build(engine::rank_chunks& chunks, int layers_per_bucket, zero_side side);
  // The same buckets over gradients held elsewhere: chunk c's blocks (its chunk_grad_blocks) at
  // offsets of grads[c]; no ZeRO side.
  void build(const std::vector<std::vector<engine::grad_block>>& blocks,
             const std::vector<float*>& grads, int layers_per_bucket);
  // Resets the per-step counters.
  void start_step();
  // Block `block` of `chunk` is final; returns the bucket it completed, if any.
  std::optional<int> block_done(int chunk, int block);
  const grad_bucket_info& bucket(int i) const { return buckets_.at(static_cast<std::size_t>(i)); }
  int size() const { return static_cast<int>(buckets_.size()); }
  // The bucket holding gradient block `block` (a chunk_grad_blocks index) of `chunk`.
  int bucket_of(int chunk, int block) const;
  // ZeRO's side: the bucket's ranges in its chunk's host parameter and gradient buffers (the
  // offsets of its gradient ranges; the gradient ranges themselves for CPU chunks).
  std::vector<std::pair<float*, std::int64_t>> param_ranges(int bucket) const;
  std::vector<std::pair<float*, std::int64_t>> shard_grad_ranges(int bucket) const;
  // The bucket whose ranges hold `grad`; throws std::logic_error if none does.
  int bucket_containing(const float* grad) const;
  // ZeRO: what `replica` of `replicas` owns of each bucket, by bucket index, packed one after the
  // other in the shard's storage (engine::make_bucket_shard); the chunks are tensor shard `tp`.
  std::vector<engine::bucket_shard> shards(int replica, int replicas,
                                           engine::tensor_shard tp = {}) const;
  // The chunks' flat host parameter and gradient buffers (shard_grads unset).
  engine::shard_views views() const;

 private:
  // A chunk's side of ZeRO: its parameter layout and host buffers.
  struct shard_side {
    engine::chunk_range range;
    const std::vector<engine::parameter_info>* layout = nullptr;
    float *params = nullptr, *grads = nullptr;
  };
  const shard_side& side(int chunk) const;
  std::vector<float*> grad_base_;  // by chunk: what the bucket ranges point into
  std::vector<shard_side> sides_;  // by chunk; empty without a ZeRO side
  std::vector<grad_bucket_info> buckets_;
  std::vector<std::vector<int>> bucket_of_block_;  // [chunk][block]
  std::vector<int> remaining_;
};

}  // namespace troupe::topology
