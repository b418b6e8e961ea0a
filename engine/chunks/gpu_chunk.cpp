// One pipeline chunk of GPT-2 on one CUDA device. See gpu_chunk.hpp. Host code only: every
// kernel is enqueued through kernels/cuda/cuda_ops.hpp on the chunk's stream.
#include "engine/chunks/gpu_chunk.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/device_info.hpp"
#include "kernels/cuda/paged_buffer.hpp"

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

// Makes `device` current for the calling thread (actors move between threads).
struct device_guard {
  explicit device_guard(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }
};

}  // namespace

bool cuda_training_available(std::string* why_not) {
  if (kernels::cuda_device_count() > 0) return true;
  if (why_not) *why_not = "no usable CUDA device";
  return false;
}

bool cudnn_attention_usable(std::string* why_not) { return cu::cudnn_attention_available(why_not); }

// What does not depend on the compute dtype; model_impl<D> adds the rest. The device is made
// current before the context is created (its stream and cuBLASLt handle belong to it).
struct gpu_chunk::impl {
  explicit impl(int device_) : device(device_), guard(device_) {
    for (auto& e : events) {
      if (const cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
          r != cudaSuccess) {
        destroy_events();  // the destructor will not run
        check(r, "cudaEventCreate");
      }
    }
  }
  virtual ~impl() { destroy_events(); }
  void destroy_events() noexcept {
    for (auto& e : events)
      if (e) cudaEventDestroy(std::exchange(e, nullptr));
  }
  // The 16-bit working copy of the weights (bf16 / fp16 runs) and every activation buffer.
  virtual void allocate() = 0;
  virtual void add_slot() = 0;  // one more slot's buffers
  virtual void* input(int slot) = 0;
  virtual void* input_gradient(int slot) = 0;
  // forward and backward as passes stopping before each piece that reads parameters
  // (pass_stops); forward's loss (a head chunk's) and backward's input gradient come out
  // through the last argument once the pass is done.
  virtual block_pass forward_pass(int slot, const std::int32_t* tokens, const std::int32_t* targets,
                                  float loss_scale, bool train, int seq_len, double* loss) = 0;
  virtual std::vector<float> last_logits(int slot, const std::int32_t* tokens, int seq_len) = 0;
  virtual const void* output(int slot) const = 0;
  // input_only (a split backward's B): the weight gradients of the linears and the embedding
  // are left to backward_weight (W), what they need kept in the slot.
  virtual block_pass backward_pass(int slot, const void* doutput, grad_block_fn on_block_done,
                                   bool input_only, const void** result) = 0;
  // W, stopping before each block it recomputes (pass_stops(range, weight, recompute)).
  virtual block_pass backward_weight_pass(int slot, grad_block_fn on_block_done) = 0;
  // AdamW on every parameter; the working copy, if any, receives the new weights.
  virtual void adamw(const kernels::adamw_hparams& hp, int step, float grad_multiplier) = 0;
  // The same on the owned segments alone, with the owned moments.
  virtual void adamw_owned(const kernels::adamw_hparams& hp, int step, float grad_multiplier) = 0;
  // The 16-bit copy of master weights [at, at + n), after they changed (nothing for fp32).
  virtual void refresh_working(std::int64_t at, std::int64_t n) = 0;

  const parameter_info& param(const std::string& name) const {
    const auto it = by_name.find(name);
    if (it == by_name.end()) throw std::logic_error("gpu_chunk: no parameter " + name);
    return *it->second;
  }
  void check_slot(int slot) const {
    if (slot < 0 || slot >= slots)
      throw std::out_of_range("gpu_chunk: slot " + std::to_string(slot) + " outside [0, " +
                              std::to_string(slots) + ")");
  }

  // Tensor parallelism: the shard's collectives, on this chunk's stream (a no-op for a whole
  // chunk). Every shard of a group calls them in the same order: they run the same passes.
  bool split() const { return shard.split(); }
  void all_reduce(void* data, std::int64_t n) {
    if (split()) group->all_reduce_sum(data, n, dtype, ctx.stream());
  }

  int device = 0;
  device_guard guard;
  gpt_config config;
  chunk_range range;
  tensor_shard shard;
  std::shared_ptr<device_tensor_group> group;  // a split shard's
  compute_dtype dtype = compute_dtype::fp32;
  // T_max: what the buffers hold; T: the micro-batch being computed (its slot's, set by
  // forward and backward).
  int B = 0, T_max = 0, T = 0, slots = 1;
  std::size_t element_bytes = 4;  // of an activation in the compute dtype
  std::vector<parameter_info> layout;
  std::unordered_map<std::string, const parameter_info*> by_name;  // into layout
  std::int64_t P = 0;
  cu::context ctx;
  // record_event()'s, used in turn: an event handed out marks its point of the stream until
  // the ring comes round, and a later point after that (waiting on it then orders more work,
  // never less), so a bucket's event may wait in a reducer while backward goes on.
  std::array<cudaEvent_t, 32> events{};
  std::size_t next_event = 0;
  device_arena arena;
  // ZeRO-3 through the devices (gpu_trainer_options::paged_parameters): the master weights and
  // their 16-bit copy mapped by granule, so released buckets give their memory back.
  std::unique_ptr<cu::paged_buffer> paged_master, paged_working;
  float *master = nullptr, *grads = nullptr, *m = nullptr, *v = nullptr;
  float* scratch = nullptr;  // gradient_scratch()
  std::int64_t scratch_floats = 0;
  // begin_state_copy's pinned host buffer, copy stream and events (made at its first call).
  struct pinned_copy {
    float* host = nullptr;
    std::int64_t floats = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, done = nullptr;
    pinned_copy() = default;
    pinned_copy(const pinned_copy&) = delete;
    pinned_copy& operator=(const pinned_copy&) = delete;
    ~pinned_copy() {
      if (done) cudaEventDestroy(done);
      if (start) cudaEventDestroy(start);
      if (stream) cudaStreamDestroy(stream);
      if (host) cudaFreeHost(host);
    }
  };
  std::unique_ptr<pinned_copy> state_copy;
  std::vector<shard_segment> owned;  // ZeRO through a zero_group: the owned segments
  float *owned_m = nullptr, *owned_v = nullptr;
  float* owned_p = nullptr;  // ZeRO-3: their master weights
  std::int64_t owned_floats = 0;
  bool recompute = false;
  bool split_backward = false;  // slots keep what a split backward's W needs
  attention_kernel attention = attention_kernel::fused;
};

namespace {

// Everything of one dtype: the weights the kernels read (W), activations and gradient scratch.
template <class D>
struct model_impl final : gpu_chunk::impl {
  using gpu_chunk::impl::impl;
  // A block's internals, kept for its backward (per slot and layer; one shared set with
  // recompute).
  struct block_buffers {
    D *ln1 = nullptr, *qkv = nullptr, *atty = nullptr, *res2 = nullptr, *ln2 = nullptr,
      *fch = nullptr, *fch_gelu = nullptr;
    float *ln1_mean = nullptr, *ln1_rstd = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr,
          *lse = nullptr;  // fused and cudnn attention: each query row's log-sum-exp
    D* probs = nullptr;    // materialized attention: the [T, T] probabilities per head
  };
  // What one micro-batch in flight keeps from its forward for its backward.
  struct slot_buffers {
    D* input = nullptr;                 // the embedding's output, or the received activation
    std::vector<block_buffers> blocks;  // per layer (without recompute)
    std::vector<D*> out;                // every block's output (res3)
    float *lnf_mean = nullptr, *lnf_rstd = nullptr;  // head
    D* dlnf = nullptr;                               // head: the gradient of ln_f's output
    std::vector<std::int32_t> tokens;                // embedding: the tokens, for dwte
    int T = 0;                                       // its micro-batch's sequence length
    // Split backward: per layer, the output gradients of its four linears, kept from B for W;
    // and the embedding's output gradient.
    struct deferred {
      D *dres = nullptr, *dfc = nullptr, *dmid = nullptr, *dqkv = nullptr;
    };
    std::vector<deferred> wgrad;
    D* demb = nullptr;
    D* dinput = nullptr;  // split backward, a chunk without the embedding: the input's gradient
  };
  int layers() const { return range.last_layer - range.first_layer; }
  bool materialized() const { return attention == attention_kernel::materialized; }
  // The shard's channels of the column-parallel pieces, heads and vocabulary rows (the whole
  // model's without tensor parallelism).
  int Cl() const { return config.width / shard.size; }
  int NHl() const { return config.heads / shard.size; }
  int Vl() const { return config.padded_vocab_size / shard.size; }
  kernels::vocab_shard vocab() const {
    return {shard.rank * Vl(), Vl(), config.vocab_size, config.padded_vocab_size};
  }

