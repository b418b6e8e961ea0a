// GPT-2 chunk backward, whole (chunk_backward) or split into B (chunk_backward_input) and W
// (chunk_backward_weight) for zero-bubble pipeline schedules. See gpt_model.hpp.
//
// Invariants:
//  - Every block (head, each transformer layer, embedding) has an input part (the gradient of
//    the block's input from the gradient of its output, no weight GEMM) and a weight part (its
//    parameter gradients from the gradients of its linear / layernorm outputs). The kernels'
//    input-only and weight-only calls do the arithmetic of the full call, so whole and split
//    backward produce the same numbers bitwise.
//  - Whole backward runs each block's weight part right after its input part, with the output
//    gradients in scratch; B writes them into acts.saved_ instead and W reads them from there.
//  - Blocks complete in chunk_grad_blocks order: head, layers last to first, embedding.
#include <cstring>
#include <stdexcept>
#include <utility>

#include "engine/model/gpt_model.hpp"

namespace troupe::engine {

namespace {

std::string layer_prefix(int layer) { return "transformer.h." + std::to_string(layer) + "."; }

void zero(float* p, std::int64_t n) { std::memset(p, 0, static_cast<std::size_t>(n) * 4); }

// Calls on_done(0), on_done(1), ... as blocks complete.
struct block_counter {
  const grad_block_fn& on_done;
  int next = 0;
  void done() {
    if (on_done) on_done(next);
    ++next;
  }
};

}  // namespace

std::vector<grad_block> chunk_grad_blocks(const gpt_chunk& chunk) {
  // (offset, numel) from the first parameter named to the end of the last, which follow each
  // other in the layout.
  auto span = [&chunk](const std::string& first, const std::string& last) {
    const auto& a = chunk.parameter(first);
    const auto& b = chunk.parameter(last);
    return std::pair<std::int64_t, std::int64_t>{a.offset, b.offset + b.numel - a.offset};
  };
  const auto& r = chunk.range();
  std::vector<grad_block> blocks;
  if (r.head) {
    grad_block head{"head", {}};
    if (!r.embedding)
      head.ranges.push_back(span("transformer.wte.weight", "transformer.wte.weight"));
    head.ranges.push_back(span("transformer.ln_f.weight", "transformer.ln_f.bias"));
    blocks.push_back(std::move(head));
  }
  for (int l = r.last_layer; l-- > r.first_layer;) {
    const std::string p = layer_prefix(l);
    blocks.push_back({"h." + std::to_string(l), {span(p + "ln_1.weight", p + "mlp.c_proj.bias")}});
  }
  if (r.embedding) {
    blocks.push_back({"embedding", {span("transformer.wte.weight", "transformer.wpe.weight")}});
  }
  return blocks;
}

// One backward pass over one micro-batch's activations. A friend of gpt_activations.
struct backward_pass {
  // Where the gradients of a layer's linear and layernorm outputs live during a pass.
  struct layer_grads {
    float *mlp_proj, *fc, *ln2, *attn_proj, *qkv, *ln1;
  };

  // On a tensor shard, Cl, NH and Vl are the shard's channels, heads and vocabulary rows
  // (the whole model's without tensor parallelism); NCl = N * Cl.
  const gpt_chunk& chunk;
  gpt_activations& a;
  const int B, T, C, Cl, NH, Vl, N;
  const std::int64_t NC, NCl;
  const std::size_t layers;

  backward_pass(const gpt_chunk& s, gpt_activations& acts)
      : chunk(s),
        a(acts),
        B(acts.B_),
        T(acts.T_),
        C(s.config().width),
        Cl(s.config().width / s.shard().size),
        NH(s.config().heads / s.shard().size),
        Vl(s.config().padded_vocab_size / s.shard().size),
        N(acts.B_ * acts.T_),
        NC(std::int64_t{acts.B_} * acts.T_ * s.config().width),
        NCl(std::int64_t{acts.B_} * acts.T_ * Cl),
        layers(acts.layers_.size()) {}

