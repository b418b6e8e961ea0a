// The trainer actor of the embedding API. See include/troupe/trainer.hpp and docs/embedding.md.
//
// Invariants:
//  T1. The trainer is the job's client: step reports, pauses and the run's end come to it, and
//      only it moves the coordinator's step limit (run_until).
//  T2. Requests that need the run paused (take_checkpoint, stop_training) wait for the pause
//      they ask for; replies to train_steps and pause_training go out on the next pause or at
//      the run's end, in the order they came.
//  T3. The run's end is finished once (training_job::finish: checkpoints committed, final
//      weights written, actors stopped), on this actor's own thread.
//  T4. Every take_checkpoint is answered: committed (with its directory) or why not, also when
//      the run ends while it is being taken.
#include <deque>
#include <functional>
#include <map>
#include <memory>

#include "actors/pipeline_run.hpp"
#include "engine/training/checkpoint.hpp"
#include "messages/protocols.hpp"
#include "troupe/trainer.hpp"

namespace troupe {
namespace {

using namespace messages;

class trainer_impl : public caf::event_based_actor {
 public:
  trainer_impl(caf::actor_config& cfg, std::shared_ptr<actors::training_job> job)
      : caf::event_based_actor(cfg), job_(std::move(job)) {
    status_.total_steps = job_->recipe().steps;
    status_.step = target_ = job_->start_step();
  }

  void on_exit() override {
    // Whatever is still waiting is answered (CAF 0.17 says nothing for a dropped promise, and a
    // kept one keeps this actor alive); the job's handles go before the actor system.
    for (auto& rp : waiting_) rp.deliver(status_);
    for (auto& rp : stops_) rp.deliver(status_);
    for (auto& [id, c] : checkpoints_)
      c.rp.deliver(checkpoint_result{false, "", "the trainer stopped before the checkpoint"});
    waiting_.clear();
    stops_.clear();
    checkpoints_.clear();
    on_pause_.clear();
    subscribers_.clear();
    job_.reset();
  }

  caf::behavior make_behavior() override {
    job_->spawn(system(), caf::actor_cast<caf::actor>(this));
    return {
        [this](train_steps& t) -> caf::result<trainer_status> {
          // A stop waiting for the pause wins (T2): no more steps.
          if (ended() || t.steps <= 0 || !stops_.empty()) return status_;
          if (!on_pause_.empty()) {  // a checkpoint waits for the pause: the steps come after it
            auto rp = make_response_promise<trainer_status>();
            on_pause_.push_back([this, rp, n = t.steps]() mutable {
              if (ended() || !stops_.empty()) {
                rp.deliver(status_);
                return;
              }
              run_more(n);
              waiting_.push_back(rp);
            });
            return rp;
          }
          run_more(t.steps);
          return await_pause();
        },
        [this](pause_training) -> caf::result<trainer_status> {
          if (ended() || status_.state == trainer_status::phase::paused) return status_;
          target_ = status_.step + 1;  // the step in flight completes (T2)
          send(caf::actor_cast<caf::actor>(job_->coordinator()), run_until{target_});
          return await_pause();
        },
        [this](query_status) { return status_; },
        [this](subscribe_steps& s) {
          subscribers_.push_back(std::move(s.subscriber));
          return status_;
        },
        [this](take_checkpoint) -> caf::result<checkpoint_result> {
          auto rp = make_response_promise<checkpoint_result>();
          when_paused([this, rp]() mutable {
            if (ended()) {
              rp.deliver(checkpoint_result{false, "", "the run has ended"});
              return;
            }
            // Kept until answered: a run that ends first answers it in on_finished (T4).
            const int id = next_checkpoint_++;
            checkpoints_.emplace(id, pending_checkpoint{rp, status_.step});
            request(caf::actor_cast<caf::actor>(job_->coordinator()), caf::infinite,
                    checkpoint_now{})
                .then(
                    [this, id](checkpoint_copied& c) {
                      if (!checkpoints_.count(id)) return;
                      checkpoints_.at(id).step = c.step;
                      request(caf::actor_cast<caf::actor>(job_->checkpointer()), caf::infinite,
                              checkpoint_flush{})
                          .then([this, id](bool) { settle_checkpoint(id, ""); },
                                [this, id](caf::error& e) { settle_checkpoint(id, to_string(e)); });
                    },
                    [this, id](caf::error& e) { settle_checkpoint(id, to_string(e)); });
          });
          return rp;
        },
        [this](use_schedule& u) -> caf::result<schedule_result> {
          auto rp = make_response_promise<schedule_result>();
          request(caf::actor_cast<caf::actor>(job_->coordinator()), caf::infinite,
                  swap_schedule{u.name})
              .then(
                  [rp](swap_result& r) mutable {
                    rp.deliver(schedule_result{r.ok, r.message});
                  },
                  [rp](caf::error& e) mutable {
                    rp.deliver(schedule_result{false, to_string(e)});
                  });
          return rp;
        },
        [this](stop_training) -> caf::result<trainer_status> {
          auto rp = make_response_promise<trainer_status>();
          stops_.push_back(rp);
          if (ended()) {
            reply_stops();
            return rp;
          }
          when_paused([this] {
            if (!ended()) send(caf::actor_cast<caf::actor>(job_->coordinator()), stop_run{});
          });
          return rp;
        },
        // The job's reports (T1).
        [this](step_report& r) {
          job_->record(r.metrics);
          const auto& m = r.metrics;
          status_.step = m.step;
          status_.last_loss = m.loss;
          step_event e{m.step,    m.total_steps, m.loss,   m.lr,      m.grad_norm, m.tokens_per_s,
                       m.step_ms, m.val_loss,    m.tokens, m.skipped, {}};
          for (const auto& r : m.memory)
            e.memory.push_back({r.replica, r.rank, r.parameters, r.gradients, r.optimizer,
                                r.buffers, r.pooled, r.activations});
          for (const auto& s : subscribers_) send(s, e);
        },
        [this](training_paused& p) {
          status_.step = p.step;
          // A pause below the limit asked for is the start's (or an earlier limit's): the
          // coordinator goes on once it has the new limit (T2).
          if (p.step < target_) return;
          status_.state = trainer_status::phase::paused;
          answer_waiting();
          auto actions = std::move(on_pause_);
          on_pause_.clear();
          for (auto& f : actions) f();
        },
        [this](run_finished& f) { on_finished(f); },
    };
  }

