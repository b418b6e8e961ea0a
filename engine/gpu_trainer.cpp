// The GPT-2 model on one CUDA device. See gpu_trainer.hpp. Host code only: every kernel is
// enqueued through kernels/cuda/cuda_ops.hpp on the context's stream.
#include "engine/gpu_trainer.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/device_info.hpp"

namespace troupe::engine {
namespace cu = kernels::cuda;
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw cu::cuda_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device allocations owned together, freed together.
class device_arena {
 public:
  device_arena() = default;
  device_arena(const device_arena&) = delete;
  device_arena& operator=(const device_arena&) = delete;
  ~device_arena() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <class T>
  T* alloc(std::int64_t n) {
    void* p = nullptr;
    const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(T);
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    blocks_.push_back(p);
    bytes_ += static_cast<std::int64_t>(bytes);
    return static_cast<T*>(p);
  }
  std::int64_t bytes() const { return bytes_; }

 private:
  std::vector<void*> blocks_;
  std::int64_t bytes_ = 0;
};

template <class T>
void zero(const cu::context& ctx, T* p, std::int64_t n) {
  check(cudaMemsetAsync(p, 0, static_cast<std::size_t>(n) * sizeof(T), ctx.stream()),
        "cudaMemsetAsync");
}
template <class T>
void copy(const cu::context& ctx, T* dst, const T* src, std::int64_t n) {
  check(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToDevice,
                        ctx.stream()),
        "cudaMemcpyAsync");
}

}  // namespace

bool cuda_training_available(std::string* why_not) {
  if (kernels::cuda_device_count() > 0) return true;
  if (why_not) *why_not = "no usable CUDA device";
  return false;
}

// What does not depend on the compute dtype; model_impl<D> adds the rest.
struct gpu_trainer::impl {
  virtual ~impl() = default;
  // The 16-bit working copy of the weights (bf16 / fp16 runs) and every activation buffer.
  virtual void allocate() = 0;
  virtual double forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                                  float loss_scale) = 0;
  virtual double evaluate(const std::int32_t* inputs, const std::int32_t* targets) = 0;
  // AdamW on every parameter; the working copy, if any, receives the new weights.
  virtual void adamw(const kernels::adamw_hparams& hp, int step, float grad_multiplier) = 0;
  gpt_config config;
  int B = 0, T = 0;
  std::vector<parameter_info> layout;
  std::unordered_map<std::string, const parameter_info*> by_name;  // into layout
  std::int64_t P = 0;
  cu::context ctx;
  device_arena arena;
  float *master = nullptr, *grads = nullptr, *m = nullptr, *v = nullptr;
  bool recompute = false;
};

namespace {

// Everything of one dtype: the weights the kernels read (W), activations and gradient scratch.
template <class D>
struct model_impl final : gpu_trainer::impl {
  struct layer {
    D *ln1, *qkv, *atty, *res2, *ln2, *fch, *fch_gelu, *res3;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *lse;
  };
  std::vector<layer> layers;
  D* working = nullptr;  // bf16 / fp16 runs: the 16-bit weights the kernels read
  std::int32_t *d_inputs = nullptr, *d_targets = nullptr;
  cu::token_groups groups;
  D *encoded = nullptr, *lnf = nullptr, *logits = nullptr;
  float *lnf_mean = nullptr, *lnf_rstd = nullptr, *losses = nullptr, *att_scratch = nullptr;
  D *da = nullptr, *db = nullptr, *dlnf = nullptr, *dfch_gelu = nullptr, *dfc = nullptr,
    *dln = nullptr, *datty = nullptr, *dqkv = nullptr;

  // The weights the kernels read: the bf16 copy, or the fp32 master weights.
  const D* W(const std::string& name) const {
    const auto off = param(name).offset;
    if constexpr (std::is_same_v<D, float>) {
      return master + off;
    } else {
      return working + off;
    }
  }
  const float* F(const std::string& name) const { return master + param(name).offset; }
  float* G(const std::string& name) const { return grads + param(name).offset; }
  const parameter_info& param(const std::string& name) const {
    const auto it = by_name.find(name);
    if (it == by_name.end()) throw std::logic_error("gpu_trainer: no parameter " + name);
    return *it->second;
  }

