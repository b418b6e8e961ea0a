// GPT-2 chunk: parameter layout, initialisation and forward (backward: gpt_backward.cpp).
// See gpt_model.hpp.
#include "engine/model/gpt_model.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "engine/model/random.hpp"

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

void check_tensor_parallel(const gpt_config& c, int t) {
  if (t < 1) throw std::invalid_argument("parallel.tp: must be positive, got " + std::to_string(t));
  if (c.heads % t != 0)
    throw std::invalid_argument("parallel.tp: " + std::to_string(c.heads) +
                                " heads (model.heads) do not split into " + std::to_string(t) +
                                " tensor shards");
  if (c.padded_vocab_size % t != 0)
    throw std::invalid_argument("parallel.tp: the padded vocabulary of " +
                                std::to_string(c.padded_vocab_size) +
                                " rows (model.padded_vocab_size) does not split into " +
                                std::to_string(t) + " tensor shards");
}

namespace {

// Rows of the whole tensor, and floats per row (1 for a vector).
std::pair<std::int64_t, std::int64_t> rows_and_width(const kernels::shape_t& full) {
  std::int64_t width = 1;
  for (std::size_t i = 1; i < full.size(); ++i) width *= full[i];
  return {full.at(0), width};
}

// Calls copy(whole offset, slice offset, floats) for every contiguous run of the shard.
template <class Copy>
void for_each_shard_run(const parameter_info& p, tensor_shard sh, Copy copy) {
  const auto [rows, width] = rows_and_width(p.full_shape);
  const std::int64_t t = sh.size, r = sh.rank;
  switch (p.split) {
    case tensor_split::replicated:
      copy(0, 0, rows * width);
      break;
    case tensor_split::rows:
      copy(r * (rows / t) * width, 0, rows / t * width);
      break;
    case tensor_split::qkv_rows: {
      const std::int64_t part = rows / 3, n = part / t;
      for (std::int64_t q = 0; q < 3; ++q)
        copy((q * part + r * n) * width, q * n * width, n * width);
      break;
    }
    case tensor_split::columns: {
      const std::int64_t n = width / t;
      for (std::int64_t i = 0; i < rows; ++i) copy(i * width + r * n, i * n, n);
      break;
    }
  }
}

}  // namespace

void take_shard(const parameter_info& p, tensor_shard sh, const float* whole, float* slice) {
  for_each_shard_run(p, sh, [&](std::int64_t w, std::int64_t s, std::int64_t n) {
    std::copy(whole + w, whole + w + n, slice + s);
  });
}

void put_shard(const parameter_info& p, tensor_shard sh, const float* slice, float* whole) {
  for_each_shard_run(p, sh, [&](std::int64_t w, std::int64_t s, std::int64_t n) {
    std::copy(slice + s, slice + s + n, whole + w);
  });
}

std::vector<chunk_range> partition_layers(const gpt_config& c, int chunks) {
  if (chunks < 1 || chunks > c.layers) {
    throw std::invalid_argument("cannot split " + std::to_string(c.layers) + " layers into " +
                                std::to_string(chunks) + " chunks");
  }
  std::vector<chunk_range> out;
  int first = 0;
  for (int s = 0; s < chunks; ++s) {
    const int n = c.layers / chunks + (s < c.layers % chunks ? 1 : 0);
    out.push_back({first, first + n, s == 0, s == chunks - 1});
    first += n;
  }
  return out;
}