  // A deque: a pass suspended at a stop keeps a reference to its slot while add_slot appends.
  std::deque<slot_buffers> slot_state;
  block_buffers shared;                 // recompute: every block's internals
  int held_slot = -1, held_layer = -1;  // recompute: which block `shared` holds
  D* working = nullptr;                 // bf16 / fp16 runs: the 16-bit weights
  std::int32_t *d_tokens = nullptr, *d_targets = nullptr;
  cu::token_groups groups;
  cu::adamw_segments adamw_table;  // fast kernels: the layout's parameters, for one AdamW launch
  D *lnf = nullptr, *logits = nullptr;
  float* losses = nullptr;
  float* att_delta = nullptr;                  // fused attention backward's scratch
  D* att_work = nullptr;                       // materialized attention's scratch
  float *row_max = nullptr, *stats = nullptr;  // a split head: the cross-entropy's statistics
  D *da = nullptr, *db = nullptr, *dfch_gelu = nullptr, *dfc = nullptr, *dln = nullptr,
    *datty = nullptr, *dqkv = nullptr;

  // The weights the kernels read: the 16-bit copy, or the fp32 master weights.
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
  static std::string block_prefix(int layer) {
    return "transformer.h." + std::to_string(layer) + ".";
  }

  block_buffers alloc_block(std::int64_t N, std::int64_t NC) {
    const std::int64_t NCl = NC / shard.size;  // the shard's column-parallel pieces
    block_buffers b;
    b.ln1 = arena.alloc<D>(NC);
    b.qkv = arena.alloc<D>(3 * NCl);
    b.atty = arena.alloc<D>(NCl);
    b.res2 = arena.alloc<D>(NC);
    b.ln2 = arena.alloc<D>(NC);
    b.fch = arena.alloc<D>(4 * NCl);
    b.fch_gelu = arena.alloc<D>(4 * NCl);
    b.ln1_mean = arena.alloc<float>(N);
    b.ln1_rstd = arena.alloc<float>(N);
    b.ln2_mean = arena.alloc<float>(N);
    b.ln2_rstd = arena.alloc<float>(N);
    if (materialized()) {
      b.probs = arena.alloc<D>(cu::attention_probs_values(B, T_max, NHl()));
    } else {
      b.lse = arena.alloc<float>(std::int64_t{B} * NHl() * T_max);
    }
    return b;
  }

  // Keep in step with plan_gpu_chunk_memory (gpu_plan.cpp): the GPU suite checks
  // device_bytes() against it.
  void allocate() override {
    if (attention == attention_kernel::cudnn) {  // before any memory: one line naming cuDNN
      std::string why;
      if (!cu::cudnn_attention_available(&why))
        throw cu::cuda_error(why + "; kernels.attention = \"materialized\" needs no cuDNN");
    }
    const int C = config.width;
    const std::int64_t N = std::int64_t{B} * T_max, NC = N * C, NCl = NC / shard.size;
    if constexpr (!std::is_same_v<D, float>) {
      if (paged_master) {
        paged_working =
            std::make_unique<cu::paged_buffer>(device, static_cast<std::size_t>(P) * sizeof(D));
        working = static_cast<D*>(paged_working->data());
      } else {
        working = arena.alloc<D>(P);
      }
      cu::convert(ctx, working, master, P);
    }
    if (recompute && layers() > 0) shared = alloc_block(N, NC);
    slot_state.resize(static_cast<std::size_t>(slots));
    for (auto& s : slot_state) alloc_slot(s);
    if (range.embedding) d_tokens = arena.alloc<std::int32_t>(N);
    if (range.head) {
      d_targets = arena.alloc<std::int32_t>(N);
      lnf = arena.alloc<D>(NC);
      logits = arena.alloc<D>(N * Vl());
      losses = arena.alloc<float>(N);
      if (split()) {
        row_max = arena.alloc<float>(N);
        stats = arena.alloc<float>(2 * N);
      }
    }
    if (layers() > 0 && materialized()) {
      att_work = arena.alloc<D>(cu::attention_materialized_scratch_values(B, T_max, Cl(), NHl()));
    } else if (layers() > 0 && attention == attention_kernel::fused) {
      att_delta = arena.alloc<float>(cu::attention_scratch_floats(B, T_max, NHl()));
    }
    da = arena.alloc<D>(NC);
    db = arena.alloc<D>(NC);
    dfch_gelu = arena.alloc<D>(4 * NCl);
    dfc = arena.alloc<D>(4 * NCl);
    dln = arena.alloc<D>(NC);
    datty = arena.alloc<D>(NCl);
    dqkv = arena.alloc<D>(3 * NCl);
  }

  void alloc_slot(slot_buffers& s) {
    const std::int64_t N = std::int64_t{B} * T_max, NC = N * config.width;
    const std::int64_t NCl = NC / shard.size;
    s.input = arena.alloc<D>(NC);
    for (int l = 0; l < layers(); ++l) {
      if (!recompute) s.blocks.push_back(alloc_block(N, NC));
      s.out.push_back(arena.alloc<D>(NC));
      if (split_backward) {
        typename slot_buffers::deferred w;
        w.dres = arena.alloc<D>(NC);
        w.dfc = arena.alloc<D>(4 * NCl);
        w.dmid = arena.alloc<D>(NC);
        w.dqkv = arena.alloc<D>(3 * NCl);
        s.wgrad.push_back(w);
      }
    }
    if (split_backward && range.embedding) s.demb = arena.alloc<D>(NC);
    if (split_backward && !range.embedding) s.dinput = arena.alloc<D>(NC);
    if (range.head) {
      s.lnf_mean = arena.alloc<float>(N);
      s.lnf_rstd = arena.alloc<float>(N);
      s.dlnf = arena.alloc<D>(NC);
    }
  }
  void add_slot() override {
    slot_buffers s;
    alloc_slot(s);
    slot_state.push_back(std::move(s));
    ++slots;
  }

  const block_buffers& internals(int slot, int l) const {
    return recompute
               ? shared
               : slot_state[static_cast<std::size_t>(slot)].blocks[static_cast<std::size_t>(l)];
  }
  const D* block_input(int slot, int l) const {
    const auto& s = slot_state[static_cast<std::size_t>(slot)];
    return l > 0 ? s.out[static_cast<std::size_t>(l) - 1] : s.input;
  }