  // The gradient of a replicated input of a column-parallel piece is the sum of the shards'.
  void all_reduce(float* d, std::int64_t n) const {
    if (chunk.shard().split()) chunk.group().all_reduce_sum({d, static_cast<std::size_t>(n)});
  }

  const float* param(const std::string& name) const {
    return chunk.params() + chunk.parameter(name).offset;
  }
  float* grad(const std::string& name) const {
    return chunk.grads() + chunk.parameter(name).offset;
  }
  std::string prefix(std::size_t i) const {
    return layer_prefix(chunk.range().first_layer + static_cast<int>(i));
  }
  // The input of layer i (or of the head when i == layers).
  const float* layer_input(std::size_t i) const {
    if (i > 0) return a.layers_[i - 1].res3.f32();
    return chunk.range().embedding ? a.encoded_.f32() : a.input_;
  }

  // Checkpointing: block i's inner activations, recomputed into the shared scratch from its
  // saved input. Must run right before the block's backward, with no pass stop between.
  void recompute(std::size_t i) const {
    if (a.recomputes())
      block_forward(chunk, static_cast<int>(i), a.layers_[i], layer_input(i), B, T, false);
  }

  void require_loss(const char* who) const {
    if (chunk.range().head && !a.logits_are_grads_)
      throw std::logic_error(std::string(who) + " on the last chunk needs the loss first");
  }

  // Whole backward: the output gradients in scratch, mlp_proj (the layer's output gradient)
  // wherever the caller keeps it.
  layer_grads scratch_grads(float* dout) const {
    return {dout, a.dfch_.f32(), a.dln_.f32(), a.dres_mid_.f32(), a.dqkv_.f32(), a.dln1_.f32()};
  }
  layer_grads saved_grads(std::size_t i) const {
    auto& g = a.saved_.layers[i];
    return {g.mlp_proj.f32(), g.fc.f32(), g.ln2.f32(), g.attn_proj.f32(), g.qkv.f32(), g.ln1.f32()};
  }

  void allocate_saved() {
    if (a.saved_allocated_) return;
    auto& s = a.saved_;
    s.layers.resize(layers);
    for (auto& g : s.layers) {
      g.mlp_proj = kernels::tensor::empty({N, C});
      g.fc = kernels::tensor::empty({N, 4 * Cl});
      g.ln2 = kernels::tensor::empty({N, C});
      g.attn_proj = kernels::tensor::empty({N, C});
      g.qkv = kernels::tensor::empty({N, 3 * Cl});
      g.ln1 = kernels::tensor::empty({N, C});
    }
    if (chunk.range().head) s.lnf = kernels::tensor::empty({N, C});
    if (chunk.range().embedding) s.encoded = kernels::tensor::empty({N, C});
    a.saved_allocated_ = true;
  }

  // ---- head: logits = ln_f(x) * wte^T ------------------------------------------------------
  // dlnf receives the gradient of ln_f's output, dx (overwritten) that of the head's input.
  void head_input(float* dlnf, float* dx) const {
    zero(dlnf, NC);
    kernels::linear_backward(dlnf, nullptr, nullptr, a.logits_.f32(), a.lnf_.f32(),
                             param("transformer.wte.weight"), N, C, Vl);
    all_reduce(dlnf, NC);
    zero(dx, NC);
    kernels::layernorm_backward(dx, nullptr, nullptr, dlnf, layer_input(layers),
                                param("transformer.ln_f.weight"), a.lnf_mean_.f32(),
                                a.lnf_rstd_.f32(), N, C);
  }
  void head_weight(const float* dlnf) const {
    kernels::linear_backward(nullptr, grad("transformer.wte.weight"), nullptr, a.logits_.f32(),
                             a.lnf_.f32(), param("transformer.wte.weight"), N, C, Vl);
    kernels::layernorm_backward(nullptr, grad("transformer.ln_f.weight"),
                                grad("transformer.ln_f.bias"), dlnf, layer_input(layers),
                                param("transformer.ln_f.weight"), a.lnf_mean_.f32(),
                                a.lnf_rstd_.f32(), N, C);
  }

