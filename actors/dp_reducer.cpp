// The in-process data-parallel reducer. See dp_reducer.hpp.
#include "actors/dp_reducer.hpp"

#include <map>

#include "engine/chunks/device_chunk.hpp"
#include "topology/collectives.hpp"

namespace troupe::actors {
namespace {

using namespace messages;

class reducer_impl : public reducer_actor::base {
 public:
  reducer_impl(caf::actor_config& cfg, reducer_config config, caf::actor tracer,
               std::vector<caf::actor> stages)
      : reducer_actor::base(cfg),
        cfg_(std::move(config)),
        tracer_(std::move(tracer)),
        stages_(std::move(stages)) {}

  void on_exit() override {
    stages_.clear();
    tracer_ = nullptr;
  }

  behavior_type make_behavior() override {
    return {[this](grad_bucket& b) { on_bucket(std::move(b)); }};
  }

 private:
  struct pending {
    std::vector<grad_bucket> parts;
  };

  void on_bucket(grad_bucket b) {
    auto& p = pending_[{b.step, b.bucket}];
    p.parts.push_back(std::move(b));
    if (static_cast<int>(p.parts.size()) < cfg_.replicas) return;
    const double t0 = cfg_.trace.now_us();
    std::vector<std::vector<std::pair<float*, std::int64_t>>> by_replica(p.parts.size());
    std::vector<void*> ready(p.parts.size(), nullptr);
    std::int64_t bytes = 0;
    for (auto& part : p.parts) {
      const auto at = static_cast<std::size_t>(part.replica - cfg_.first_replica);
      by_replica.at(at) = part.ranges;
      ready.at(at) = part.ready;
      if (at == 0)
        for (const auto& r : part.ranges) bytes += r.second * 4;
    }
    std::vector<void*> done(p.parts.size(), nullptr);
    if (cfg_.group) {
      done = cfg_.group->mean(by_replica, ready);  // enqueued on the devices
    } else {
      topology::ring_order_mean(by_replica);
    }
    const int step = p.parts[0].step, bucket = p.parts[0].bucket;
    for (std::size_t d = 0; d < stages_.size(); ++d)
      caf::anon_send(stages_[d], grad_bucket_reduced{step, bucket, 0.0, done.at(d)});
    cfg_.trace.span("collective", cfg_.group ? "all-reduce (enqueued)" : "all-reduce", t0,
                    cfg_.trace.now_us(), {step, -1, -1, bytes});
    pending_.erase({step, bucket});
    if (pending_.empty() && cfg_.trace.enabled() && !cfg_.trace.empty())
      caf::anon_send(tracer_, trace_batch{cfg_.trace.take()});
  }

  reducer_config cfg_;
  caf::actor tracer_;
  std::vector<caf::actor> stages_;  // by replica
  std::map<std::pair<int, int>, pending> pending_;
};

}  // namespace

reducer_actor spawn_dp_reducer(caf::actor_system& system, reducer_config config, caf::actor tracer,
                               std::vector<caf::actor> stages) {
  return system.spawn<reducer_impl, caf::detached>(std::move(config), std::move(tracer),
                                                   std::move(stages));
}

}  // namespace troupe::actors
