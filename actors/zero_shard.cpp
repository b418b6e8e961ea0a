// The ZeRO optimizer shard. See zero_shard.hpp.
#include "actors/zero_shard.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "topology/collectives.hpp"

namespace troupe::actors {
namespace {

using namespace messages;

class zero_shard_impl : public zero_shard_actor::base {
 public:
  zero_shard_impl(caf::actor_config& cfg, zero_shard_config config)
      : zero_shard_actor::base(cfg), cfg_(std::move(config)) {}

  void on_exit() override { wiring_ = {}; }

  behavior_type make_behavior() override {
    return {
        [this](ring_wiring& w) { wiring_ = std::move(w); },
        [this](zero_layout& l) { on_layout(std::move(l)); },
        [this](grad_bucket& b) { on_bucket(b); },
        [this](ring_chunk& c) { on_chunk(std::move(c)); },
        [this](zero_update& u) { on_update(u); },
    };
  }

 private:
  struct collective {
    std::optional<topology::ring_allreduce> ring;       // set once this replica takes part
    std::map<std::pair<int, int>, float_buffer> early;  // (phase, chunk) from the previous replica
    double t0 = 0;
    std::int64_t bytes = 0;
  };
  using key = std::tuple<int, int, int>;  // (step, bucket, phase): 0 reduce-scatter, 1 all-gather

  bool sharded_grads() const { return cfg_.zero >= engine::zero_stage::gradients; }

  void on_layout(zero_layout l) {
    layout_ = std::move(l);
    std::int64_t owned = 0;
    for (const auto& b : layout_.buckets) owned = std::max(owned, b.at + (b.end - b.begin));
    m_.assign(static_cast<std::size_t>(owned), 0.0f);
    v_.assign(static_cast<std::size_t>(owned), 0.0f);
    if (sharded_grads()) grads_.assign(static_cast<std::size_t>(owned), 0.0f);
    views_.params = layout_.params;
    views_.grads = layout_.grads;
    views_.shard_grads = sharded_grads() ? grads_.data() : nullptr;
  }

  const engine::bucket_shard& shard_of(int bucket) const {
    if (bucket < 0 || bucket >= static_cast<int>(layout_.buckets.size()))
      throw std::logic_error("zero shard: bucket " + std::to_string(bucket) +
                             " is not in the layout");
    return layout_.buckets[static_cast<std::size_t>(bucket)];
  }

  // The bucket's ranges in the parameter buffers (the gradient ranges' offsets).
  topology::float_ranges param_ranges(const engine::bucket_shard& b) const {
    topology::float_ranges r;
    float* base = layout_.params.at(static_cast<std::size_t>(b.chunk));
    for (const auto& [offset, n] : b.ranges) r.emplace_back(base + offset, n);
    return r;
  }

  void on_bucket(const grad_bucket& b) {
    auto& c = running_[{b.step, b.bucket, 0}];
    c.t0 = cfg_.trace.now_us();
    for (const auto& r : b.ranges) c.bytes += r.second * 4;
    c.ring.emplace(b.ranges, cfg_.replica, cfg_.replicas, topology::ring_kind::reduce_scatter);
    send(b.step, b.bucket, c.ring->start());
    drain({b.step, b.bucket, 0}, c);
  }

  void on_update(const zero_update& u) {
    const double t0 = cfg_.trace.now_us();
    lr_ = engine::shard_adamw_step(layout_.buckets, views_, m_.data(), v_.data(), cfg_.optimizer,
                                   u.step, cfg_.total_steps, u.grad_norm);
    cfg_.trace.span("optimizer", "AdamW shard", t0, cfg_.trace.now_us(), {u.step});
    update_step_ = u.step;
    gathers_pending_ = static_cast<int>(layout_.buckets.size());
    if (gathers_pending_ == 0) update_finished();
    for (int b = 0; b < static_cast<int>(layout_.buckets.size()); ++b) {
      auto& c = running_[{u.step, b, 1}];
      c.t0 = cfg_.trace.now_us();
      c.bytes = shard_of(b).numel * 4;
      c.ring.emplace(param_ranges(shard_of(b)), cfg_.replica, cfg_.replicas,
                     topology::ring_kind::all_gather);
      send(u.step, b, c.ring->start());
      drain({u.step, b, 1}, c);
    }
  }

  void on_chunk(ring_chunk m) {
    const key k{m.step, m.bucket, m.phase};
    auto& c = running_[k];
    early_bytes_ += static_cast<std::int64_t>(m.data->size() * 4);
    peak_early_bytes_ = std::max(peak_early_bytes_, early_bytes_);
    c.early[{m.phase, m.chunk}] = std::move(m.data);
    if (c.ring) drain(k, c);
  }

  // Feeds the ring the chunks it expects next, in ring order (the previous replica may be ahead).
  void drain(const key& k, collective& c) {
    const auto [step, bucket, phase] = k;
    for (bool progressed = true; progressed && !c.ring->done();) {
      progressed = false;
      for (auto it = c.early.begin(); it != c.early.end(); ++it) {
        const auto [ph, chunk] = it->first;
        if (!c.ring->expects(ph, chunk)) continue;
        const float_buffer data = std::move(it->second);
        c.early.erase(it);
        early_bytes_ -= static_cast<std::int64_t>(data->size() * 4);
        send(step, bucket,
             c.ring->receive(ph, chunk, data->data(), static_cast<std::int64_t>(data->size())));
        progressed = true;
        break;
      }
    }
    if (!c.ring->done()) return;
    cfg_.trace.span("collective", phase == 0 ? "reduce-scatter" : "all-gather", c.t0,
                    cfg_.trace.now_us(), {step, -1, -1, c.bytes});
    running_.erase(k);
    if (phase == 0) {
      reduced(step, bucket);
    } else if (--gathers_pending_ == 0) {
      update_finished();
    }
  }

  // This replica's chunk of the bucket holds the mean: keep it (ZeRO-2) and tell the stage.
  void reduced(int step, int bucket) {
    const auto& b = shard_of(bucket);
    if (sharded_grads()) {
      for (const auto& s : b.segments)
        std::memcpy(grads_.data() + s.at,
                    layout_.grads.at(static_cast<std::size_t>(s.chunk)) + s.offset,
                    static_cast<std::size_t>(s.numel) * sizeof(float));
    }
    const double sq = engine::shard_square_sum(b, views_);
    caf::anon_send(wiring_.stage, grad_bucket_reduced{step, bucket, sq});
  }

  void update_finished() {
    if (sharded_grads()) std::fill(grads_.begin(), grads_.end(), 0.0f);
    zero_update_done d;
    d.step = update_step_;
    d.lr = lr_;
    d.memory.optimizer = static_cast<std::int64_t>((m_.size() + v_.size()) * sizeof(float));
    d.memory.gradients = static_cast<std::int64_t>(grads_.size() * sizeof(float));
    d.memory.buffers = peak_early_bytes_;
    peak_early_bytes_ = early_bytes_;
    caf::anon_send(wiring_.stage, std::move(d));
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

  zero_shard_config cfg_;
  ring_wiring wiring_;
  zero_layout layout_;
  engine::shard_views views_;
  std::vector<float> m_, v_, grads_;  // owned floats, bucket by bucket (bucket_shard::at)
  std::map<key, collective> running_;
  int update_step_ = 0, gathers_pending_ = 0;
  double lr_ = 0;
  std::int64_t early_bytes_ = 0, peak_early_bytes_ = 0;
};

}  // namespace

zero_shard_actor spawn_zero_shard(caf::actor_system& system, zero_shard_config config) {
  return system.spawn<zero_shard_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
