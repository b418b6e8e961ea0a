// The foundation ops on the GPU (docs/gpu.md): the same semantics as kernels/cpu_ops.hpp
// (shapes, accumulate conventions, ignore index), on device pointers, enqueued on a stream.
// T is float (fp32), __nv_bfloat16 (bf16) or __half (fp16): the activations and working weights;
// statistics, reductions, master weights and optimizer state are fp32, norms and loss sums fp64.
//
// Invariants:
//  - Every reduction has a fixed order (no atomics), so a kernel's result is bitwise the same
//    from run to run on the same GPU.
//  - Backward kernels ACCUMULATE (+=) into their outputs, as on the CPU; a nullptr output is
//    not computed.
//  - Errors (a failed launch, a cuBLASLt status) throw cuda_error naming the call.
// Compiled only when nvcc exists (kernels/meson.build); this header needs the CUDA include
// directory, not nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu_ops.hpp"

namespace troupe::kernels::cuda {

struct cuda_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using bf16 = __nv_bfloat16;
using fp16 = __half;

struct gemm_cache;   // cuBLASLt descriptors and algorithms by GEMM shape (cuda_ops.cu)
struct cudnn_state;  // cuDNN's handle, attention plans and workspace (attention_cudnn.cu)
struct op_timer;     // CUDA events around ops, while timing is on (cuda_ops.cu)
namespace detail {
class timed_op;  // cuda_common.cuh
}

// The op families whose device time a context can measure (`troupe bench train-step
// --breakdown`). Each public op below that takes a context belongs to one.
enum class op_family {
  attention_forward,
  attention_backward,
  linear_forward,   // GEMMs (and their bias epilogue)
  linear_backward,  // GEMMs and the bias gradient's column sums
  layernorm_forward,
  layernorm_backward,
  elementwise,  // GELU, residual, conversions
  cross_entropy,
  embedding,
  optimizer,  // AdamW and the gradient norm
};
constexpr int kOpFamilies = 10;
const char* op_family_name(op_family family);
struct op_family_time {
  op_family family;
  // Stream time between events recorded as the op starts and ends, summed over its calls: its
  // kernels, plus any time the stream sat idle inside the bracket while the host worked (a
  // GEMM shape's first plan, a loss sum's copy back) — warm up before timing.
  double ms = 0;
  int calls = 0;
};

// A stream, a cuBLASLt handle, its workspace and a cache of GEMM plans on the current device.
// One per thread.
class context {
 public:
  context();
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  cudaStream_t stream() const { return stream_; }
  void synchronize() const;

  // While on, every op on this context is bracketed by two CUDA events (a few microseconds of
  // host time each), and take_timings() sums their device time per op family. Off by default.
  void set_timing(bool on);

  // The newer kernels where they apply: 128-bit layernorm forward and backward, and
  // adamw_update_flat's single launch (recipe key kernels.fast_paths). Off by default.
  void set_fast_kernels(bool on) { fast_kernels_ = on; }
  bool fast_kernels() const { return fast_kernels_; }
  // The families' times since timing was turned on or last taken (those with calls), after
  // waiting for the stream; starts the next period (its event pairs are reused: take them
  // every step or so, or they grow with every op).
  std::vector<op_family_time> take_timings();
  // How many GEMM shapes asked for a fused epilogue (GELU, bias gradient) that cuBLASLt has no
  // algorithm for, and so run the unfused ops instead.
  int unfused_epilogue_shapes() const;

