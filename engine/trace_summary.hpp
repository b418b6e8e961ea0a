// `troupe trace summary`: per-stage busy and idle time, the measured bubble beside the
// schedule's theoretical one, and the share of data-parallel communication hidden behind compute.
#pragma once

#include <string>
#include <vector>

#include "engine/trace.hpp"

namespace troupe::engine::trace {

struct stage_summary {
  int track = 0;
  std::string name;
  int rank = -1, replica = -1;
  double busy_us = 0;  // compute spans (F, B, W) inside the pipeline windows
  double idle_us = 0;  // pipeline windows minus busy
  double forward_us = 0, backward_us = 0, weight_us = 0;
  int forward_count = 0, backward_count = 0, weight_count = 0;
};

struct summary {
  int steps = 0;               // steps with compute, after skipping
  double window_us = 0;        // sum over steps of the pipeline window (first compute start to
                               // last compute end, over all stage tracks of the step)
  double measured_bubble = 0;  // 1 - sum(busy) / (stage tracks * window)
  double theory_bubble = -1;   // from the metadata
  double dp_comm_us = 0;       // sum of "collective" spans
  double dp_exposed_us = 0;    // sum of stage-track "wait" spans named "dp" (waiting for
                               // reductions after compute finished)
  double dp_hidden_fraction = -1;  // 1 - exposed / comm, clamped to [0, 1]; -1 without DP
  std::vector<stage_summary> stages;
};

// skip_steps: leading steps left out (warm-up).
summary summarize(const trace_file& trace, int skip_steps = 0);
std::string format_summary(const summary& s, const metadata& meta);  // human-readable table
std::string summary_json(const summary& s, const metadata& meta);    // one JSON object

}  // namespace troupe::engine::trace
