// `troupe trace summary`: per-stage busy and idle time, the measured bubble beside the
// schedule's theoretical one, and the share of data-parallel communication hidden behind compute.
//
// How the figures are measured (docs/trace.md):
//  - Steps are the distinct `step` values of "compute" spans on stage tracks; compute spans
//    without a step are ignored. The leading skip_steps of them are left out.
//  - A step's pipeline window runs from its first compute start to its last compute end over all
//    stage tracks. A stage's busy time is the time covered by its compute spans (overlaps counted
//    once), idle = window - busy. measured bubble = 1 - sum(busy) / (stage tracks * sum(window)).
//  - DP: "collective" spans and stage-track "wait" spans named "dp" count when their `step` is a
//    counted step, or when they have no step and no step was skipped.
//  - Overlap, per collective span name: the counted collective spans' total duration, and the
//    part of each span during which a stage track it serves was computing. A collective track
//    serves the stage tracks of its rank and replica (-1: any); their "compute" spans, of any
//    step, are merged first, so compute overlapping compute is counted once.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/trace/trace.hpp"

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

// Collective spans of one name ("all-reduce", "reduce-scatter", "all-gather") and how much of
// their time the compute of the stages they serve covered.
struct collective_overlap {
  std::string name;
  int spans = 0;
  double total_us = 0;   // sum of the spans' durations
  double hidden_us = 0;  // sum over spans of the time they overlap the served stages' compute
  double hidden_fraction() const { return total_us > 0 ? hidden_us / total_us : -1; }
};

struct summary {
  int steps = 0;                   // steps with compute, after skipping
  int skipped_steps = 0;           // steps with compute left out (at most skip_steps)
  double window_us = 0;            // sum over steps of the pipeline window (first compute start to
                                   // last compute end, over all stage tracks of the step)
  double measured_bubble = 0;      // 1 - sum(busy) / (stage tracks * window); -1 when steps == 0
  double theory_bubble = -1;       // from the metadata
  double dp_comm_us = 0;           // sum of "collective" spans
  double dp_exposed_us = 0;        // per collective track and step, the shortest "wait"/"dp" span
                                   // among the stage tracks it serves (same rank, and replica if
                                   // set): the wait of the replica that finished compute last, i.e.
                                   // communication not hidden behind any replica's compute; summed.
  double dp_wait_us = 0;           // plain sum of stage-track "wait" spans named "dp"
  double dp_hidden_fraction = -1;  // 1 - exposed / comm, clamped to [0, 1]; -1 without DP
  std::vector<collective_overlap> overlap;  // per span name, by the name's first start
  std::vector<stage_summary> stages;        // stage tracks sorted by (replica, rank)
};

// Stage tracks sorted by (replica, rank, id): the rows of the summary and of the timeline.
std::vector<const track*> sorted_stage_tracks(const trace_file& trace);
// step -> its pipeline window [first compute start, last compute end] in µs over stage tracks.
std::map<int, std::pair<double, double>> pipeline_windows(const trace_file& trace);

// skip_steps: leading steps left out (warm-up).
summary summarize(const trace_file& trace, int skip_steps = 0);
// One step only (the step's `step` value, not its position); steps == 0 when it has no compute.
summary summarize_step(const trace_file& trace, int step);
std::string format_summary(const summary& s, const metadata& meta);  // human-readable table
std::string summary_json(const summary& s, const metadata& meta);    // one JSON object

}  // namespace troupe::engine::trace
