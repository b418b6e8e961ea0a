// One replica's side of one ring collective of one bucket, as a message-driven state machine:
// the ring (collectives.hpp) plus the chunks from the previous replica that arrived before this
// replica expects them (the previous replica can be ahead: its backward finished first). The
// ring reducer and the ZeRO shard both drive their collectives through it; no transport here.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "messages/pipeline.hpp"
#include "topology/collectives.hpp"

namespace troupe::topology {

class ring_feed {
 public:
  using sends = std::vector<ring_allreduce::send>;

  // This replica takes part: returns its first sends, then whatever early chunks now allow.
  sends start(float_ranges ranges, int replica, int replicas, ring_kind kind);
  // A chunk from the previous replica (before or after start); returns what to send on, in order.
  sends deliver(int phase, int chunk, messages::float_buffer data);

  bool started() const { return ring_.has_value(); }
  bool done() const { return ring_ && ring_->done(); }
  // Floats of early chunks held now.
  std::int64_t held_floats() const { return held_; }

 private:
  sends drain(sends out);

  std::optional<ring_allreduce> ring_;
  std::map<std::pair<int, int>, messages::float_buffer> early_;  // (phase, chunk)
  std::int64_t held_ = 0;
};

}  // namespace troupe::topology