  // ---- transformer layer i ------------------------------------------------------------------
  // From g.mlp_proj (the gradient of the layer's output) fills the other output gradients of g
  // and OVERWRITES dx (distinct from g's buffers) with the gradient of the layer's input.
  void layer_input_grad(std::size_t i, const layer_grads& g, float* dx) const {
    const auto& L = a.layers_[i];
    const std::string p = prefix(i);
    auto P = [&](const char* n) { return param(p + n); };
    // MLP branch: res3 = res2 + c_proj(gelu(c_fc(ln_2(res2)))).
    float* dfch_gelu = a.dfch_gelu_.f32();
    zero(dfch_gelu, 4 * NCl);
    kernels::linear_backward(dfch_gelu, nullptr, nullptr, g.mlp_proj, L.fch_gelu.f32(),
                             P("mlp.c_proj.weight"), N, 4 * Cl, C);
    zero(g.fc, 4 * NCl);
    kernels::gelu_backward(g.fc, L.fch.f32(), dfch_gelu, 4 * NCl);
    zero(g.ln2, NC);
    kernels::linear_backward(g.ln2, nullptr, nullptr, g.fc, L.ln2.f32(), P("mlp.c_fc.weight"), N, C,
                             4 * Cl);
    all_reduce(g.ln2, NC);
    std::memcpy(g.attn_proj, g.mlp_proj, static_cast<std::size_t>(NC) * sizeof(float));
    kernels::layernorm_backward(g.attn_proj, nullptr, nullptr, g.ln2, L.res2.f32(),
                                P("ln_2.weight"), L.ln2_mean.f32(), L.ln2_rstd.f32(), N, C);
    // Attention branch: res2 = x + c_proj(attn(c_attn(ln_1(x)))).
    float* datty = a.datty_.f32();
    zero(datty, NCl);
    kernels::linear_backward(datty, nullptr, nullptr, g.attn_proj, L.atty.f32(),
                             P("attn.c_proj.weight"), N, Cl, C);
    zero(g.qkv, 3 * NCl);
    kernels::attention_backward(g.qkv, datty, L.qkv.f32(), L.att.f32(), B, T, Cl, NH);
    zero(g.ln1, NC);
    kernels::linear_backward(g.ln1, nullptr, nullptr, g.qkv, L.ln1.f32(), P("attn.c_attn.weight"),
                             N, C, 3 * Cl);
    all_reduce(g.ln1, NC);
    std::memcpy(dx, g.attn_proj, static_cast<std::size_t>(NC) * sizeof(float));
    kernels::layernorm_backward(dx, nullptr, nullptr, g.ln1, layer_input(i), P("ln_1.weight"),
                                L.ln1_mean.f32(), L.ln1_rstd.f32(), N, C);
  }
  void layer_weight(std::size_t i, const layer_grads& g) const {
    const auto& L = a.layers_[i];
    const std::string p = prefix(i);
    auto P = [&](const char* n) { return param(p + n); };
    auto G = [&](const char* n) { return grad(p + n); };
    kernels::linear_backward(nullptr, G("mlp.c_proj.weight"), G("mlp.c_proj.bias"), g.mlp_proj,
                             L.fch_gelu.f32(), P("mlp.c_proj.weight"), N, 4 * Cl, C);
    kernels::linear_backward(nullptr, G("mlp.c_fc.weight"), G("mlp.c_fc.bias"), g.fc, L.ln2.f32(),
                             P("mlp.c_fc.weight"), N, C, 4 * Cl);
    kernels::layernorm_backward(nullptr, G("ln_2.weight"), G("ln_2.bias"), g.ln2, L.res2.f32(),
                                P("ln_2.weight"), L.ln2_mean.f32(), L.ln2_rstd.f32(), N, C);
    kernels::linear_backward(nullptr, G("attn.c_proj.weight"), G("attn.c_proj.bias"), g.attn_proj,
                             L.atty.f32(), P("attn.c_proj.weight"), N, Cl, C);
    kernels::linear_backward(nullptr, G("attn.c_attn.weight"), G("attn.c_attn.bias"), g.qkv,
                             L.ln1.f32(), P("attn.c_attn.weight"), N, C, 3 * Cl);
    kernels::layernorm_backward(nullptr, G("ln_1.weight"), G("ln_1.bias"), g.ln1, layer_input(i),
                                P("ln_1.weight"), L.ln1_mean.f32(), L.ln1_rstd.f32(), N, C);
  }

