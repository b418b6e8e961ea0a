// An actor's trace buffer: timestamps against the run's shared origin, events kept locally
// and handed over in batches (so tracing costs a vector push per event, not a message).
// Disabled recorders record nothing.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/random.hpp"
#include "engine/trace/trace.hpp"

namespace troupe::engine::trace {

using trace_clock = std::chrono::steady_clock;

// The identity of a traced event (-1: not applicable).
struct trace_ids {
  int step = -1, micro_batch = -1, virtual_stage = -1;
  std::int64_t bytes = -1;
};

class recorder {
 public:
  recorder() = default;
  recorder(bool enabled, trace_clock::time_point origin, int track)
      : enabled_(enabled), origin_(origin), track_(track) {}

  bool enabled() const { return enabled_; }
  double now_us() const {
    return std::chrono::duration<double, std::micro>(trace_clock::now() - origin_).count();
  }
  using ids = trace_ids;
  void span(const char* category, std::string name, double start_us, double end_us, ids id = {}) {
    if (!enabled_) return;
    events_.push_back(make(event_kind::span, category, std::move(name), start_us, id));
    events_.back().dur_us = end_us - start_us;
  }
  void flow(event_kind kind, std::uint64_t flow_id, double ts_us, ids id = {}) {
    if (!enabled_) return;
    events_.push_back(make(kind, "flow", "micro-batch", ts_us, id));
    events_.back().flow_id = flow_id;
  }
  std::vector<event> take() { return std::exchange(events_, {}); }
  bool empty() const { return events_.empty(); }

 private:
  event make(event_kind kind, const char* category, std::string name, double ts, ids id) const {
    event e;
    e.kind = kind;
    e.track = track_;
    e.category = category;
    e.name = std::move(name);
    e.ts_us = ts;
    e.step = id.step;
    e.micro_batch = id.micro_batch;
    e.virtual_stage = id.virtual_stage;
    e.bytes = id.bytes;
    return e;
  }
  bool enabled_ = false;
  trace_clock::time_point origin_{};
  int track_ = 0;
  std::vector<event> events_;
};

// A flow id that both ends of a link compute from the message identity.
inline std::uint64_t flow_id(int kind, int step, int round, int micro_batch, int virtual_stage,
                             int replica, bool eval) {
  std::uint64_t h = 0;
  for (std::int64_t v :
       {std::int64_t{kind}, std::int64_t{step}, std::int64_t{round}, std::int64_t{micro_batch},
        std::int64_t{virtual_stage}, std::int64_t{replica}, std::int64_t{eval}})
    h = splitmix64(h ^ static_cast<std::uint64_t>(v));
  return h >> 11;  // fits a JSON double exactly
}

}  // namespace troupe::engine::trace