 private:
  friend struct gemm_access;
  friend struct cudnn_access;
  friend class detail::timed_op;
  void release() noexcept;
  op_timer* timer_ = nullptr;
  bool fast_kernels_ = false;
  cudaStream_t stream_ = nullptr;
  void* lt_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  gemm_cache* gemms_ = nullptr;
  // Made on the first cuDNN attention call (attention_cudnn.cu): contexts that never use cuDNN
  // never load it.
  mutable cudnn_state* cudnn_ = nullptr;
};

// ---- layer normalisation (eps 1e-5, biased variance); fp32 weight, bias, mean[N], rstd[N] -----
template <class T>
void layernorm_forward(const context& ctx, T* out, float* mean, float* rstd, const T* inp,
                       const float* weight, const float* bias, int N, int C);
template <class T>
void layernorm_backward(const context& ctx, T* dinp, float* dweight, float* dbias, const T* dout,
                        const T* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C);

// ---- linear through cuBLASLt: out[N,OC] = inp[N,C] weight[OC,C]^T (+ bias[OC]) ----------------
// fp32 accumulation for both types; bias through the GEMM's epilogue. Backward accumulates
// dinp, dweight (into fp32 for bf16: master-weight gradients) and dbias.
template <class T>
void linear_forward(const context& ctx, T* out, const T* inp, const T* weight, const T* bias, int N,
                    int C, int OC);
template <class T>
void linear_backward(const context& ctx, T* dinp, float* dweight, float* dbias, const T* dout,
                     const T* inp, const T* weight, int N, int C, int OC);

// The MLP's first linear and its GELU: out[N,OC] = gelu(inp weight^T + bias), pre[N,OC] = inp
// weight^T + bias (the GELU's input, kept for backward). With the fast kernels one GEMM
// (cuBLASLt's GELU_AUX_BIAS epilogue) where cuBLASLt has an algorithm for the shape; else
// linear_forward into pre, then gelu_forward.
template <class T>
void linear_gelu_forward(const context& ctx, T* out, T* pre, const T* inp, const T* weight,
                         const T* bias, int N, int C, int OC);
// The backward of a linear whose input was act = gelu(pre): dpre[N,C] = (dout[N,OC] weight) *
// gelu'(pre), OVERWRITTEN; dweight and dbias accumulate as linear_backward's (from act). With the
// fast kernels dpre is one GEMM (cuBLASLt's DGELU epilogue) where cuBLASLt has an algorithm for
// the shape; else the GEMM into dact (scratch [N,C], overwritten), then the GELU's gradient.
template <class T>
void linear_backward_dgelu(const context& ctx, T* dpre, T* dact, float* dweight, float* dbias,
                           const T* dout, const T* act, const T* pre, const T* weight, int N, int C,
                           int OC);

// ---- GELU (tanh approximation) and residual ----------------------------------------------------
template <class T>
void gelu_forward(const context& ctx, T* out, const T* inp, std::int64_t n);
template <class T>
void gelu_backward(const context& ctx, T* dinp, const T* inp, const T* dout, std::int64_t n);
template <class T>
void residual_forward(const context& ctx, T* out, const T* a, const T* b, std::int64_t n);
// A residual add and the layernorm of its sum: res[N,C] = a + b (may alias a or b), then out =
// layernorm(res) with mean and rstd as layernorm_forward's. With the fast kernels one pass where
// the row fits the 128-bit kernel (the sum read back from registers, not memory); else the two
// ops. Bitwise residual_forward then layernorm_forward either way.
template <class T>
void residual_layernorm_forward(const context& ctx, T* res, T* out, float* mean, float* rstd,
                                const T* a, const T* b, const float* weight, const float* bias,
                                int N, int C);

// ---- fused softmax + cross-entropy over the first V of Vp columns ------------------------------
// losses[N] (fp32) receives each row's loss (0 for ignored rows); dlogits (may alias logits) is
// OVERWRITTEN with (softmax - onehot) * grad_scale / count, 0 for ignored rows and padded columns.
// count (the rows whose target is not ignore_index) is passed in: the caller has the targets.
// Returns the sum of the losses in fp64, summed on the host in row order.
template <class T>
cross_entropy_result softmax_cross_entropy_backward(const context& ctx, T* dlogits, const T* logits,
                                                    const std::int32_t* targets, float* losses,
                                                    int N, int V, int Vp, int ignore_index,
                                                    std::int64_t count, float grad_scale);

// ---- token + position embedding ---------------------------------------------------------------
// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:] (tokens on the device).
template <class T>
void embedding_forward(const context& ctx, T* out, const std::int32_t* tokens, const T* wte,
                       const T* wpe, int B, int T_, int C);

// The positions of a batch grouped by token (stable order), built on the host from the host copy
// of the tokens and uploaded, so the embedding backward sums each token's rows in a fixed order
// without atomics.
class token_groups {
 public:
  token_groups() = default;
  ~token_groups();
  token_groups(const token_groups&) = delete;
  token_groups& operator=(const token_groups&) = delete;
  // Groups host_tokens[0, N) and uploads the groups on ctx's stream. With rows >= 0 (a tensor
  // shard's rows [first_row, first_row + rows) of wte) only the tokens in that range are
  // grouped, each as token - first_row; the others have no group.
  void build(const context& ctx, const std::int32_t* host_tokens, int N, int first_row = 0,
             int rows = -1);
  int groups() const { return groups_; }
  const std::int32_t* device() const { return device_; }  // [tokens G][offsets G+1][positions N]
  int rows() const { return rows_; }

