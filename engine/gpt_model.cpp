// GPT-2 stage: parameter layout, initialisation and forward (backward: gpt_backward.cpp).
// See gpt_model.hpp.
#include "engine/gpt_model.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "engine/random.hpp"

namespace troupe::engine {

using kernels::tensor;

void gpt_config::validate() const {
  auto positive = [](int v, const char* key) {
    if (v <= 0)
      throw std::invalid_argument(std::string(key) + ": must be positive, got " +
                                  std::to_string(v));
  };
  positive(vocab_size, "model.vocab_size");
  positive(padded_vocab_size, "model.padded_vocab_size");
  positive(context, "model.context");
  positive(layers, "model.layers");
  positive(heads, "model.heads");
  positive(width, "model.width");
  if (padded_vocab_size < vocab_size) {
    throw std::invalid_argument("model.padded_vocab_size: " + std::to_string(padded_vocab_size) +
                                " is smaller than model.vocab_size " + std::to_string(vocab_size));
  }
  if (width % heads != 0) {
    throw std::invalid_argument("model.heads: width " + std::to_string(width) +
                                " is not divisible by " + std::to_string(heads) + " heads");
  }
}

std::int64_t gpt_config::parameter_count() const {
  const std::int64_t C = width;
  const std::int64_t per_layer = 12 * C * C + 13 * C;
  return std::int64_t{padded_vocab_size} * C + std::int64_t{context} * C + layers * per_layer +
         2 * C;
}

double gpt_config::train_flops_per_token(int T) const {
  // 6 flops per parameter per token for the matmuls (embedding lookups excluded, tied head
  // included once as a matmul), plus attention scores and weighted sums: 6 * 2 * L * T * C.
  const double C = width;
  const double matmul_params = layers * 12.0 * C * C + double(padded_vocab_size) * C;
  return 6.0 * matmul_params + 12.0 * layers * double(T) * C;
}

std::vector<stage_range> partition_layers(const gpt_config& c, int stages) {
  if (stages < 1 || stages > c.layers) {
    throw std::invalid_argument("cannot split " + std::to_string(c.layers) + " layers into " +
                                std::to_string(stages) + " stages");
  }
  std::vector<stage_range> out;
  int first = 0;
  for (int s = 0; s < stages; ++s) {
    const int n = c.layers / stages + (s < c.layers % stages ? 1 : 0);
    out.push_back({first, first + n, s == 0, s == stages - 1});
    first += n;
  }
  return out;
}

std::vector<parameter_info> stage_parameter_layout(const gpt_config& config,
                                                   const stage_range& range) {
  config.validate();
  if (range.first_layer < 0 || range.last_layer > config.layers ||
      range.first_layer > range.last_layer) {
    throw std::invalid_argument("stage layer range [" + std::to_string(range.first_layer) + ", " +
                                std::to_string(range.last_layer) + ") is outside the model");
  }
  std::vector<parameter_info> params;
  auto add = [&params](const std::string& name, kernels::shape_t shape, bool conv1d) {
    parameter_info p;
    p.name = name;
    p.numel = kernels::shape_numel(shape);
    p.decay = shape.size() >= 2;
    p.shape = std::move(shape);
    p.conv1d = conv1d;
    // Keep every parameter 64-byte aligned (16 floats) for vectorised kernels.
    const std::int64_t end = params.empty() ? 0 : params.back().offset + params.back().numel;
    p.offset = (end + 15) / 16 * 16;
    params.push_back(std::move(p));
  };
  const std::int64_t C = config.width, Vp = config.padded_vocab_size;
  if (range.embedding || range.head) add("transformer.wte.weight", {Vp, C}, false);
  if (range.embedding) add("transformer.wpe.weight", {config.context, C}, false);
  for (int l = range.first_layer; l < range.last_layer; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    add(p + "ln_1.weight", {C}, false);
    add(p + "ln_1.bias", {C}, false);
    add(p + "attn.c_attn.weight", {3 * C, C}, true);
    add(p + "attn.c_attn.bias", {3 * C}, false);
    add(p + "attn.c_proj.weight", {C, C}, true);
    add(p + "attn.c_proj.bias", {C}, false);
    add(p + "ln_2.weight", {C}, false);
    add(p + "ln_2.bias", {C}, false);
    add(p + "mlp.c_fc.weight", {4 * C, C}, true);
    add(p + "mlp.c_fc.bias", {4 * C}, false);
    add(p + "mlp.c_proj.weight", {C, 4 * C}, true);
    add(p + "mlp.c_proj.bias", {C}, false);
  }
  if (range.head) {
    add("transformer.ln_f.weight", {C}, false);
    add("transformer.ln_f.bias", {C}, false);
  }
  return params;
}

gpt_stage::gpt_stage(const gpt_config& config, const stage_range& range)
    : config_(config), range_(range), params_(stage_parameter_layout(config, range)) {
  const std::int64_t total = params_.empty() ? 0 : params_.back().offset + params_.back().numel;
  // Mappings of their own: ZeRO releases and moves their pages (engine/zero.hpp).
  param_buf_ = tensor::mapped_zeros({total});
  grad_buf_ = tensor::mapped_zeros({total});
}

const parameter_info& gpt_stage::parameter(const std::string& name) const {
  for (const auto& p : params_) {
    if (p.name == name) return p;
  }
  throw std::out_of_range("no parameter " + name + " in this stage");
}

tensor gpt_stage::param(const std::string& name) const {
  const auto& p = parameter(name);
  return param_buf_.view(p.offset, p.shape);
}

tensor gpt_stage::grad(const std::string& name) const {
  const auto& p = parameter(name);
  return grad_buf_.view(p.offset, p.shape);
}

void gpt_stage::init_gpt2(std::uint64_t seed) {
  const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(config_.layers));
  for (const auto& p : params_) {
    float* w = params() + p.offset;
    const bool is_bias = p.name.ends_with(".bias");
    const bool is_ln = p.name.find(".ln_") != std::string::npos;
    if (is_ln && !is_bias) {
      std::fill(w, w + p.numel, 1.0f);
    } else if (is_bias) {
      std::fill(w, w + p.numel, 0.0f);
    } else {
      const float stddev = p.name.ends_with("c_proj.weight") ? residual_std : 0.02f;
      std::int64_t n = p.numel;
      if (p.name == "transformer.wte.weight") n = std::int64_t{config_.vocab_size} * config_.width;
      fill_normal(w, n, 0.0f, stddev, seed, p.name);
      std::fill(w + n, w + p.numel, 0.0f);  // padded vocabulary rows
    }
  }
}

