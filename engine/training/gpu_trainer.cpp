// The whole GPT-2 model on one CUDA device: one gpu_chunk holding every layer, with one
// micro-batch in flight. See gpu_trainer.hpp. No CUDA here: built with or without it (without,
// gpu_chunk's constructor says why not).
#include "engine/training/gpu_trainer.hpp"

#include <cmath>
#include <stdexcept>

namespace troupe::engine {
namespace {
gpt_chunk initial_weights(const gpt_config& config, std::uint64_t seed) {
  config.validate();
  gpt_chunk host(config, chunk_range::whole(config));
  host.init_gpt2(seed);
  return host;
}
}  // namespace

gpu_trainer::gpu_trainer(const gpt_config& config, int B, int T, compute_dtype dtype,
                         std::uint64_t seed)
    : gpu_trainer(config, B, T, gpu_trainer_options{dtype, false}, seed) {}

gpu_trainer::gpu_trainer(const gpt_config& config, int B, int T, const gpu_trainer_options& options,
                         std::uint64_t seed)
    : gpu_trainer(initial_weights(config, seed), B, T, options) {}

gpu_trainer::gpu_trainer(const gpt_chunk& weights, int B, int T,
                         const gpu_trainer_options& options) {
  const gpt_config& config = weights.config();
  const chunk_range& range = weights.range();
  if (range.first_layer != 0 || range.last_layer != config.layers || !range.embedding ||
      !range.head)
    throw std::invalid_argument("gpu_trainer: the host weights are not a whole model");
  chunk_ = std::make_unique<gpu_chunk>(weights, B, T, options);
}

gpu_trainer::~gpu_trainer() = default;

double gpu_trainer::forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                                     float loss_scale) {
  const double loss = chunk_->forward(0, inputs, targets, loss_scale, true);
  chunk_->backward(0, nullptr);
  return loss;
}

double gpu_trainer::evaluate(const std::int32_t* inputs, const std::int32_t* targets) {
  return chunk_->forward(0, inputs, targets, 1.0f, false);
}

std::vector<float> gpu_trainer::last_logits(const std::int32_t* tokens, int T) {
  return chunk_->last_logits(0, tokens, T);
}

void gpu_trainer::zero_grad() { chunk_->zero_grad(); }

double gpu_trainer::grad_square_sum() { return chunk_->grad_square_sum(); }

double gpu_trainer::update(const optimizer_config& config, int step, int total_steps,
                           double grad_multiplier) {
  const double lr = learning_rate(config, step, total_steps);
  chunk_->adamw(adamw_hparams_at(config, lr), step + 1, static_cast<float>(grad_multiplier));
  return lr;
}

gpu_trainer::step_result gpu_trainer::train_step(const std::int32_t* inputs,
                                                 const std::int32_t* targets,
                                                 const optimizer_config& config, int step,
                                                 int total_steps) {
  step_result r;
  zero_grad();
  r.loss = forward_backward(inputs, targets, 1.0f);
  r.grad_norm = std::sqrt(grad_square_sum());
  r.lr = update(config, step, total_steps, clip_coefficient(r.grad_norm, config.grad_clip));
  return r;
}

std::vector<float> gpu_trainer::parameters() const { return chunk_->parameters(); }
void gpu_trainer::copy_parameters_to(gpt_chunk& host) const { chunk_->copy_parameters_to(host); }
std::vector<float> gpu_trainer::gradients() const { return chunk_->gradients(); }
const std::vector<parameter_info>& gpu_trainer::layout() const { return chunk_->layout(); }
std::int64_t gpu_trainer::device_bytes() const { return chunk_->device_bytes(); }
std::string gpu_trainer::device_name() const { return chunk_->device_name(); }
void gpu_trainer::synchronize() const { chunk_->synchronize(); }

}  // namespace troupe::engine