  // Keep in step with plan_gpu_memory (gpu_plan.cpp): the GPU suite checks device_bytes()
  // against it. With recompute, every layer's internals are one shared set of buffers.
  void allocate() override {
    const int C = config.width, Vp = config.padded_vocab_size, NH = config.heads;
    const std::int64_t N = std::int64_t{B} * T, NC = N * C;
    if constexpr (!std::is_same_v<D, float>) {
      working = arena.alloc<D>(P);
      cu::convert(ctx, working, master, P);
    }
    d_inputs = arena.alloc<std::int32_t>(N);
    d_targets = arena.alloc<std::int32_t>(N);
    encoded = arena.alloc<D>(NC);
    for (int l = 0; l < config.layers; ++l) {
      layer L{};
      if (recompute && l > 0) {
        L = layers.front();
      } else {
        L.ln1 = arena.alloc<D>(NC);
        L.qkv = arena.alloc<D>(3 * NC);
        L.atty = arena.alloc<D>(NC);
        L.res2 = arena.alloc<D>(NC);
        L.ln2 = arena.alloc<D>(NC);
        L.fch = arena.alloc<D>(4 * NC);
        L.fch_gelu = arena.alloc<D>(4 * NC);
        L.ln1_mean = arena.alloc<float>(N);
        L.ln1_rstd = arena.alloc<float>(N);
        L.ln2_mean = arena.alloc<float>(N);
        L.ln2_rstd = arena.alloc<float>(N);
        L.lse = arena.alloc<float>(std::int64_t{B} * NH * T);
      }
      L.res3 = arena.alloc<D>(NC);
      layers.push_back(L);
    }
    lnf = arena.alloc<D>(NC);
    lnf_mean = arena.alloc<float>(N);
    lnf_rstd = arena.alloc<float>(N);
    logits = arena.alloc<D>(N * Vp);
    losses = arena.alloc<float>(N);
    att_scratch = arena.alloc<float>(cu::attention_scratch_floats(B, T, NH));
    da = arena.alloc<D>(NC);
    db = arena.alloc<D>(NC);
    dlnf = arena.alloc<D>(NC);
    dfch_gelu = arena.alloc<D>(4 * NC);
    dfc = arena.alloc<D>(4 * NC);
    dln = arena.alloc<D>(NC);
    datty = arena.alloc<D>(NC);
    dqkv = arena.alloc<D>(3 * NC);
  }

  // Block l's forward from its input x into its buffers (the shared ones with recompute).
  void block_forward(int l, const D* x) {
    const int C = config.width, NH = config.heads, N = B * T;
    const std::int64_t NC = std::int64_t{N} * C;
    const auto& L = layers[static_cast<std::size_t>(l)];
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    cu::layernorm_forward(ctx, L.ln1, L.ln1_mean, L.ln1_rstd, x, F(p + "ln_1.weight"),
                          F(p + "ln_1.bias"), N, C);
    cu::linear_forward(ctx, L.qkv, L.ln1, W(p + "attn.c_attn.weight"), W(p + "attn.c_attn.bias"), N,
                       C, 3 * C);
    cu::attention_forward(ctx, L.atty, L.lse, L.qkv, B, T, C, NH);
    cu::linear_forward(ctx, L.res2, L.atty, W(p + "attn.c_proj.weight"), W(p + "attn.c_proj.bias"),
                       N, C, C);
    cu::residual_forward(ctx, L.res2, L.res2, x, NC);
    cu::layernorm_forward(ctx, L.ln2, L.ln2_mean, L.ln2_rstd, L.res2, F(p + "ln_2.weight"),
                          F(p + "ln_2.bias"), N, C);
    cu::linear_forward(ctx, L.fch, L.ln2, W(p + "mlp.c_fc.weight"), W(p + "mlp.c_fc.bias"), N, C,
                       4 * C);
    cu::gelu_forward(ctx, L.fch_gelu, L.fch, 4 * NC);
    cu::linear_forward(ctx, L.res3, L.fch_gelu, W(p + "mlp.c_proj.weight"),
                       W(p + "mlp.c_proj.bias"), N, 4 * C, C);
    cu::residual_forward(ctx, L.res3, L.res3, L.res2, NC);
  }