  // ---- embedding: out = wte[tokens] + wpe ---------------------------------------------------
  void embedding_weight(const float* dencoded) const {
    if (chunk.shard().split()) {  // vocabulary-parallel: the shard's rows only
      kernels::embedding_rows_backward(grad("transformer.wte.weight"), dencoded, a.tokens_,
                                       chunk.shard().rank * Vl, Vl, N, C);
      kernels::embedding_backward(nullptr, grad("transformer.wpe.weight"), dencoded, a.tokens_, B,
                                  T, C);
      return;
    }
    kernels::embedding_backward(grad("transformer.wte.weight"), grad("transformer.wpe.weight"),
                                dencoded, a.tokens_, B, T, C);
  }

  // The top of the chain: the head's input gradient, or a copy of doutput, into dx.
  void chunk_output_grad(const float* doutput, float* dlnf, float* dx) const {
    if (chunk.range().head) {
      head_input(dlnf, dx);
    } else if (dx != doutput) {
      std::memcpy(dx, doutput, static_cast<std::size_t>(NC) * sizeof(float));
    }
  }

  // A coroutine (block_pass): stops before each piece that reads parameters, at pass_stops.
  block_pass run_whole(const float* doutput, float* dinput, grad_block_fn on_block_done) {
    require_loss("chunk_backward");
    const auto stops = pass_stops(chunk, pass_kind::backward);
    std::size_t stop = 0;
    auto next_stop = [&] { return stops.at(stop++); };
    block_counter blocks{on_block_done};
    float* const dinput_direct = chunk.range().embedding ? nullptr : dinput;
    // top: the gradient of the current block's output; spare: free for its input's.
    float* top = layers == 0 && dinput_direct ? dinput_direct : a.dres_.f32();
    float* spare = a.dres_next_.f32();
    if (chunk.range().head) co_yield next_stop();
    chunk_output_grad(doutput, a.dln_.f32(), top);
    if (chunk.range().head) {
      head_weight(a.dln_.f32());
      blocks.done();
    }
    for (std::size_t i = layers; i-- > 0;) {
      co_yield next_stop();
      float* dx = i == 0 && dinput_direct ? dinput_direct : spare;
      const layer_grads g = scratch_grads(top);
      recompute(i);
      layer_input_grad(i, g, dx);
      layer_weight(i, g);
      blocks.done();
      spare = top;
      top = dx;
    }
    if (chunk.range().embedding) {
      embedding_weight(top);
      blocks.done();
    }
  }

