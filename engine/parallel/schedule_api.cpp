// The public schedule API (include/troupe/schedule.hpp) over the engine's registry
// (schedule.hpp): a user's token lines become a plan through parse_plan; make_plan checks it.
#include "troupe/schedule.hpp"

#include <stdexcept>
#include <utility>

#include "engine/parallel/schedule.hpp"

namespace troupe {
namespace {
engine::schedule_shape to_engine(const schedule_shape& s) {
  return {s.ranks, s.micro_batches, s.virtual_stages};
}
}  // namespace

void register_schedule(const std::string& name, schedule_function fn) {
  if (!fn)
    throw std::invalid_argument("register_schedule: schedule '" + name + "' has no function");
  for (const char* built_in : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"})
    if (name == built_in)
      throw std::invalid_argument("register_schedule: '" + name + "' is a built-in schedule");
  // make_plan names the schedule in every error.
  engine::register_schedule(name, [name, fn = std::move(fn)](const engine::schedule_shape& shape) {
    const auto lines = fn({shape.ranks, shape.micro_batches, shape.virtual_stages});
    if (static_cast<int>(lines.size()) != shape.ranks)
      throw std::invalid_argument("gave " + std::to_string(lines.size()) + " ranks' actions for " +
                                  std::to_string(shape.ranks) + " pipeline ranks");
    std::string text;  // "rank N:" keeps a rank without actions a line of its own
    for (std::size_t r = 0; r < lines.size(); ++r) {
      if (lines[r].find_first_of("\n#") != std::string::npos)
        throw std::invalid_argument("rank " + std::to_string(r) +
                                    "'s actions hold a newline or '#': tokens only");
      text += "rank " + std::to_string(r) + ": " + lines[r] + "\n";
    }
    return engine::parse_plan(text, shape, name);
  });
}

std::vector<std::string> schedule_names() { return engine::schedule_names(); }

std::string format_schedule(const std::string& name, const schedule_shape& shape) {
  return engine::format_plan(engine::make_plan(name, to_engine(shape)));
}

}  // namespace troupe
