// The cross-process ring reducer. See ring_reducer.hpp.
#include "actors/ring_reducer.hpp"

#include <map>
#include <optional>

#include "topology/collectives.hpp"

namespace troupe::actors {
namespace {

using namespace messages;

class ring_reducer_impl : public ring_reducer_actor::base {
 public:
  ring_reducer_impl(caf::actor_config& cfg, ring_reducer_config config)
      : ring_reducer_actor::base(cfg), cfg_(std::move(config)) {}

  void on_exit() override { wiring_ = {}; }

  behavior_type make_behavior() override {
    return {
        [this](ring_wiring& w) { wiring_ = std::move(w); },
        [this](grad_bucket& b) { on_bucket(std::move(b)); },
        [this](ring_chunk& c) { on_chunk(std::move(c)); },
    };
  }

 private:
  struct collective {
    std::optional<topology::ring_allreduce> ring;       // set once the local bucket is final
    std::map<std::pair<int, int>, float_buffer> early;  // (phase, chunk) from the previous replica
    double t0 = 0;
    std::int64_t bytes = 0;
  };

  void on_bucket(grad_bucket b) {
    auto& c = running_[{b.step, b.bucket}];
    c.t0 = cfg_.trace.now_us();
    for (const auto& r : b.ranges) c.bytes += r.second * 4;
    c.ring.emplace(b.ranges, cfg_.replica, cfg_.replicas);
    send(b.step, b.bucket, c.ring->start());
    drain(b.step, b.bucket, c);
  }

  void on_chunk(ring_chunk m) {
    auto& c = running_[{m.step, m.bucket}];
    c.early[{m.phase, m.chunk}] = std::move(m.data);
    if (c.ring) drain(m.step, m.bucket, c);
  }

  // Feeds the ring the chunks it expects next, in ring order (chunks may arrive early: the
  // previous replica can be ahead of this one's backward).
  void drain(int step, int bucket, collective& c) {
    for (bool progressed = true; progressed && !c.ring->done();) {
      progressed = false;
      for (auto it = c.early.begin(); it != c.early.end(); ++it) {
        const auto [phase, chunk] = it->first;
        if (!c.ring->expects(phase, chunk)) continue;
        const float_buffer data = std::move(it->second);
        c.early.erase(it);
        send(step, bucket,
             c.ring->receive(phase, chunk, data->data(), static_cast<std::int64_t>(data->size())));
        progressed = true;
        break;
      }
    }
    if (!c.ring->done()) return;
    caf::anon_send(wiring_.stage, grad_bucket_reduced{step, bucket});
    cfg_.trace.span("collective", "all-reduce", c.t0, cfg_.trace.now_us(), {step, -1, -1, c.bytes});
    running_.erase({step, bucket});
    if (running_.empty() && cfg_.trace.enabled() && !cfg_.trace.empty())
      caf::anon_send(wiring_.tracer, trace_batch{cfg_.trace.take()});
  }

  void send(int step, int bucket, std::vector<topology::ring_allreduce::send> sends) {
    for (auto& s : sends) {
      ring_chunk m;
      m.step = step;
      m.rank = cfg_.rank;
      m.bucket = bucket;
      m.from_replica = cfg_.replica;
      m.phase = s.phase;
      m.chunk = s.chunk;
      m.data = std::make_shared<payload<float>>(std::move(s.data));
      caf::anon_send(wiring_.next, std::move(m));
    }
  }

  ring_reducer_config cfg_;
  ring_wiring wiring_;
  std::map<std::pair<int, int>, collective> running_;  // (step, bucket)
};

}  // namespace

ring_reducer_actor spawn_ring_reducer(caf::actor_system& system, ring_reducer_config config) {
  return system.spawn<ring_reducer_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
