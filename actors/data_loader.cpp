// The data loader actor. See data_loader.hpp.
#include "actors/data_loader.hpp"

#include <algorithm>
#include <map>

#include "engine/model/gpt_model.hpp"

namespace troupe::actors {
namespace {

using namespace messages;

class loader_impl : public loader_actor::base {
 public:
  loader_impl(caf::actor_config& cfg, loader_config config)
      : loader_actor::base(cfg), cfg_(std::move(config)) {}

  void on_exit() override { wiring_ = {}; }

  behavior_type make_behavior() override {
    return {
        [this](loader_wiring& w) {
          wiring_ = std::move(w);
          next_[0] = next_[1] = std::int64_t{cfg_.start_step} * per_step();
          fill(batch_part::inputs);
          fill(batch_part::targets);
        },
        [this](batch_credit& c) {
          --outstanding_[static_cast<int>(c.part)];
          fill(c.part);
        },
        [this](begin_eval& e) { send_eval(e); },
    };
  }

 private:
  std::int64_t per_step() const { return std::int64_t{cfg_.rounds} * cfg_.micro_batches; }
  std::int64_t total() const { return per_step() * cfg_.steps; }

  void fill(batch_part part) {
    const int p = static_cast<int>(part);
    while (outstanding_[p] < cfg_.prefetch && next_[p] < total()) {
      send_position(part, next_[p]++);
      ++outstanding_[p];
    }
  }

  // Samples position `pos` of this replica's stream once; both parts are kept until sent.
  void send_position(batch_part part, std::int64_t pos) {
    auto it = made_.find(pos);
    if (it == made_.end()) it = made_.emplace(pos, make(pos)).first;
    auto& [pair, sent] = it->second;
    const int p = static_cast<int>(part);
    batch_message b = pair[p];
    b.part = part;
    const caf::actor& to = part == batch_part::inputs ? wiring_.first_stage : wiring_.last_stage;
    const double t0 = cfg_.trace.now_us();
    caf::anon_send(to, std::move(b));
    cfg_.trace.span("data", part == batch_part::inputs ? "inputs" : "targets", t0,
                    cfg_.trace.now_us(), {pair[p].step, pair[p].micro_batch, -1});
    if (++sent == 2) made_.erase(it);
    if (cfg_.trace.enabled() && pos % per_step() == per_step() - 1 && part == batch_part::targets)
      caf::anon_send(wiring_.tracer, trace_batch{cfg_.trace.take()});
  }

  std::pair<std::array<batch_message, 2>, int> make(std::int64_t pos) const {
    const std::int64_t step = pos / per_step(), within = pos % per_step();
    const std::size_t which = static_cast<std::size_t>(within) % cfg_.seq_lens.size();
    const int T = cfg_.seq_lens[which];
    const std::int64_t g = cfg_.start_micro_batches +
                           (step - cfg_.start_step) * per_step() * cfg_.replicas +
                           std::int64_t{cfg_.replica} * per_step() + within;
    batch_message in;
    in.step = static_cast<int>(step);
    in.round = static_cast<int>(within / cfg_.micro_batches);
    in.micro_batch = static_cast<int>(within % cfg_.micro_batches);
    in.replica = cfg_.replica;
    in.B = cfg_.B;
    in.T = T;
    in.tokens = std::make_shared<payload<std::int32_t>>(std::size_t(cfg_.B) * std::size_t(T));
    batch_message tg = in;
    tg.tokens = std::make_shared<payload<std::int32_t>>(in.tokens->size());
    cfg_.train[which]->fill(g, in.tokens->data(), tg.tokens->data());
    return {{std::move(in), std::move(tg)}, 0};
  }

  // Replica r evaluates batches r, r + replicas, ...; every replica sends the same number of
  // micro-batches, the slots past the last batch being fillers whose targets are all ignored
  // (the last stage counts no loss for them).
  void send_eval(const begin_eval& e) {
    const int per_replica = (e.batches + cfg_.replicas - 1) / cfg_.replicas;
    for (int i = 0; i < per_replica; ++i) {
      const int j = cfg_.replica + i * cfg_.replicas;
      batch_message in;
      in.eval = true;
      in.step = e.step;
      in.micro_batch = i;
      in.replica = cfg_.replica;
      in.B = cfg_.B;
      in.T = static_cast<int>(cfg_.val->config().T);
      in.tokens = std::make_shared<payload<std::int32_t>>(std::size_t(in.B) * std::size_t(in.T));
      batch_message tg = in;
      tg.part = batch_part::targets;
      tg.tokens = std::make_shared<payload<std::int32_t>>(in.tokens->size());
      if (j < e.batches) {
        cfg_.val->fill(j, in.tokens->data(), tg.tokens->data());
      } else {
        std::fill(in.tokens->begin(), in.tokens->end(), 0);
        std::fill(tg.tokens->begin(), tg.tokens->end(), engine::ignore_index);
      }
      caf::anon_send(wiring_.first_stage, std::move(in));
      caf::anon_send(wiring_.last_stage, std::move(tg));
    }
  }

  loader_config cfg_;
  loader_wiring wiring_;
  std::int64_t next_[2] = {0, 0};
  int outstanding_[2] = {0, 0};
  std::map<std::int64_t, std::pair<std::array<batch_message, 2>, int>> made_;
};

}  // namespace

loader_actor spawn_data_loader(caf::actor_system& system, loader_config config) {
  return system.spawn<loader_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