  // Local block l of `slot` (layer first_layer + l): from its input into its internals and its
  // output.
  void block_forward(int slot, int l) {
    const int C = config.width, Cl = this->Cl(), N = B * T;
    const std::int64_t NC = std::int64_t{N} * C;
    const auto& L = internals(slot, l);
    const D* x = block_input(slot, l);
    D* out = slot_state[static_cast<std::size_t>(slot)].out[static_cast<std::size_t>(l)];
    const std::string p = block_prefix(range.first_layer + l);
    cu::layernorm_forward(ctx, L.ln1, L.ln1_mean, L.ln1_rstd, x, F(p + "ln_1.weight"),
                          F(p + "ln_1.bias"), N, C);
    cu::linear_forward(ctx, L.qkv, L.ln1, W(p + "attn.c_attn.weight"), W(p + "attn.c_attn.bias"), N,
                       C, 3 * Cl);
    if (materialized()) {
      cu::attention_materialized_forward(ctx, L.atty, L.probs, att_work, L.qkv, B, T, Cl, NHl());
    } else if (attention == attention_kernel::cudnn) {
      cu::attention_cudnn_forward(ctx, L.atty, L.lse, L.qkv, B, T, Cl, NHl());
    } else {
      cu::attention_forward(ctx, L.atty, L.lse, L.qkv, B, T, Cl, NHl());
    }
    row_parallel(L.res2, L.atty, p + "attn.c_proj.", N, Cl, C);
    cu::residual_layernorm_forward(ctx, L.res2, L.ln2, L.ln2_mean, L.ln2_rstd, L.res2, x,
                                   F(p + "ln_2.weight"), F(p + "ln_2.bias"), N, C);
    cu::linear_gelu_forward(ctx, L.fch_gelu, L.fch, L.ln2, W(p + "mlp.c_fc.weight"),
                            W(p + "mlp.c_fc.bias"), N, C, 4 * Cl);
    row_parallel(out, L.fch_gelu, p + "mlp.c_proj.", N, 4 * Cl, C);
    cu::residual_forward(ctx, out, out, L.res2, NC);
    held_slot = slot;
    held_layer = l;
  }

  // out[N, OC] = inp[N, K] weight^T + bias. On a tensor shard the linear is row-parallel (K is
  // the shard's slice): the partial products are summed over the shards, the replicated bias
  // added by shard 0 alone before the sum.
  void row_parallel(D* out, const D* inp, const std::string& prefix, int N, int K, int OC) {
    const D* bias = !split() || shard.rank == 0 ? W(prefix + "bias") : nullptr;
    cu::linear_forward(ctx, out, inp, W(prefix + "weight"), bias, N, K, OC);
    all_reduce(out, std::int64_t{N} * OC);
  }

  void* input(int slot) override {
    check_slot(slot);
    if (range.embedding)
      throw std::logic_error("gpu_chunk: a chunk with the embedding takes tokens, not an input");
    return slot_state[static_cast<std::size_t>(slot)].input;
  }

  void* input_gradient(int slot) override {
    void* in = input(slot);
    const auto& s = slot_state[static_cast<std::size_t>(slot)];
    return split_backward ? static_cast<void*>(s.dinput) : in;
  }

  const void* output(int slot) const override {
    check_slot(slot);
    if (range.head) throw std::logic_error("gpu_chunk: a head chunk has no output activation");
    const auto& s = slot_state[static_cast<std::size_t>(slot)];
    return layers() > 0 ? s.out.back() : s.input;
  }

  // The embedding (a chunk with it) and the blocks of one micro-batch of seq_len into `slot`,
  // as a pass stopping before each piece that reads parameters (pass_stops' forward stops but
  // the head's).
  block_pass blocks_pass(int slot, const std::int32_t* tokens, int seq_len) {
    const auto stops = pass_stops(range, pass_kind::forward);
    std::size_t k = 0;
    auto next_stop = [&] { return stops.at(k++); };
    check_slot(slot);
    if (seq_len < 1 || seq_len > T_max)
      throw std::invalid_argument("gpu_chunk: a micro-batch of sequence length " +
                                  std::to_string(seq_len) + " (the chunk holds 1 to " +
                                  std::to_string(T_max) + ")");
    slot_state[static_cast<std::size_t>(slot)].T = seq_len;
    const int C = config.width, V = config.vocab_size;
    const int N = B * seq_len;
    auto& s = slot_state[static_cast<std::size_t>(slot)];
    if (range.embedding) {
      co_yield next_stop();
      T = seq_len;  // the chunk's passes run one at a time, each setting T as it goes on
      if (!tokens) throw std::invalid_argument("gpu_chunk: the embedding chunk needs tokens");
      for (int i = 0; i < N; ++i) {
        if (tokens[i] < 0 || tokens[i] >= V)
          throw std::invalid_argument("gpu_chunk: token " + std::to_string(tokens[i]) +
                                      " outside the vocabulary of " + std::to_string(V));
      }
      s.tokens.assign(tokens, tokens + N);
      check(cudaMemcpyAsync(d_tokens, tokens, static_cast<std::size_t>(N) * sizeof(std::int32_t),
                            cudaMemcpyHostToDevice, ctx.stream()),
            "cudaMemcpyAsync(tokens)");
      if (split()) {  // vocabulary-parallel: each token's row lives on one shard
        cu::embedding_rows_forward(ctx, s.input, d_tokens, W("transformer.wte.weight"),
                                   shard.rank * Vl(), Vl(), N, C);
        all_reduce(s.input, std::int64_t{N} * C);
        cu::add_positions(ctx, s.input, W("transformer.wpe.weight"), B, T, C);
      } else {
        cu::embedding_forward(ctx, s.input, d_tokens, W("transformer.wte.weight"),
                              W("transformer.wpe.weight"), B, T, C);
      }
    }
    for (int l = 0; l < layers(); ++l) {
      co_yield next_stop();
      T = seq_len;
      block_forward(slot, l);
    }
  }

  std::vector<float> last_logits(int slot, const std::int32_t* tokens, int seq_len) override {
    if (!range.embedding || !range.head || split() || B != 1)
      throw std::logic_error("gpu_chunk: logits for sampling need the whole model, B = 1");
    blocks_pass(slot, tokens, seq_len).run();
    T = seq_len;
    const int C = config.width, V = config.vocab_size;
    auto& s = slot_state[static_cast<std::size_t>(slot)];
    const D* x = (layers() > 0 ? s.out.back() : s.input) + std::int64_t{T - 1} * C;
    cu::layernorm_forward(ctx, lnf, s.lnf_mean, s.lnf_rstd, x, F("transformer.ln_f.weight"),
                          F("transformer.ln_f.bias"), 1, C);  // the last position only
    cu::linear_forward<D>(ctx, logits, lnf, W("transformer.wte.weight"), nullptr, 1, C, Vl());
    std::vector<D> row(static_cast<std::size_t>(V));
    check(cudaMemcpyAsync(row.data(), logits, row.size() * sizeof(D), cudaMemcpyDeviceToHost,
                          ctx.stream()),
          "cudaMemcpyAsync(logits)");
    ctx.synchronize();
    std::vector<float> out(row.size());
    for (std::size_t i = 0; i < row.size(); ++i) out[i] = static_cast<float>(row[i]);
    return out;
  }

  block_pass forward_pass(int slot, const std::int32_t* tokens, const std::int32_t* targets,
                          float loss_scale, bool train, int seq_len, double* loss) override {
    block_pass blocks = blocks_pass(slot, tokens, seq_len);
    while (const auto* stop = blocks.next()) co_yield *stop;
    if (!range.head) {
      if (loss) *loss = std::numeric_limits<double>::quiet_NaN();
      co_return;
    }
    co_yield pass_stops(range, pass_kind::forward).back();
    T = seq_len;
    const double l = head_forward(slot, targets, loss_scale, train);
    if (loss) *loss = l;
  }

