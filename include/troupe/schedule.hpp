// User-defined pipeline schedules (docs/schedules.md, docs/embedding.md): a program that embeds
// Troupe registers a schedule under a name, then uses it as any built-in one, from a recipe
// (parallel.schedule = "name") or by swapping to it while a trainer runs (troupe::use_schedule).
//
//   troupe::register_schedule("gpipe_lifo", [](const troupe::schedule_shape& s) {
//     std::vector<std::string> ranks;  // one line of tokens per pipeline rank
//     ...
//     return ranks;
//   });
//
// A schedule is a pure function of the shape: for each pipeline rank, its actions in order, as
// tokens "<virtual stage><F|B|W><micro-batch>" separated by spaces (torchtitan's notation):
// "0F0 0F1 0B1 0B0" is rank 0 running the forwards of micro-batches 0 and 1, then their
// backwards in reverse order. Virtual stage k runs on rank k % ranks; W (a weight gradient
// apart from its B) makes the plan a split-backward one. Every plan a schedule returns is run
// through the schedule simulator before any actor sees it: one that is incomplete, sends to a
// rank that never receives, or could deadlock is refused with the first problem, naming the
// schedule.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace troupe {

struct schedule_shape {
  int ranks = 1;           // pipeline ranks (parallel.pp)
  int micro_batches = 1;   // micro-batches per step (parallel.micro_batches)
  int virtual_stages = 1;  // model chunks per rank (parallel.virtual_stages)
};

// Per pipeline rank, its action tokens in order. Throwing std::invalid_argument says the shape
// is one the schedule cannot serve (the message is shown to the user).
using schedule_function = std::function<std::vector<std::string>(const schedule_shape&)>;

// Registers (or replaces) `name` for every trainer of this process. Throws
// std::invalid_argument for an empty function or the name of a built-in schedule.
void register_schedule(const std::string& name, schedule_function fn);

// The names a recipe may use: the built-in ones (gpipe, 1f1b, interleaved_1f1b, zb_h1) and the
// registered ones, sorted.
std::vector<std::string> schedule_names();

// The plan `name` makes for `shape`, one line per rank ("rank 0: 0F0 0F1 ..."), after the
// simulator's checks; throws std::invalid_argument with the first problem.
std::string format_schedule(const std::string& name, const schedule_shape& shape);

}  // namespace troupe
