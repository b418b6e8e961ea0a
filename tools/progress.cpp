// Progress line and plain log lines. See progress.hpp.
#include "tools/progress.hpp"

#include <unistd.h>

#include <cmath>

namespace troupe::tools {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long s = std::lround(seconds);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lds", s);
  }
  return buf;
}

std::string format_step_line(const engine::step_metrics& m) {
  const double eta = m.elapsed_s / m.step * (m.total_steps - m.step);
  char val[32] = "";
  if (m.val_loss) std::snprintf(val, sizeof val, " | val %.4f", *m.val_loss);
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "step %d/%d | loss %.4f%s | %.0f tok/s | lr %.2e | norm %.3f | ETA %s", m.step,
                m.total_steps, m.loss, val, m.tokens_per_s, m.lr, m.grad_norm,
                format_duration(eta).c_str());
  return buf;
}

progress_printer::progress_printer(std::FILE* out)
    : out_(out), tty_(::isatty(::fileno(out)) != 0) {}

void progress_printer::step(const engine::step_metrics& m) {
  std::string line = format_step_line(m);
  if (tty_) {
    if (m.val_loss) last_val_ = *m.val_loss;
    if (!m.val_loss && last_val_ >= 0) {
      char val[32];
      std::snprintf(val, sizeof val, " (val %.4f)", last_val_);
      line += val;
    }
    std::fprintf(out_, "\r\x1b[K%s", line.c_str());
    line_open_ = true;
    if (m.val_loss || m.step == m.total_steps) {
      std::fputc('\n', out_);
      line_open_ = false;
    }
  } else {
    const int every = m.total_steps <= 50 ? 1 : m.total_steps / 50;
    if (m.step % every == 0 || m.val_loss || m.step == m.total_steps || m.step == 1) {
      std::fprintf(out_, "%s\n", line.c_str());
    }
  }
  std::fflush(out_);
}

void progress_printer::message(const std::string& line) {
  if (line_open_) std::fputc('\n', out_);
  line_open_ = false;
  std::fprintf(out_, "%s\n", line.c_str());
  std::fflush(out_);
}

void progress_printer::finish() {
  if (line_open_) std::fputc('\n', out_);
  line_open_ = false;
  std::fflush(out_);
}

}  // namespace troupe::tools