  block_pass run_input(const float* doutput, float* dinput, grad_block_fn /*unused*/) {
    require_loss("chunk_backward_input");
    const auto stops = pass_stops(chunk, pass_kind::backward);
    std::size_t stop = 0;
    auto next_stop = [&] { return stops.at(stop++); };
    if (a.weight_grads_pending_) {
      throw std::logic_error(
          "chunk_backward_input: the previous chunk_backward_input on these activations still "
          "waits for its chunk_backward_weight");
    }
    allocate_saved();
    auto& s = a.saved_;
    float* const stage_dx = chunk.range().embedding ? s.encoded.f32()
                            : dinput                ? dinput
                                                    : a.dres_.f32();
    // Where the gradient of layer i's input goes: layer i-1's saved output gradient (i == 0:
    // the chunk's input gradient; i == layers: the head's input, or doutput's copy).
    auto input_grad_of = [&](std::size_t i) {
      return i == 0 ? stage_dx : s.layers[i - 1].mlp_proj.f32();
    };
    if (chunk.range().head) co_yield next_stop();
    chunk_output_grad(doutput, chunk.range().head ? s.lnf.f32() : nullptr, input_grad_of(layers));
    for (std::size_t i = layers; i-- > 0;) {
      co_yield next_stop();
      recompute(i);
      layer_input_grad(i, saved_grads(i), input_grad_of(i));
    }
    a.weight_grads_pending_ = true;
  }

  block_pass run_weight(const float* /*unused*/, float* /*unused*/, grad_block_fn on_block_done) {
    const auto stops = pass_stops(chunk, pass_kind::weight, a.recomputes());
    std::size_t stop = 0;
    auto next_stop = [&] { return stops.at(stop++); };
    if (!a.weight_grads_pending_) {
      throw std::logic_error(
          "chunk_backward_weight: no chunk_backward_input on these activations waits for its "
          "weight gradients");
    }
    a.weight_grads_pending_ = false;  // a second W must throw, not add the gradients twice
    block_counter blocks{on_block_done};
    const auto& s = a.saved_;
    if (chunk.range().head) {
      head_weight(s.lnf.f32());
      blocks.done();
    }
    for (std::size_t i = layers; i-- > 0;) {
      if (a.recomputes()) co_yield next_stop();  // checkpointing: W reads the block's parameters
      recompute(i);
      layer_weight(i, saved_grads(i));
      blocks.done();
    }
    if (chunk.range().embedding) {
      embedding_weight(s.encoded.f32());
      blocks.done();
    }
  }
};

namespace {

// Runs a backward_pass coroutine whose backward_pass object lives in this frame.
block_pass drive(backward_pass p,
                 block_pass (backward_pass::*run)(const float*, float*, grad_block_fn),
                 const float* doutput, float* dinput, grad_block_fn on_block_done) {
  auto inner = (p.*run)(doutput, dinput, std::move(on_block_done));
  while (const auto* stop = inner.next()) co_yield *stop;
}

}  // namespace

block_pass chunk_backward_pass(const gpt_chunk& chunk, gpt_activations& acts, const float* doutput,
                               float* dinput, grad_block_fn on_block_done) {
  return drive(backward_pass(chunk, acts), &backward_pass::run_whole, doutput, dinput,
               std::move(on_block_done));
}

block_pass chunk_backward_input_pass(const gpt_chunk& chunk, gpt_activations& acts,
                                     const float* doutput, float* dinput) {
  return drive(backward_pass(chunk, acts), &backward_pass::run_input, doutput, dinput, {});
}

void chunk_backward(const gpt_chunk& chunk, gpt_activations& acts, const float* doutput,
                    float* dinput, const grad_block_fn& on_block_done) {
  chunk_backward_pass(chunk, acts, doutput, dinput, on_block_done).run();
}

void chunk_backward_input(const gpt_chunk& chunk, gpt_activations& acts, const float* doutput,
                          float* dinput) {
  chunk_backward_input_pass(chunk, acts, doutput, dinput).run();
}

block_pass chunk_backward_weight_pass(const gpt_chunk& chunk, gpt_activations& acts,
                                      grad_block_fn on_block_done) {
  return drive(backward_pass(chunk, acts), &backward_pass::run_weight, nullptr, nullptr,
               std::move(on_block_done));
}

void chunk_backward_weight(const gpt_chunk& chunk, gpt_activations& acts,
                           const grad_block_fn& on_block_done) {
  chunk_backward_weight_pass(chunk, acts, on_block_done).run();
}

}  // namespace troupe::engine