std::vector<parameter_info> chunk_parameter_layout(const gpt_config& config,
                                                   const chunk_range& range, tensor_shard shard) {
  config.validate();
  check_tensor_parallel(config, shard.size);
  if (range.first_layer < 0 || range.last_layer > config.layers ||
      range.first_layer > range.last_layer) {
    throw std::invalid_argument("chunk layer range [" + std::to_string(range.first_layer) + ", " +
                                std::to_string(range.last_layer) + ") is outside the model");
  }
  std::vector<parameter_info> params;
  using enum tensor_split;
  auto add = [&params, shard](const std::string& name, kernels::shape_t shape, bool conv1d,
                              tensor_split split = replicated) {
    parameter_info p;
    p.name = name;
    p.full_shape = shape;
    p.split = shard.split() ? split : replicated;
    if (p.split == columns)
      shape[1] /= shard.size;
    else if (p.split != replicated)
      shape[0] /= shard.size;
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
  if (range.embedding || range.head) add("transformer.wte.weight", {Vp, C}, false, rows);
  if (range.embedding) add("transformer.wpe.weight", {config.context, C}, false);
  for (int l = range.first_layer; l < range.last_layer; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    add(p + "ln_1.weight", {C}, false);
    add(p + "ln_1.bias", {C}, false);
    add(p + "attn.c_attn.weight", {3 * C, C}, true, qkv_rows);
    add(p + "attn.c_attn.bias", {3 * C}, false, qkv_rows);
    add(p + "attn.c_proj.weight", {C, C}, true, columns);
    add(p + "attn.c_proj.bias", {C}, false);
    add(p + "ln_2.weight", {C}, false);
    add(p + "ln_2.bias", {C}, false);
    add(p + "mlp.c_fc.weight", {4 * C, C}, true, rows);
    add(p + "mlp.c_fc.bias", {4 * C}, false, rows);
    add(p + "mlp.c_proj.weight", {C, 4 * C}, true, columns);
    add(p + "mlp.c_proj.bias", {C}, false);
  }
  if (range.head) {
    add("transformer.ln_f.weight", {C}, false);
    add("transformer.ln_f.bias", {C}, false);
  }
  return params;
}

gpt_chunk::gpt_chunk(const gpt_config& config, const chunk_range& range, tensor_shard shard)
    : config_(config),
      range_(range),
      shard_(shard),
      params_(chunk_parameter_layout(config, range, shard)) {
  const std::int64_t total = params_.empty() ? 0 : params_.back().offset + params_.back().numel;
  // Mappings of their own: ZeRO releases and moves their pages (engine/parallel/zero.hpp).
  param_buf_ = tensor::mapped_zeros({total});
  grad_buf_ = tensor::mapped_zeros({total});
}

void gpt_chunk::set_tensor_group(std::shared_ptr<tensor_group> group) {
  if (group && (group->size() != shard_.size || group->rank() != shard_.rank))
    throw std::invalid_argument("tensor group member " + std::to_string(group->rank()) + " of " +
                                std::to_string(group->size()) + " for tensor shard " +
                                std::to_string(shard_.rank) + " of " + std::to_string(shard_.size));
  group_ = std::move(group);
}

tensor_group& gpt_chunk::group() const {
  if (!group_)
    throw std::logic_error("tensor shard " + std::to_string(shard_.rank) + " of " +
                           std::to_string(shard_.size) + " has no tensor-parallel group");
  return *group_;
}

const parameter_info& gpt_chunk::parameter(const std::string& name) const {
  for (const auto& p : params_) {
    if (p.name == name) return p;
  }
  throw std::out_of_range("no parameter " + name + " in this chunk");
}

tensor gpt_chunk::param(const std::string& name) const {
  const auto& p = parameter(name);
  return param_buf_.view(p.offset, p.shape);
}

tensor gpt_chunk::grad(const std::string& name) const {
  const auto& p = parameter(name);
  return grad_buf_.view(p.offset, p.shape);
}

void gpt_chunk::init_gpt2(std::uint64_t seed) {
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
      // The whole tensor's values (a function of seed and name), then this shard's slice.
      const float stddev = p.name.ends_with("c_proj.weight") ? residual_std : 0.02f;
      const std::int64_t whole = kernels::shape_numel(p.full_shape);
      std::vector<float> buffer(p.split == tensor_split::replicated ? 0 : whole);
      float* out = buffer.empty() ? w : buffer.data();
      std::int64_t n = whole;
      if (p.name == "transformer.wte.weight") n = std::int64_t{config_.vocab_size} * config_.width;
      fill_normal(out, n, 0.0f, stddev, seed, p.name);
      std::fill(out + n, out + whole, 0.0f);  // padded vocabulary rows
      if (!buffer.empty()) take_shard(p, shard_, buffer.data(), w);
    }
  }
}

