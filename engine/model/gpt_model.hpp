// The GPT-2 family as a chunk: a contiguous range of transformer blocks, with the token and
// position embedding if it is the first chunk and the final layernorm + tied LM head if it is
// the last. A whole model is the one chunk that has both ends.
//
// Invariants:
//  - Parameters live in one flat f32 buffer, gradients in another with the same layout; each
//    parameter is a named view (Hugging Face GPT-2 names). Linear weights are [out, in].
//  - GPT-2 initialisation depends only on (seed, parameter name), so every partition of the
//    model into chunks starts from the same weights as the serial model.
//  - Activations belong to a micro-batch (gpt_activations), not to the model, so a pipeline
//    chunk can hold several micro-batches in flight.
//  - A last chunk without the embedding holds its own copy of the tied wte; keeping the two
//    copies equal (summing their gradients) is the pipeline's job.
//  - Backward can run whole (chunk_backward) or split (Qi et al. 2024, zero-bubble pipelines):
//    B = chunk_backward_input (input gradient only, no weight-gradient GEMM) and later
//    W = chunk_backward_weight (the weight gradients from what B saved). Both give
//    chunk_backward's numbers bitwise. The forward/backward code is in gpt_model.cpp and
//    gpt_backward.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/chunks/tensor_group.hpp"
#include "engine/model/block_pass.hpp"
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

struct chunk_range {
  int first_layer = 0;  // blocks [first_layer, last_layer)
  int last_layer = 0;
  bool embedding = true;  // holds wte + wpe, consumes tokens
  bool head = true;       // holds ln_f (+ tied wte), produces the loss

  static chunk_range whole(const gpt_config& c) { return {0, c.layers, true, true}; }
};

// Contiguous layer ranges for `chunks` pipeline chunks, as even as possible (earlier chunks
// take the remainder). Throws if chunks < 1 or chunks > layers.
std::vector<chunk_range> partition_layers(const gpt_config& c, int chunks);

// How a tensor shard holds a slice of a whole parameter (engine/chunks/tensor_group.hpp).
enum class tensor_split {
  replicated,  // the whole tensor on every shard (layernorms, wpe, row-parallel biases)
  rows,        // rows [r*n/t, (r+1)*n/t) of dimension 0 (wte, mlp.c_fc)
  columns,     // columns [r*n/t, (r+1)*n/t) of dimension 1 (attn.c_proj, mlp.c_proj weights)
  qkv_rows,    // of each of q, k and v (thirds of dimension 0), rows [r*n/t, (r+1)*n/t)
};

struct parameter_info {
  std::string name;         // Hugging Face name, e.g. "transformer.h.0.attn.c_attn.weight"
  kernels::shape_t shape;   // Troupe layout ([out, in] for linear weights); this shard's slice
  std::int64_t offset = 0;  // into the flat buffers
  std::int64_t numel = 0;
  bool conv1d = false;  // Hugging Face stores it transposed ([in, out])
  bool decay = false;   // receives weight decay (2-D tensors)
  tensor_split split = tensor_split::replicated;
  kernels::shape_t full_shape;  // the whole tensor's shape (== shape without tensor parallelism)
};

// Copies this shard's slice of the whole tensor `whole` (full_shape, Troupe layout) into
// `slice` (shape), or writes `slice` back into its place in `whole`.
void take_shard(const parameter_info& p, tensor_shard shard, const float* whole, float* slice);
void put_shard(const parameter_info& p, tensor_shard shard, const float* slice, float* whole);

// Throws std::invalid_argument naming parallel.tp when the model cannot be split t ways
// (heads and the padded vocabulary must be divisible by t).
void check_tensor_parallel(const gpt_config& config, int t);

// The parameters of a chunk, in order, with their offsets into the flat buffers.
std::vector<parameter_info> chunk_parameter_layout(const gpt_config& config,
                                                   const chunk_range& range,
                                                   tensor_shard shard = {});

