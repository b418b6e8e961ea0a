// Ring collectives over the data-parallel replicas of one pipeline rank, as pure state machines
// (no transport, no CAF): the in-process reducer and the cross-process ring reducer both use the
// order defined here, so a job gives bitwise the same parameters whether its replicas share a
// process or not.
//
// A bucket is the concatenation of its gradient ranges, N floats, cut into d chunks;
// chunk c = [c*N/d, (c+1)*N/d). Ring reduce-scatter: replica r first sends chunk r to replica
// r+1; a replica adds what it receives to its own copy (received + own) and passes the sum on,
// d-1 times, so chunk c is summed in the order x_c + x_{c+1} + ... + x_{c+d-1} and ends, final,
// on replica c-1 (its owner), which scales it by 1/d. All-gather: each owner sends its final
// chunk around the ring; every replica overwrites its copy and forwards it, d-1 times.
// Each replica sends and receives 2(d-1)/d * N floats in 2(d-1) messages.
// The same machine runs either half alone (ring_kind): a reduce-scatter leaves the mean of chunk
// r+1 (mod d) on replica r, bitwise the all-reduce's value there (ZeRO-1/2 gradients); an
// all-gather starts from each owner's chunk (ZeRO parameters after the shard update).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "messages/payload.hpp"

namespace troupe::topology {

using float_ranges = std::vector<std::pair<float*, std::int64_t>>;

// [begin, end) of chunk c when n floats are cut into d chunks.
std::pair<std::int64_t, std::int64_t> ring_chunk_bounds(std::int64_t n, int d, int c);

// The in-process all-reduce in ring order: every range of every replica becomes the mean over
// replicas, each chunk summed in the order the ring sums it. Throws std::logic_error if the
// replicas' layouts differ.
void ring_order_mean(const std::vector<float_ranges>& replicas);

enum class ring_kind { all_reduce, reduce_scatter, all_gather };

// The chunk replica r owns after a reduce-scatter (and sends first in an all-gather).
inline int ring_owned_chunk(int replica, int replicas) { return (replica + 1) % replicas; }

// One replica's part of one ring all-reduce (mean), reduce-scatter (mean) or all-gather of one
// bucket.
class ring_allreduce {
 public:
  struct send {
    int phase = 0;  // 0 reduce-scatter, 1 all-gather
    int chunk = 0;
    // In a payload's own storage (payload_memory: huge pages), sent as it is.
    std::shared_ptr<messages::payload<float>> data;
  };
  ring_allreduce(float_ranges ranges, int replica, int replicas,
                 ring_kind kind = ring_kind::all_reduce);
  // The sends that start the collective (none when d = 1).
  std::vector<send> start();
  // A chunk from the previous replica arrived; returns what to send to the next. Throws
  // std::logic_error for a chunk this replica does not expect (wrong phase, chunk or size).
  std::vector<send> receive(int phase, int chunk, const float* data, std::int64_t n);
  // The next chunk this replica accepts is (phase, chunk).
  bool expects(int phase, int chunk) const {
    return !done() && (phase == 0 || received_[0] == replicas_ - 1) &&
           received_[phase] < replicas_ - 1 && expected_chunk(phase) == chunk;
  }
  // Every chunk of this replica's ranges holds the final mean.
  bool done() const { return received_[0] == replicas_ - 1 && received_[1] == replicas_ - 1; }
  std::int64_t size() const { return n_; }

 private:
  std::shared_ptr<messages::payload<float>> gather(int chunk) const;
  void scatter(int chunk, const float* data, bool add);
  int expected_chunk(int phase) const;

  float_ranges ranges_;
  int replica_, replicas_;
  ring_kind kind_;
  std::int64_t n_ = 0;
  int received_[2] = {0, 0};
};

}  // namespace troupe::topology
