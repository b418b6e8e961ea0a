// The coordinator. See coordinator.hpp.
//
// Invariants:
//  C1. Step s+1 begins only after every stage reported update_done for step s.
//  C2. The global gradient norm is the square root of the sum of the ranks' squared norms of
//      replica 0 (all replicas hold the same reduced gradients), or with ZeRO of every replica
//      (each holds one shard of them). With tensor parallelism, every tensor shard of replica 0
//      (lanes 0..tp-1) counts its own slices, and shard 0 the replicated parameters.
//  C5. Tensor shards compute the same loss: only shard 0 of each replica's losses count.
//  C3. Every actor of the run is monitored; a stop before run_finished is a failure naming it.
//  C6. With a step limit (run_until), the next step begins only below it; at it the coordinator
//      pauses between steps (no action in flight) and tells its client.
//  C4. The update guard (engine::update_guard) sees every step once, in step order, with the
//      step's mean loss and the global norm of the unscaled gradients (the stages' gradients
//      carry the loss scale the step began with); every stage gets the same decision.
#include "actors/coordinator.hpp"

#include "actors/error_text.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

namespace troupe::actors {
namespace {

using namespace messages;
using clock_type = std::chrono::steady_clock;

class coordinator_impl : public coordinator_actor::base {
 public:
  coordinator_impl(caf::actor_config& cfg, coordinator_config config)
      : coordinator_actor::base(cfg), cfg_(std::move(config)), guard_(cfg_.guard, cfg_.scaling) {
    if (cfg_.guard_state) guard_.restore(*cfg_.guard_state);
    // run_until may come before start_run: the limit is set here, once.
    limit_ = cfg_.step_limit < 0 ? cfg_.steps : std::min(cfg_.step_limit, cfg_.steps);
    tokens_ = cfg_.start_tokens;
  }

  void on_exit() override { wiring_ = {}; }

  behavior_type make_behavior() override {
    set_down_handler([this](caf::down_msg& d) { on_down(d); });
    return {
        [this](coordinator_wiring& w) {
          wiring_ = std::move(w);
          for (const auto& a : wiring_.watched) monitor(a);
        },
        [this](start_run) {
          start_ = clock_type::now();
          if (cfg_.start_step >= cfg_.steps)  // resumed after the last step: nothing to run
            finish(true, "");
          else
            go_on(cfg_.start_step);
        },
        [this](stop_run) {  // now, or after the step in flight
          stopping_ = true;
          if (paused_at_ >= 0) finish(true, "");
        },
        [this](run_until& u) {
          limit_ = std::min(u.step, cfg_.steps);
          if (paused_at_ >= 0) go_on(paused_at_);
        },
        [this](checkpoint_now) -> caf::result<checkpoint_copied> {
          if (paused_at_ < 0)
            throw std::logic_error("coordinator: a checkpoint asked for while steps run");
          if (!wiring_.checkpointer)
            throw std::logic_error("coordinator: a checkpoint asked for without a writer");
          if (paused_at_ == checkpointed_) return checkpoint_copied{paused_at_};
          auto rp = make_response_promise<checkpoint_copied>();
          asked_.push_back(rp);
          if (asked_.size() > 1) return rp;  // this step's checkpoint is on its way already
          request(caf::actor_cast<checkpoint_writer_actor>(wiring_.checkpointer), caf::infinite,
                  checkpoint_begin{checkpoint_state(paused_at_)})
              .then(
                  [this](checkpoint_copied& c) {
                    checkpointed_ = c.step;
                    for (auto& p : asked_) p.deliver(c);
                    asked_.clear();
                  },
                  [](caf::error&) {});
          return rp;
        },
        [this](grads_ready& g) { on_grads(g); },
        [this](update_done& u) { on_updated(u); },
        [this](eval_done& e) { on_eval(e); },
        [this](swap_schedule& s) -> caf::delegated<swap_result> {
          return delegate(caf::actor_cast<schedule_actor>(wiring_.schedule), s);
        },
    };
  }

 private:
  int stage_count() const { return cfg_.ranks * cfg_.replicas; }