class gpt_chunk {
 public:
  // With a split shard, set_tensor_group must name the shard's group before a pass runs.
  gpt_chunk(const gpt_config& config, const chunk_range& range, tensor_shard shard = {});

  const gpt_config& config() const { return config_; }
  const chunk_range& range() const { return range_; }
  const tensor_shard& shard() const { return shard_; }
  void set_tensor_group(std::shared_ptr<tensor_group> group);
  // The shard's group; throws std::logic_error for a split shard without one.
  tensor_group& group() const;
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
  chunk_range range_;
  tensor_shard shard_;
  std::shared_ptr<tensor_group> group_;
  std::vector<parameter_info> params_;
  kernels::tensor param_buf_;
  kernels::tensor grad_buf_;
};

// What one transformer block's forward keeps for its backward ([N,C] unless noted; N = B*T).
struct block_activations {
  kernels::tensor ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2;  // qkv [N,3C], att [B,H,T,T]
  kernels::tensor ln2, ln2_mean, ln2_rstd, fch, fch_gelu, res3;   // fch, fch_gelu [N,4C]
};

// Activation checkpointing ("full": every transformer block is recomputed in backward, as
// Megatron-LM's full recomputation and torchtitan's activation_checkpoint.mode = "full"). The
// inner activations of a block (everything but its output res3) live in one block_scratch,
// shared by every micro-batch of the same shape on a rank; each micro-batch keeps only its
// blocks' outputs. Backward recomputes a block's forward from its saved input just before the
// block's backward (and again before its weight gradients when the backward is split). The
// recomputation runs the same kernels on the same input, so gradients are bitwise those of a
// run without checkpointing. One pass at a time may use a scratch: a block's recomputation and
// its backward run between the same two pass stops.
class block_scratch {
 public:
  block_scratch(const gpt_config& config, int B, int T, int tp = 1);
  int batch() const { return B_; }
  int seq_len() const { return T_; }
  std::int64_t bytes() const;

 private:
  friend class gpt_activations;
  int B_, T_;
  block_activations acts_;  // res3 unset
};

// Bytes a micro-batch's gpt_activations hold once its backward has run (split_backward: the
// output gradients chunk_backward_input saves for chunk_backward_weight included), with or
// without checkpointing; and the bytes of the block_scratch checkpointing adds per rank and
// shape. gpt_activations::bytes() is exactly the first (tested); `troupe train --dry-run`
// plans with both.
// tp: the tensor-parallel degree (one shard's bytes).
std::int64_t activation_bytes(const gpt_config& config, const chunk_range& range, int B, int T,
                              bool recompute, bool split_backward, int tp = 1);
std::int64_t block_scratch_bytes(const gpt_config& config, int B, int T, int tp = 1);

// The saved state of one micro-batch's forward pass through a chunk, and its gradient scratch.
// With a block_scratch, blocks are checkpointed (recomputed in backward).
class gpt_activations {
 public:
  gpt_activations(const gpt_chunk& chunk, int B, int T,
                  std::shared_ptr<block_scratch> recompute = nullptr);
  int batch() const { return B_; }
  int seq_len() const { return T_; }
  bool recomputes() const { return scratch_ != nullptr; }
  // Bytes of the tensors this micro-batch holds itself (not the shared block_scratch).
  std::int64_t bytes() const;

 private:
  friend block_pass chunk_forward_pass(const gpt_chunk&, gpt_activations&, const std::int32_t*,
                                       const float*);
  friend kernels::cross_entropy_result chunk_loss_backward_start(const gpt_chunk&, gpt_activations&,
                                                                 const std::int32_t*, float);
  friend kernels::cross_entropy_result chunk_loss(const gpt_chunk&, gpt_activations&,
                                                  const std::int32_t*);
  friend const float* chunk_output(const gpt_activations&);
  friend struct backward_pass;  // chunk_backward, _input and _weight (gpt_backward.cpp)

