// Whether an optimizer step applies its update. Three rules, in this order:
// - a non-finite loss or gradient norm skips the update (the gradients overflowed: with fp16
//   dynamic loss scaling the scale was too high; otherwise the step is lost, not the job);
// - a loss or gradient-norm spike skips it: the value's z-score against a rolling window of the
//   previous steps' values (llm.c's outlier detector: 128 steps, and only once the window is
//   full) above the configured threshold;
// - dynamic loss scaling (torch.amp.GradScaler's rule): a non-finite step multiplies the scale by
//   backoff_factor; growth_interval finite steps in a row multiply it by growth_factor.
// After max_skips skipped updates in a row the decision says stop. Pure logic without kernels or
// actors: the CPU trainer and the coordinator actor share it, so CI tests it without a GPU.
#pragma once

#include <string>
#include <vector>

namespace troupe::engine {

struct guard_config {
  double loss_zscore = 0;       // skip when the loss's z-score exceeds this; 0: off
  double grad_norm_zscore = 0;  // skip when the gradient norm's z-score exceeds this; 0: off
  int window = 128;             // steps in the rolling mean and standard deviation
  int max_skips = 16;           // stop after this many skipped updates in a row; 0: never
};

struct loss_scale_config {
  bool dynamic = false;       // scale the loss before backward (fp16 needs it)
  double init_scale = 65536;  // 2^16, GradScaler's default
  double growth_factor = 2;   // powers of two keep scaling exact in binary floating point
  double backoff_factor = 0.5;
  int growth_interval = 2000;  // finite steps in a row before the scale grows
};

// The z-score of a value against the `window` values before it (population standard deviation,
// as llm.c). NaN until the window is full, and when the window's deviation is 0.
class outlier_detector {
 public:
  explicit outlier_detector(int window);
  // Returns x's z-score against the window, then adds x to it (so a spike enters the window).
  double update(double x);

  // What a checkpoint keeps: the window's values in slot order, the next slot, the count.
  struct state {
    std::vector<double> values;
    std::size_t next = 0, count = 0;
  };
  state save() const { return {values_, next_, count_}; }
  // Throws std::invalid_argument when the state's window has another size.
  void restore(const state& s);

 private:
  std::vector<double> values_;
  std::size_t next_ = 0, count_ = 0;
};

struct guard_decision {
  bool apply = true;
  std::string skipped;                           // why the update was skipped; empty when applied
  double loss_zscore = 0, grad_norm_zscore = 0;  // NaN until the windows are full
  double loss_scale = 1;  // the scale this step's gradients carried (1 without scaling)
  int skips_in_a_row = 0;
  bool stop = false;  // max_skips updates in a row were skipped
};

// The one-line reason a run stops when decision.stop: "step N: K updates skipped in a row
// (guard.max_skips; last: WHY); stopping". step is 1-based.
std::string stop_message(int step, const guard_decision& decision);

class update_guard {
 public:
  update_guard(const guard_config& guard, const loss_scale_config& scaling);
  // The factor to seed this step's backward with (the loss scale; 1 without dynamic scaling).
  double loss_scale() const { return scale_; }
  // loss: the step's mean loss; grad_norm: the global norm of the unscaled gradients (the
  // scaled norm divided by loss_scale()). Moves the scale for the next step.
  guard_decision decide(double loss, double grad_norm);

  // Everything a later decision depends on, for checkpoints: restoring it makes the guard decide
  // the following steps as the saved one would have.
  struct state {
    double scale = 1;
    int good_steps = 0, skips_in_a_row = 0;
    outlier_detector::state loss, grad_norm;
  };
  state save() const {
    return {scale_, good_steps_, skips_in_a_row_, loss_.save(), grad_norm_.save()};
  }
  void restore(const state& s);

 private:
  guard_config guard_;
  loss_scale_config scaling_;
  outlier_detector loss_, grad_norm_;
  double scale_ = 1;
  int good_steps_ = 0, skips_in_a_row_ = 0;
};

}  // namespace troupe::engine
