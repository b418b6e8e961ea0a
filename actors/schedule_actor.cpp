// The schedule actor. See schedule_actor.hpp.
#include "actors/schedule_actor.hpp"

#include <memory>

namespace troupe::actors {
namespace {

using namespace messages;

class schedule_impl : public schedule_actor::base {
 public:
  schedule_impl(caf::actor_config& cfg, schedule_config config)
      : schedule_actor::base(cfg), cfg_(std::move(config)) {
    plan_ = std::make_shared<const engine::pipeline_plan>(engine::make_plan(cfg_.name, cfg_.shape));
  }

  void on_exit() override { wiring_ = {}; }

  behavior_type make_behavior() override {
    return {
        [this](schedule_wiring& w) { wiring_ = std::move(w); },
        [this](begin_step& b) {
          for (const auto& replica : wiring_.stages)
            for (const auto& stage : replica)
              caf::anon_send(stage, step_plan{b.step, b.rounds, false, plan_, b.loss_scale});
        },
        [this](begin_eval& e) {
          // Every replica runs the same number of micro-batches (the loader fills the slots
          // past the last batch with ignored targets), so replicas issue the same collectives
          // (ZeRO-3 gathers) whether or not the batches divide among them.
          auto shape = cfg_.shape;
          shape.micro_batches = (e.batches + cfg_.replicas - 1) / cfg_.replicas;
          auto plan =
              std::make_shared<const engine::pipeline_plan>(engine::plan_forward_only(shape));
          for (const auto& replica : wiring_.stages)
            for (const auto& stage : replica)
              caf::anon_send(stage, step_plan{e.step, 1, true, plan, 1.0});
        },
        [this](swap_schedule& s) -> swap_result {
          try {
            auto plan = engine::make_plan(s.name, cfg_.shape);
            if (plan.split_backward && !cfg_.split_backward_possible)
              return {false, "schedule " + s.name +
                                 " splits backward (W actions), and this job's device chunks "
                                 "were made without a split backward's buffers: start the job "
                                 "with a split-backward schedule (e.g. zb_h1) to swap to one"};
            plan_ = std::make_shared<const engine::pipeline_plan>(std::move(plan));
            cfg_.name = s.name;
            return {true, "schedule " + s.name + " from the next step"};
          } catch (const std::exception& e) {
            return {false, e.what()};
          }
        },
    };
  }

 private:
  schedule_config cfg_;
  schedule_wiring wiring_;
  std::shared_ptr<const engine::pipeline_plan> plan_;
};

}  // namespace

schedule_actor spawn_schedule_actor(caf::actor_system& system, schedule_config config) {
  return system.spawn<schedule_impl>(std::move(config));
}

}  // namespace troupe::actors