// ---- activations ---------------------------------------------------------------------------

namespace {

block_activations allocate_block(const gpt_config& c, int B, int T, bool with_output) {
  const std::int64_t N = std::int64_t{B} * T, C = c.width, NH = c.heads;
  block_activations a;
  a.ln1 = tensor::empty({N, C});
  a.ln1_mean = tensor::empty({N});
  a.ln1_rstd = tensor::empty({N});
  a.qkv = tensor::empty({N, 3 * C});
  a.att = tensor::empty({B, NH, T, T});
  a.atty = tensor::empty({N, C});
  a.res2 = tensor::empty({N, C});
  a.ln2 = tensor::empty({N, C});
  a.ln2_mean = tensor::empty({N});
  a.ln2_rstd = tensor::empty({N});
  a.fch = tensor::empty({N, 4 * C});
  a.fch_gelu = tensor::empty({N, 4 * C});
  if (with_output) a.res3 = tensor::empty({N, C});
  return a;
}

std::int64_t block_bytes(const block_activations& a, bool inner, bool output) {
  std::int64_t b = 0;
  if (inner)
    for (const auto* t : {&a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.att, &a.atty, &a.res2,
                          &a.ln2, &a.ln2_mean, &a.ln2_rstd, &a.fch, &a.fch_gelu})
      b += static_cast<std::int64_t>(t->nbytes());
  if (output) b += static_cast<std::int64_t>(a.res3.nbytes());
  return b;
}

void check_micro_batch(const gpt_config& c, int B, int T) {
  if (B <= 0 || T <= 0 || T > c.context) {
    throw std::invalid_argument("micro-batch " + std::to_string(B) + "x" + std::to_string(T) +
                                " does not fit context " + std::to_string(c.context));
  }
}

}  // namespace