  // ln_f, the logits and the loss of slot's micro-batch (its blocks' output in place), and
  // when training the head's backward up to ln_f's output.
  double head_forward(int slot, const std::int32_t* targets, float loss_scale, bool train) {
    const int C = config.width, V = config.vocab_size, Vp = config.padded_vocab_size;
    const int N = B * T;
    auto& s = slot_state[static_cast<std::size_t>(slot)];

    if (!targets) throw std::invalid_argument("gpu_chunk: the head chunk needs targets");
    std::int64_t count = 0;
    for (int i = 0; i < N; ++i) {
      if (targets[i] == ignore_index) continue;
      if (targets[i] < 0 || targets[i] >= V)  // the kernel would read outside the logits row
        throw std::invalid_argument("gpu_chunk: target " + std::to_string(targets[i]) +
                                    " outside the vocabulary of " + std::to_string(V));
      ++count;
    }
    check(cudaMemcpyAsync(d_targets, targets, static_cast<std::size_t>(N) * sizeof(std::int32_t),
                          cudaMemcpyHostToDevice, ctx.stream()),
          "cudaMemcpyAsync(targets)");
    const D* x = layers() > 0 ? s.out.back() : s.input;
    cu::layernorm_forward(ctx, lnf, s.lnf_mean, s.lnf_rstd, x, F("transformer.ln_f.weight"),
                          F("transformer.ln_f.bias"), N, C);
    cu::linear_forward<D>(ctx, logits, lnf, W("transformer.wte.weight"), nullptr, N, C, Vl());
    // Leaves dlogits (seeded with loss_scale) in `logits`.
    const auto loss =
        split() ? vocab_parallel_loss(N, count, loss_scale)
                : cu::softmax_cross_entropy_backward(ctx, logits, logits, d_targets, losses, N, V,
                                                     Vp, ignore_index, count, loss_scale);
    if (train) {  // the head's backward up to ln_f's output: the logits are not kept
      zero(ctx, s.dlnf, std::int64_t{N} * C);
      cu::linear_backward(ctx, s.dlnf, G("transformer.wte.weight"), nullptr, logits, lnf,
                          W("transformer.wte.weight"), N, C, Vl());
      all_reduce(s.dlnf, std::int64_t{N} * C);  // ln_f's output feeds every vocabulary shard
    }
    return loss.mean();
  }

  // The vocabulary-parallel cross-entropy over the shard's logits (the CPU's steps and
  // collectives, engine/model/gpt_model.cpp): leaves the shard's dlogits in `logits`.
  kernels::cross_entropy_result vocab_parallel_loss(int N, std::int64_t count, float loss_scale) {
    const auto v = vocab();
    cu::vocab_shard_max(ctx, row_max, logits, N, v);
    group->all_reduce_max(row_max, N, ctx.stream());
    cu::vocab_shard_stats(ctx, stats, logits, d_targets, row_max, N, v, ignore_index);
    group->all_reduce_sum(stats, 2 * std::int64_t{N}, ctx.stream());
    return cu::vocab_parallel_cross_entropy_backward(ctx, logits, logits, d_targets, row_max, stats,
                                                     losses, N, v, ignore_index, count, loss_scale);
  }

  block_pass backward_pass(int slot, const void* doutput, grad_block_fn on_block_done,
                           bool input_only, const void** result) override {
    const auto stops = pass_stops(range, pass_kind::backward);
    std::size_t k = 0;
    auto next_stop = [&] { return stops.at(k++); };
    if (result) *result = nullptr;
    if (input_only && !split_backward)
      throw std::logic_error("gpu_chunk: a split backward in a chunk made without split_backward");
    // chunk_grad_blocks' order: the head, the layers from last to first, the embedding. A split
    // backward's B makes no block final (W does).
    int block = 0;
    auto done = [&] {
      if (on_block_done && !input_only) on_block_done(block);
      ++block;
    };
    check_slot(slot);
    T = slot_state[static_cast<std::size_t>(slot)].T;
    if (T < 1) throw std::logic_error("gpu_chunk: backward of a slot without forward");
    const int C = config.width, Cl = this->Cl();
    const int N = B * T;
    const std::int64_t NC = std::int64_t{N} * C, NCl = std::int64_t{N} * Cl;
    auto& s = slot_state[static_cast<std::size_t>(slot)];
    D* dres = da;  // the gradient of the current block's output, then of its input
    D* dmid = db;  // the gradient of res2
    if (range.head) {
      co_yield next_stop();
      T = s.T;
      zero(ctx, dres, NC);
      const D* x = layers() > 0 ? s.out.back() : s.input;
      cu::layernorm_backward(ctx, dres, G("transformer.ln_f.weight"), G("transformer.ln_f.bias"),
                             s.dlnf, x, F("transformer.ln_f.weight"), s.lnf_mean, s.lnf_rstd, N, C);
      done();  // the head's wte copy was accumulated by forward
    } else {
      if (!doutput) throw std::invalid_argument("gpu_chunk: backward needs the output's gradient");
      copy(ctx, dres, static_cast<const D*>(doutput), NC);
    }
    for (int l = layers() - 1; l >= 0; --l) {
      co_yield next_stop();
      T = s.T;
      // The block's internals: its own (no recompute), or the shared ones, recomputed unless
      // they still hold this block of this slot (the last block right after its forward).
      if (recompute && (held_slot != slot || held_layer != l)) block_forward(slot, l);
      const auto& L = internals(slot, l);
      const D* in = block_input(slot, l);
      const std::string p = block_prefix(range.first_layer + l);
      // B: the four linears' input gradients only; their output gradients kept for W (the
      // layernorms' weight gradients are B's).
      typename slot_buffers::deferred w;
      if (input_only) {
        w = s.wgrad[static_cast<std::size_t>(l)];
        copy(ctx, w.dres, dres, NC);
      }
      auto G_ = [&](const std::string& name) { return input_only ? nullptr : G(name); };
      D* dfc_ = input_only ? w.dfc : dfc;
      D* dqkv_ = input_only ? w.dqkv : dqkv;
      cu::linear_backward_dgelu(ctx, dfc_, dfch_gelu, G_(p + "mlp.c_proj.weight"),
                                G_(p + "mlp.c_proj.bias"), dres, L.fch_gelu, L.fch,
                                W(p + "mlp.c_proj.weight"), N, 4 * Cl, C);
      zero(ctx, dln, NC);
      cu::linear_backward(ctx, dln, G_(p + "mlp.c_fc.weight"), G_(p + "mlp.c_fc.bias"), dfc_, L.ln2,
                          W(p + "mlp.c_fc.weight"), N, C, 4 * Cl);
      all_reduce(dln, NC);  // ln_2's output feeds every shard's c_fc
      copy(ctx, dmid, dres, NC);
      cu::layernorm_backward(ctx, dmid, G(p + "ln_2.weight"), G(p + "ln_2.bias"), dln, L.res2,
                             F(p + "ln_2.weight"), L.ln2_mean, L.ln2_rstd, N, C);
      if (input_only) copy(ctx, w.dmid, dmid, NC);
      zero(ctx, datty, NCl);
      cu::linear_backward(ctx, datty, G_(p + "attn.c_proj.weight"), G_(p + "attn.c_proj.bias"),
                          dmid, L.atty, W(p + "attn.c_proj.weight"), N, Cl, C);
      if (materialized()) {
        zero(ctx, dqkv_, 3 * NCl);
        cu::attention_materialized_backward(ctx, dqkv_, datty, L.qkv, L.probs, att_work, B, T, Cl,
                                            NHl());
      } else if (attention == attention_kernel::cudnn) {  // writes dqkv_ whole
        cu::attention_cudnn_backward(ctx, dqkv_, datty, L.qkv, L.atty, L.lse, B, T, Cl, NHl());
      } else {
        zero(ctx, dqkv_, 3 * NCl);
        cu::attention_backward(ctx, dqkv_, datty, L.qkv, L.atty, L.lse, att_delta, B, T, Cl, NHl());
      }
      zero(ctx, dln, NC);
      cu::linear_backward(ctx, dln, G_(p + "attn.c_attn.weight"), G_(p + "attn.c_attn.bias"), dqkv_,
                          L.ln1, W(p + "attn.c_attn.weight"), N, C, 3 * Cl);
      all_reduce(dln, NC);  // ln_1's output feeds every shard's c_attn
      copy(ctx, dres, dmid, NC);
      cu::layernorm_backward(ctx, dres, G(p + "ln_1.weight"), G(p + "ln_1.bias"), dln, in,
                             F(p + "ln_1.weight"), L.ln1_mean, L.ln1_rstd, N, C);
      done();
    }
    if (!range.embedding) {
      if (result) *result = dres;
      co_return;
    }
    if (input_only) {  // the embedding's weight gradients are W's
      copy(ctx, s.demb, dres, NC);
      co_return;
    }
    embedding_backward(s, dres);
    done();
  }

