// ZeRO arithmetic of one pipeline rank within its data-parallel group (no actors, no transport):
// which part of each gradient bucket a replica owns, the AdamW update of that part, the model-
// state memory formulas, and the operating-system side of releasing a gradient buffer.
//
// A bucket is the concatenation of its ranges (topology/collectives.hpp): N floats cut into d
// ring chunks; replica r owns chunk ring_owned_chunk(r, d) = (r + 1) mod d, where the ring's
// reduce-scatter leaves the mean. Chunks need not be equal: N need not divide by d, so no
// padding exists anywhere (nothing to leak into numerics or checkpoints). The alignment gaps
// between parameters inside a range are never a segment: the update touches parameters only.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/training/optimizer.hpp"

namespace troupe::engine {

// parallel.zero: 0 DDP; 1 optimizer state sharded; 2 gradients too; 3 parameters too.
enum class zero_stage : int { none = 0, optimizer = 1, gradients = 2, parameters = 3 };

// A piece of one parameter inside a replica's shard of a bucket.
struct shard_segment {
  int chunk = 0;            // the rank's model chunk
  std::int64_t offset = 0;  // into that chunk's flat parameter and gradient buffers
  std::int64_t numel = 0;
  std::int64_t at = 0;  // into the replica's shard storage (its owned floats, bucket by bucket)
  bool decay = false;
  // In the global gradient norm (false: a head's copy of the tied wte, and a replicated
  // parameter on tensor shards other than 0, whose shard 0 counts it once).
  bool counted = true;
};

// What one replica owns of one bucket.
struct bucket_shard {
  int chunk = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  // the bucket: (offset, numel)
  std::int64_t numel = 0;                                     // the whole bucket
  std::int64_t begin = 0, end = 0;  // the owned chunk of the concatenation
  std::int64_t at = 0;              // where the owned floats start in the shard storage
  std::vector<shard_segment> segments;
};

// The shard of a bucket of `chunk` (ranges in increasing offset order, from
// topology::grad_buckets) that `replica` of `replicas` owns; `at` is the shard storage used by
// the buckets before it. Segments come from the chunk's parameter layout, that of tensor shard
// `tp` (ZeRO over tensor shards: each shard's data-parallel group shards its own slices).
bucket_shard make_bucket_shard(const chunk_range& range, const std::vector<parameter_info>& layout,
                               int chunk, std::vector<std::pair<std::int64_t, std::int64_t>> ranges,
                               int replica, int replicas, std::int64_t at, tensor_shard tp = {});
inline bucket_shard make_bucket_shard(const gpt_chunk& weights, int chunk,
                                      std::vector<std::pair<std::int64_t, std::int64_t>> ranges,
                                      int replica, int replicas, std::int64_t at) {
  return make_bucket_shard(weights.range(), weights.parameters(), chunk, std::move(ranges), replica,
                           replicas, at, weights.shard());
}

// Where a shard's numbers live: parameters and (ZeRO-1) gradients in the rank's chunk
// buffers, or (ZeRO-2) gradients and (ZeRO-3) parameters in the shard's own storage, indexed by
// segment.at.
struct shard_views {
  std::vector<float*> params, grads;  // per chunk: the flat buffers
  float* shard_grads = nullptr;       // ZeRO-2: owned gradients; nullptr: in grads
  float* shard_params = nullptr;      // ZeRO-3: owned parameters; nullptr: in params
  float* param(const shard_segment& s) const {
    return shard_params ? shard_params + s.at : params.at(std::size_t(s.chunk)) + s.offset;
  }
  float* grad(const shard_segment& s) const {
    return shard_grads ? shard_grads + s.at : grads.at(std::size_t(s.chunk)) + s.offset;
  }
};

// Sum of squared gradients of a bucket shard's counted segments, in double, in segment order.
double shard_square_sum(const bucket_shard& b, const shard_views& views);

// One AdamW step of a shard, exactly the arithmetic adamw_optimizer applies to the same
// elements: gradients unscaled (unscale_and_clip) and scaled by the clip coefficient of
// grad_norm, then the update with the schedule's lr. m and v are the shard's moments (indexed by
// segment.at). Returns the lr.
double shard_adamw_step(const std::vector<bucket_shard>& shards, const shard_views& views, float* m,
                        float* v, const optimizer_config& c, int step, int total_steps,
                        double grad_norm, double unscale = 1);

// ZeRO-3: when a pipeline rank gathers its parameter buckets and when it releases them, over
// one pass plan. `uses` are the plan's parameter uses in execution order, each the set of
// buckets one piece of a pass reads (engine::pass_stops mapped to buckets). Every replica runs
// the same uses and must issue the same gathers in the same order (they are collectives), so
// nothing here depends on timing, only on the order of calls:
//  - use j is issued when use j - prefetch - 1 finishes (uses 0..prefetch at start);
//  - issuing a use gathers each of its buckets that no issued, unfinished use holds;
//  - finishing a use releases each of its buckets that no issued, unfinished use still holds.
// A bucket is gathered at most once while held, so a gather never writes parameters in use.
class param_residency {
 public:
  struct changes {
    std::vector<int> gather, release;  // buckets; never one in both
  };
  changes start(std::vector<std::vector<int>> plan, int prefetch);
  int uses() const { return static_cast<int>(uses_.size()); }
  const std::vector<int>& use(int j) const { return uses_.at(static_cast<std::size_t>(j)); }
  void gathered(int bucket);  // a gather this class asked for has completed
  bool ready(int use) const;  // every bucket of the issued use is gathered
  changes finished(int use);  // uses finish in order; throws std::logic_error otherwise
  bool holds_nothing() const { return refs_.empty(); }
  bool all_issued() const { return issued_ >= uses(); }  // every use's gathers asked for

