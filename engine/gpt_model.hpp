// The GPT-2 family as a stage: a contiguous range of transformer blocks, with the token and
// position embedding if it is the first stage and the final layernorm + tied LM head if it is
// the last. A whole model is the one stage that has both ends.
//
// Invariants:
//  - Parameters live in one flat f32 buffer, gradients in another with the same layout; each
//    parameter is a named view (Hugging Face GPT-2 names). Linear weights are [out, in].
//  - GPT-2 initialisation depends only on (seed, parameter name), so every partition of the
//    model into stages starts from the same weights as the serial model.
//  - Activations belong to a micro-batch (gpt_activations), not to the model, so a pipeline
//    stage can hold several micro-batches in flight.
//  - A last stage without the embedding holds its own copy of the tied wte; keeping the two
//    copies equal (summing their gradients) is the pipeline's job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu_ops.hpp"
#include "kernels/tensor.hpp"

namespace troupe::engine {

struct gpt_config {
  int vocab_size = 256;
  int padded_vocab_size = 256;
  int context = 128;
  int layers = 4;
  int heads = 4;
  int width = 256;

  // Throws std::invalid_argument naming the offending field ("model.heads: ...").
  void validate() const;
  // Parameters of the whole model (tied head counted once, padded vocab rows included).
  std::int64_t parameter_count() const;
  // Forward + backward FLOPs per token for a sequence of length T (6N + attention), used for MFU.
  double train_flops_per_token(int T) const;
};

struct stage_range {
  int first_layer = 0;  // blocks [first_layer, last_layer)
  int last_layer = 0;
  bool embedding = true;  // holds wte + wpe, consumes tokens
  bool head = true;       // holds ln_f (+ tied wte), produces the loss

  static stage_range whole(const gpt_config& c) { return {0, c.layers, true, true}; }
};

// Contiguous layer ranges for `stages` pipeline stages, as even as possible (earlier stages
// take the remainder). Throws if stages < 1 or stages > layers.
std::vector<stage_range> partition_layers(const gpt_config& c, int stages);

struct parameter_info {
  std::string name;         // Hugging Face name, e.g. "transformer.h.0.attn.c_attn.weight"
  kernels::shape_t shape;   // Troupe layout ([out, in] for linear weights)
  std::int64_t offset = 0;  // into the flat buffers
  std::int64_t numel = 0;
  bool conv1d = false;  // Hugging Face stores it transposed ([in, out])
  bool decay = false;   // receives weight decay (2-D tensors)
};

// The parameters of a stage, in order, with their offsets into the flat buffers.
std::vector<parameter_info> stage_parameter_layout(const gpt_config& config,
                                                   const stage_range& range);

class gpt_stage {
 public:
  gpt_stage(const gpt_config& config, const stage_range& range);

  const gpt_config& config() const { return config_; }
  const stage_range& range() const { return range_; }
  const std::vector<parameter_info>& parameters() const { return params_; }
  const parameter_info& parameter(const std::string& name) const;  // throws naming it
  std::int64_t parameter_count() const { return param_buf_.numel(); }

  float* params() const { return param_buf_.f32(); }
  float* grads() const { return grad_buf_.f32(); }
  kernels::tensor param(const std::string& name) const;
  kernels::tensor grad(const std::string& name) const;
  void zero_grad() const { grad_buf_.fill_zero(); }

  // GPT-2 init: N(0, 0.02), c_proj weights N(0, 0.02/sqrt(2*layers)), biases 0, layernorm 1/0,
  // padded vocabulary rows 0. Deterministic in (seed, name).
  void init_gpt2(std::uint64_t seed);

 private:
  gpt_config config_;
  stage_range range_;
  std::vector<parameter_info> params_;
  kernels::tensor param_buf_;
  kernels::tensor grad_buf_;
};

// The saved state of one micro-batch's forward pass through a stage, and its gradient scratch.
class gpt_activations {
 public:
  gpt_activations(const gpt_stage& stage, int B, int T);
  int batch() const { return B_; }
  int seq_len() const { return T_; }

 private:
  friend void stage_forward(const gpt_stage&, gpt_activations&, const std::int32_t*, const float*);
  friend kernels::cross_entropy_result stage_loss_backward_start(const gpt_stage&, gpt_activations&,
                                                                 const std::int32_t*, float);
  friend kernels::cross_entropy_result stage_loss(const gpt_stage&, gpt_activations&,
                                                  const std::int32_t*);
  friend void stage_backward(const gpt_stage&, gpt_activations&, const float*, float*);
  friend const float* stage_output(const gpt_activations&);

  struct layer_acts {
    kernels::tensor ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2;
    kernels::tensor ln2, ln2_mean, ln2_rstd, fch, fch_gelu, res3;
  };
  int B_, T_;
  const std::int32_t* tokens_ = nullptr;  // first stage: the micro-batch's tokens (caller keeps)
  const float* input_ = nullptr;          // later stages: the previous stage's output
  kernels::tensor encoded_;               // first stage: embedding output
  std::vector<layer_acts> layers_;
  kernels::tensor lnf_, lnf_mean_, lnf_rstd_, logits_;  // last stage
  // Gradient scratch, reused layer by layer.
  kernels::tensor dres_, dln_, dqkv_, datty_, dfch_, dfch_gelu_, dres_mid_;
  bool logits_are_grads_ = false;
};

// Forward through the stage. First stage: tokens[B*T] (input ignored). Later stages:
// input[B*T*C] (tokens ignored). Pointers must stay valid until backward.
void stage_forward(const gpt_stage& stage, gpt_activations& acts, const std::int32_t* tokens,
                   const float* input);
// Last stage only, after stage_forward: the loss against targets (ignore index -100), no grads.
kernels::cross_entropy_result stage_loss(const gpt_stage& stage, gpt_activations& acts,
                                         const std::int32_t* targets);
// Last stage only, after stage_forward: the loss, and the logits overwritten by
// d(grad_scale * loss)/dlogits, ready for stage_backward.
kernels::cross_entropy_result stage_loss_backward_start(const gpt_stage& stage,
                                                        gpt_activations& acts,
                                                        const std::int32_t* targets,
                                                        float grad_scale);
// Backward through the stage, ACCUMULATING parameter gradients into stage.grads().
// Last stage: doutput is ignored (the loss gradient is used). Other stages: doutput[B*T*C].
// dinput[B*T*C] (not for the first stage; may be nullptr) is OVERWRITTEN with the gradient of
// the stage's input.
void stage_backward(const gpt_stage& stage, gpt_activations& acts, const float* doutput,
                    float* dinput);
// The stage's output hidden state [B,T,C] (not for the last stage) or logits [B,T,Vp].
const float* stage_output(const gpt_activations& acts);

constexpr int ignore_index = -100;

}  // namespace troupe::engine
