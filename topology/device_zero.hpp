// ZeRO-1/2/3 of a stage's device chunks through their data-parallel group (engine::zero_group),
// with no actors in it: what this replica owns of each gradient bucket (engine::make_bucket_shard)
// and the AdamW moments of those floats live on the chunks' devices. A bucket is
// reduce-scattered once it is final; at the update the owned floats get AdamW. ZeRO-1/2: then
// every bucket's parameters are all-gathered into every replica's master weights, whose compute
// copy then follows. ZeRO-3: the owned master weights live beside the moments, and a bucket is
// gathered before each use (topology::param_gathers decides when) and released after it. The
// stage calls it and carries each collective's completion back to itself as a message
// (actors/stage.cpp): zero_group's `done` runs on whichever replica's thread calls last.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "topology/grad_buckets.hpp"

namespace troupe::topology {

class device_zero {
 public:
  device_zero() = default;
  // `buckets` built over the chunks with their device side (grad_buckets::build, zero_side
  // device): the bucket ranges are the chunks' device gradients, param_ranges their device
  // master weights. Allocates the owned moments on the devices (zeroed) and, with `parameters`
  // (ZeRO-3), keeps the owned master weights there too (copied from the chunks' now).
  device_zero(engine::rank_chunks& chunks, const grad_buckets& buckets,
              std::shared_ptr<engine::zero_group> group, int replica, int replicas,
              engine::tensor_shard tp, bool parameters);
  bool active() const { return group_ != nullptr; }
  // What this replica owns of each bucket (shard storage: `at` over all of the rank's chunks).
  const std::vector<engine::bucket_shard>& shards() const { return shards_; }
  // The owned moments in shard storage order (bucket_shard::at), from the devices; loading them.
  std::pair<std::vector<float>, std::vector<float>> moments();
  void load_moments(const std::vector<float>& m, const std::vector<float>& v);

  // Bucket b's gradients are final on its chunk's stream: their reduce-scatter (done(event):
  // the chunk waits for it before reading the owned mean).
  void reduce_scatter(int step, int b, engine::zero_group::done_fn done);
  // Sum of the owned, counted squared gradients: per bucket (engine::shard_square_sum's
  // order), then over the buckets in bucket order, after every reduce-scatter was waited for.
  double square_sum();
  // AdamW on the owned floats of every chunk; returns the lr. Then every bucket's all_gather,
  // and, once every gather's event was waited for, gathered().
  double update(const engine::optimizer_config& c, int step, int total_steps, double grad_norm,
                double unscale);
  void all_gather(int step, int b, engine::zero_group::done_fn done);
  void gathered();

  // ---- ZeRO-3 ----
  // The owned master weights in shard storage order, from the devices.
  std::vector<float> parameters();
  std::int64_t owned_floats() const;
  // Bucket b's master weights may go / are needed again (engine::device_chunk::release_parameters).
  void release(int b);
  void acquire(int b);
  void parameter_round();  // engine::device_chunk::parameter_round of every chunk
  // Bucket b (acquired) gathered: this replica's owned master weights into it, then the
  // all-gather; once its event was waited for, bucket_gathered(b) makes the compute copy follow.
  void gather(int step, int b, engine::zero_group::done_fn done);
  void bucket_gathered(int b);

 private:
  engine::rank_chunks* chunks_ = nullptr;
  const grad_buckets* buckets_ = nullptr;
  std::shared_ptr<engine::zero_group> group_;
  int replica_ = 0;
  std::vector<engine::bucket_shard> shards_;  // at: shard storage
  std::vector<engine::bucket_shard> local_;   // the same, at: its chunk's owned storage
  std::vector<std::int64_t> owned_floats_;    // by chunk
  // The owned floats of one kind (moments, parameters), by chunk, in shard storage order.
  std::vector<float> to_shard_order(const std::vector<std::vector<float>>& local) const;
  // A range of bucket b's parameters: (chunk offset, numel) each.
  template <class F>
  void for_each_param_range(int b, F f);
};

}  // namespace troupe::topology
