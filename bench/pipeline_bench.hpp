// `troupe bench pipeline`: the actor engine's pipeline measured against the schedule theory
// (the simulator, fed the measured F/B/W costs), the share of step time spent in actor dispatch
// (against the serial loop doing the same arithmetic), and how much data-parallel
// communication is hidden behind backward compute.
#pragma once

#include <string>
#include <vector>

namespace troupe::bench {

struct pipeline_bench_options {
  int steps = 4;  // per case; the first is a warm-up and is not counted
  std::string corpus = "/usr/share/games/fortunes";
};

struct bubble_case {
  std::string schedule;
  int p = 4, m = 1, v = 1;
  double measured = 0, theory = 0;  // fractions
  double dispatch_share = 0;        // of stage time in the pipeline window
};

struct pipeline_bench_report {
  int cores = 0;
  std::vector<bubble_case> bubbles;
  double actor_tokens_per_s = 0, serial_tokens_per_s = 0;   // pp = 1: the same arithmetic
  double actor_dispatch_share = 0;                          // pp = 1, from the trace
  double dp_comm_ms = 0, dp_exposed_ms = 0, dp_hidden = 0;  // pp = 1 x dp = 2
};

pipeline_bench_report run_pipeline_bench(const pipeline_bench_options& options);
std::string format_report(const pipeline_bench_report& r);
std::string report_json(const pipeline_bench_report& r);

}  // namespace troupe::bench
