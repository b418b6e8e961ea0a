// The trace sink. See tracer.hpp.
#include "actors/tracer.hpp"

#include <algorithm>

namespace troupe::actors {
namespace {

using namespace messages;

tracer_actor::behavior_type tracer_fn(
    tracer_actor::stateful_pointer<engine::trace::trace_file> self) {
  return {
      [self](trace_batch& b) {
        auto& ev = self->state.events;
        ev.insert(ev.end(), std::make_move_iterator(b.events.begin()),
                  std::make_move_iterator(b.events.end()));
      },
      [self](trace_write& w) -> std::string {
        auto& t = self->state;
        t.meta = w.finish.meta;
        t.tracks = w.finish.tracks;
        std::stable_sort(t.events.begin(), t.events.end(),
                         [](const auto& a, const auto& b) { return a.ts_us < b.ts_us; });
        try {
          engine::trace::write_json(t, w.path);
        } catch (const std::exception& e) {
          return e.what();
        }
        return "";
      },
  };
}

}  // namespace

tracer_actor spawn_tracer(caf::actor_system& system) { return system.spawn(tracer_fn); }

}  // namespace troupe::actors
