// ZeRO-3 on one pipeline rank: which parameter buckets its buffers hold while a plan runs. The
// plan's parameter uses (the stops of its passes, as buckets, in execution order) go through
// engine::param_residency, which decides what to gather and release from the order of calls
// alone, so every replica asks for the same gathers in the same order. Released buckets' pages
// go to a page pool and move under the next gathered bucket (engine::page_pool), so a gather
// writes no freshly faulted page; device chunks' go where the chunks say
// (engine::device_chunk::release_parameters). Gathers are asked for through a callback: no CAF
// here.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "engine/parallel/zero.hpp"
#include "topology/grad_buckets.hpp"

namespace troupe::topology {

class param_gathers {
 public:
  // Called once per gather, after the bucket's pages are in place: `seq` numbers the gathers
  // of the plan (the collective's id across replicas).
  using gather_fn = std::function<void(int seq, int bucket)>;

  // What becomes of a bucket's parameter memory between its uses: released after the last,
  // acquired (whole, before its gather writes it) for the next.
  // round (if set) runs before each use's releases and acquires.
  struct bucket_memory {
    std::function<void(int bucket)> release, acquire;
    std::function<void()> round;
  };

  // buckets must outlive this. The buckets' parameter ranges are host memory, whose pages move
  // through a page pool of capacity_bytes (the rank's parameters).
  param_gathers(const grad_buckets& buckets, std::int64_t capacity_bytes);
  // The buckets' parameter memory is released and acquired by `memory` (device chunks').
  param_gathers(const grad_buckets& buckets, bucket_memory memory);
  param_gathers(const param_gathers&) = delete;
  param_gathers& operator=(const param_gathers&) = delete;

  // The sorted, distinct buckets holding `blocks` (chunk_grad_blocks indices) of `chunk`.
  std::vector<int> buckets_of(int chunk, const std::vector<int>& blocks) const;

  // A plan starts: releases and gathers what the first prefetch + 1 uses need.
  void start(std::vector<std::vector<int>> uses, int prefetch, gather_fn gather);
  // A pass stopped before a piece reading `buckets`: throws std::logic_error unless that is the
  // plan's next use (every replica must agree on the sequence).
  void check_next(const std::vector<int>& buckets) const;
  // Every bucket of the next use is gathered.
  bool next_ready() const;
  // The next use begins (its pieces run); returns its index for finish().
  int begin_next() { return cursor_++; }
  // The use is done: releases what no issued use holds, then gathers the next use's buckets.
  void finish(int use);
  // Gather number `seq` of the plan completed; returns its bucket.
  int gathered(int seq);

  // Every use of the plan is issued: no gather of the plan is left to ask for.
  bool all_issued() const { return residency_.all_issued(); }

  // Every bucket gathered once more, kept from then on (the final weights): gather(b, b).
  void gather_all(const gather_fn& gather);

  std::int64_t peak_bytes() const { return peak_; }  // most gathered at once since start()
  std::int64_t pooled_bytes() const { return pool_ ? pool_->pooled_bytes() : 0; }

 private:
  void apply(const engine::param_residency::changes& ch);
  std::int64_t bucket_bytes(int b) const;

  const grad_buckets& buckets_;
  std::unique_ptr<engine::page_pool> pool_;  // host memory's
  bucket_memory memory_;
  engine::param_residency residency_;
  gather_fn gather_;
  int cursor_ = 0;  // the plan's next use
  int seq_ = 0;     // gathers asked for in this plan
  std::map<int, int> bucket_of_seq_;
  std::int64_t gathered_ = 0, peak_ = 0;
};

}  // namespace troupe::topology