// ---- activations ---------------------------------------------------------------------------

namespace {

// One tensor shard's block (tp = 1: the whole block): the column-parallel outputs (qkv, att,
// atty, fch, fch_gelu) hold the shard's heads and hidden units only.
block_activations allocate_block(const gpt_config& c, int B, int T, bool with_output, int tp) {
  const std::int64_t N = std::int64_t{B} * T, C = c.width;
  const std::int64_t Cl = C / tp, NH = c.heads / tp;
  block_activations a;
  a.ln1 = tensor::empty({N, C});
  a.ln1_mean = tensor::empty({N});
  a.ln1_rstd = tensor::empty({N});
  a.qkv = tensor::empty({N, 3 * Cl});
  a.att = tensor::empty({B, NH, T, T});
  a.atty = tensor::empty({N, Cl});
  a.res2 = tensor::empty({N, C});
  a.ln2 = tensor::empty({N, C});
  a.ln2_mean = tensor::empty({N});
  a.ln2_rstd = tensor::empty({N});
  a.fch = tensor::empty({N, 4 * Cl});
  a.fch_gelu = tensor::empty({N, 4 * Cl});
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

block_scratch::block_scratch(const gpt_config& config, int B, int T, int tp) : B_(B), T_(T) {
  check_micro_batch(config, B, T);
  acts_ = allocate_block(config, B, T, false, tp);
}

std::int64_t block_scratch::bytes() const { return block_bytes(acts_, true, false); }

std::int64_t block_scratch_bytes(const gpt_config& c, int B, int T, int tp) {
  const std::int64_t N = std::int64_t{B} * T, C = c.width, Cl = C / tp;
  // ln1, res2, ln2 whole; qkv (3), atty, fch (4), fch_gelu (4) of the shard
  return 4 * (N * (3 * C + 12 * Cl) + N * 4 + std::int64_t{B} * (c.heads / tp) * T * T);
}

std::int64_t activation_bytes(const gpt_config& c, const chunk_range& s, int B, int T,
                              bool recompute, bool split_backward, int tp) {
  const std::int64_t N = std::int64_t{B} * T, C = c.width, NC = N * C, NCl = NC / tp;
  const std::int64_t layers = s.last_layer - s.first_layer;
  std::int64_t f = 4 * NC + NCl;       // gradient scratch: dres x3, dln, datty (shard)
  if (layers > 0) f += NC + 11 * NCl;  // dln1; dqkv (3), dfch, dfch_gelu (4) of the shard
  f += layers * NC;                    // every block's output (res3)
  if (!recompute) f += layers * (block_scratch_bytes(c, B, T, tp) / 4);
  if (s.embedding) f += NC;                                    // encoded
  if (s.head) f += NC + 2 * N + N * c.padded_vocab_size / tp;  // ln_f, statistics, logits
  if (split_backward) {  // chunk_backward_input's saved gradients (fc and qkv of the shard)
    f += layers * (4 * NC + 7 * NCl);
    if (s.head) f += NC;
    if (s.embedding) f += NC;
  }
  return 4 * f;
}

gpt_activations::gpt_activations(const gpt_chunk& chunk, int B, int T,
                                 std::shared_ptr<block_scratch> recompute)
    : B_(B), T_(T), scratch_(std::move(recompute)) {
  const auto& c = chunk.config();
  check_micro_batch(c, B, T);
  if (scratch_ && (scratch_->batch() != B || scratch_->seq_len() != T))
    throw std::invalid_argument("gpt_activations: a block_scratch for micro-batches of " +
                                std::to_string(scratch_->batch()) + "x" +
                                std::to_string(scratch_->seq_len()) + ", not " + std::to_string(B) +
                                "x" + std::to_string(T));
  const int tp = chunk.shard().size;
  if (scratch_ && scratch_->acts_.qkv.shape()[1] != 3 * c.width / tp)
    throw std::invalid_argument("gpt_activations: a block_scratch for another tensor shard size");
  const std::int64_t N = std::int64_t{B} * T, C = c.width, Cl = C / tp;
  if (chunk.range().embedding) encoded_ = tensor::empty({N, C});
  for (int l = chunk.range().first_layer; l < chunk.range().last_layer; ++l) {
    if (scratch_) {
      layer_acts a = scratch_->acts_;  // the inner activations: views of the shared scratch
      a.res3 = tensor::empty({N, C});
      layers_.push_back(std::move(a));
    } else {
      layers_.push_back(allocate_block(c, B, T, true, tp));
    }
  }
  if (chunk.range().head) {
    lnf_ = tensor::empty({N, C});
    lnf_mean_ = tensor::empty({N});
    lnf_rstd_ = tensor::empty({N});
    logits_ = tensor::empty({N, std::int64_t{c.padded_vocab_size} / tp});
  }
  dres_ = tensor::empty({N, C});
  dres_next_ = tensor::empty({N, C});
  dres_mid_ = tensor::empty({N, C});
  dln_ = tensor::empty({N, C});
  datty_ = tensor::empty({N, Cl});
  if (!layers_.empty()) {
    dln1_ = tensor::empty({N, C});
    dqkv_ = tensor::empty({N, 3 * Cl});
    dfch_ = tensor::empty({N, 4 * Cl});
    dfch_gelu_ = tensor::empty({N, 4 * Cl});
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

// out[N,OC] = inp[N,K] * w[OC,K]^T + bias + residual. On a tensor shard the linear is
// row-parallel (K is the shard's slice): its partial products are all-reduced, then the
// (replicated) bias and the residual are added.
void row_parallel_forward(const gpt_chunk& st, float* out, const float* inp, const float* w,
                          const float* bias, const float* residual, int N, int K, int OC) {
  const std::int64_t n = std::int64_t{N} * OC;
  if (!st.shard().split()) {
    kernels::linear_forward(out, inp, w, bias, N, K, OC);
    add_into(out, residual, n);
    return;
  }
  kernels::linear_forward(out, inp, w, nullptr, N, K, OC);
  st.group().all_reduce_sum({out, static_cast<std::size_t>(n)});
#pragma omp parallel for schedule(static)
  for (std::int64_t row = 0; row < N; ++row) {
    float* o = out + row * OC;
    const float* r = residual + row * OC;
#pragma omp simd
    for (int c = 0; c < OC; ++c) o[c] = (o[c] + bias[c]) + r[c];
  }
}

// The tensor shard's slice of the vocabulary, for the vocabulary-parallel head.
kernels::vocab_shard vocab_of(const gpt_chunk& st) {
  const auto& c = st.config();
  const int cols = c.padded_vocab_size / st.shard().size;
  return {st.shard().rank * cols, cols, c.vocab_size, c.padded_vocab_size};
}

// Vocabulary-parallel cross-entropy over the shard's logits; with dlogits, also its gradient
// (dlogits may alias logits).
kernels::cross_entropy_result vocab_parallel_cross_entropy(const gpt_chunk& st, const float* logits,
                                                           float* dlogits,
                                                           const std::int32_t* targets, int N,
                                                           float grad_scale) {
  const auto v = vocab_of(st);
  std::vector<float> row_max(static_cast<std::size_t>(N));
  std::vector<double> stats(2 * static_cast<std::size_t>(N));
  kernels::vocab_shard_max(row_max.data(), logits, N, v);
  st.group().all_reduce_max(row_max);
  kernels::vocab_shard_stats(stats.data(), logits, targets, row_max.data(), N, v, ignore_index);
  st.group().all_reduce_sum(stats);
  const auto r = kernels::vocab_parallel_loss(targets, row_max.data(), stats.data(), N, v.V, v.Vp,
                                              ignore_index);
  if (dlogits)
    kernels::vocab_shard_backward(dlogits, logits, targets, row_max.data(), stats.data(), N, v,
                                  ignore_index, grad_scale, r.count);
  return r;
}

}  // namespace

const float* chunk_output(const gpt_activations& acts) {
  if (acts.logits_.numel() > 0) return acts.logits_.f32();
  if (!acts.layers_.empty()) return acts.layers_.back().res3.f32();
  return acts.encoded_.numel() > 0 ? acts.encoded_.f32() : acts.input_;
}

std::vector<std::vector<int>> pass_stops(const chunk_range& r, pass_kind kind, bool recompute) {
  const int layers = r.last_layer - r.first_layer;
  const int head = r.head ? 1 : 0;
  const int embedding = head + layers;  // its index, when the chunk has it
  auto layer = [&](int i) { return head + layers - 1 - i; };
  std::vector<int> head_stop;  // the head reads ln_f and wte (the embedding block's, if here)
  if (r.head) head_stop = r.embedding ? std::vector<int>{0, embedding} : std::vector<int>{0};
  std::vector<std::vector<int>> stops;
  if (kind == pass_kind::forward) {
    if (r.embedding) stops.push_back({embedding});
    for (int i = 0; i < layers; ++i) stops.push_back({layer(i)});
    if (r.head) stops.push_back(head_stop);
  } else if (kind == pass_kind::backward) {  // no embedding parameter: its gradient needs tokens
    if (r.head) stops.push_back(head_stop);
    for (int i = layers; i-- > 0;) stops.push_back({layer(i)});
  } else if (recompute) {  // weight gradients: only checkpointed blocks read parameters again
    for (int i = layers; i-- > 0;) stops.push_back({layer(i)});
  }
  return stops;
}

void chunk_forward(const gpt_chunk& chunk, gpt_activations& acts, const std::int32_t* tokens,
                   const float* input) {
  chunk_forward_pass(chunk, acts, tokens, input).run();
}

void block_forward(const gpt_chunk& chunk, int i, const block_activations& L, const float* x, int B,
                   int T, bool output) {
  // Cl, NH: the tensor shard's channels and heads (the whole block's without tensor parallelism).
  const int t = chunk.shard().size;
  const int C = chunk.config().width, Cl = C / t, NH = chunk.config().heads / t, N = B * T;
  const std::string p = "transformer.h." + std::to_string(chunk.range().first_layer + i) + ".";
  auto P = [&](const char* n) { return chunk.params() + chunk.parameter(p + n).offset; };
  kernels::layernorm_forward(L.ln1.f32(), L.ln1_mean.f32(), L.ln1_rstd.f32(), x, P("ln_1.weight"),
                             P("ln_1.bias"), N, C);
  kernels::linear_forward(L.qkv.f32(), L.ln1.f32(), P("attn.c_attn.weight"), P("attn.c_attn.bias"),
                          N, C, 3 * Cl);
  kernels::attention_forward(L.atty.f32(), L.att.f32(), L.qkv.f32(), B, T, Cl, NH);
  row_parallel_forward(chunk, L.res2.f32(), L.atty.f32(), P("attn.c_proj.weight"),
                       P("attn.c_proj.bias"), x, N, Cl, C);
  kernels::layernorm_forward(L.ln2.f32(), L.ln2_mean.f32(), L.ln2_rstd.f32(), L.res2.f32(),
                             P("ln_2.weight"), P("ln_2.bias"), N, C);
  kernels::linear_forward(L.fch.f32(), L.ln2.f32(), P("mlp.c_fc.weight"), P("mlp.c_fc.bias"), N, C,
                          4 * Cl);
  kernels::gelu_forward(L.fch_gelu.f32(), L.fch.f32(), std::int64_t{N} * 4 * Cl);
  if (!output) return;
  row_parallel_forward(chunk, L.res3.f32(), L.fch_gelu.f32(), P("mlp.c_proj.weight"),
                       P("mlp.c_proj.bias"), L.res2.f32(), N, 4 * Cl, C);
}

block_pass chunk_forward_pass(const gpt_chunk& chunk, gpt_activations& a,
                              const std::int32_t* tokens, const float* input) {
  const auto stops = pass_stops(chunk, pass_kind::forward);
  std::size_t stop = 0;
  auto next_stop = [&] { return stops.at(stop++); };
  const auto& c = chunk.config();
  const int B = a.B_, T = a.T_, C = c.width, Vl = c.padded_vocab_size / chunk.shard().size;
  const int N = B * T;
  if (a.weight_grads_pending_) {
    throw std::logic_error(
        "chunk_forward: these activations still wait for chunk_backward_weight, which needs them");
  }
  const float* x;
  if (chunk.range().embedding) {
    co_yield next_stop();
    a.tokens_ = tokens;
    const float* wte = chunk.param("transformer.wte.weight").f32();
    const float* wpe = chunk.param("transformer.wpe.weight").f32();
    if (chunk.shard().split()) {  // vocabulary-parallel: each token's row lives on one shard
      kernels::embedding_rows_forward(a.encoded_.f32(), tokens, wte, chunk.shard().rank * Vl, Vl, N,
                                      C);
      chunk.group().all_reduce_sum({a.encoded_.f32(), static_cast<std::size_t>(N) * C});
      kernels::add_positions(a.encoded_.f32(), wpe, B, T, C);
    } else {
      kernels::embedding_forward(a.encoded_.f32(), tokens, wte, wpe, B, T, C);
    }
    x = a.encoded_.f32();
  } else {
    a.input_ = input;
    x = input;
  }
  for (int i = 0; i < static_cast<int>(a.layers_.size()); ++i) {
    co_yield next_stop();
    const auto& L = a.layers_[static_cast<std::size_t>(i)];
    block_forward(chunk, i, L, x, B, T, true);
    x = L.res3.f32();
  }
  if (chunk.range().head) {
    co_yield next_stop();
    kernels::layernorm_forward(a.lnf_.f32(), a.lnf_mean_.f32(), a.lnf_rstd_.f32(), x,
                               chunk.param("transformer.ln_f.weight").f32(),
                               chunk.param("transformer.ln_f.bias").f32(), N, C);
    kernels::linear_forward(a.logits_.f32(), a.lnf_.f32(),
                            chunk.param("transformer.wte.weight").f32(), nullptr, N, C, Vl);
    a.logits_are_grads_ = false;
  }
}

kernels::cross_entropy_result chunk_loss(const gpt_chunk& chunk, gpt_activations& a,
                                         const std::int32_t* targets) {
  if (!chunk.range().head || a.logits_are_grads_)
    throw std::logic_error("chunk_loss needs fresh logits");
  const auto& c = chunk.config();
  if (chunk.shard().split())
    return vocab_parallel_cross_entropy(chunk, a.logits_.f32(), nullptr, targets, a.B_ * a.T_, 1);
  return kernels::cross_entropy_forward(nullptr, a.logits_.f32(), targets, a.B_ * a.T_,
                                        c.vocab_size, c.padded_vocab_size, ignore_index);
}

kernels::cross_entropy_result chunk_loss_backward_start(const gpt_chunk& chunk, gpt_activations& a,
                                                        const std::int32_t* targets,
                                                        float grad_scale) {
  if (!chunk.range().head || a.logits_are_grads_) {
    throw std::logic_error("chunk_loss_backward_start needs fresh logits");
  }
  const auto& c = chunk.config();
  auto r = chunk.shard().split()
               ? vocab_parallel_cross_entropy(chunk, a.logits_.f32(), a.logits_.f32(), targets,
                                              a.B_ * a.T_, grad_scale)
               : kernels::softmax_cross_entropy_backward(
                     a.logits_.f32(), a.logits_.f32(), targets, a.B_ * a.T_, c.vocab_size,
                     c.padded_vocab_size, ignore_index, grad_scale);
  a.logits_are_grads_ = true;
  return r;
}

}  // namespace troupe::engine
