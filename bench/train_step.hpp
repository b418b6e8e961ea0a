// Benchmark of one training step (forward + backward + AdamW) of Troupe's serial engine on
// random tokens, reported as the median over timed steps.
#pragma once

#include <cstdint>
#include <string>

#include "engine/model/gpt_model.hpp"

namespace troupe::bench {

struct train_step_case {
  std::string name;
  engine::gpt_config model;
  int batch = 8;
  int seq_len = 128;
  int warmup = 2;
  int steps = 5;
};

struct train_step_result {
  double tokens_per_s = 0;  // from the median step time
  double step_ms_median = 0;
  double flops_per_s = 0;  // model FLOPs (6N + attention) per second
  std::int64_t parameters = 0;
};

train_step_result measure_troupe_train_step(const train_step_case& c);

}  // namespace troupe::bench