  // Uploads a batch (checked against the vocabulary) and runs the forward up to the fused
  // softmax + cross-entropy, which leaves dlogits (seeded with loss_scale) in `logits`.
  kernels::cross_entropy_result forward(const std::int32_t* inputs, const std::int32_t* targets,
                                        float loss_scale) {
    const int C = config.width, V = config.vocab_size, Vp = config.padded_vocab_size;
    const int N = B * T;
    for (int i = 0; i < N; ++i) {
      if (inputs[i] < 0 || inputs[i] >= V)
        throw std::invalid_argument("gpu_trainer: token " + std::to_string(inputs[i]) +
                                    " outside the vocabulary of " + std::to_string(V));
    }
    std::int64_t count = 0;
    for (int i = 0; i < N; ++i) count += targets[i] != ignore_index;
    check(cudaMemcpyAsync(d_inputs, inputs, static_cast<std::size_t>(N) * sizeof(std::int32_t),
                          cudaMemcpyHostToDevice, ctx.stream()),
          "cudaMemcpyAsync(inputs)");
    check(cudaMemcpyAsync(d_targets, targets, static_cast<std::size_t>(N) * sizeof(std::int32_t),
                          cudaMemcpyHostToDevice, ctx.stream()),
          "cudaMemcpyAsync(targets)");
    cu::embedding_forward(ctx, encoded, d_inputs, W("transformer.wte.weight"),
                          W("transformer.wpe.weight"), B, T, C);
    const D* x = encoded;
    for (int l = 0; l < config.layers; ++l) {
      block_forward(l, x);
      x = layers[static_cast<std::size_t>(l)].res3;
    }
    cu::layernorm_forward(ctx, lnf, lnf_mean, lnf_rstd, x, F("transformer.ln_f.weight"),
                          F("transformer.ln_f.bias"), N, C);
    cu::linear_forward<D>(ctx, logits, lnf, W("transformer.wte.weight"), nullptr, N, C, Vp);
    return cu::softmax_cross_entropy_backward(ctx, logits, logits, d_targets, losses, N, V, Vp,
                                              ignore_index, count, loss_scale);
  }

  double evaluate(const std::int32_t* inputs, const std::int32_t* targets) override {
    return forward(inputs, targets, 1.0f).mean();
  }

  void adamw(const kernels::adamw_hparams& hp, int step, float grad_multiplier) override {
    for (const auto& p : layout) {
      const auto o = p.offset;
      if constexpr (std::is_same_v<D, float>) {
        cu::adamw_update(ctx, master + o, grads + o, m + o, v + o, p.numel, hp, step, p.decay,
                         grad_multiplier, static_cast<cu::bf16*>(nullptr));
      } else {
        cu::adamw_update(ctx, master + o, grads + o, m + o, v + o, p.numel, hp, step, p.decay,
                         grad_multiplier, working + o);
      }
    }
  }

