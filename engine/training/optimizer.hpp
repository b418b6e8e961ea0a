// AdamW over a chunk's flat parameter buffer, with global gradient-norm clipping and the
// learning-rate schedule (linear warmup, then cosine/linear decay to min_lr, or constant).
// Invariants: the moment buffers share the chunk's parameter layout (so a ZeRO shard is a
// slice of them); weight decay applies to parameters whose info says decay (2-D tensors).
#pragma once

#include <string>

#include "engine/model/gpt_model.hpp"

namespace troupe::engine {

struct optimizer_config {
  float lr = 1e-3f;
  float min_lr = 1e-4f;
  int warmup_steps = 20;
  std::string decay = "cosine";  // cosine | linear | constant
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  float grad_clip = 1.0f;  // 0: off
};

// The learning rate of 0-based step `step` out of `total_steps` (docs/recipe.md).
double learning_rate(const optimizer_config& config, int step, int total_steps);

// The AdamW kernel's hyperparameters of `config` at learning rate lr.
kernels::adamw_hparams adamw_hparams_at(const optimizer_config& config, double lr);
// Sum of squared gradients of a chunk, in double. A last chunk without the embedding holds a
// copy of the tied wte; pass count_tied_copy = false so the pipeline counts wte once.
double grad_square_sum(const gpt_chunk& chunk, bool count_tied_copy = true);

// torch.nn.utils.clip_grad_norm_'s factor for a global norm: max_norm / (norm + 1e-6) when
// that is < 1, else 1 (and 1 when max_norm <= 0).
double clip_coefficient(double grad_norm, double max_norm);

// g[i] = float(g[i] * unscale) * float(clip_coef) over n gradients: first the loss scale's
// unscaling (in double, so a scale outside float's normal range loses nothing; exact for the
// power-of-two scales of dynamic loss scaling), then clipping as clip_grad_norm_ does (a float
// factor, only when < 1). Nothing is touched when both are 1.
void unscale_and_clip(float* g, std::int64_t n, double unscale, double clip_coef);

class adamw_optimizer {
 public:
  explicit adamw_optimizer(const gpt_chunk& chunk);

  struct step_result {
    double grad_norm = 0;  // before clipping
    double lr = 0;
  };
  // Clips the chunk's gradients (global norm over the chunk) and applies one AdamW update.
  // step is 0-based; the bias correction uses step + 1.
  step_result step(gpt_chunk& chunk, const optimizer_config& config, int step, int total_steps);

  // The same, when the gradient norm is global over several chunks (a pipeline): the caller
  // computed grad_norm (of the unscaled gradients) from every chunk's grad_square_sum; this
  // unscales the gradients (1 / the loss scale they carry), clips them with it and updates.
  step_result step_with_norm(gpt_chunk& chunk, const optimizer_config& config, int step,
                             int total_steps, double grad_norm, double unscale = 1);

  const kernels::tensor& first_moment() const { return m_; }
  const kernels::tensor& second_moment() const { return v_; }
  // A checkpoint's moments, in the chunk's flat layout (parameter_count floats each).
  void load_moments(const float* m, const float* v);

 private:
  void update(gpt_chunk& chunk, const optimizer_config& config, int step, int total_steps,
              step_result& r);
  kernels::tensor m_, v_;
};

}  // namespace troupe::engine