  void begin(int s) {
    step_ = s;
    step_start_ = clock_type::now();
    trace_start_ = cfg_.trace.now_us();
    grads_ = updates_ = evals_ = 0;
    square_sum_ = loss_sum_ = eval_sum_ = 0;
    losses_ = eval_losses_ = 0;
    reported_.assign(static_cast<std::size_t>(stage_count()), grads_ready{});
    memory_.assign(static_cast<std::size_t>(stage_count()), engine::memory_report{});
    eval_reported_.assign(static_cast<std::size_t>(cfg_.replicas), eval_done{});
    caf::anon_send(caf::actor_cast<schedule_actor>(wiring_.schedule),
                   begin_step{s, cfg_.rounds, guard_.loss_scale()});
  }

  // Sums are taken in (replica, rank) order once all reports are in, never in arrival order:
  // a job's metrics and clipping are then bitwise the same whatever the timing, in one process
  // or many.
  void on_grads(const grads_ready& g) {
    reported_.at(static_cast<std::size_t>(g.replica * cfg_.ranks + g.rank)) = g;
    if (++grads_ < stage_count()) return;
    for (const auto& r : reported_) {
      if (r.replica < cfg_.tp || cfg_.sharded_grads) square_sum_ += r.grad_square_sum;
      if (r.replica % cfg_.tp != 0) continue;  // C5
      loss_sum_ += r.loss_sum;
      losses_ += r.losses;
    }
    const double scale = guard_.loss_scale();
    grad_norm_ = std::sqrt(square_sum_) / scale;
    decision_ = guard_.decide(loss_sum_ / std::max(1, losses_), grad_norm_);
    const apply_update u{step_, grad_norm_, !decision_.apply, 1.0 / scale};
    for (const auto& replica : wiring_.stages)
      for (const auto& st : replica) caf::anon_send(st, u);
  }

  bool eval_due() const {
    if (cfg_.eval_interval <= 0 || cfg_.eval_batches <= 0) return false;
    return (step_ + 1) % cfg_.eval_interval == 0 || step_ + 1 == cfg_.steps;
  }

  void on_updated(const update_done& u) {
    lr_ = u.lr;
    memory_.at(static_cast<std::size_t>(u.replica * cfg_.ranks + u.rank)) = u.memory;
    if (++updates_ < stage_count()) return;
    if (!eval_due()) {
      finish_step();
      return;
    }
    evals_expected_ = cfg_.replicas;
    const begin_eval e{step_, cfg_.eval_batches};
    caf::anon_send(caf::actor_cast<schedule_actor>(wiring_.schedule), e);
    for (const auto& l : wiring_.loaders) caf::anon_send(caf::actor_cast<loader_actor>(l), e);
  }

  void on_eval(const eval_done& e) {
    eval_reported_.at(static_cast<std::size_t>(e.replica)) = e;
    if (++evals_ < evals_expected_) return;
    for (const auto& r : eval_reported_) {
      if (r.replica % cfg_.tp != 0) continue;  // C5
      eval_sum_ += r.loss_sum;
      eval_losses_ += r.losses;
    }
    finish_step();
  }

