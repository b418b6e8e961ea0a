// Pipeline schedules as pure functions. A schedule maps (p ranks, m micro-batches, v model chunks
// per rank) to one ordered action list per rank; nothing here communicates.
//
// Invariants:
//  - Virtual stage k (0 <= k < p*v) holds the k-th contiguous slice of the layers and runs on
//    rank k % p (chunk k / p of that rank). Activations flow k -> k+1, gradients k+1 -> k.
//  - An action is F (forward), B (backward) or W (weight gradient) of one (virtual stage,
//    micro-batch). When a plan has split_backward, B computes only the input gradient and a
//    later W on the same rank computes the weight gradient; otherwise B is the full backward
//    and the plan holds no W.
//  - Tokens print as "<virtual stage><F|B|W><micro-batch>", e.g. "0F1", "2B3", "1W0"
//    (torchtitan's notation).
//  - Every built-in and every registered plan passes check_plan (schedule_sim.hpp).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::engine {

enum class action_kind : unsigned char { forward, backward, weight };

struct pipeline_action {
  action_kind kind = action_kind::forward;
  int virtual_stage = 0;
  int micro_batch = 0;  // 0-based within the pipeline pass
  friend bool operator==(const pipeline_action&, const pipeline_action&) = default;
};

struct schedule_shape {
  int ranks = 1;           // p: pipeline ranks (stage actors)
  int micro_batches = 1;   // m
  int virtual_stages = 1;  // v: model chunks per rank
  int virtual_stage_count() const { return ranks * virtual_stages; }
  int rank_of(int virtual_stage) const { return virtual_stage % ranks; }
  int chunk_of(int virtual_stage) const { return virtual_stage / ranks; }
};

struct pipeline_plan {
  std::string name;
  schedule_shape shape;
  bool split_backward = false;
  std::vector<std::vector<pipeline_action>> ranks;  // ranks[r]: rank r's actions, in order
};

std::string to_token(const pipeline_action& a);
// Throws std::invalid_argument quoting the token.
pipeline_action parse_token(std::string_view token);
// One line per rank: "rank 0: 0F0 0F1 0B0 ...".
std::string format_plan(const pipeline_plan& plan);
// Parses whitespace-separated tokens, one line per rank (an optional "rank N:" prefix is
// ignored; '#' starts a comment; commas count as spaces, as in torchtitan's CSV files; a line
// that is blank after its comment is skipped, "rank N:" alone is an empty rank).
// split_backward is set when any W appears. Does not check.
pipeline_plan parse_plan(std::string_view text, const schedule_shape& shape,
                         const std::string& name);

// Built-in schedules. Each throws std::invalid_argument (naming the constraint) for shapes it
// cannot serve, e.g. interleaved needs v >= 2 and m % p == 0; the others need v == 1.
pipeline_plan plan_gpipe(const schedule_shape& shape);
pipeline_plan plan_1f1b(const schedule_shape& shape);
pipeline_plan plan_interleaved_1f1b(const schedule_shape& shape);
pipeline_plan plan_zb_h1(const schedule_shape& shape);
// Evaluation: every chunk's forward of every micro-batch, no backward; rank r runs F(c*p + r, j)
// for j, then c ascending.
pipeline_plan plan_forward_only(const schedule_shape& shape);

// The registry: "gpipe", "1f1b", "interleaved_1f1b", "zb_h1" are built in.
using schedule_fn = std::function<pipeline_plan(const schedule_shape&)>;
// Registers (or replaces) a user schedule. The function is checked on a few shapes only when
// it is used: make_plan runs check_plan on every plan it returns.
void register_schedule(const std::string& name, schedule_fn fn);
bool has_schedule(const std::string& name);
std::vector<std::string> schedule_names();  // sorted
// Builds and checks the plan; throws std::invalid_argument naming the schedule and the first
// problem (unknown name with the list of known ones, bad shape, or a check_plan failure).
pipeline_plan make_plan(const std::string& name, const schedule_shape& shape);

}  // namespace troupe::engine