  void embedding_backward(const slot_buffers& s, const D* dout) {
    const int N = B * T;
    if (split()) {  // the shard's rows of wte only
      groups.build(ctx, s.tokens.data(), N, shard.rank * Vl(), Vl());
    } else {
      groups.build(ctx, s.tokens.data(), N);
    }
    cu::embedding_backward(ctx, G("transformer.wte.weight"), G("transformer.wpe.weight"), dout,
                           groups, B, T, config.width);
  }

  // W of a split backward: the weight gradients B left, from what it kept; blocks final in
  // chunk_grad_blocks' order, as backward makes them. With recompute it stops before each block
  // (the recomputation reads the block's parameters).
  block_pass backward_weight_pass(int slot, grad_block_fn on_block_done) override {
    const auto stops = pass_stops(range, pass_kind::weight, recompute);
    std::size_t k = 0;
    auto next_stop = [&] { return stops.at(k++); };
    if (!split_backward)
      throw std::logic_error("gpu_chunk: a split backward in a chunk made without split_backward");
    check_slot(slot);
    auto& s = slot_state[static_cast<std::size_t>(slot)];
    T = s.T;
    const int C = config.width, Cl = this->Cl(), N = B * T;
    int block = 0;
    auto done = [&] {
      if (on_block_done) on_block_done(block);
      ++block;
    };
    if (range.head) done();  // ln_f's gradients are B's, the head's wte copy forward's
    for (int l = layers() - 1; l >= 0; --l) {
      // Recompute: the block's internals again, from its input (kept: B wrote the input's
      // gradient apart), unless the shared scratch still holds them.
      if (recompute) {
        co_yield next_stop();
        T = s.T;
      }
      if (recompute && (held_slot != slot || held_layer != l)) block_forward(slot, l);
      const auto& L = internals(slot, l);
      const auto& w = s.wgrad[static_cast<std::size_t>(l)];
      const std::string p = block_prefix(range.first_layer + l);
      cu::linear_backward<D>(ctx, nullptr, G(p + "mlp.c_proj.weight"), G(p + "mlp.c_proj.bias"),
                             w.dres, L.fch_gelu, W(p + "mlp.c_proj.weight"), N, 4 * Cl, C);
      cu::linear_backward<D>(ctx, nullptr, G(p + "mlp.c_fc.weight"), G(p + "mlp.c_fc.bias"), w.dfc,
                             L.ln2, W(p + "mlp.c_fc.weight"), N, C, 4 * Cl);
      cu::linear_backward<D>(ctx, nullptr, G(p + "attn.c_proj.weight"), G(p + "attn.c_proj.bias"),
                             w.dmid, L.atty, W(p + "attn.c_proj.weight"), N, Cl, C);
      cu::linear_backward<D>(ctx, nullptr, G(p + "attn.c_attn.weight"), G(p + "attn.c_attn.bias"),
                             w.dqkv, L.ln1, W(p + "attn.c_attn.weight"), N, C, 3 * Cl);
      done();
    }
    if (!range.embedding) co_return;
    embedding_backward(s, s.demb);
    done();
  }

  void refresh_working(std::int64_t at, std::int64_t n) override {
    if constexpr (!std::is_same_v<D, float>) cu::convert(ctx, working + at, master + at, n);
  }

  void adamw_owned(const kernels::adamw_hparams& hp, int step, float grad_multiplier) override {
    for (const auto& sg : owned) {
      const auto o = sg.offset;
      if (owned_p) {  // ZeRO-3: the owned copy; the working copy follows the next gather
        cu::adamw_update(ctx, owned_p + sg.at, grads + o, owned_m + sg.at, owned_v + sg.at,
                         sg.numel, hp, step, sg.decay, grad_multiplier,
                         static_cast<cu::bf16*>(nullptr));
      } else if constexpr (std::is_same_v<D, float>) {
        cu::adamw_update(ctx, master + o, grads + o, owned_m + sg.at, owned_v + sg.at, sg.numel, hp,
                         step, sg.decay, grad_multiplier, static_cast<cu::bf16*>(nullptr));
      } else {
        cu::adamw_update(ctx, master + o, grads + o, owned_m + sg.at, owned_v + sg.at, sg.numel, hp,
                         step, sg.decay, grad_multiplier, working + o);
      }
    }
  }

  void adamw(const kernels::adamw_hparams& hp, int step, float grad_multiplier) override {
    if (!m) throw std::logic_error("gpu_chunk: AdamW in a chunk made without optimizer state");
    if (ctx.fast_kernels()) {  // one launch over the flat buffers
      if (adamw_table.count() == 0) {
        // The layout's parameters, and the alignment gaps between them (zero in every buffer, so
        // AdamW keeps them zero) as segments without decay: the segments tile [0, P).
        std::vector<cu::adamw_segments::segment> segments;
        std::int64_t at = 0;
        for (const auto& p : layout) {
          if (p.offset > at) segments.push_back({at, p.offset - at, false});
          segments.push_back({p.offset, p.numel, p.decay});
          at = p.offset + p.numel;
        }
        if (P > at) segments.push_back({at, P - at, false});
        adamw_table.upload(ctx, segments);
      }
      if constexpr (std::is_same_v<D, float>) {
        cu::adamw_update_flat(ctx, master, grads, m, v, adamw_table, hp, step, grad_multiplier,
                              static_cast<cu::bf16*>(nullptr));
      } else {
        cu::adamw_update_flat(ctx, master, grads, m, v, adamw_table, hp, step, grad_multiplier,
                              working);
      }
      return;
    }
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
};

std::unique_ptr<gpu_chunk::impl> make_impl(compute_dtype dtype, int device) {
  switch (dtype) {
    case compute_dtype::bf16:
      return std::make_unique<model_impl<cu::bf16>>(device);
    case compute_dtype::fp16:
      return std::make_unique<model_impl<cu::fp16>>(device);
    case compute_dtype::fp32:
      break;
  }
  return std::make_unique<model_impl<float>>(device);
}

}  // namespace

namespace {
// The capture's pinned buffer, copy stream and events, with room for `floats` (made or grown
// once; kept).
gpu_chunk::impl::pinned_copy& reserve_state_copy(gpu_chunk::impl& s, std::int64_t floats) {
  auto& c = s.state_copy;
  if (!c) {
    c = std::make_unique<gpu_chunk::impl::pinned_copy>();
    check(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "cudaStreamCreate(copy)");
    check(cudaEventCreateWithFlags(&c->start, cudaEventDisableTiming), "cudaEventCreate");
    // The capture's thread sleeps on it instead of spinning a core for the copy's length.
    check(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming | cudaEventBlockingSync),
          "cudaEventCreate");
  }
  if (c->floats < floats) {
    if (c->host) check(cudaFreeHost(c->host), "cudaFreeHost");
    c->host = nullptr;
    c->floats = 0;
    check(cudaMallocHost(reinterpret_cast<void**>(&c->host),
                         static_cast<std::size_t>(floats) * sizeof(float)),
          "cudaMallocHost(checkpoint copy)");
    c->floats = floats;
  }
  return *c;
}
}  // namespace

