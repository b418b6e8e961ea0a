// The host-side parts of the GPU trainer (gpu_trainer.hpp), built with or without CUDA: dtype
// names and the device memory plan.
#include <stdexcept>

#include "engine/gpu_trainer.hpp"

namespace troupe::engine {

compute_dtype parse_compute_dtype(const std::string& name) {
  if (name == "fp32") return compute_dtype::fp32;
  if (name == "bf16") return compute_dtype::bf16;
  if (name == "fp16") return compute_dtype::fp16;
  throw std::invalid_argument("'" + name + "' is not fp32, bf16 or fp16");
}

const char* compute_dtype_name(compute_dtype dtype) {
  switch (dtype) {
    case compute_dtype::bf16:
      return "bf16";
    case compute_dtype::fp16:
      return "fp16";
    case compute_dtype::fp32:
      break;
  }
  return "fp32";
}

// The arena of gpu_trainer.cpp allocation by allocation (model_impl::allocate and the
// constructor); the GPU suite checks gpu_trainer::device_bytes() against it.
gpu_memory_plan plan_gpu_memory(const gpt_config& config, int B, int T,
                                const gpu_trainer_options& options) {
  const std::int64_t d = options.dtype == compute_dtype::fp32 ? 4 : 2;  // activation bytes
  const auto layout = stage_parameter_layout(config, stage_range::whole(config));
  const std::int64_t P = layout.empty() ? 0 : layout.back().offset + layout.back().numel;
  const std::int64_t N = std::int64_t{B} * T, NC = N * config.width;
  const std::int64_t L = config.layers;
  gpu_memory_plan plan;
  plan.model_state = 4 * P * 4 + (d == 2 ? 2 * P : 0);
  const std::int64_t lse = 4 * std::int64_t{B} * config.heads * T;
  // A block's internals: ln1, qkv, atty, res2, ln2, fch, fch_gelu (15 NC), two layernorms'
  // statistics and the attention's log-sum-exp.
  const std::int64_t internals = 15 * NC * d + 4 * N * 4 + lse;
  const std::int64_t outputs = L * NC * d;                      // res3 of every block
  const std::int64_t rest = 2 * N * 4                           // tokens and targets
                            + NC * d                            // the embedding's output
                            + NC * d + 2 * N * 4                // ln_f and its statistics
                            + N * config.padded_vocab_size * d  // logits (then dlogits)
                            + N * 4                             // per-row losses
                            + lse                               // attention backward's scratch
                            + 16 * NC * d;                      // backward's gradient buffers
  plan.activations_without_recompute = L * internals + outputs + rest;
  plan.activations = (options.recompute && L > 0 ? internals : L * internals) + outputs + rest;
  return plan;
}

}  // namespace troupe::engine