  using layer_acts = block_activations;
  // The gradients of one block's linear and layernorm outputs, which its weight gradients need.
  // [N,C] unless noted.
  struct layer_output_grads {
    kernels::tensor mlp_proj;   // of res3 (mlp.c_proj output)
    kernels::tensor fc;         // of mlp.c_fc output, before GELU [N,4C]
    kernels::tensor ln2;        // of ln_2 output
    kernels::tensor attn_proj;  // of res2 (attn.c_proj output)
    kernels::tensor qkv;        // of attn.c_attn output [N,3C]
    kernels::tensor ln1;        // of ln_1 output
  };
  // What chunk_backward_input saves for chunk_backward_weight. Allocated by the first
  // chunk_backward_input only. The head's dlogits stay in logits_.
  struct saved_output_grads {
    std::vector<layer_output_grads> layers;
    kernels::tensor lnf;      // of ln_f output (last chunk)
    kernels::tensor encoded;  // of the embedding output (first chunk)
  };
  int B_, T_;
  std::shared_ptr<block_scratch> scratch_;  // checkpointing: the blocks' inner activations
  const std::int32_t* tokens_ = nullptr;    // first chunk: the micro-batch's tokens (caller keeps)
  const float* input_ = nullptr;            // later chunks: the previous chunk's output
  kernels::tensor encoded_;                 // first chunk: embedding output
  std::vector<layer_acts> layers_;
  kernels::tensor lnf_, lnf_mean_, lnf_rstd_, logits_;  // last chunk
  // Gradient scratch, reused layer by layer. dres_ and dres_next_ take turns holding the
  // gradient of a block's output and of its input.
  kernels::tensor dres_, dres_next_, dln_, dln1_, dqkv_, datty_, dfch_, dfch_gelu_, dres_mid_;
  bool logits_are_grads_ = false;
  saved_output_grads saved_;
  bool saved_allocated_ = false;
  bool weight_grads_pending_ = false;  // chunk_backward_input ran, chunk_backward_weight not yet
};

// The passes over a micro-batch, as block_pass stops: for each piece that reads parameters,
// the blocks (indices into chunk_grad_blocks) it reads, in order. Forward: embedding, layers
// first to last, head; backward (whole or its input half): head, layers last to first. The head
// reads ln_f and the wte it holds (on a chunk with both ends, the embedding block's). Weight
// gradients (W of a split backward) read no parameters, so chunk_backward_weight_pass has no
// stops, unless the blocks are checkpointed (recompute): then it recomputes each layer, last to
// first, and stops before each. recompute changes only the weight stops.
enum class pass_kind { forward, backward, weight };
std::vector<std::vector<int>> pass_stops(const chunk_range& range, pass_kind kind,
                                         bool recompute = false);
inline std::vector<std::vector<int>> pass_stops(const gpt_chunk& chunk, pass_kind kind,
                                                bool recompute = false) {
  return pass_stops(chunk.range(), kind, recompute);
}

// Forward through the chunk. First chunk: tokens[B*T] (input ignored). Later chunks:
// input[B*T*C] (tokens ignored). Pointers must stay valid until backward (until
// chunk_backward_weight when the backward is split). Throws std::logic_error while the
// activations still wait for a chunk_backward_weight (the forward would overwrite what it needs).
void chunk_forward(const gpt_chunk& chunk, gpt_activations& acts, const std::int32_t* tokens,
                   const float* input);
// chunk_forward as a pass that stops before each piece reading parameters (pass_stops).
block_pass chunk_forward_pass(const gpt_chunk& chunk, gpt_activations& acts,
                              const std::int32_t* tokens, const float* input);
// Last chunk only, after chunk_forward: the loss against targets (ignore index -100), no grads.
kernels::cross_entropy_result chunk_loss(const gpt_chunk& chunk, gpt_activations& acts,
                                         const std::int32_t* targets);