 private:
  bool ended() const {
    return status_.state == trainer_status::phase::finished ||
           status_.state == trainer_status::phase::failed;
  }

  // n more steps (up to the recipe's): the coordinator's limit raised.
  void run_more(int n) {
    target_ = std::min(status_.total_steps, std::max(target_, status_.step) + n);
    status_.state = trainer_status::phase::running;
    send(caf::actor_cast<caf::actor>(job_->coordinator()), run_until{target_});
  }

  // Answers checkpoint `id` (if still waiting): committed when `error` is empty.
  void settle_checkpoint(int id, const std::string& error) {
    const auto it = checkpoints_.find(id);
    if (it == checkpoints_.end()) return;
    auto& c = it->second;
    if (error.empty()) {
      c.rp.deliver(checkpoint_result{
          true, engine::checkpoint_dir(job_->recipe().checkpoint_path(), c.step).string(), ""});
    } else {
      c.rp.deliver(checkpoint_result{false, "", error});
    }
    checkpoints_.erase(it);
  }

  caf::result<trainer_status> await_pause() {
    auto rp = make_response_promise<trainer_status>();
    waiting_.push_back(rp);
    return rp;
  }

  void answer_waiting() {
    for (auto& rp : waiting_) rp.deliver(status_);
    waiting_.clear();
  }

  // Runs `f` once the run is paused (now, if it is), or has ended.
  void when_paused(std::function<void()> f) {
    if (ended() || status_.state == trainer_status::phase::paused) {
      f();
      return;
    }
    on_pause_.push_back(std::move(f));
    if (target_ > status_.step + 1) {  // ask for the pause after the step in flight
      target_ = status_.step + 1;
      send(caf::actor_cast<caf::actor>(job_->coordinator()), run_until{target_});
    }
  }

  void on_finished(const run_finished& f) {  // T3
    std::string failure = f.ok ? "" : f.message;
    try {
      failure = job_->finish(system(), failure);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    status_.state =
        failure.empty() ? trainer_status::phase::finished : trainer_status::phase::failed;
    status_.error = failure;
    // T4: a checkpoint still waiting is committed by finish (every checkpoint begun is), or
    // not at all when the run failed.
    while (!checkpoints_.empty()) {
      const auto& [id, c] = *checkpoints_.begin();
      const auto dir = engine::checkpoint_dir(job_->recipe().checkpoint_path(), c.step);
      const bool committed = failure.empty() && engine::verify_checkpoint(dir).empty();
      settle_checkpoint(id, committed ? ""
                                      : "the run ended before the checkpoint was committed" +
                                            (failure.empty() ? "" : ": " + failure));
    }
    answer_waiting();
    auto actions = std::move(on_pause_);
    on_pause_.clear();
    for (auto& a : actions) a();
    reply_stops();
  }

  void reply_stops() {
    if (stops_.empty()) return;
    for (auto& rp : stops_) rp.deliver(status_);
    stops_.clear();
    quit();
  }

  std::shared_ptr<actors::training_job> job_;
  trainer_status status_;
  int target_ = 0;  // the coordinator's step limit
  std::vector<caf::typed_response_promise<trainer_status>> waiting_, stops_;
  std::vector<std::function<void()>> on_pause_;
  struct pending_checkpoint {
    caf::typed_response_promise<checkpoint_result> rp;
    int step = 0;  // the step it is of (the pause's, then the coordinator's answer)
  };
  std::map<int, pending_checkpoint> checkpoints_;  // take_checkpoint requests not answered yet
  int next_checkpoint_ = 0;
  std::vector<caf::actor> subscribers_;
};

}  // namespace

namespace {
caf::expected<trainer_actor> spawn_job(caf::actor_system& system, const engine::recipe& r,
                                       const trainer_options& options) {
  actors::run_options o;
  o.step_limit = 0;  // paused before the first step
  o.checkpoint_writer = true;
  o.resume = options.resume;
  o.compute_threads = options.threads;
  o.collect_parameters = false;
  auto job = std::make_shared<actors::training_job>(r, engine::train_callbacks{}, o);
  return caf::actor_cast<trainer_actor>(system.spawn<trainer_impl, caf::detached>(job));
}
}  // namespace

caf::expected<trainer_actor> spawn_trainer(caf::actor_system& system,
                                           const std::string& recipe_path,
                                           const trainer_options& options) {
  try {
    return spawn_job(system, engine::load_recipe(recipe_path, options.overrides), options);
  } catch (const std::exception& e) {
    return caf::make_error(caf::sec::invalid_argument, e.what());
  }
}

caf::expected<trainer_actor> spawn_trainer(caf::actor_system& system, const recipe_text& recipe,
                                           const trainer_options& options) {
  try {
    auto r = engine::parse_recipe(recipe.toml, recipe.source, options.overrides);
    engine::check_recipe_inputs(r);
    return spawn_job(system, r, options);
  } catch (const std::exception& e) {
    return caf::make_error(caf::sec::invalid_argument, e.what());
  }
}

}  // namespace troupe