  double forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                          float loss_scale) override {
    const int C = config.width, NH = config.heads, Vp = config.padded_vocab_size;
    const int N = B * T;
    const std::int64_t NC = std::int64_t{N} * C;
    const auto loss = forward(inputs, targets, loss_scale);
    groups.build(ctx, inputs, N);
    const D* x = layers.empty() ? encoded : layers.back().res3;

    // ---- backward (logits now hold dlogits) ----
    zero(ctx, dlnf, NC);
    cu::linear_backward(ctx, dlnf, G("transformer.wte.weight"), nullptr, logits, lnf,
                        W("transformer.wte.weight"), N, C, Vp);
    D* dres = da;  // the gradient of the current layer's output, then of its input
    D* dmid = db;  // the gradient of res2
    zero(ctx, dres, NC);
    cu::layernorm_backward(ctx, dres, G("transformer.ln_f.weight"), G("transformer.ln_f.bias"),
                           dlnf, x, F("transformer.ln_f.weight"), lnf_mean, lnf_rstd, N, C);
    for (int l = config.layers - 1; l >= 0; --l) {
      const auto& L = layers[static_cast<std::size_t>(l)];
      const D* in = l > 0 ? layers[static_cast<std::size_t>(l) - 1].res3 : encoded;
      const std::string p = "transformer.h." + std::to_string(l) + ".";
      // The last block's internals are still in the shared buffers from the forward.
      if (recompute && l + 1 < config.layers) block_forward(l, in);
      zero(ctx, dfch_gelu, 4 * NC);
      cu::linear_backward(ctx, dfch_gelu, G(p + "mlp.c_proj.weight"), G(p + "mlp.c_proj.bias"),
                          dres, L.fch_gelu, W(p + "mlp.c_proj.weight"), N, 4 * C, C);
      zero(ctx, dfc, 4 * NC);
      cu::gelu_backward(ctx, dfc, L.fch, dfch_gelu, 4 * NC);
      zero(ctx, dln, NC);
      cu::linear_backward(ctx, dln, G(p + "mlp.c_fc.weight"), G(p + "mlp.c_fc.bias"), dfc, L.ln2,
                          W(p + "mlp.c_fc.weight"), N, C, 4 * C);
      copy(ctx, dmid, dres, NC);
      cu::layernorm_backward(ctx, dmid, G(p + "ln_2.weight"), G(p + "ln_2.bias"), dln, L.res2,
                             F(p + "ln_2.weight"), L.ln2_mean, L.ln2_rstd, N, C);
      zero(ctx, datty, NC);
      cu::linear_backward(ctx, datty, G(p + "attn.c_proj.weight"), G(p + "attn.c_proj.bias"), dmid,
                          L.atty, W(p + "attn.c_proj.weight"), N, C, C);
      zero(ctx, dqkv, 3 * NC);
      cu::attention_backward(ctx, dqkv, datty, L.qkv, L.atty, L.lse, att_scratch, B, T, C, NH);
      zero(ctx, dln, NC);
      cu::linear_backward(ctx, dln, G(p + "attn.c_attn.weight"), G(p + "attn.c_attn.bias"), dqkv,
                          L.ln1, W(p + "attn.c_attn.weight"), N, C, 3 * C);
      copy(ctx, dres, dmid, NC);
      cu::layernorm_backward(ctx, dres, G(p + "ln_1.weight"), G(p + "ln_1.bias"), dln, in,
                             F(p + "ln_1.weight"), L.ln1_mean, L.ln1_rstd, N, C);
    }
    cu::embedding_backward(ctx, G("transformer.wte.weight"), G("transformer.wpe.weight"), dres,
                           groups, B, T, C);
    return loss.mean();
  }
};

}  // namespace

namespace {
gpt_stage initial_weights(const gpt_config& config, std::uint64_t seed) {
  config.validate();
  gpt_stage host(config, stage_range::whole(config));
  host.init_gpt2(seed);
  return host;
}
}  // namespace

gpu_trainer::gpu_trainer(const gpt_config& config, int B, int T, compute_dtype dtype,
                         std::uint64_t seed)
    : gpu_trainer(initial_weights(config, seed), B, T, gpu_trainer_options{dtype, false}) {}

