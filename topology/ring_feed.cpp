// Ring collective feeding. See ring_feed.hpp.
#include "topology/ring_feed.hpp"

namespace troupe::topology {

ring_feed::sends ring_feed::start(float_ranges ranges, int replica, int replicas, ring_kind kind) {
  ring_.emplace(std::move(ranges), replica, replicas, kind);
  return drain(ring_->start());
}

ring_feed::sends ring_feed::deliver(int phase, int chunk, messages::float_buffer data) {
  held_ += static_cast<std::int64_t>(data->size());
  early_[{phase, chunk}] = std::move(data);
  return ring_ ? drain({}) : sends{};
}

// Feeds the ring the early chunks it expects next, in ring order, until none fits.
ring_feed::sends ring_feed::drain(sends out) {
  for (bool progressed = true; progressed && !ring_->done();) {
    progressed = false;
    for (auto it = early_.begin(); it != early_.end(); ++it) {
      const auto [phase, chunk] = it->first;
      if (!ring_->expects(phase, chunk)) continue;
      const messages::float_buffer data = std::move(it->second);
      early_.erase(it);
      held_ -= static_cast<std::int64_t>(data->size());
      for (auto& s :
           ring_->receive(phase, chunk, data->data(), static_cast<std::int64_t>(data->size())))
        out.push_back(std::move(s));
      progressed = true;
      break;
    }
  }
  return out;
}

}  // namespace troupe::topology