 private:
  std::vector<std::int32_t> host_;  // what device_ holds, kept for the asynchronous upload
  std::int32_t* device_ = nullptr;
  std::size_t capacity_ = 0;
  int groups_ = 0, rows_ = 0;
};
// dwte[tokens[n],:] += dout[n,:] (grouped: one block per token, positions in order) and
// dwpe[t,:] += sum over b of dout[b,t,:]; either may be nullptr. fp32 gradients.
template <class T>
void embedding_backward(const context& ctx, float* dwte, float* dwpe, const T* dout,
                        const token_groups& groups, int B, int T_, int C);

// ---- tensor parallelism: the vocabulary-parallel embedding and cross-entropy ------------------
// A shard holds rows [first_row, first_row + rows) of wte. out[n,:] = wte[tokens[n] - first_row,:]
// where the shard holds tokens[n]'s row, else 0: summed over the shards (an all-reduce), then
// add_positions (out[b,t,:] += wpe[t,:]), it is embedding_forward's result, bitwise.
template <class T>
void embedding_rows_forward(const context& ctx, T* out, const std::int32_t* tokens, const T* wte,
                            int first_row, int rows, std::int64_t N, int C);
template <class T>
void add_positions(const context& ctx, T* out, const T* wpe, int B, int T_, int C);

// The vocabulary-parallel cross-entropy over a shard's logits [N, v.cols] (columns v.first + j of
// the whole padded vocabulary; those >= v.V are padding), in three steps around the group's
// all-reduces, as the CPU's (kernels/cpu_ops.hpp):
//  1. vocab_shard_max: row_max[N] = the max of each row's real columns (-inf without any);
//     then all-reduce max;
//  2. vocab_shard_stats: stats[2n] = the sum of exp(x - row_max) over the row's real columns,
//     stats[2n+1] = the target's logit where the shard holds it, else 0; then all-reduce sum;
//  3. vocab_parallel_cross_entropy_backward: losses[N] and, when dlogits is not null, the
//     shard's dlogits (may alias logits): (softmax - onehot) * grad_scale / count, 0 for ignored
//     rows and padded columns. Returns the losses' sum (the host's, in row order) and count.
template <class T>
void vocab_shard_max(const context& ctx, float* row_max, const T* logits, int N,
                     const vocab_shard& v);
template <class T>
void vocab_shard_stats(const context& ctx, float* stats, const T* logits,
                       const std::int32_t* targets, const float* row_max, int N,
                       const vocab_shard& v, int ignore_index);
template <class T>
cross_entropy_result vocab_parallel_cross_entropy_backward(
    const context& ctx, T* dlogits, const T* logits, const std::int32_t* targets,
    const float* row_max, const float* stats, float* losses, int N, const vocab_shard& v,
    int ignore_index, std::int64_t count, float grad_scale);

// ---- one device's members of a group: sums and maxima in place --------------------------------
// copies[0..k) (all on the current device), each n values, all become their sum (max), taken
// in member order in fp32 and rounded once to T. At most kMaxLocalReplicas copies; on `stream`.
template <class T>
void local_sum(cudaStream_t stream, T* const* copies, int k, std::int64_t n);
void local_max(cudaStream_t stream, float* const* copies, int k, std::int64_t n);

// ---- causal multi-head self-attention, fused (flash-attention style) ---------------------------
// qkv[B,T,3C] as on the CPU; out[B,T,C]; lse[B,NH,T] (fp32) receives each query row's
// log-sum-exp of its scaled scores, which backward uses instead of the [T,T] probabilities (the
// probabilities are never stored). Scores, softmax and accumulation in fp32, online softmax over
// key tiles. Head size hs = C/NH must be 16, 32, 64 or 128 (throws std::invalid_argument).
template <class T>
void attention_forward(const context& ctx, T* out, float* lse, const T* qkv, int B, int T_, int C,
                       int NH);
// dqkv += the gradient, from dout, the forward's out and lse. Deterministic: dK/dV by key rows and
// dQ by query rows in two kernels (the scores are recomputed in each), no atomics. scratch needs
// attention_scratch_floats(B, T, NH) floats.
std::int64_t attention_scratch_floats(int B, int T_, int NH);
template <class T>
void attention_backward(const context& ctx, T* dqkv, const T* dout, const T* qkv, const T* out,
                        const float* lse, float* scratch, int B, int T_, int C, int NH);

// ---- causal multi-head self-attention on tensor cores, materialised -----------------------------
// The same result as attention_forward/backward through cuBLASLt strided-batched GEMMs (Q·Kᵀ, P·V
// and their gradients, fp32 accumulation) around a fused causal softmax (llm.c's route): scores
// and probabilities are stored in T, one [T, T] matrix per (batch, head), with the softmax's max,
// sum and row dot products in fp32. Any head size. forward fills probs (attention_probs_values
// values of T), which backward reads in place of the fused route's lse; scratch holds
// attention_materialized_scratch_values values of T, shared by every layer (its contents do not
// outlive a call). backward accumulates (+=) into dqkv and repeats bitwise.
std::int64_t attention_probs_values(int B, int T_, int NH);
std::int64_t attention_materialized_scratch_values(int B, int T_, int C, int NH);
template <class T>
void attention_materialized_forward(const context& ctx, T* out, T* probs, T* scratch, const T* qkv,
                                    int B, int T_, int C, int NH);
template <class T>
void attention_materialized_backward(const context& ctx, T* dqkv, const T* dout, const T* qkv,
                                     const T* probs, T* scratch, int B, int T_, int C, int NH);

// ---- causal multi-head self-attention through cuDNN's fused flash attention ---------------
// attention_forward/backward's result within 16-bit rounding, from cuDNN's
// scaled-dot-product-attention graph (tensor cores, fp32 softmax statistics), bf16 and fp16 only
// (float throws cuda_error), head sizes multiples of 8 up to 128 (std::invalid_argument). cuDNN
// is loaded on first use (cudnn_loader.hpp). q, k and v are read in place from qkv[B,T,3C]
// (strided views, no copies): qkv, out, dout and dqkv must be 16-byte aligned, as arena
// allocations are. lse[B,NH,T] (fp32) receives each row's log-sum-exp of its scaled scores for
// backward. Unlike the other backward ops this one WRITES dqkv (=, every value), in cuDNN's
// deterministic backward: bitwise repeatable. Plans are built once per shape and kept on the
// context; the first call of a shape costs cuDNN's plan building. cuDNN's workspace (B·NH·T²·2
// bytes for the deterministic backward) and backward's scratch are the context's own device
// memory, outside any arena and memory plan, grown to the largest plan's
// (attention_cudnn_workspace_bytes()); growing waits for the stream on the host.
template <class T>
void attention_cudnn_forward(const context& ctx, T* out, float* lse, const T* qkv, int B, int T_,
                             int C, int NH);
template <class T>
void attention_cudnn_backward(const context& ctx, T* dqkv, const T* dout, const T* qkv,
                              const T* out, const float* lse, int B, int T_, int C, int NH);
std::size_t attention_cudnn_workspace_bytes(const context& ctx);
// The operations of the forward or backward graph for this shape (with the padding mask cuDNN
// 9.14 needs in backward when T is no multiple of 128), built and finalized without a device or
// handle: cuDNN checks each descriptor as it is finalized (the unit suite runs this on CPUs).
int attention_cudnn_graph_operations(bool bf16_io, int B, int T_, int NH, int hs, bool backward,
                                     bool padding);
// Whether cuDNN's attention can run in this process: loads the library; on false, *why says
// what is missing (the library, a function, the version).
bool cudnn_attention_available(std::string* why);

// ---- conversions and fills -----------------------------------------------------------------
// out[i] = T(in[i]) (fp32 master weights to the working copy).
template <class T>
void convert(const context& ctx, T* out, const float* in, std::int64_t n);

// ---- optimizer and norms ---------------------------------------------------------------------
// torch.optim.AdamW on fp32 master weights, exactly the CPU kernel's arithmetic. grad_scale
// multiplies every gradient first (unscaling and clipping); param_copy (may be nullptr) receives
// the updated weights as bf16 (or fp16) for the next forward.
void adamw_update(const context& ctx, float* param, const float* grad, float* m, float* v,
                  std::int64_t n, const adamw_hparams& hp, int step, bool decay, float grad_scale,
                  bf16* param_copy);
void adamw_update(const context& ctx, float* param, const float* grad, float* m, float* v,
                  std::int64_t n, const adamw_hparams& hp, int step, bool decay, float grad_scale,
                  fp16* param_copy);
// The parameters of a flat buffer for adamw_update_flat: each [offset, offset + numel) and
// whether it decays; they must tile [0, total) in order (upload throws otherwise). The table is
// uploaded once, on ctx's stream, and kept on the device.
class adamw_segments {
 public:
  struct segment {
    std::int64_t offset = 0, numel = 0;
    bool decay = false;
  };
  adamw_segments() = default;
  ~adamw_segments();
  adamw_segments(const adamw_segments&) = delete;
  adamw_segments& operator=(const adamw_segments&) = delete;
  void upload(const context& ctx, const std::vector<segment>& segments);
  std::int64_t total() const { return total_; }
  int count() const { return count_; }
  const std::int64_t* starts() const;  // device: count + 1 values, the last = total
  const std::uint8_t* decay() const;   // device: count flags