gpu_chunk::gpu_chunk(const gpt_chunk& weights, int B, int T, const gpu_trainer_options& options,
                     int slots, int device, std::shared_ptr<device_tensor_group> group) {
  const gpt_config& config = weights.config();
  config.validate();
  if (B < 1 || T < 1 || T > config.context)
    throw std::invalid_argument("gpu_chunk: batch " + std::to_string(B) + " x sequence " +
                                std::to_string(T) + " (the context is " +
                                std::to_string(config.context) + ")");
  if (slots < 1)
    throw std::invalid_argument("gpu_chunk: " + std::to_string(slots) + " slots (at least 1)");
  std::string why;
  if (!cuda_training_available(&why)) throw std::runtime_error("--device cuda: " + why);
  if (device < 0 || device >= kernels::cuda_device_count())
    throw std::invalid_argument("gpu_chunk: CUDA device " + std::to_string(device) +
                                " does not exist (" + std::to_string(kernels::cuda_device_count()) +
                                " here)");
  const tensor_shard shard = weights.shard();
  if (shard.split() && (!group || group->size() != shard.size || group->rank() != shard.rank))
    throw std::invalid_argument("gpu_chunk: tensor shard " + std::to_string(shard.rank) + " of " +
                                std::to_string(shard.size) + " needs its member of a group of " +
                                std::to_string(shard.size));
  impl_ = make_impl(options.dtype, device);
  auto& s = *impl_;
  s.config = config;
  s.range = weights.range();
  s.shard = shard;
  if (shard.split()) s.group = std::move(group);
  s.dtype = options.dtype;
  s.B = B;
  s.T_max = s.T = T;
  s.slots = slots;
  s.element_bytes = options.dtype == compute_dtype::fp32 ? 4 : 2;
  s.recompute = options.recompute;
  s.attention = options.attention;
  s.split_backward = options.split_backward;
  s.ctx.set_fast_kernels(options.fast_kernels);
  s.layout = weights.parameters();
  for (const auto& p : s.layout) s.by_name.emplace(p.name, &p);
  s.P = weights.parameter_count();
  if (options.paged_parameters && cu::paged_buffer::supported(device)) {
    s.paged_master =
        std::make_unique<cu::paged_buffer>(device, static_cast<std::size_t>(s.P) * sizeof(float));
    s.master = static_cast<float*>(s.paged_master->data());
  } else {
    s.master = s.arena.alloc<float>(s.P);
  }
  s.grads = s.arena.alloc<float>(s.P);
  if (options.optimizer_state) {
    s.m = s.arena.alloc<float>(s.P);
    s.v = s.arena.alloc<float>(s.P);
  }
  // On the chunk's stream: a plain cudaMemcpy from pageable memory may return before its DMA
  // lands, and the non-blocking stream would not wait for it (the bf16 convert reads master).
  check(cudaMemcpyAsync(s.master, weights.params(), static_cast<std::size_t>(s.P) * sizeof(float),
                        cudaMemcpyHostToDevice, s.ctx.stream()),
        "cudaMemcpyAsync(parameters)");
  zero(s.ctx, s.grads, s.P);
  if (s.m) {
    zero(s.ctx, s.m, s.P);
    zero(s.ctx, s.v, s.P);
  }
  s.allocate();
  // Pinned memory is slow to allocate (a large buffer takes a good part of a second): with the
  // chunk, not at the first checkpoint, whose capture would hold the step up.
  if (options.pinned_state_copy) reserve_state_copy(s, s.P * (s.m ? 3 : 1));
  s.ctx.synchronize();
}

gpu_chunk::~gpu_chunk() {
  if (impl_) cudaSetDevice(impl_->device);  // the stream and buffers belong to it
}

const gpt_config& gpu_chunk::config() const { return impl_->config; }
const chunk_range& gpu_chunk::range() const { return impl_->range; }
int gpu_chunk::slots() const { return impl_->slots; }
bool gpu_chunk::recomputes() const { return impl_->recompute; }
int gpu_chunk::add_slot() {
  device_guard g(impl_->device);
  impl_->add_slot();
  return impl_->slots;
}
std::size_t gpu_chunk::activation_bytes() const {
  return static_cast<std::size_t>(impl_->B) * static_cast<std::size_t>(impl_->T_max) *
         static_cast<std::size_t>(impl_->config.width) * impl_->element_bytes;
}

void* gpu_chunk::input(int slot) {
  device_guard g(impl_->device);
  return impl_->input(slot);
}
void* gpu_chunk::input_gradient(int slot) {
  device_guard g(impl_->device);
  return impl_->input_gradient(slot);
}
// Each piece of an impl pass runs with the chunk's device current (the caller's restored at
// each stop: other chunks may run on other devices between the pieces).
block_pass gpu_chunk::on_device(block_pass inner) {
  for (;;) {
    const std::vector<int>* stop = nullptr;
    {
      device_guard g(impl_->device);
      stop = inner.next();
    }
    if (!stop) co_return;
    co_yield *stop;
  }
}
block_pass gpu_chunk::forward_pass(int slot, const std::int32_t* tokens,
                                   const std::int32_t* targets, float loss_scale, bool train,
                                   int seq_len, double* loss) {
  return on_device(impl_->forward_pass(slot, tokens, targets, loss_scale, train,
                                       seq_len > 0 ? seq_len : impl_->T_max, loss));
}
block_pass gpu_chunk::backward_pass(int slot, const void* doutput, grad_block_fn on_block_done,
                                    const void** dinput) {
  return on_device(impl_->backward_pass(slot, doutput, std::move(on_block_done), false, dinput));
}
block_pass gpu_chunk::backward_input_pass(int slot, const void* doutput, const void** dinput) {
  return on_device(impl_->backward_pass(slot, doutput, {}, true, dinput));
}
double gpu_chunk::forward(int slot, const std::int32_t* tokens, const std::int32_t* targets,
                          float loss_scale, bool train, int seq_len) {
  double loss = std::numeric_limits<double>::quiet_NaN();
  forward_pass(slot, tokens, targets, loss_scale, train, seq_len, &loss).run();
  return loss;
}
std::vector<float> gpu_chunk::last_logits(int slot, const std::int32_t* tokens, int seq_len) {
  device_guard g(impl_->device);
  return impl_->last_logits(slot, tokens, seq_len);
}
const void* gpu_chunk::output(int slot) const { return impl_->output(slot); }
const void* gpu_chunk::backward(int slot, const void* doutput, const grad_block_fn& on_block_done) {
  const void* dinput = nullptr;
  backward_pass(slot, doutput, on_block_done, &dinput).run();
  return dinput;
}
const void* gpu_chunk::backward_input(int slot, const void* doutput) {
  const void* dinput = nullptr;
  backward_input_pass(slot, doutput, &dinput).run();
  return dinput;
}
block_pass gpu_chunk::backward_weight_pass(int slot, grad_block_fn on_block_done) {
  return on_device(impl_->backward_weight_pass(slot, std::move(on_block_done)));
}
void gpu_chunk::backward_weight(int slot, const grad_block_fn& on_block_done) {
  backward_weight_pass(slot, on_block_done).run();
}

void* gpu_chunk::output_gradient(int slot) { return const_cast<void*>(impl_->output(slot)); }
void gpu_chunk::copy(void* destination, const void* source, std::size_t bytes) {
  device_guard g(impl_->device);
  check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, impl_->ctx.stream()),
        "cudaMemcpyAsync(device to device)");
}

