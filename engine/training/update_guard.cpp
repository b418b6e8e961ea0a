#include "engine/training/update_guard.hpp"

#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

namespace troupe::engine {
namespace {

std::string number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", x);
  return text;
}

}  // namespace

outlier_detector::outlier_detector(int window)
    : values_(static_cast<std::size_t>(window > 0 ? window : 1)) {}

double outlier_detector::update(double x) {
  double z = std::numeric_limits<double>::quiet_NaN();
  if (count_ == values_.size()) {
    double sum = 0;
    for (double v : values_) sum += v;
    const double mean = sum / double(values_.size());
    double squares = 0;
    for (double v : values_) squares += (v - mean) * (v - mean);
    const double deviation = std::sqrt(squares / double(values_.size()));
    if (deviation > 0) z = (x - mean) / deviation;
  }
  values_[next_] = x;
  next_ = (next_ + 1) % values_.size();
  if (count_ < values_.size()) ++count_;
  return z;
}

void outlier_detector::restore(const state& s) {
  if (s.values.size() != values_.size() || s.next >= values_.size() || s.count > values_.size())
    throw std::invalid_argument("a guard window of " + std::to_string(s.values.size()) +
                                " steps where the recipe has " + std::to_string(values_.size()));
  values_ = s.values;
  next_ = s.next;
  count_ = s.count;
}

void update_guard::restore(const state& s) {
  loss_.restore(s.loss);
  grad_norm_.restore(s.grad_norm);
  scale_ = s.scale;
  good_steps_ = s.good_steps;
  skips_in_a_row_ = s.skips_in_a_row;
}

update_guard::update_guard(const guard_config& guard, const loss_scale_config& scaling)
    : guard_(guard),
      scaling_(scaling),
      loss_(guard.window),
      grad_norm_(guard.window),
      scale_(scaling.dynamic ? scaling.init_scale : 1.0) {}

guard_decision update_guard::decide(double loss, double grad_norm) {
  guard_decision d;
  d.loss_scale = scale_;
  d.loss_zscore = d.grad_norm_zscore = std::numeric_limits<double>::quiet_NaN();
  const bool finite = std::isfinite(loss) && std::isfinite(grad_norm);
  if (!finite) {
    d.apply = false;
    d.skipped = !std::isfinite(grad_norm) ? "non-finite gradient norm (" + number(grad_norm) + ")"
                                          : "non-finite loss (" + number(loss) + ")";
  } else {
    // Both windows see every finite step, skipped or not (llm.c), so they stay aligned.
    d.loss_zscore = loss_.update(loss);
    d.grad_norm_zscore = grad_norm_.update(grad_norm);
    if (guard_.loss_zscore > 0 && d.loss_zscore > guard_.loss_zscore) {
      d.apply = false;
      d.skipped = "loss spike: z-score " + number(d.loss_zscore) + " > " +
                  number(guard_.loss_zscore) + " (loss " + number(loss) + ")";
    } else if (guard_.grad_norm_zscore > 0 && d.grad_norm_zscore > guard_.grad_norm_zscore) {
      d.apply = false;
      d.skipped = "gradient-norm spike: z-score " + number(d.grad_norm_zscore) + " > " +
                  number(guard_.grad_norm_zscore) + " (norm " + number(grad_norm) + ")";
    }
  }
  if (scaling_.dynamic) {
    if (!finite) {
      scale_ *= scaling_.backoff_factor;
      good_steps_ = 0;
    } else if (++good_steps_ >= scaling_.growth_interval) {
      scale_ *= scaling_.growth_factor;
      good_steps_ = 0;
    }
  }
  skips_in_a_row_ = d.apply ? 0 : skips_in_a_row_ + 1;
  d.skips_in_a_row = skips_in_a_row_;
  d.stop = guard_.max_skips > 0 && skips_in_a_row_ >= guard_.max_skips;
  return d;
}

std::string stop_message(int step, const guard_decision& d) {
  return "step " + std::to_string(step) + ": " + std::to_string(d.skips_in_a_row) +
         " updates skipped in a row (guard.max_skips; last: " + d.skipped + "); stopping";
}

}  // namespace troupe::engine
