// `troupe bench checkpoint`: what checkpoints cost. For each model shape (the recipe's, and
// GPT-2 small's: 12 layers, width 768, 50257 tokens) it runs the same steps without checkpoints
// and with a checkpoint every `every` steps, in one process on the recipe's pipeline, alternating
// the two `rounds` times (so that a drift of the machine's speed falls on both alike), and
// reports the median wall time of a step of each (a checkpoint's collection holds training up;
// its writing runs beside the next steps and competes for the cores), the overhead, the
// checkpoint's size, and the time to resume: from the start of a resumed run to its first step,
// beside a fresh run's. A benchmark: it prints, it asserts nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe::bench {

struct checkpoint_bench_options {
  std::string recipe;  // TOML file; evaluation and the weights file off
  int steps = 12;      // per run of the recipe's shape
  int gpt2_steps = 4;  // per run of the GPT-2 small shape (0: not run)
  int warmup = 2;      // leading steps of each run left out of the step time
  int rounds = 2;      // runs of each kind, alternating
  int every = 1;       // checkpoint.every of the runs with checkpoints
};

struct checkpoint_case {
  std::string shape;
  std::int64_t parameters = 0;
  int steps = 0;
  std::string error;  // non-empty: a run failed; the figures are unset
  int rounds = 0;
  int every = 1;
  // Wall time of a step without checkpoints and with one every `every` steps: the median with
  // one after every step, else the mean (a median would leave the checkpoints' steps out).
  double step_ms_without = 0;
  double step_ms_every = 0;
  double overhead = 0;  // step_ms_every / step_ms_without - 1
  std::int64_t checkpoint_bytes = 0;
  double first_step_fresh_s = 0;   // start of the run to its first step, fresh
  double first_step_resume_s = 0;  // the same, resuming from the last checkpoint
};

std::vector<checkpoint_case> run_checkpoint_bench(const checkpoint_bench_options& options);
std::string format_checkpoint_report(const std::vector<checkpoint_case>& cases);
std::string checkpoint_report_json(const std::vector<checkpoint_case>& cases);

// `troupe bench checkpoint --device cuda`: GPT-2 small (T = 1024, bf16, cuDNN attention, the
// fast kernels) on one GPU in one process (the recipe's data, optimizer and checkpoint format;
// its pipeline and batch replaced), run without checkpoints and with one every `every` steps,
// the state copied to the host through pinned memory (checkpoint.pinned_copy, the default) and
// through pageable memory. For each run: the median step, the overhead (mean step against the
// run without), and each checkpoint's stall: the wall time of the `window` steps after it beyond
// the run's median step (the capture, the update's wait for the copy and a checkpoint that waits
// for the previous one's commit all fall there).
struct checkpoint_device_options {
  std::string recipe;
  std::string data;  // data.train instead of the recipe's ("": the recipe's)
  int batch = 16;
  std::vector<int> every = {10, 100};
  int checkpoints = 4;  // per run at the smallest `every`; at least 2 at each
  int warmup = 3;       // leading steps left out
  int window = 3;
};
struct checkpoint_device_run {
  std::string copy;  // "pinned" or "pageable"; "" for the run without checkpoints
  int every = 0;
  int steps = 0;
  std::string error;
  double step_ms_median = 0;
  double step_ms_mean = 0;
  double overhead = 0;           // against the run without, over the same steps
  std::vector<double> stall_ms;  // per checkpoint
  double stall_ms_median = 0;    // in ms, and in steps of the run without:
  double stall_steps = 0;        //   the goal is at most 1
  std::int64_t checkpoint_bytes = 0;
};
std::vector<checkpoint_device_run> run_checkpoint_device_bench(
    const checkpoint_device_options& options);
std::string format_checkpoint_device_report(const std::vector<checkpoint_device_run>& runs);
std::string checkpoint_device_report_json(const std::vector<checkpoint_device_run>& runs);

}  // namespace troupe::bench