void gpu_chunk::copy_to_host(void* host, const void* device, std::size_t bytes) {
  device_guard g(impl_->device);
  check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, impl_->ctx.stream()),
        "cudaMemcpyAsync(device to host)");
  impl_->ctx.synchronize();
}
void gpu_chunk::copy_from_host(void* device, const void* host, std::size_t bytes) {
  device_guard g(impl_->device);
  check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, impl_->ctx.stream()),
        "cudaMemcpyAsync(host to device)");
  impl_->ctx.synchronize();  // from pageable memory the copy may not be done at return
}

void gpu_chunk::zero_grad() {
  device_guard g(impl_->device);
  zero(impl_->ctx, impl_->grads, impl_->P);
}

double gpu_chunk::grad_square_sum(bool count_tied_copy) {
  device_guard g(impl_->device);
  auto& s = *impl_;
  const bool tied_copy = s.range.head && !s.range.embedding;
  // Left out: a head chunk's copy of the tied wte (unless asked), and on tensor shards other
  // than 0 the replicated parameters (shard 0 counts them). The rest in contiguous runs, in
  // layout order: one run for a whole chunk.
  auto counted = [&](const parameter_info& p) {
    if (tied_copy && !count_tied_copy && p.name == "transformer.wte.weight") return false;
    return !(s.shard.rank > 0 && p.split == tensor_split::replicated);
  };
  double sum = 0;
  std::int64_t at = 0, n = 0;
  auto flush = [&] {
    if (n > 0) sum += cu::square_sum(s.ctx, s.grads + at, n);
    n = 0;
  };
  for (const auto& p : s.layout) {
    if (!counted(p)) {
      flush();
      continue;
    }
    if (n > 0 && at + n != p.offset) flush();
    if (n == 0) at = p.offset;
    n += p.numel;
  }
  flush();
  return sum;
}

void gpu_chunk::adamw(const kernels::adamw_hparams& hp, int step, float grad_multiplier) {
  device_guard g(impl_->device);
  impl_->adamw(hp, step, grad_multiplier);
}

float* gpu_chunk::device_parameters() { return impl_->master; }
float* gpu_chunk::device_gradients() { return impl_->grads; }
std::int64_t gpu_chunk::parameter_count() const { return impl_->P; }
const std::vector<parameter_info>& gpu_chunk::layout() const { return impl_->layout; }

