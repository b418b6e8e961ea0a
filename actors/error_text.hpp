// The text of an actor's exit reason for people: the message an actor stopped with
// (caf::make_error(sec, "text")) without CAF's tuple punctuation, else CAF's own rendering.
#pragma once

#include <caf/all.hpp>
#include <string>

namespace troupe::actors {

inline std::string error_text(const caf::error& e) {
  if (!e) return "exited normally";
  const auto& ctx = e.context();
  if (ctx.match_elements<std::string>()) return ctx.get_as<std::string>(0);
  if (!ctx.empty()) return caf::to_string(ctx);
  return caf::to_string(e);
}

}  // namespace troupe::actors
