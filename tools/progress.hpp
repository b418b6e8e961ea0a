// The console view of a training run: a live progress line on a terminal (rewritten in place),
// plain lines otherwise (logs, CI). Formatting only; the numbers come from engine metrics.
#pragma once

#include <cstdio>
#include <string>

#include "engine/training/metrics.hpp"

namespace troupe::tools {

std::string format_duration(double seconds);  // "1h02m", "3m07s", "42s"
std::string format_step_line(const engine::step_metrics& m);

class progress_printer {
 public:
  explicit progress_printer(std::FILE* out);
  void step(const engine::step_metrics& m);
  void message(const std::string& line);
  void finish();

 private:
  std::FILE* out_;
  bool tty_;
  bool line_open_ = false;
  double last_val_ = -1;
};

}  // namespace troupe::tools