// Last chunk only, after chunk_forward: the loss, and the logits overwritten by
// d(grad_scale * loss)/dlogits, ready for chunk_backward.
kernels::cross_entropy_result chunk_loss_backward_start(const gpt_chunk& chunk,
                                                        gpt_activations& acts,
                                                        const std::int32_t* targets,
                                                        float grad_scale);
// Contiguous parameter ranges of a chunk whose gradients become final together in backward.
struct grad_block {
  std::string name;                                           // "head", "h.<layer>", "embedding"
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  // (offset, numel) into flat buffers
};
// In the order backward completes them: "head" (ln_f, plus the tied wte copy on a last chunk
// WITHOUT the embedding), then "h.N" from the last layer to the first, then "embedding" (wte +
// wpe; on a chunk with both embedding and head the wte belongs here because the embedding
// backward is the last to touch it). Every parameter is in exactly one block. A range spans
// consecutive parameters of the layout and so includes the alignment padding between them
// (never written, zero in the gradient buffer); ranges are in increasing offset order.
std::vector<grad_block> chunk_grad_blocks(const gpt_chunk& chunk);
// Called with an index into chunk_grad_blocks(chunk).
using grad_block_fn = std::function<void(int block_index)>;

// Backward through the chunk, ACCUMULATING parameter gradients into chunk.grads().
// Last chunk: doutput is ignored (the loss gradient is used). Other chunks: doutput[B*T*C].
// dinput[B*T*C] (not for the first chunk; may be nullptr) is OVERWRITTEN with the gradient of
// the chunk's input. on_block_done(i) (if set) runs right after block i's gradient for this
// micro-batch is fully accumulated, so a data-parallel reduction can start on it while
// backward continues on earlier layers.
void chunk_backward(const gpt_chunk& chunk, gpt_activations& acts, const float* doutput,
                    float* dinput, const grad_block_fn& on_block_done = {});
// chunk_backward as a pass (pass_stops(chunk, pass_kind::backward)). on_block_done is kept by
// the pass.
block_pass chunk_backward_pass(const gpt_chunk& chunk, gpt_activations& acts, const float* doutput,
                               float* dinput, grad_block_fn on_block_done);
// B of a split backward: dinput exactly as chunk_backward (same doutput and loss rules), and
// the output gradients that the weight gradients need saved in acts (allocated on first use).
// No parameter gradient is touched and no weight-gradient GEMM runs. Throws std::logic_error
// while an earlier B on these activations waits for its W.
void chunk_backward_input(const gpt_chunk& chunk, gpt_activations& acts, const float* doutput,
                          float* dinput);
// chunk_backward_input as a pass (the same stops as chunk_backward_pass).
block_pass chunk_backward_input_pass(const gpt_chunk& chunk, gpt_activations& acts,
                                     const float* doutput, float* dinput);
// W of a split backward: the weight gradients of the micro-batch whose chunk_backward_input
// ran, ACCUMULATED into chunk.grads() (bitwise what chunk_backward adds), calling
// on_block_done as chunk_backward does. Throws std::logic_error if no B waits for its W.
void chunk_backward_weight(const gpt_chunk& chunk, gpt_activations& acts,
                           const grad_block_fn& on_block_done = {});
// chunk_backward_weight as a pass (pass_stops(chunk, pass_kind::weight, acts.recomputes())).
// on_block_done is kept by the pass.
block_pass chunk_backward_weight_pass(const gpt_chunk& chunk, gpt_activations& acts,
                                      grad_block_fn on_block_done);
// Transformer block i of the chunk (0 = its first) forward from x[N,C] into L. With output =
// false it stops after the MLP's GELU: what a recomputation for the block's backward needs.
void block_forward(const gpt_chunk& chunk, int i, const block_activations& L, const float* x, int B,
                   int T, bool output);
// The chunk's output hidden state [B,T,C] (not for the last chunk) or logits [B,T,Vp].
const float* chunk_output(const gpt_activations& acts);

constexpr int ignore_index = -100;

}  // namespace troupe::engine
