// AdamW step and learning-rate schedule. See optimizer.hpp.
#include "engine/training/optimizer.hpp"

#include <cstring>

#include <cmath>
#include <numbers>

namespace troupe::engine {

double learning_rate(const optimizer_config& c, int step, int total_steps) {
  if (step < c.warmup_steps) return double(c.lr) * (step + 1) / c.warmup_steps;
  if (c.decay == "constant") return c.lr;
  const double ratio = double(step - c.warmup_steps) / std::max(1, total_steps - c.warmup_steps);
  if (c.decay == "linear") return c.lr + ratio * (double(c.min_lr) - c.lr);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
  return c.min_lr + coeff * (double(c.lr) - c.min_lr);
}

adamw_optimizer::adamw_optimizer(const gpt_chunk& chunk)
    : m_(kernels::tensor::zeros({chunk.parameter_count()})),
      v_(kernels::tensor::zeros({chunk.parameter_count()})) {}

void adamw_optimizer::load_moments(const float* m, const float* v) {
  std::memcpy(m_.data(), m, m_.nbytes());
  std::memcpy(v_.data(), v, v_.nbytes());
}

double grad_square_sum(const gpt_chunk& chunk, bool count_tied_copy) {
  double sum = 0;
  const bool tied_copy = chunk.range().head && !chunk.range().embedding;
  for (const auto& p : chunk.parameters()) {
    if (tied_copy && !count_tied_copy && p.name == "transformer.wte.weight") continue;
    if (chunk.shard().rank > 0 && p.split == tensor_split::replicated) continue;  // shard 0's
    const kernels::gradient_span g{chunk.grads() + p.offset, p.numel};
    const double n = kernels::global_grad_norm({&g, 1});
    sum += n * n;
  }
  return sum;
}

kernels::adamw_hparams adamw_hparams_at(const optimizer_config& c, double lr) {
  kernels::adamw_hparams hp;
  hp.lr = static_cast<float>(lr);
  hp.beta1 = c.beta1;
  hp.beta2 = c.beta2;
  hp.eps = c.eps;
  hp.weight_decay = c.weight_decay;
  return hp;
}

double clip_coefficient(double grad_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coef = max_norm / (grad_norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

void unscale_and_clip(float* g, std::int64_t n, double unscale, double clip_coef) {
  const float f = clip_coef < 1.0 ? static_cast<float>(clip_coef) : 1.0f;
  if (unscale == 1.0) {
    if (f == 1.0f) return;
    for (std::int64_t i = 0; i < n; ++i) g[i] *= f;
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(double(g[i]) * unscale) * f;
}

adamw_optimizer::step_result adamw_optimizer::step(gpt_chunk& chunk, const optimizer_config& c,
                                                   int step, int total_steps) {
  step_result r;
  const kernels::gradient_span all{chunk.grads(), chunk.parameter_count()};
  r.grad_norm = kernels::clip_grad_norm({&all, 1}, c.grad_clip);
  update(chunk, c, step, total_steps, r);
  return r;
}

adamw_optimizer::step_result adamw_optimizer::step_with_norm(gpt_chunk& chunk,
                                                             const optimizer_config& c, int step,
                                                             int total_steps, double grad_norm,
                                                             double unscale) {
  step_result r;
  r.grad_norm = grad_norm;
  unscale_and_clip(chunk.grads(), chunk.parameter_count(), unscale,
                   clip_coefficient(grad_norm, c.grad_clip));
  update(chunk, c, step, total_steps, r);
  return r;
}

void adamw_optimizer::update(gpt_chunk& chunk, const optimizer_config& c, int step, int total_steps,
                             step_result& r) {
  r.lr = learning_rate(c, step, total_steps);
  const kernels::adamw_hparams hp = adamw_hparams_at(c, r.lr);
  for (const auto& p : chunk.parameters()) {
    kernels::adamw_update(chunk.params() + p.offset, chunk.grads() + p.offset, m_.f32() + p.offset,
                          v_.f32() + p.offset, p.numel, hp, step + 1, p.decay);
  }
}

}  // namespace troupe::engine