block_scratch::block_scratch(const gpt_config& config, int B, int T) : B_(B), T_(T) {
  check_micro_batch(config, B, T);
  acts_ = allocate_block(config, B, T, false);
}

std::int64_t block_scratch::bytes() const { return block_bytes(acts_, true, false); }

std::int64_t block_scratch_bytes(const gpt_config& c, int B, int T) {
  const std::int64_t N = std::int64_t{B} * T, C = c.width;
  return 4 * (N * C * 15 + N * 4 + std::int64_t{B} * c.heads * T * T);
}

std::int64_t activation_bytes(const gpt_config& c, const stage_range& s, int B, int T,
                              bool recompute, bool split_backward) {
  const std::int64_t N = std::int64_t{B} * T, C = c.width, NC = N * C;
  const std::int64_t layers = s.last_layer - s.first_layer;
  std::int64_t f = 5 * NC;       // gradient scratch: dres x3, dln, datty
  if (layers > 0) f += 12 * NC;  // dln1, dqkv (3C), dfch, dfch_gelu (4C)
  f += layers * NC;              // every block's output (res3)
  if (!recompute) f += layers * (block_scratch_bytes(c, B, T) / 4);
  if (s.embedding) f += NC;                               // encoded
  if (s.head) f += NC + 2 * N + N * c.padded_vocab_size;  // ln_f, its statistics, logits
  if (split_backward) {                                   // stage_backward_input's saved gradients
    f += layers * 11 * NC;
    if (s.head) f += NC;
    if (s.embedding) f += NC;
  }
  return 4 * f;
}

gpt_activations::gpt_activations(const gpt_stage& stage, int B, int T,
                                 std::shared_ptr<block_scratch> recompute)
    : B_(B), T_(T), scratch_(std::move(recompute)) {
  const auto& c = stage.config();
  check_micro_batch(c, B, T);
  if (scratch_ && (scratch_->batch() != B || scratch_->seq_len() != T))
    throw std::invalid_argument("gpt_activations: a block_scratch for micro-batches of " +
                                std::to_string(scratch_->batch()) + "x" +
                                std::to_string(scratch_->seq_len()) + ", not " + std::to_string(B) +
                                "x" + std::to_string(T));
  const std::int64_t N = std::int64_t{B} * T, C = c.width;
  if (stage.range().embedding) encoded_ = tensor::empty({N, C});
  for (int l = stage.range().first_layer; l < stage.range().last_layer; ++l) {
    if (scratch_) {
      layer_acts a = scratch_->acts_;  // the inner activations: views of the shared scratch
      a.res3 = tensor::empty({N, C});
      layers_.push_back(std::move(a));
    } else {
      layers_.push_back(allocate_block(c, B, T, true));
    }
  }
  if (stage.range().head) {
    lnf_ = tensor::empty({N, C});
    lnf_mean_ = tensor::empty({N});
    lnf_rstd_ = tensor::empty({N});
    logits_ = tensor::empty({N, std::int64_t{c.padded_vocab_size}});
  }
  dres_ = tensor::empty({N, C});
  dres_next_ = tensor::empty({N, C});
  dres_mid_ = tensor::empty({N, C});
  dln_ = tensor::empty({N, C});
  datty_ = tensor::empty({N, C});
  if (!layers_.empty()) {
    dln1_ = tensor::empty({N, C});
    dqkv_ = tensor::empty({N, 3 * C});
    dfch_ = tensor::empty({N, 4 * C});
    dfch_gelu_ = tensor::empty({N, 4 * C});
  }
}