 private:
  void issue(changes& out);
  std::vector<std::vector<int>> uses_;
  int prefetch_ = 1, issued_ = 0, finished_ = 0;
  std::map<int, int> refs_;  // bucket -> issued, unfinished uses holding it
  std::set<int> present_;    // held buckets whose gather completed
};

// Model-state bytes per rank for fp32 AdamW (params 4, grads 4, two moments 8 per parameter)
// with psi parameters on the pipeline rank and n data-parallel replicas: 16 psi (DDP),
// 8 psi + 8 psi / n (ZeRO-1), 4 psi + 12 psi / n (ZeRO-2), 16 psi / n (ZeRO-3).
struct model_state_bytes {
  double parameters = 0, gradients = 0, optimizer = 0;
  double total() const { return parameters + gradients + optimizer; }
};
model_state_bytes zero_formula(zero_stage zero, double psi, int n);

// Zeroes [data, data + n) and hands its whole pages back to the operating system
// (madvise(MADV_DONTNEED): the next write faults in a zero page), so a released gradient
// range holds no memory until backward writes it again.
void release_zeroed(float* data, std::int64_t n);
// Bytes of [data, data + n) resident in memory (mincore), rounded to whole pages.
std::int64_t resident_bytes(const void* data, std::int64_t n);

// Whole pages moved between buffers instead of handed back to the kernel and faulted in again
// one by one (a ZeRO-3 bucket gathered for every use). release() is release_zeroed, except that
// the range's whole pages move into the pool (mremap with MREMAP_DONTUNMAP, Linux >= 5.7), so
// the range reads zeros and holds no memory. acquire(), before a range is written whole, moves
// pooled pages under the range's whole pages, so writing it faults nothing; until written its
// contents are unspecified. Pages are only moved, never copied: what the pool holds plus what
// its acquired ranges hold never exceeds what was released into it. Ranges must lie in private
// anonymous mappings (kernels::tensor::mapped_zeros). Where the kernel cannot move pages,
// release() is release_zeroed and acquire() does nothing. Pages move in blocks (a power of two
// pages, at most 512 blocks per capacity), so mapping boundaries stay few; the partial blocks at
// a range's ends are released as release_zeroed does. Not thread-safe: one owner.
class page_pool {
 public:
  // Holds at most capacity_bytes (rounded down to blocks); pages beyond go back to the kernel.
  explicit page_pool(std::int64_t capacity_bytes);
  ~page_pool();
  page_pool(const page_pool&) = delete;
  page_pool& operator=(const page_pool&) = delete;

  void release(float* data, std::int64_t n);
  void acquire(float* data, std::int64_t n);
  std::int64_t pooled_bytes() const;  // bytes of pages held now
  std::int64_t block_bytes() const { return static_cast<std::int64_t>(block_); }

 private:
  bool move(void* from, void* to, std::size_t bytes);
  std::pair<std::uintptr_t, std::uintptr_t> whole_blocks(const float* data, std::int64_t n) const;
  std::byte* region_ = nullptr;
  std::size_t block_ = 0, slots_ = 0;        // pages move in blocks; the region has slots_
  std::map<std::size_t, std::size_t> held_;  // region slot -> run length of held blocks
  std::size_t held_slots_ = 0;
  bool can_move_ = true;
};

}  // namespace troupe::engine