namespace {
std::vector<float> to_host(const gpu_chunk::impl& s, const float* p) {
  device_guard g(s.device);
  std::vector<float> out(static_cast<std::size_t>(s.P));
  s.ctx.synchronize();
  check(cudaMemcpy(out.data(), p, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy(to host)");
  return out;
}
void check_span(const gpu_chunk::impl& s, std::int64_t at, std::int64_t n) {
  if (at < 0 || n < 0 || at + n > s.P)
    throw std::out_of_range("gpu_chunk: gradients [" + std::to_string(at) + ", " +
                            std::to_string(at + n) + ") outside the " + std::to_string(s.P) +
                            " parameters");
}
}  // namespace

std::vector<float> gpu_chunk::parameters() const { return to_host(*impl_, impl_->master); }
void gpu_chunk::add_gradients(std::int64_t at, const float* values, std::int64_t n) {
  check_span(*impl_, at, n);
  device_guard g(impl_->device);
  float* own = impl_->grads + at;
  cu::residual_forward(impl_->ctx, own, static_cast<const float*>(own), values, n);
}
void gpu_chunk::copy_gradients(std::int64_t at, const float* values, std::int64_t n) {
  check_span(*impl_, at, n);
  copy(impl_->grads + at, values, static_cast<std::size_t>(n) * sizeof(float));
}
float* gpu_chunk::gradient_scratch(std::int64_t n) {
  auto& s = *impl_;
  if (!s.scratch) {
    device_guard g(s.device);
    s.scratch = s.arena.alloc<float>(n);
    s.scratch_floats = n;
  }
  if (n != s.scratch_floats)
    throw std::logic_error("gpu_chunk: gradient scratch of " + std::to_string(n) + " floats, not " +
                           std::to_string(s.scratch_floats));
  return s.scratch;
}
std::vector<float> gpu_chunk::gradients() const { return to_host(*impl_, impl_->grads); }

void gpu_chunk::copy_parameters_to(gpt_chunk& host) const {
  const auto& r = host.range();
  const auto& mine = impl_->range;
  if (host.parameter_count() != impl_->P || r.first_layer != mine.first_layer ||
      r.last_layer != mine.last_layer || r.embedding != mine.embedding || r.head != mine.head)
    throw std::invalid_argument("gpu_chunk: the host stage holds a different range");
  device_guard g(impl_->device);
  impl_->ctx.synchronize();
  check(cudaMemcpy(host.params(), impl_->master, static_cast<std::size_t>(impl_->P) * sizeof(float),
                   cudaMemcpyDeviceToHost),
        "cudaMemcpy(to host)");
}

void gpu_chunk::load_parameters(std::int64_t at, const float* host, std::int64_t n) {
  if (at < 0 || n < 0 || at + n > impl_->P)
    throw std::out_of_range("gpu_chunk: parameters outside the layout");
  device_guard g(impl_->device);
  check(cudaMemcpyAsync(impl_->master + at, host, static_cast<std::size_t>(n) * sizeof(float),
                        cudaMemcpyHostToDevice, impl_->ctx.stream()),
        "cudaMemcpyAsync(parameters)");
  impl_->refresh_working(at, n);
  impl_->ctx.synchronize();  // from pageable memory the copy may not be done at return
}

namespace {
// n floats of m and of v (device) to the host, after the stream's work so far; and back.
std::pair<std::vector<float>, std::vector<float>> moments_to_host(const gpu_chunk::impl& s,
                                                                  const float* m, const float* v,
                                                                  std::int64_t n) {
  device_guard g(s.device);
  s.ctx.synchronize();
  const auto k = static_cast<std::size_t>(n);
  std::pair<std::vector<float>, std::vector<float>> out{std::vector<float>(k),
                                                        std::vector<float>(k)};
  if (k == 0) return out;
  check(cudaMemcpy(out.first.data(), m, k * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy(moments)");
  check(cudaMemcpy(out.second.data(), v, k * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy(moments)");
  return out;
}
void moments_from_host(const gpu_chunk::impl& s, float* m, float* v, const float* host_m,
                       const float* host_v, std::int64_t n) {
  device_guard g(s.device);
  const auto bytes = static_cast<std::size_t>(n) * sizeof(float);
  if (bytes == 0) return;
  check(cudaMemcpyAsync(m, host_m, bytes, cudaMemcpyHostToDevice, s.ctx.stream()),
        "cudaMemcpyAsync(moments)");
  check(cudaMemcpyAsync(v, host_v, bytes, cudaMemcpyHostToDevice, s.ctx.stream()),
        "cudaMemcpyAsync(moments)");
  s.ctx.synchronize();  // from pageable memory the copy may not be done at return
}
}  // namespace

std::pair<std::vector<float>, std::vector<float>> gpu_chunk::moments() const {
  if (!impl_->m) throw std::logic_error("gpu_chunk: no optimizer state (ZeRO holds the moments)");
  return moments_to_host(*impl_, impl_->m, impl_->v, impl_->P);
}

void gpu_chunk::load_moments(const float* m, const float* v) {
  if (!impl_->m) throw std::logic_error("gpu_chunk: no optimizer state (ZeRO holds the moments)");
  moments_from_host(*impl_, impl_->m, impl_->v, m, v, impl_->P);
}

gpu_chunk::state_view gpu_chunk::begin_state_copy(bool with_moments) {
  auto& s = *impl_;
  if (with_moments && !s.m)
    throw std::logic_error("gpu_chunk: no optimizer state (ZeRO holds the moments)");
  device_guard g(s.device);
  auto& c = reserve_state_copy(s, s.P * (with_moments ? 3 : 1));
  check(cudaEventRecord(c.start, s.ctx.stream()), "cudaEventRecord");
  check(cudaStreamWaitEvent(c.stream, c.start, 0), "cudaStreamWaitEvent");
  const auto bytes = static_cast<std::size_t>(s.P) * sizeof(float);
  check(cudaMemcpyAsync(c.host, s.master, bytes, cudaMemcpyDeviceToHost, c.stream),
        "cudaMemcpyAsync(checkpoint copy)");
  if (with_moments) {
    check(cudaMemcpyAsync(c.host + s.P, s.m, bytes, cudaMemcpyDeviceToHost, c.stream),
          "cudaMemcpyAsync(checkpoint copy)");
    check(cudaMemcpyAsync(c.host + 2 * s.P, s.v, bytes, cudaMemcpyDeviceToHost, c.stream),
          "cudaMemcpyAsync(checkpoint copy)");
  }
  check(cudaEventRecord(c.done, c.stream), "cudaEventRecord");
  return [copy = &c, device = s.device]() -> const float* {
    device_guard g(device);
    check(cudaEventSynchronize(copy->done), "cudaEventSynchronize(checkpoint copy)");
    return copy->host;
  };
}

void gpu_chunk::own(std::vector<shard_segment> segments, bool parameters) {
  auto& s = *impl_;
  if (s.m || s.owned_m)
    throw std::logic_error("gpu_chunk: owned segments in a chunk with optimizer state");
  std::int64_t n = 0;
  for (const auto& sg : segments) {
    check_span(s, sg.offset, sg.numel);
    n = std::max(n, sg.at + sg.numel);
  }
  device_guard g(s.device);
  s.owned = std::move(segments);
  s.owned_floats = n;
  s.owned_m = s.arena.alloc<float>(std::max<std::int64_t>(n, 1));
  s.owned_v = s.arena.alloc<float>(std::max<std::int64_t>(n, 1));
  zero(s.ctx, s.owned_m, n);
  zero(s.ctx, s.owned_v, n);
  if (!parameters) return;
  s.owned_p = s.arena.alloc<float>(std::max<std::int64_t>(n, 1));
  for (const auto& sg : s.owned)
    engine::copy(s.ctx, s.owned_p + sg.at, s.master + sg.offset, sg.numel);
}

double gpu_chunk::owned_square_sum(const std::vector<shard_segment>& segments) {
  device_guard g(impl_->device);
  std::vector<std::pair<const float*, std::int64_t>> spans;
  for (const auto& sg : segments)
    if (sg.counted && sg.numel > 0) spans.emplace_back(impl_->grads + sg.offset, sg.numel);
  double sum = 0;  // in segment order, as the host shards sum
  for (const double s : cu::square_sums(impl_->ctx, spans)) sum += s;
  return sum;
}

void gpu_chunk::adamw_owned(const kernels::adamw_hparams& hp, int step, float grad_multiplier) {
  if (!impl_->owned_m) throw std::logic_error("gpu_chunk: AdamW of owned segments before own()");
  device_guard g(impl_->device);
  impl_->adamw_owned(hp, step, grad_multiplier);
}

void gpu_chunk::parameters_changed(std::int64_t at, std::int64_t n) {
  check_span(*impl_, at, n);
  device_guard g(impl_->device);
  impl_->refresh_working(at, n);
}

std::pair<std::vector<float>, std::vector<float>> gpu_chunk::owned_moments() const {
  return moments_to_host(*impl_, impl_->owned_m, impl_->owned_v, impl_->owned_floats);
}

void gpu_chunk::load_owned_moments(const float* m, const float* v) {
  moments_from_host(*impl_, impl_->owned_m, impl_->owned_v, m, v, impl_->owned_floats);
}

void gpu_chunk::put_owned_parameters(const std::vector<shard_segment>& segments) {
  auto& s = *impl_;
  if (!s.owned_p && !segments.empty())
    throw std::logic_error("gpu_chunk: owned parameters put before own() with parameters");
  device_guard g(s.device);
  for (const auto& sg : segments) {
    check_span(s, sg.offset, sg.numel);
    if (sg.at < 0 || sg.at + sg.numel > s.owned_floats)
      throw std::out_of_range("gpu_chunk: a segment outside the owned storage");
    engine::copy(s.ctx, s.master + sg.offset, s.owned_p + sg.at, sg.numel);
  }
}

std::vector<float> gpu_chunk::owned_parameters() const {
  auto& s = *impl_;
  if (!s.owned_p) return {};
  device_guard g(s.device);
  s.ctx.synchronize();
  std::vector<float> out(static_cast<std::size_t>(s.owned_floats));
  if (!out.empty())
    check(cudaMemcpy(out.data(), s.owned_p, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
          "cudaMemcpy(owned parameters)");
  return out;
}

std::int64_t gpu_chunk::owned_parameter_bytes() const {
  return impl_->owned_p ? impl_->owned_floats * static_cast<std::int64_t>(sizeof(float)) : 0;
}

// Without paged parameters the memory stays: the span is only checked.
void gpu_chunk::release_parameters(std::int64_t at, std::int64_t n) {
  auto& s = *impl_;
  check_span(s, at, n);
  device_guard g(s.device);
  const auto k = static_cast<std::size_t>(at), bytes = static_cast<std::size_t>(n);
  if (s.paged_master) s.paged_master->release(k * sizeof(float), bytes * sizeof(float), stream());
  if (s.paged_working)
    s.paged_working->release(k * s.element_bytes, bytes * s.element_bytes, stream());
}

void gpu_chunk::parameter_round() {
  auto& s = *impl_;
  device_guard g(s.device);
  if (s.paged_master) s.paged_master->next_round();
  if (s.paged_working) s.paged_working->next_round();
}

void gpu_chunk::acquire_parameters(std::int64_t at, std::int64_t n) {
  auto& s = *impl_;
  check_span(s, at, n);
  device_guard g(s.device);
  const auto k = static_cast<std::size_t>(at), bytes = static_cast<std::size_t>(n);
  if (s.paged_master) s.paged_master->acquire(k * sizeof(float), bytes * sizeof(float));
  if (s.paged_working) s.paged_working->acquire(k * s.element_bytes, bytes * s.element_bytes);
}

std::int64_t gpu_chunk::device_bytes() const {
  const auto& s = *impl_;
  return s.arena.bytes() +
         static_cast<std::int64_t>((s.paged_master ? s.paged_master->size() : 0) +
                                   (s.paged_working ? s.paged_working->size() : 0));
}
std::int64_t gpu_chunk::optimizer_bytes() const {
  return (impl_->m ? 2 * impl_->P : 2 * impl_->owned_floats) *
         static_cast<std::int64_t>(sizeof(float));
}
std::string gpu_chunk::device_name() const { return kernels::cuda_device_name(impl_->device); }
void* gpu_chunk::stream() const { return impl_->ctx.stream(); }
void* gpu_chunk::record_event() {
  device_guard g(impl_->device);
  auto& s = *impl_;
  cudaEvent_t e = s.events[s.next_event++ % s.events.size()];
  check(cudaEventRecord(e, s.ctx.stream()), "cudaEventRecord");
  return e;
}
void gpu_chunk::wait_event(void* event) {
  device_guard g(impl_->device);
  check(cudaStreamWaitEvent(impl_->ctx.stream(), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}
void gpu_chunk::synchronize() const {
  device_guard g(impl_->device);
  impl_->ctx.synchronize();
}

void gpu_chunk::set_kernel_timing(bool on) {
  device_guard g(impl_->device);
  impl_->ctx.set_timing(on);
}

std::vector<kernel_time> gpu_chunk::take_kernel_times() {
  device_guard g(impl_->device);
  std::vector<kernel_time> out;
  for (const auto& t : impl_->ctx.take_timings())
    out.push_back({cu::op_family_name(t.family), t.ms, t.calls});
  return out;
}

}  // namespace troupe::engine