  void finish_step() {
    const auto now = clock_type::now();
    const double step_s = std::chrono::duration<double>(now - step_start_).count();
    engine::step_metrics m;
    m.step = step_ + 1;
    m.total_steps = cfg_.steps;
    m.loss = loss_sum_ / std::max(1, losses_);
    if (eval_losses_ > 0) m.val_loss = eval_sum_ / eval_losses_;
    m.lr = lr_;
    m.grad_norm = grad_norm_;
    m.step_ms = step_s * 1e3;
    m.tokens_per_s = double(cfg_.tokens_per_step) / step_s;
    m.flops_per_s = m.tokens_per_s * cfg_.flops_per_token;
    tokens_ += cfg_.tokens_per_step;
    m.tokens = tokens_;
    m.elapsed_s = std::chrono::duration<double>(now - start_).count();
    m.memory = memory_;
    m.skipped = decision_.skipped;
    if (cfg_.scaling.dynamic) m.loss_scale = decision_.loss_scale;
    cfg_.trace.span("step", "step " + std::to_string(step_ + 1), trace_start_, cfg_.trace.now_us(),
                    {step_});
    if (cfg_.trace.enabled()) caf::anon_send(wiring_.tracer, trace_batch{cfg_.trace.take()});
    caf::anon_send(wiring_.client, step_report{m});
    if (!decision_.stop && cfg_.checkpoint_every > 0 && (step_ + 1) % cfg_.checkpoint_every == 0) {
      // The stages' state is copied before the next step begins; it is written meanwhile.
      request(caf::actor_cast<checkpoint_writer_actor>(wiring_.checkpointer), caf::infinite,
              checkpoint_begin{checkpoint_state(step_ + 1)})
          .then(
              [this](checkpoint_copied& c) {
                checkpointed_ = c.step;
                next_step();
              },
              // The writer stopped: its reason reaches on_down (C3), which ends the run.
              [](caf::error&) {});
      return;
    }
    next_step();
  }

  void next_step() {
    if (decision_.stop) {
      finish(false, engine::stop_message(step_ + 1, decision_));
    } else if (step_ + 1 < cfg_.steps) {
      go_on(step_ + 1);
    } else {
      finish(true, "");
    }
  }

  // Step s next, unless the limit says pause first (C6).
  void go_on(int s) {
    if (stopping_) {
      finish(true, "");
      return;
    }
    if (s >= limit_) {
      paused_at_ = s;
      caf::anon_send(wiring_.client, training_paused{s});
      return;
    }
    paused_at_ = -1;
    begin(s);
  }

  // What a checkpoint after `steps` steps holds of the coordinator's.
  engine::checkpoint_state checkpoint_state(int steps) const {
    engine::checkpoint_state s;
    s.step = steps;
    s.tokens = tokens_;
    s.micro_batches = cfg_.start_micro_batches +
                      std::int64_t{steps - cfg_.start_step} * cfg_.micro_batches_per_step;
    s.guard = guard_.save();
    return s;
  }

  void finish(bool ok, std::string message) {
    finished_ = true;
    caf::anon_send(wiring_.client, run_finished{ok, std::move(message)});
  }

  void on_down(const caf::down_msg& d) {
    if (finished_) return;
    std::string who = "an actor";
    for (std::size_t i = 0; i < wiring_.watched.size(); ++i)
      if (wiring_.watched[i].address() == d.source) who = wiring_.watched_names[i];
    finish(false,
           who + " stopped during step " + std::to_string(step_ + 1) + ": " + error_text(d.reason));
  }

  coordinator_config cfg_;
  engine::update_guard guard_;
  engine::guard_decision decision_;  // this step's
  coordinator_wiring wiring_;
  clock_type::time_point start_, step_start_;
  double trace_start_ = 0;
  int step_ = 0, grads_ = 0, updates_ = 0, evals_ = 0, evals_expected_ = 0;
  double square_sum_ = 0, loss_sum_ = 0, eval_sum_ = 0, grad_norm_ = 0, lr_ = 0;
  std::vector<engine::memory_report> memory_;  // this step's, by replica * ranks + rank
  std::vector<grads_ready> reported_;          // this step's, by replica * ranks + rank
  std::vector<eval_done> eval_reported_;       // by replica
  int losses_ = 0, eval_losses_ = 0;
  std::int64_t tokens_ = 0;
  bool finished_ = false;
  int limit_ = 0;          // steps to have done before pausing
  int paused_at_ = -1;     // paused with this many steps done; -1: running
  int checkpointed_ = -1;  // the steps done at the last checkpoint
  bool stopping_ = false;  // stop_run: end at the next step boundary
  // checkpoint_now requests waiting for the one checkpoint of the step paused at.
  std::vector<caf::typed_response_promise<checkpoint_copied>> asked_;
};

}  // namespace

coordinator_actor spawn_coordinator(caf::actor_system& system, coordinator_config config) {
  return system.spawn<coordinator_impl>(std::move(config));
}

}  // namespace troupe::actors
