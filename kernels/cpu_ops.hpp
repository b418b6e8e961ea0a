// CPU fp32 forward and backward kernels for the GPT-2 family, llm.c style: raw row-major
// pointers, forward/backward side by side, one op per source file.
//
// Conventions (every kernel keeps them; tests check them):
//  - Backward kernels ACCUMULATE (+=) into every gradient output (input and parameter
//    gradients alike); the caller zeroes buffers. This makes residual branches and gradient
//    accumulation free. A gradient pointer may be nullptr where documented: it is then skipped.
//  - Where the gradient outputs may be nullptr, each part's arithmetic does not depend on the
//    others: an input-only call (parameter gradients nullptr) and a weight-only call (dinp
//    nullptr) together give the full call's results bitwise. Split backward (B/W) relies on it.
//  - Linear weights are stored [out, in] (torch.nn.Linear / llm.c layout). Hugging Face's Conv1D
//    [in, out] layout is transposed at import/export, not here.
//  - GEMMs go through CBLAS (OpenBLAS); the rest is parallelised with OpenMP.
//  - Shapes: B batch, T time, C channels, NH heads (C % NH == 0), N = B*T rows,
//    V real vocabulary, Vp padded vocabulary (row stride of logits and wte, Vp >= V).
#pragma once

#include <cstdint>
#include <span>

namespace troupe::kernels {

// ---- token + position embedding --------------------------------------------------------
// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
void embedding_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                       int B, int T, int C);
// dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:] (each may be nullptr)
void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int B, int T, int C);
// Vocabulary-parallel pieces (a tensor shard holds wte rows [first_row, first_row + rows)):
// out[n,:] = wte[tokens[n] - first_row,:] for a token in the shard's rows, 0 otherwise;
// dwte[tokens[n] - first_row,:] += dout[n,:] for those tokens; out[b,t,:] += wpe[t,:].
// embedding_rows_forward summed over the shards, then add_positions, is embedding_forward bitwise.
void embedding_rows_forward(float* out, const std::int32_t* tokens, const float* wte, int first_row,
                            int rows, std::int64_t N, int C);
void embedding_rows_backward(float* dwte, const float* dout, const std::int32_t* tokens,
                             int first_row, int rows, std::int64_t N, int C);
void add_positions(float* out, const float* wpe, int B, int T, int C);

// ---- layer normalisation (eps = 1e-5, biased variance, as torch.nn.LayerNorm) -------------
// mean[N], rstd[N] are saved for backward. In backward dinp, dweight, dbias may each be nullptr.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C);

// ---- linear: out[N,OC] = inp[N,C] * weight[OC,C]^T (+ bias[OC]) ----------------------------
// bias may be nullptr (no bias). In backward dinp, dweight, dbias may each be nullptr; a
// weight-only call (dinp nullptr) runs no input-gradient GEMM and an input-only call no
// weight-gradient GEMM.
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int C, int OC);
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int C, int OC);

// ---- GELU, tanh approximation (GPT-2's "gelu_new") ----------------------------------------
void gelu_forward(float* out, const float* inp, std::int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n);

// ---- causal multi-head self-attention ------------------------------------------------------
// qkv[B,T,3C] holds q, k, v side by side per row; head h uses channels [h*hs, (h+1)*hs) of each.
// out[B,T,C]; att[B,NH,T,T] receives the softmax probabilities (saved for backward; entries
// above the diagonal are written as 0). Scale 1/sqrt(hs).
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH);

// ---- residual add ---------------------------------------------------------------------------
void residual_forward(float* out, const float* a, const float* b, std::int64_t n);
void residual_backward(float* da, float* db, const float* dout, std::int64_t n);

// ---- softmax + cross-entropy over the first V of Vp columns --------------------------------
// Rows whose target equals ignore_index contribute nothing. Loss = mean over counted rows
// (0 if none). losses[N] (may be nullptr) receives each row's loss (0 for ignored rows).
struct cross_entropy_result {
  double loss_sum = 0;     // sum of counted rows' losses
  std::int64_t count = 0;  // counted rows
  double mean() const { return count > 0 ? loss_sum / static_cast<double>(count) : 0.0; }
};
cross_entropy_result cross_entropy_forward(float* losses, const float* logits,
                                           const std::int32_t* targets, int N, int V, int Vp,
                                           int ignore_index);
// Fused forward + backward. Computes the loss, then OVERWRITES dlogits (which may alias logits)
// with d(grad_scale * mean loss)/dlogits: (softmax - onehot) * grad_scale / count for counted
// rows, 0 for ignored rows and for the padded columns [V, Vp).
cross_entropy_result softmax_cross_entropy_backward(float* dlogits, const float* logits,
                                                    const std::int32_t* targets, int N, int V,
                                                    int Vp, int ignore_index, float grad_scale);

// Vocabulary-parallel cross-entropy (Megatron-LM's): a tensor shard holds the logits columns
// [first, first + cols) of the whole Vp (V of them real vocabulary). Between the steps the
// caller's group reduces: (1) vocab_shard_max -> all-reduce max of row_max[N]; (2)
// vocab_shard_stats -> all-reduce sum of stats[2N] (per row: sum of exp(x - max) over the shard's
// real columns, and the target's logit where the shard holds it, else 0); then the loss
// (vocab_parallel_loss, the same on every shard) and the shard's dlogits (vocab_shard_backward,
// may alias logits): softmax_cross_entropy_backward's formula on the shard's columns.
struct vocab_shard {
  int first = 0, cols = 0, V = 0, Vp = 0;
};
void vocab_shard_max(float* row_max, const float* logits, int N, const vocab_shard& s);
void vocab_shard_stats(double* stats, const float* logits, const std::int32_t* targets,
                       const float* row_max, int N, const vocab_shard& s, int ignore_index);
cross_entropy_result vocab_parallel_loss(const std::int32_t* targets, const float* row_max,
                                         const double* stats, int N, int V, int Vp,
                                         int ignore_index);
void vocab_shard_backward(float* dlogits, const float* logits, const std::int32_t* targets,
                          const float* row_max, const double* stats, int N, const vocab_shard& s,
                          int ignore_index, float grad_scale, std::int64_t count);

// ---- optimizer -------------------------------------------------------------------------------
struct adamw_hparams {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};
// torch.optim.AdamW (decoupled decay, bias correction), step is 1-based. decay=false skips
// the weight decay (biases, layernorm, as in nanoGPT/Megatron param groups).
void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t n,
                  const adamw_hparams& hp, int step, bool decay);

struct gradient_span {
  float* data;
  std::int64_t n;
};
// sqrt(sum of squares) over all spans, accumulated in double.
double global_grad_norm(std::span<const gradient_span> grads);
// torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when coef < 1.
// Returns the norm before clipping. max_norm <= 0 disables clipping (norm still returned).
double clip_grad_norm(std::span<const gradient_span> grads, double max_norm);

}  // namespace troupe::kernels