std::int64_t gpt_activations::bytes() const {
  std::int64_t b = 0;
  auto add = [&](const tensor& t) { b += static_cast<std::int64_t>(t.nbytes()); };
  add(encoded_);
  for (const auto& L : layers_) b += block_bytes(L, !scratch_, true);
  for (const auto* t : {&lnf_, &lnf_mean_, &lnf_rstd_, &logits_, &dres_, &dres_next_, &dln_, &dln1_,
                        &dqkv_, &datty_, &dfch_, &dfch_gelu_, &dres_mid_})
    add(*t);
  for (const auto& g : saved_.layers)
    for (const auto* t : {&g.mlp_proj, &g.fc, &g.ln2, &g.attn_proj, &g.qkv, &g.ln1}) add(*t);
  add(saved_.lnf);
  add(saved_.encoded);
  return b;
}

namespace {

void add_into(float* out, const float* a, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] += a[i];
}

}  // namespace

const float* stage_output(const gpt_activations& acts) {
  if (acts.logits_.numel() > 0) return acts.logits_.f32();
  if (!acts.layers_.empty()) return acts.layers_.back().res3.f32();
  return acts.encoded_.numel() > 0 ? acts.encoded_.f32() : acts.input_;
}

std::vector<std::vector<int>> pass_stops(const gpt_stage& stage, pass_kind kind) {
  const auto& r = stage.range();
  const int layers = r.last_layer - r.first_layer;
  const int head = r.head ? 1 : 0;
  const int embedding = head + layers;  // its index, when the stage has it
  auto layer = [&](int i) { return head + layers - 1 - i; };
  std::vector<int> head_stop;  // the head reads ln_f and wte (the embedding block's, if here)
  if (r.head) head_stop = r.embedding ? std::vector<int>{0, embedding} : std::vector<int>{0};
  std::vector<std::vector<int>> stops;
  if (kind == pass_kind::forward) {
    if (r.embedding) stops.push_back({embedding});
    for (int i = 0; i < layers; ++i) stops.push_back({layer(i)});
    if (r.head) stops.push_back(head_stop);
  } else {  // backward reads no embedding parameter: its weight gradient needs tokens only
    if (r.head) stops.push_back(head_stop);
    for (int i = layers; i-- > 0;) stops.push_back({layer(i)});
  }
  return stops;
}

void stage_forward(const gpt_stage& stage, gpt_activations& acts, const std::int32_t* tokens,
                   const float* input) {
  stage_forward_pass(stage, acts, tokens, input).run();
}

void block_forward(const gpt_stage& stage, int i, const block_activations& L, const float* x, int B,
                   int T, bool output) {
  const int C = stage.config().width, NH = stage.config().heads, N = B * T;
  const std::string p = "transformer.h." + std::to_string(stage.range().first_layer + i) + ".";
  auto P = [&](const char* n) { return stage.params() + stage.parameter(p + n).offset; };
  kernels::layernorm_forward(L.ln1.f32(), L.ln1_mean.f32(), L.ln1_rstd.f32(), x, P("ln_1.weight"),
                             P("ln_1.bias"), N, C);
  kernels::linear_forward(L.qkv.f32(), L.ln1.f32(), P("attn.c_attn.weight"), P("attn.c_attn.bias"),
                          N, C, 3 * C);
  kernels::attention_forward(L.atty.f32(), L.att.f32(), L.qkv.f32(), B, T, C, NH);
  kernels::linear_forward(L.res2.f32(), L.atty.f32(), P("attn.c_proj.weight"),
                          P("attn.c_proj.bias"), N, C, C);
  add_into(L.res2.f32(), x, std::int64_t{N} * C);
  kernels::layernorm_forward(L.ln2.f32(), L.ln2_mean.f32(), L.ln2_rstd.f32(), L.res2.f32(),
                             P("ln_2.weight"), P("ln_2.bias"), N, C);
  kernels::linear_forward(L.fch.f32(), L.ln2.f32(), P("mlp.c_fc.weight"), P("mlp.c_fc.bias"), N, C,
                          4 * C);
  kernels::gelu_forward(L.fch_gelu.f32(), L.fch.f32(), std::int64_t{N} * 4 * C);
  if (!output) return;
  kernels::linear_forward(L.res3.f32(), L.fch_gelu.f32(), P("mlp.c_proj.weight"),
                          P("mlp.c_proj.bias"), N, 4 * C, C);
  add_into(L.res3.f32(), L.res2.f32(), std::int64_t{N} * C);
}

