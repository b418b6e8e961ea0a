// `troupe bench zero`: ZeRO-1/2/3 against DDP at the same data-parallel width, PP = 1, on one
// recipe (the default one unless told otherwise). For each (dp, zero) it reports:
//  - the step time relative to DDP, from an in-process run (one process, every replica);
//  - the model-state memory per rank that the actors report (metrics `memory`: parameters,
//    gradients, optimizer, buffers) beside the ZeRO formula (engine::zero_formula);
//  - the measured peak resident memory of each rank: the same job run as dp processes
//    (`troupe launch --nproc D -- train ... --report-peak-rss`), each reporting its own peak.
// A configuration that fails (ZeRO-3 before it is implemented, a job that dies) gets its error
// on its row and the benchmark goes on. A benchmark: it prints, it asserts nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/parallel/zero.hpp"
#include "engine/training/metrics.hpp"

namespace troupe::bench {

struct zero_bench_options {
  std::string recipe;             // TOML file; PP is forced to 1, evaluation and weights off
  int steps = 10;                 // per configuration
  int warmup = 2;                 // leading steps left out of the step time
  std::vector<int> dps = {2, 4};  // data-parallel widths
  std::vector<int> levels = {0, 1, 2, 3};  // parallel.zero values; 0 (DDP) is the reference
  std::string self_exe;  // the troupe binary for the multi-process runs ("": no peak RSS)
};

struct zero_case {
  int dp = 1, zero = 0;
  std::string error;        // non-empty: the in-process run failed, the figures below are unset
  double step_ms = 0;       // median over the timed steps
  double tokens_per_s = 0;  // over the timed steps
  double step_vs_ddp = -1;  // step_ms / DDP's step_ms at the same dp; -1 without DDP
  double final_loss = 0;
  engine::memory_report memory;        // the rank with the largest model state, last step
  engine::model_state_bytes formula;   // zero_formula(zero, psi, dp)
  std::vector<std::int64_t> peak_rss;  // bytes, per process rank of the multi-process run
  std::string rss_error;               // non-empty: the multi-process run failed or was skipped
};

struct zero_bench_report {
  std::string recipe;
  int steps = 0, warmup = 0;
  std::vector<std::int64_t> parameters;  // psi per rank (PP = 1: the whole model), by dps order
  std::vector<zero_case> cases;          // dp-major, levels in the order given
};

// The step-time goal of a ZeRO level against DDP (1.1 for ZeRO-1/2, 1.3 for ZeRO-3; 0 for DDP).
double step_time_goal(int zero);

zero_bench_report run_zero_bench(const zero_bench_options& options);
std::string format_zero_report(const zero_bench_report& r);
std::string zero_report_json(const zero_bench_report& r);

}  // namespace troupe::bench