 private:
  std::vector<unsigned char> host_;  // what the device holds, kept for the asynchronous upload
  void* device_ = nullptr;
  std::int64_t total_ = 0;
  int count_ = 0;
};
// adamw_update over every segment in one launch: bitwise each segment's adamw_update.
void adamw_update_flat(const context& ctx, float* param, const float* grad, float* m, float* v,
                       const adamw_segments& segments, const adamw_hparams& hp, int step,
                       float grad_scale, bf16* param_copy);
void adamw_update_flat(const context& ctx, float* param, const float* grad, float* m, float* v,
                       const adamw_segments& segments, const adamw_hparams& hp, int step,
                       float grad_scale, fp16* param_copy);
// Sum of squares of n values, in fp64, in a fixed order.
double square_sum(const context& ctx, const float* x, std::int64_t n);
// square_sum of each span, bitwise, with one wait for the stream instead of one per span.
std::vector<double> square_sums(const context& ctx,
                                const std::vector<std::pair<const float*, std::int64_t>>& spans);

// ---- data parallelism on one device -----------------------------------------------------------
// The replicas' copies of n floats, all on the current device, each become their mean:
// (x_0 + x_1 + ... + x_{k-1}) * (1/k), summed in replica order (ring_order_mean's order for
// k <= 2). At most kMaxLocalReplicas copies; enqueued on `stream`.
constexpr int kMaxLocalReplicas = 16;
void replica_mean(cudaStream_t stream, float* const* copies, int k, std::int64_t n);

}  // namespace troupe::kernels::cuda
