// The ZeRO optimizer shard. See zero_shard.hpp.
#include "actors/zero_shard.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <tuple>

#include "actors/ring_chunks.hpp"
#include "topology/ring_feed.hpp"

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
        [this](zero_gather& g) { on_gather(g); },
        [this](zero_state_request) {
          return zero_state{m_, v_, params_};
        },
    };
  }

 private:
  struct collective {
    topology::ring_feed feed;
    double t0 = 0;
    std::int64_t bytes = 0;
  };
  // (collective, step, bucket or gather number, phase): phase 0 reduce-scatter, 1 all-gather.
  using key = std::tuple<zero_collective, int, int, int>;

  bool sharded_grads() const { return cfg_.zero >= engine::zero_stage::gradients; }
  bool sharded_params() const { return cfg_.zero >= engine::zero_stage::parameters; }

  void on_layout(zero_layout l) {
    layout_ = std::move(l);
    std::int64_t owned = 0;
    for (const auto& b : layout_.buckets) owned = std::max(owned, b.at + (b.end - b.begin));
    m_.assign(static_cast<std::size_t>(owned), 0.0f);
    v_.assign(static_cast<std::size_t>(owned), 0.0f);
    if (!layout_.m.empty()) {  // resuming from a checkpoint
      if (static_cast<std::int64_t>(layout_.m.size()) != owned ||
          static_cast<std::int64_t>(layout_.v.size()) != owned)
        throw std::logic_error("zero shard: the layout's moments do not fit its buckets");
      m_ = std::move(layout_.m);
      v_ = std::move(layout_.v);
    }
    if (sharded_grads()) grads_.assign(static_cast<std::size_t>(owned), 0.0f);
    layout_.views.shard_grads = sharded_grads() ? grads_.data() : nullptr;
    if (sharded_params()) {
      if (static_cast<std::int64_t>(layout_.params.size()) != owned)
        throw std::logic_error("zero shard: the layout's owned parameters do not fit its buckets");
      params_ = std::move(layout_.params);
      layout_.views.shard_params = params_.data();
    }
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
    float* base = layout_.views.params.at(static_cast<std::size_t>(b.chunk));
    for (const auto& [offset, n] : b.ranges) r.emplace_back(base + offset, n);
    return r;
  }

  void on_bucket(const grad_bucket& b) {
    start_ring({zero_collective::buckets, b.step, b.bucket, 0}, b.ranges,
               topology::ring_kind::reduce_scatter);
  }

  // Starts this replica's part of a ring over `ranges` (a bucket, in the stage's buffers).
  void start_ring(const key& k, const topology::float_ranges& ranges, topology::ring_kind kind) {
    auto& c = running_[k];
    c.t0 = cfg_.trace.now_us();
    for (const auto& r : ranges) c.bytes += r.second * 4;
    send(k, counted(c, [&] { return c.feed.start(ranges, cfg_.replica, cfg_.replicas, kind); }));
    finish_if_done(k, c);
  }

  // A skipped update (the coordinator's guard) changes no parameter, so every replica still holds
  // them whole (ZeRO-1/2) and there is nothing to all-gather; the gradients are dropped.
  void on_update(const zero_update& u) {
    update_step_ = u.step;
    if (u.skip) {
      lr_ = engine::learning_rate(cfg_.optimizer, u.step, cfg_.total_steps);
      update_finished();
      return;
    }
    const double t0 = cfg_.trace.now_us();
    lr_ =
        engine::shard_adamw_step(layout_.buckets, layout_.views, m_.data(), v_.data(),
                                 cfg_.optimizer, u.step, cfg_.total_steps, u.grad_norm, u.unscale);
    cfg_.trace.span("optimizer", "AdamW shard", t0, cfg_.trace.now_us(), {u.step});
    if (sharded_params()) {  // parameters are gathered before each use, not after the update
      update_finished();
      return;
    }
    gathers_pending_ = static_cast<int>(layout_.buckets.size());
    if (gathers_pending_ == 0) update_finished();
    for (int b = 0; b < static_cast<int>(layout_.buckets.size()); ++b)
      start_ring({zero_collective::buckets, u.step, b, 1}, param_ranges(shard_of(b)),
                 topology::ring_kind::all_gather);
  }

  // ZeRO-3: this replica's owned floats of the bucket into the stage's buffer, then the ring
  // all-gather of the rest; zero_gathered when the bucket is whole.
  void on_gather(const zero_gather& g) {
    const auto& b = shard_of(g.bucket);
    for (const auto& s : b.segments)
      std::memcpy(layout_.views.params.at(static_cast<std::size_t>(s.chunk)) + s.offset,
                  params_.data() + s.at, static_cast<std::size_t>(s.numel) * sizeof(float));
    start_ring({g.collective, g.step, g.seq, 1}, param_ranges(b), topology::ring_kind::all_gather);
  }

  void on_chunk(ring_chunk m) {
    const key k{static_cast<zero_collective>(m.collective), m.step, m.bucket, m.phase};
    auto& c = running_[k];
    send(k, counted(c, [&] { return c.feed.deliver(m.phase, m.chunk, std::move(m.data)); }));
    finish_if_done(k, c);
  }

  // Runs fn on c's feed, keeping the count of floats held in early chunks (and its peak) current.
  template <class Fn>
  topology::ring_feed::sends counted(collective& c, Fn&& fn) {
    early_floats_ -= c.feed.held_floats();
    auto sends = fn();
    early_floats_ += c.feed.held_floats();
    peak_early_floats_ = std::max(peak_early_floats_, early_floats_);
    return sends;
  }

  void finish_if_done(const key& k, collective& c) {
    if (!c.feed.done()) return;
    const auto [collective, step, bucket, phase] = k;
    cfg_.trace.span("collective", phase == 0 ? "reduce-scatter" : "all-gather", c.t0,
                    cfg_.trace.now_us(), {step, -1, -1, c.bytes});
    running_.erase(k);
    if (collective != zero_collective::buckets) {
      caf::anon_send(wiring_.stage, zero_gathered{step, collective, bucket});
    } else if (phase == 0) {
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
                    layout_.views.grads.at(static_cast<std::size_t>(s.chunk)) + s.offset,
                    static_cast<std::size_t>(s.numel) * sizeof(float));
    }
    const double sq = engine::shard_square_sum(b, layout_.views);
    caf::anon_send(wiring_.stage, grad_bucket_reduced{step, bucket, sq, nullptr});
  }

  void update_finished() {
    if (sharded_grads()) std::fill(grads_.begin(), grads_.end(), 0.0f);
    zero_update_done d;
    d.step = update_step_;
    d.lr = lr_;
    d.memory.optimizer = static_cast<std::int64_t>((m_.size() + v_.size()) * sizeof(float));
    d.memory.gradients = static_cast<std::int64_t>(grads_.size() * sizeof(float));
    d.memory.parameters = static_cast<std::int64_t>(params_.size() * sizeof(float));
    d.memory.buffers = peak_early_floats_ * static_cast<std::int64_t>(sizeof(float));
    peak_early_floats_ = early_floats_;
    caf::anon_send(wiring_.stage, std::move(d));
    if (running_.empty() && cfg_.trace.enabled() && !cfg_.trace.empty())
      caf::anon_send(wiring_.tracer, trace_batch{cfg_.trace.take()});
  }

  void send(const key& k, topology::ring_feed::sends sends) {
    const auto [collective, step, bucket, phase] = k;
    send_ring_chunks(wiring_.next, step, cfg_.rank, bucket, cfg_.replica, std::move(sends),
                     static_cast<int>(collective));
  }

  zero_shard_config cfg_;
  ring_wiring wiring_;
  zero_layout layout_;                // views.shard_grads points into grads_ (ZeRO-2)
  std::vector<float> m_, v_, grads_;  // owned floats, bucket by bucket (bucket_shard::at)
  std::vector<float> params_;         // ZeRO-3: owned parameters, the same way
  std::map<key, collective> running_;
  int update_step_ = 0, gathers_pending_ = 0;
  double lr_ = 0;
  std::int64_t early_floats_ = 0, peak_early_floats_ = 0;  // in chunks that arrived early
};

}  // namespace

zero_shard_actor spawn_zero_shard(caf::actor_system& system, zero_shard_config config) {
  return system.spawn<zero_shard_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
