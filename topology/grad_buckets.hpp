// Data-parallel gradient buckets of one pipeline rank: consecutive gradient blocks of a chunk
// (engine::stage_grad_blocks: head, layers from last to first, embedding) grouped so that a
// bucket is complete as soon as its last block's gradient is final. Backward reports blocks as
// they finish; a complete bucket can be reduced while backward continues on earlier layers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/gpt_model.hpp"
#include "engine/zero.hpp"

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
  void build(const std::vector<engine::gpt_stage*>& chunks, int layers_per_bucket);
  // The same buckets over gradients held elsewhere (a device): chunk c's blocks (its
  // stage_grad_blocks) at offsets of grads[c]. param_ranges, shards and views need build().
  void build(const std::vector<std::vector<engine::grad_block>>& blocks,
             const std::vector<float*>& grads, int layers_per_bucket);
  // Resets the per-step counters.
  void start_step();
  // Block `block` of `chunk` is final; returns the bucket it completed, if any.
  std::optional<int> block_done(int chunk, int block);
  const grad_bucket_info& bucket(int i) const { return buckets_.at(static_cast<std::size_t>(i)); }
  int size() const { return static_cast<int>(buckets_.size()); }
  // The bucket holding gradient block `block` (a stage_grad_blocks index) of `chunk`.
  int bucket_of(int chunk, int block) const;
  // The bucket's ranges in its chunk's parameter buffer (same offsets as its gradient ranges).
  std::vector<std::pair<float*, std::int64_t>> param_ranges(int bucket) const;
  // The bucket whose ranges hold `grad`; throws std::logic_error if none does.
  int bucket_containing(const float* grad) const;
  // ZeRO: what `replica` of `replicas` owns of each bucket, by bucket index, packed one after the
  // other in the shard's storage (engine::make_bucket_shard).
  std::vector<engine::bucket_shard> shards(int replica, int replicas) const;
  // The chunks' flat parameter and gradient buffers (shard_grads unset).
  engine::shard_views views() const;

 private:
  std::vector<const engine::gpt_stage*> chunks_;
  std::vector<grad_bucket_info> buckets_;
  std::vector<std::vector<int>> bucket_of_block_;  // [chunk][block]
  std::vector<int> remaining_;
};

}  // namespace troupe::topology
