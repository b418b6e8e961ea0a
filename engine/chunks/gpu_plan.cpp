// The host-side parts of the GPU chunks (gpu_chunk.hpp), built with or without CUDA: dtype
// names and the device memory plan.
#include <stdexcept>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::engine {

compute_dtype parse_compute_dtype(const std::string& name) {
  if (name == "fp32") return compute_dtype::fp32;
  if (name == "bf16") return compute_dtype::bf16;
  if (name == "fp16") return compute_dtype::fp16;
  throw std::invalid_argument("'" + name + "' is not fp32, bf16 or fp16");
}

attention_kernel parse_attention_kernel(const std::string& name) {
  if (name == "fused") return attention_kernel::fused;
  if (name == "materialized") return attention_kernel::materialized;
  if (name == "cudnn") return attention_kernel::cudnn;
  throw std::invalid_argument("'" + name + "' is not fused, materialized or cudnn");
}

const char* attention_kernel_name(attention_kernel kernel) {
  switch (kernel) {
    case attention_kernel::materialized:
      return "materialized";
    case attention_kernel::cudnn:
      return "cudnn";
    case attention_kernel::fused:
      break;
  }
  return "fused";
}

gpu_trainer_options gpu_options(const recipe& r) {
  gpu_trainer_options o;
  o.dtype = parse_compute_dtype(r.precision.dtype);
  o.recompute = r.activation_checkpoint.full();
  o.attention = parse_attention_kernel(attention_kernel_for(r));
  o.fast_kernels = r.kernels.fast_paths;
  o.pinned_state_copy = r.checkpoint.pinned_copy && r.checkpoint.every > 0;
  o.paged_parameters = zero_on_device(r) && r.parallel.zero >= 3;
  return o;
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

namespace {
// gpu_chunk.cpp's arena allocation by allocation (model_impl::allocate and the constructor);
// the GPU suite checks gpu_chunk::device_bytes() against it. On a tensor shard (tp > 1) the
// column-parallel pieces (qkv, atty, fch, fch_gelu and their gradients), the attention's
// heads and the logits are the shard's; the head adds the cross-entropy's row maxima and
// statistics.
std::int64_t activation_bytes(const gpt_config& config, const chunk_range& range, int B, int T,
                              std::int64_t d, bool recompute, attention_kernel attention,
                              bool split_backward, int slots, int tp) {
  const std::int64_t N = std::int64_t{B} * T, NC = N * config.width, NCl = NC / tp;
  const std::int64_t layers = range.last_layer - range.first_layer;
  const std::int64_t rows = std::int64_t{B} * (config.heads / tp) * T;  // the shard's query rows
  const bool materialized = attention == attention_kernel::materialized;
  // What a block's attention keeps for backward: each row's log-sum-exp (fused, cudnn), or the
  // [T, T] probabilities (materialized); and its scratch, shared by every block (none without
  // blocks): delta (fused), or q, k, v, dO, dq, dk, dv and dP
  // (kernels::cuda::attention_materialized_scratch_values); cuDNN's workspace is its own, outside
  // the arena (kernels::cuda::attention_cudnn_workspace_bytes).
  const std::int64_t attention_kept = materialized ? rows * T * d : rows * 4;
  const std::int64_t attention_scratch = layers == 0 || attention == attention_kernel::cudnn ? 0
                                         : materialized ? (7 * NCl + rows * T) * d
                                                        : rows * 4;
  // A block's internals: ln1, res2, ln2 (3 NC), the shard's qkv, atty, fch, fch_gelu (12 NC
  // / tp), two layernorms' statistics and what the attention keeps.
  const std::int64_t internals = (3 * NC + 12 * NCl) * d + 4 * N * 4 + attention_kept;
  // What each micro-batch in flight keeps: its input (the embedding's output or the received
  // activation), every block's output, the blocks' internals unless recomputed, and on a head
  // chunk ln_f's statistics and the gradient of its output.
  // A split backward's slot keeps, per layer, its four linears' output gradients (2 NC + 7 NC /
  // tp), and the embedding's output gradient, or (no embedding) the input's gradient apart from
  // the input.
  const std::int64_t deferred = split_backward ? layers * (2 * NC + 7 * NCl) * d + NC * d : 0;
  const std::int64_t per_slot = NC * d + layers * NC * d + (recompute ? 0 : layers * internals) +
                                (range.head ? 2 * N * 4 + NC * d : 0) + deferred;
  const std::int64_t head = N * 4                                        // targets
                            + NC * d                                     // ln_f's output
                            + N * (config.padded_vocab_size / tp) * d    // logits
                            + N * 4                                      // per-row losses
                            + (tp > 1 ? 3 * N * 4 : 0);                  // row maxima, statistics
  const std::int64_t shared = (recompute && layers > 0 ? internals : 0)  // the shared internals
                              + (range.embedding ? N * 4 : 0)            // tokens
                              + (range.head ? head : 0) + attention_scratch +
                              (3 * NC + 12 * NCl) * d;  // backward's gradient buffers
  return slots * per_slot + shared;
}
}  // namespace

gpu_memory_plan plan_gpu_chunk_memory(const gpt_config& config, const chunk_range& range, int B,
                                      int T, const gpu_trainer_options& options, int slots,
                                      int tp) {
  const std::int64_t d = options.dtype == compute_dtype::fp32 ? 4 : 2;  // activation bytes
  const auto layout = chunk_parameter_layout(config, range, {0, tp});
  const std::int64_t P = layout.empty() ? 0 : layout.back().offset + layout.back().numel;
  gpu_memory_plan plan;
  plan.model_state = (options.optimizer_state ? 4 : 2) * P * 4 + (d == 2 ? 2 * P : 0);
  plan.activations_without_recompute = activation_bytes(
      config, range, B, T, d, false, options.attention, options.split_backward, slots, tp);
  plan.activations = activation_bytes(config, range, B, T, d, options.recompute, options.attention,
                                      options.split_backward, slots, tp);
  return plan;
}

gpu_memory_plan plan_gpu_memory(const gpt_config& config, int B, int T,
                                const gpu_trainer_options& options) {
  return plan_gpu_chunk_memory(config, chunk_range::whole(config), B, T, options, 1);
}

}  // namespace troupe::engine
