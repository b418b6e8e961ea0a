// The cross-process ring reducer. See ring_reducer.hpp.
#include "actors/ring_reducer.hpp"

#include <map>

#include "actors/ring_chunks.hpp"
#include "topology/ring_feed.hpp"

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
    topology::ring_feed feed;
    double t0 = 0;
    std::int64_t bytes = 0;
  };

  void on_bucket(grad_bucket b) {
    auto& c = running_[{b.step, b.bucket}];
    c.t0 = cfg_.trace.now_us();
    for (const auto& r : b.ranges) c.bytes += r.second * 4;
    send(b.step, b.bucket,
         c.feed.start(b.ranges, cfg_.replica, cfg_.replicas, topology::ring_kind::all_reduce));
    finish_if_done(b.step, b.bucket, c);
  }

  void on_chunk(ring_chunk m) {
    auto& c = running_[{m.step, m.bucket}];
    send(m.step, m.bucket, c.feed.deliver(m.phase, m.chunk, std::move(m.data)));
    finish_if_done(m.step, m.bucket, c);
  }

  void finish_if_done(int step, int bucket, collective& c) {
    if (!c.feed.done()) return;
    caf::anon_send(wiring_.stage, grad_bucket_reduced{step, bucket, 0.0, nullptr});
    cfg_.trace.span("collective", "all-reduce", c.t0, cfg_.trace.now_us(), {step, -1, -1, c.bytes});
    running_.erase({step, bucket});
    if (running_.empty() && cfg_.trace.enabled() && !cfg_.trace.empty())
      caf::anon_send(wiring_.tracer, trace_batch{cfg_.trace.take()});
  }

  void send(int step, int bucket, topology::ring_feed::sends sends) {
    send_ring_chunks(wiring_.next, step, cfg_.rank, bucket, cfg_.replica, std::move(sends));
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
