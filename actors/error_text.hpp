// The text of an actor's exit reason for people: the message an actor stopped with
// (caf::make_error(sec, "text")) without CAF's tuple punctuation, else CAF's own rendering; and
// the exit reason an actor's exception handler makes of what a handler threw, naming the actor.
#pragma once

#include <caf/all.hpp>
#include <exception>
#include <string>

namespace troupe::actors {

inline std::string error_text(const caf::error& e) {
  if (!e) return "exited normally";
  const auto& ctx = e.context();
  if (ctx.match_elements<std::string>()) return ctx.get_as<std::string>(0);
  if (!ctx.empty()) return caf::to_string(ctx);
  return caf::to_string(e);
}

// For set_exception_handler: "WHO: what()" as a runtime error (rethrows what is no
// std::exception, which CAF then reports as unhandled).
inline caf::error exit_reason(const std::string& who, std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return caf::make_error(caf::sec::runtime_error, who + ": " + x.what());
  }
}

}  // namespace troupe::actors
