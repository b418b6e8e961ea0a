// The trace sink. See tracer.hpp.
#include "actors/tracer.hpp"

#include <algorithm>

#include "engine/parallel/schedule_sim.hpp"

namespace troupe::actors {
namespace {

using namespace messages;

// A class, not a function-based actor: CAF 0.17 binds a reference to an empty argument tuple
// when it starts a function-based actor without arguments, which UBSan reports.
class tracer_impl : public tracer_actor::base {
 public:
  explicit tracer_impl(caf::actor_config& cfg) : tracer_actor::base(cfg) {}

  behavior_type make_behavior() override {
    return {
        [this](trace_batch& b) {
          auto& ev = trace_.events;
          ev.insert(ev.end(), std::make_move_iterator(b.events.begin()),
                    std::make_move_iterator(b.events.end()));
        },
        [this](trace_write& w) -> std::string {
          trace_.meta = w.finish.meta;
          trace_.tracks = w.finish.tracks;
          if (w.finish.plan) trace_.meta.theory_bubble = theory_bubble(*w.finish.plan);
          std::stable_sort(trace_.events.begin(), trace_.events.end(),
                           [](const auto& a, const auto& b) { return a.ts_us < b.ts_us; });
          try {
            engine::trace::write_json(trace_, w.path);
          } catch (const std::exception& e) {
            return e.what();
          }
          return "";
        },
    };
  }

 private:
  // The plan's bubble with the mean F/B/W costs measured in the trace (unit costs if none).
  double theory_bubble(const engine::pipeline_plan& plan) const {
    double sum[3] = {0, 0, 0};
    int n[3] = {0, 0, 0};
    for (const auto& e : trace_.events) {
      if (e.kind != engine::trace::event_kind::span || e.category != "compute") continue;
      const int k = e.name == "F" ? 0 : e.name == "B" ? 1 : 2;
      sum[k] += e.dur_us;
      ++n[k];
    }
    engine::action_costs costs;
    if (n[0] > 0) costs.forward = sum[0] / n[0];
    if (n[1] > 0) costs.backward = sum[1] / n[1];
    costs.weight = n[2] > 0 ? sum[2] / n[2] : 0;
    return engine::simulate(plan, costs).bubble_fraction;
  }

  engine::trace::trace_file trace_;
};

}  // namespace

tracer_actor spawn_tracer(caf::actor_system& system) { return system.spawn<tracer_impl>(); }

}  // namespace troupe::actors
