// The trace sink. See tracer.hpp.
#include "actors/tracer.hpp"

#include <algorithm>

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
  engine::trace::trace_file trace_;
};

}  // namespace

tracer_actor spawn_tracer(caf::actor_system& system) { return system.spawn<tracer_impl>(); }

}  // namespace troupe::actors