gpu_trainer::gpu_trainer(const gpt_stage& weights, int B, int T,
                         const gpu_trainer_options& options) {
  const gpt_config& config = weights.config();
  config.validate();
  const stage_range& range = weights.range();
  if (range.first_layer != 0 || range.last_layer != config.layers || !range.embedding ||
      !range.head)
    throw std::invalid_argument("gpu_trainer: the host weights are not a whole model");
  if (B < 1 || T < 1 || T > config.context)
    throw std::invalid_argument("gpu_trainer: batch " + std::to_string(B) + " x sequence " +
                                std::to_string(T) + " (the context is " +
                                std::to_string(config.context) + ")");
  std::string why;
  if (!cuda_training_available(&why)) throw std::runtime_error("--device cuda: " + why);
  switch (options.dtype) {
    case compute_dtype::bf16:
      impl_ = std::make_unique<model_impl<cu::bf16>>();
      break;
    case compute_dtype::fp16:
      impl_ = std::make_unique<model_impl<cu::fp16>>();
      break;
    case compute_dtype::fp32:
      impl_ = std::make_unique<model_impl<float>>();
      break;
  }
  auto& s = *impl_;
  s.config = config;
  s.B = B;
  s.T = T;
  s.recompute = options.recompute;
  s.layout = weights.parameters();
  for (const auto& p : s.layout) s.by_name.emplace(p.name, &p);
  s.P = weights.parameter_count();
  s.master = s.arena.alloc<float>(s.P);
  s.grads = s.arena.alloc<float>(s.P);
  s.m = s.arena.alloc<float>(s.P);
  s.v = s.arena.alloc<float>(s.P);
  check(cudaMemcpy(s.master, weights.params(), static_cast<std::size_t>(s.P) * sizeof(float),
                   cudaMemcpyHostToDevice),
        "cudaMemcpy(parameters)");
  zero(s.ctx, s.grads, s.P);
  zero(s.ctx, s.m, s.P);
  zero(s.ctx, s.v, s.P);
  s.allocate();
  s.ctx.synchronize();
}

gpu_trainer::~gpu_trainer() = default;

double gpu_trainer::forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                                     float loss_scale) {
  return impl_->forward_backward(inputs, targets, loss_scale);
}

double gpu_trainer::evaluate(const std::int32_t* inputs, const std::int32_t* targets) {
  return impl_->evaluate(inputs, targets);
}

void gpu_trainer::zero_grad() { zero(impl_->ctx, impl_->grads, impl_->P); }

double gpu_trainer::grad_square_sum() { return cu::square_sum(impl_->ctx, impl_->grads, impl_->P); }

double gpu_trainer::update(const optimizer_config& config, int step, int total_steps,
                           double grad_multiplier) {
  auto& s = *impl_;
  const double lr = learning_rate(config, step, total_steps);
  const kernels::adamw_hparams hp = adamw_hparams_at(config, lr);
  s.adamw(hp, step + 1, static_cast<float>(grad_multiplier));
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

namespace {
std::vector<float> to_host(const cu::context& ctx, const float* p, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  ctx.synchronize();
  check(cudaMemcpy(out.data(), p, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy(to host)");
  return out;
}
}  // namespace

std::vector<float> gpu_trainer::parameters() const {
  return to_host(impl_->ctx, impl_->master, impl_->P);
}
void gpu_trainer::copy_parameters_to(gpt_stage& host) const {
  if (host.parameter_count() != impl_->P)
    throw std::invalid_argument("gpu_trainer: the host stage does not hold the whole model");
  impl_->ctx.synchronize();
  check(cudaMemcpy(host.params(), impl_->master, static_cast<std::size_t>(impl_->P) * sizeof(float),
                   cudaMemcpyDeviceToHost),
        "cudaMemcpy(to host)");
}
std::vector<float> gpu_trainer::gradients() const {
  return to_host(impl_->ctx, impl_->grads, impl_->P);
}
const std::vector<parameter_info>& gpu_trainer::layout() const { return impl_->layout; }
std::int64_t gpu_trainer::device_bytes() const { return impl_->arena.bytes(); }
std::string gpu_trainer::device_name() const { return kernels::cuda_device_name(0); }
void gpu_trainer::synchronize() const { impl_->ctx.synchronize(); }

}  // namespace troupe::engine