block_pass stage_forward_pass(const gpt_stage& stage, gpt_activations& a,
                              const std::int32_t* tokens, const float* input) {
  const auto stops = pass_stops(stage, pass_kind::forward);
  std::size_t stop = 0;
  auto next_stop = [&] { return stops.at(stop++); };
  const auto& c = stage.config();
  const int B = a.B_, T = a.T_, C = c.width, Vp = c.padded_vocab_size;
  const int N = B * T;
  if (a.weight_grads_pending_) {
    throw std::logic_error(
        "stage_forward: these activations still wait for stage_backward_weight, which needs them");
  }
  const float* x;
  if (stage.range().embedding) {
    co_yield next_stop();
    a.tokens_ = tokens;
    kernels::embedding_forward(a.encoded_.f32(), tokens,
                               stage.param("transformer.wte.weight").f32(),
                               stage.param("transformer.wpe.weight").f32(), B, T, C);
    x = a.encoded_.f32();
  } else {
    a.input_ = input;
    x = input;
  }
  for (int i = 0; i < static_cast<int>(a.layers_.size()); ++i) {
    co_yield next_stop();
    const auto& L = a.layers_[static_cast<std::size_t>(i)];
    block_forward(stage, i, L, x, B, T, true);
    x = L.res3.f32();
  }
  if (stage.range().head) {
    co_yield next_stop();
    kernels::layernorm_forward(a.lnf_.f32(), a.lnf_mean_.f32(), a.lnf_rstd_.f32(), x,
                               stage.param("transformer.ln_f.weight").f32(),
                               stage.param("transformer.ln_f.bias").f32(), N, C);
    kernels::linear_forward(a.logits_.f32(), a.lnf_.f32(),
                            stage.param("transformer.wte.weight").f32(), nullptr, N, C, Vp);
    a.logits_are_grads_ = false;
  }
}

kernels::cross_entropy_result stage_loss(const gpt_stage& stage, gpt_activations& a,
                                         const std::int32_t* targets) {
  if (!stage.range().head || a.logits_are_grads_)
    throw std::logic_error("stage_loss needs fresh logits");
  const auto& c = stage.config();
  return kernels::cross_entropy_forward(nullptr, a.logits_.f32(), targets, a.B_ * a.T_,
                                        c.vocab_size, c.padded_vocab_size, ignore_index);
}

kernels::cross_entropy_result stage_loss_backward_start(const gpt_stage& stage, gpt_activations& a,
                                                        const std::int32_t* targets,
                                                        float grad_scale) {
  if (!stage.range().head || a.logits_are_grads_) {
    throw std::logic_error("stage_loss_backward_start needs fresh logits");
  }
  const auto& c = stage.config();
  auto r = kernels::softmax_cross_entropy_backward(a.logits_.f32(), a.logits_.f32(), targets,
                                                   a.B_ * a.T_, c.vocab_size, c.padded_vocab_size,
                                                   ignore_index, grad_scale);
  a.logits_are_grads_ = true;
  return r;
}

}  // namespace troupe::engine
