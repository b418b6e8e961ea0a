// The whole GPT-2 model trained on one CUDA device (docs/gpu.md): the serial engine's model,
// optimizer and schedule, with every op from kernels/cuda.
//
// Invariants:
//  - The weights start as the host model given (gpt_chunk::init_gpt2(seed), or Hugging Face
//    weights loaded into a gpt_chunk), so a GPU run starts from the CPU model's exact weights;
//    parameters and gradients keep gpt_chunk's flat layout.
//  - Master weights, gradients and AdamW moments are fp32. With compute_dtype bf16 or fp16 the
//    forward and backward run on a 16-bit copy of the weights (refreshed by every AdamW update)
//    and 16-bit activations; layernorm parameters and statistics, GEMM accumulation, softmax and
//    every gradient reduction stay fp32. fp16 needs dynamic loss scaling (its gradients
//    underflow without it): the caller seeds backward with the scale and skips non-finite steps.
//  - Activation checkpointing (recompute): each block keeps only its output; its internals live
//    in one shared scratch and are recomputed, by the same kernels, before the block's backward,
//    so a step's numbers are bitwise those of the run without it.
//  - Gradients accumulate (+=) across forward_backward calls until zero_grad, as on the CPU.
//  - No atomics in any kernel: a step's numbers repeat bitwise on the same GPU.
//  - plan_gpu_memory() gives, without a device, exactly the bytes the trainer allocates.
// It is the whole model as one gpu_chunk (gpu_chunk.hpp) with one micro-batch in flight.
// Without CUDA (the build or the machine), constructing one throws std::runtime_error saying
// why; cuda_training_available() tells beforehand.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/gpt_model.hpp"
#include "engine/training/optimizer.hpp"

namespace troupe::engine {

class gpu_trainer {
 public:
  // A model for batches of B sequences of T tokens (T <= config.context) on device 0, with
  // gpt_chunk::init_gpt2(seed)'s weights.
  gpu_trainer(const gpt_config& config, int B, int T, compute_dtype dtype, std::uint64_t seed);
  gpu_trainer(const gpt_config& config, int B, int T, const gpu_trainer_options& options,
              std::uint64_t seed);
  // The same with the weights of a whole-model host chunk (e.g. loaded from Hugging Face).
  gpu_trainer(const gpt_chunk& weights, int B, int T, const gpu_trainer_options& options);
  ~gpu_trainer();
  gpu_trainer(const gpu_trainer&) = delete;
  gpu_trainer& operator=(const gpu_trainer&) = delete;

  // Forward and backward of one batch (host arrays of B*T tokens); gradients accumulate. The
  // backward is seeded with loss_scale (dynamic loss scaling), so gradients carry it. Returns
  // the mean loss (unscaled) over the counted targets.
  double forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                          float loss_scale = 1.0f);
  // The mean loss of one batch, forward only (validation); gradients are untouched.
  double evaluate(const std::int32_t* inputs, const std::int32_t* targets);
  // A trainer made with B = 1: the logits at the last of `T` tokens (host, T <= its T), fp32,
  // vocab_size values (`troupe sample --device cuda`).
  std::vector<float> last_logits(const std::int32_t* tokens, int T);
  void zero_grad();
  // Sum of squared gradients as held (still carrying the loss scale), in fp64.
  double grad_square_sum();
  // One AdamW update at the schedule's learning rate for 0-based `step`; every gradient is
  // multiplied by grad_multiplier first (1 / loss scale, times the clipping coefficient).
  // Returns the learning rate.
  double update(const optimizer_config& config, int step, int total_steps, double grad_multiplier);

  struct step_result {
    double loss = 0;
    double grad_norm = 0;  // before clipping
    double lr = 0;
  };
  // zero_grad, forward_backward, the global norm, clipping (config.grad_clip) and update: the
  // serial trainer's step.
  step_result train_step(const std::int32_t* inputs, const std::int32_t* targets,
                         const optimizer_config& config, int step, int total_steps);

  // fp32 master weights and gradients, in gpt_chunk's layout (copied to the host).
  std::vector<float> parameters() const;
  // The master weights copied into a whole-model host chunk of the same config (to save them).
  void copy_parameters_to(gpt_chunk& host) const;
  std::vector<float> gradients() const;
  const std::vector<parameter_info>& layout() const;
  std::int64_t device_bytes() const;  // everything this trainer allocated on the device
  std::string device_name() const;
  void synchronize() const;  // waits for everything enqueued

  // The whole model as one chunk with one slot.
  gpu_chunk& chunk() { return *chunk_; }

 private:
  std::unique_ptr<gpu_chunk> chunk_;
};

}  // namespace troupe::engine
