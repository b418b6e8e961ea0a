// zero_groups (device_chunk.hpp) whose replicas share this process: their calls meet here, and
// the last one enqueues the collective for all. make_host_zero_group is the kind for host chunks
// (tests, the host test chunks of `troupe train`): the ring's arithmetic in host memory.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "engine/chunks/device_chunk.hpp"

namespace troupe::engine {

// A replica's ring chunk c of a bucket of n floats over d replicas: [n c / d, n (c + 1) / d), as
// topology::ring_chunk_bounds (engine does not include topology). Its owner is replica
// (c + d - 1) mod d (topology::ring_owned_chunk).
inline std::pair<std::int64_t, std::int64_t> owned_chunk_bounds(std::int64_t n, int d, int c) {
  return {n * c / d, n * (c + 1) / d};
}
inline int chunk_owner(int chunk, int replicas) { return (chunk + replicas - 1) % replicas; }

// Calls fn(pointer, count, offset into [begin, end)) for the pieces of [begin, end) of the
// concatenation of `ranges`.
template <class Fn>
void for_each_piece(const zero_group::float_ranges& ranges, std::int64_t begin, std::int64_t end,
                    Fn&& fn) {
  std::int64_t at = 0;
  for (const auto& [p, k] : ranges) {
    const std::int64_t lo = std::max(begin, at), hi = std::min(end, at + k);
    if (lo < hi) fn(p + (lo - at), hi - lo, lo - begin);
    at += k;
    if (at >= end) break;
  }
}

// Ring chunk c of a bucket's ranges (d replicas' chunks) copied out of them, and into them.
std::vector<float> copy_chunk_out(const zero_group::float_ranges& ranges, int d, int c);
void copy_chunk_in(const zero_group::float_ranges& ranges, int d, int c, const float* values);
// Chunk c's mean over the d replicas' copies of it (by replica, n floats each), summed in the
// ring's order (x_c + x_{c+1} + ... + x_{c+d-1}) and scaled by 1/d: bitwise what the ring leaves.
std::vector<float> ring_chunk_mean(const std::vector<const float*>& by_replica, int c,
                                   std::size_t n);

// Calls meet by their place in each replica's sequence: the k-th call of every replica is one
// collective, and must name the same (operation, step, bucket) or the group throws, naming both:
// the order NCCL needs of every rank (zero_group's callers keep one order), checked here on every
// kind, host chunks' included.
class replicas_zero_group : public zero_group {
 public:
  replicas_zero_group(int replicas, std::string name);
  void reduce_scatter(int step, int bucket, int replica, const float_ranges& ranges, void* ready,
                      done_fn done) override;
  void all_gather(int step, int bucket, int replica, const float_ranges& ranges, void* ready,
                  done_fn done) override;
  int replicas() const { return replicas_; }
  const std::string& name() const { return name_; }

 protected:
  enum class op { reduce_scatter, all_gather };
  // Enqueues `o` over every replica's ranges (by replica, checked to agree), each after its
  // event; returns by replica the event after which its ranges hold the result. One run() at a
  // time, enqueueing for every replica at once: every replica's collectives go in one order.
  virtual std::vector<void*> run(op o, const std::vector<float_ranges>& ranges,
                                 const std::vector<void*>& ready) = 0;

 private:
  void call(op o, int step, int bucket, int replica, const float_ranges& ranges, void* ready,
            done_fn done);
  struct pending {
    std::tuple<int, int, int> key;  // (op, step, bucket) of the first caller
    std::vector<float_ranges> ranges;
    std::vector<void*> ready;
    std::vector<done_fn> done;
    int arrived = 0;
  };
  int replicas_;
  std::string name_;
  std::mutex mutex_;                          // pending_, calls_
  std::mutex run_mutex_;                      // one run() at a time
  std::map<std::uint64_t, pending> pending_;  // by place in the sequence
  std::vector<std::uint64_t> calls_;          // by replica: its calls so far
};

// Host memory: each ring chunk summed in the ring's order (x_c + x_{c+1} + ... + x_{c+d-1}) and
// scaled by 1/d into its owner (reduce_scatter), or copied from its owner (all_gather): bitwise
// what the host shards' ring leaves. Events are nullptr.
std::shared_ptr<zero_group> make_host_zero_group(int replicas, std::string name);

}  // namespace troupe::engine
