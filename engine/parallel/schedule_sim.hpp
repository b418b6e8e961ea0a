// The schedule simulator: runs every rank's action list against given F/B/W costs, with
// dependencies between virtual stages, and reports what went wrong and how good the plan is.
//
// Dependencies (k = virtual stage, j = micro-batch):
//   F(k, j) needs F(k-1, j) done (k > 0);  B(k, j) needs F(k, j) and B(k+1, j) (k < last);
//   W(k, j) needs B(k, j).  Each rank runs its list strictly in order, one action at a time.
// A message between ranks arrives comm_latency after its producer finishes (0 by default);
// between chunks on the same rank it is available at once.
#pragma once

#include <string>
#include <vector>

#include "engine/parallel/schedule.hpp"

namespace troupe::engine {

struct action_costs {
  double forward = 1;
  double backward = 1;  // input-gradient part; a full (non-split) B costs backward + weight
  double weight = 1;
  double comm_latency = 0;
};

struct timed_action {
  pipeline_action action;
  double start = 0, end = 0;
};

struct simulation {
  // Structural problems (missing/duplicate actions, B before its F on a rank, W without B,
  // W in a non-split plan, ranks vector of the wrong size, virtual stage on the wrong rank...).
  std::vector<std::string> errors;
  bool deadlock = false;
  std::string deadlock_report;  // which rank waits for which action, when deadlock
  double makespan = 0;
  double bubble_fraction = 0;       // 1 - sum(busy) / (p * makespan)
  std::vector<double> busy;         // per rank
  std::vector<int> peak_in_flight;  // per rank: max micro-batch activations held (F done,
                                    // last backward action of that (virtual stage, mb) not done)
  std::vector<int> peak_link_messages;  // per rank r: max messages sent to rank r but not yet
                                        // consumed by it (activations + gradients)
  std::vector<std::vector<timed_action>> timeline;  // per rank, in execution order
  bool ok() const { return errors.empty() && !deadlock; }
};

// Structural errors are found first; when there are any, no timing is run (makespan 0, no
// timeline). Throws std::invalid_argument for negative costs.
simulation simulate(const pipeline_plan& plan, const action_costs& costs = {});

// Throws std::invalid_argument naming the plan and its first error or the deadlock.
void check_plan(const pipeline_plan& plan);
// An evaluation plan (plan_forward_only's shape): on every rank, each of its chunks' forward of
// each micro-batch exactly once and nothing else. Throws std::invalid_argument naming the rank.
void check_forward_plan(const pipeline_plan& plan);

}  // namespace troupe::engine
