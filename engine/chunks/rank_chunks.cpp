// The one chunk contract's two kinds. See rank_chunks.hpp.
#include "engine/chunks/rank_chunks.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

#include "engine/chunks/device_chunk.hpp"
#include "kernels/tensor.hpp"

namespace troupe::engine {
namespace {

std::string describe(int c, micro_batch_id id) {
  return "chunk " + std::to_string(c) + " round " + std::to_string(id.round) + " micro-batch " +
         std::to_string(id.micro_batch);
}

// ---- CPU chunks: cpu_chunks ---------------------------------------------------------------
class cpu_rank_chunks final : public rank_chunks {
 public:
  cpu_rank_chunks(const gpt_config& model, const std::vector<chunk_range>& ranges,
                  const chunk_init& init, bool optimizer_state, bool recompute, tensor_shard shard,
                  std::shared_ptr<tensor_group> group)
      : compute_(model, ranges, optimizer_state, recompute, shard, std::move(group)) {
    for (int c = 0; c < compute_.chunk_count(); ++c) {
      auto& st = compute_.chunk(c);
      init(st);
      st.zero_grad();
      blocks_.push_back(chunk_grad_blocks(st));
    }
  }

  std::string kind() const override { return "cpu"; }
  int chunk_count() const override { return compute_.chunk_count(); }
  const chunk_range& range(int c) const override { return weights_of(c).range(); }
  const std::vector<parameter_info>& layout(int c) const override {
    return weights_of(c).parameters();
  }
  std::int64_t parameter_count(int c) const override { return weights_of(c).parameter_count(); }
  const std::vector<grad_block>& grad_blocks(int c) const override {
    return blocks_.at(static_cast<std::size_t>(c));
  }
  float* gradients(int c) override { return compute_.chunk(c).grads(); }
  gpt_chunk* cpu_chunk(int c) override { return &compute_.chunk(c); }
  device_chunk* device(int) override { return nullptr; }
  std::vector<float> parameters(int c) const override {
    const auto& st = weights_of(c);
    return {st.params(), st.params() + st.parameter_count()};
  }

  bool host_payloads() const override { return true; }
  void* receive_buffer(int, micro_batch_id, payload_kind, int, int) override { return nullptr; }
  const void* send_buffer(int, micro_batch_id, payload_kind) override { return nullptr; }
  std::size_t payload_bytes(int c, micro_batch_id id) const override {
    const auto [B, T] = compute_.shape(c, id);
    return std::size_t(B) * std::size_t(T) * std::size_t(weights_of(c).config().width) *
           sizeof(float);
  }
  int slot_count(int) const override { return 0; }
  void hold(int, micro_batch_id) override {}
  void drop(int, micro_batch_id) override {}

  block_pass forward(int c, micro_batch_id id, forward_args args) override {
    return compute_.forward(c, id, std::move(args));
  }
  double loss(int c, micro_batch_id id) const override { return compute_.loss(c, id); }
  const float* output(int c, micro_batch_id id) const override { return compute_.output(c, id); }
  std::pair<int, int> shape(int c, micro_batch_id id) const override {
    return compute_.shape(c, id);
  }
  block_pass backward(int c, micro_batch_id id, const float* doutput, float* dinput,
                      grad_block_fn on_block_done) override {
    return compute_.backward(c, id, doutput, dinput, std::move(on_block_done));
  }
  block_pass backward_input(int c, micro_batch_id id, const float* doutput,
                            float* dinput) override {
    return compute_.backward_input(c, id, doutput, dinput);
  }
  block_pass backward_weight(int c, micro_batch_id id, grad_block_fn on_block_done) override {
    return compute_.backward_weight(c, id, std::move(on_block_done));
  }
  std::vector<std::vector<int>> stops(int c, pass_kind kind) const override {
    return compute_.stops(c, kind);
  }
  void release(int c, micro_batch_id id) override { compute_.release(c, id); }

  void zero_grad() override { compute_.zero_grad(); }
  double grad_square_sum(int c, bool count_tied_copy) override {
    return engine::grad_square_sum(weights_of(c), count_tied_copy);
  }
  double update(int c, const optimizer_config& config, int step, int total_steps, double grad_norm,
                double unscale) override {
    return compute_.optimizer(c)
        .step_with_norm(compute_.chunk(c), config, step, total_steps, grad_norm, unscale)
        .lr;
  }
  void add_gradients(int c, std::int64_t at, const float* values, std::int64_t n) override {
    float* g = span(c, at, n);
    for (std::int64_t i = 0; i < n; ++i) g[i] = g[i] + values[i];
  }
  void copy_gradients(int c, std::int64_t at, const float* values, std::int64_t n) override {
    std::copy(values, values + n, span(c, at, n));
  }
  float* gradient_scratch(int c, std::int64_t n) override {
    auto& s = scratch_[c];
    if (s.empty()) s.resize(static_cast<std::size_t>(n));
    if (static_cast<std::int64_t>(s.size()) != n)
      throw std::logic_error("chunk " + std::to_string(c) + ": gradient scratch of another size");
    return s.data();
  }
  void* record_event(int) override { return nullptr; }
  void wait_event(int, void*) override {}
  void copy_to_host(int, void* host, const void* memory, std::size_t bytes) override {
    std::memcpy(host, memory, bytes);
  }
  void copy_from_host(int, void* memory, const void* host, std::size_t bytes) override {
    std::memcpy(memory, host, bytes);
  }

  float* host_parameters(int c) override { return compute_.chunk(c).params(); }
  float* host_gradients(int c) override { return compute_.chunk(c).grads(); }
  void gradients_to_host(int, std::int64_t, std::int64_t) override {}
  void parameters_from_host(int, std::int64_t, std::int64_t) override {}
  std::pair<std::vector<float>, std::vector<float>> moments(int c) override {
    const auto& o = compute_.optimizer(c);
    const float* m = o.first_moment().f32();
    const float* v = o.second_moment().f32();
    const auto n = static_cast<std::size_t>(o.first_moment().numel());
    return {{m, m + n}, {v, v + n}};
  }
  host_state state_on_host(int c, bool with_moments) override {
    host_state h;
    h.params = weights_of(c).params();
    if (with_moments) {
      const auto& o = compute_.optimizer(c);
      h.m = o.first_moment().f32();
      h.v = o.second_moment().f32();
    }
    return h;
  }
  void load_moments(int c, const float* m, const float* v) override {
    compute_.optimizer(c).load_moments(m, v);
  }

  std::int64_t optimizer_bytes() const override { return compute_.optimizer_bytes(); }
  std::int64_t activation_bytes() const override { return compute_.activation_bytes(); }

 private:
  const gpt_chunk& weights_of(int c) const { return compute_.chunk(c); }
  float* span(int c, std::int64_t at, std::int64_t n) {
    if (at < 0 || n < 0 || at + n > parameter_count(c))
      throw std::out_of_range("chunk " + std::to_string(c) + ": gradients outside the layout");
    return compute_.chunk(c).grads() + at;
  }

  cpu_chunks compute_;
  std::vector<std::vector<grad_block>> blocks_;
  std::map<int, std::vector<float>> scratch_;
};

// ---- device chunks: device_chunk slots -------------------------------------------------------
// A chunk's slots: a slot is free when nothing holds it. When none is free the chunk adds one,
// so a chunk holds what the schedule and its early arrivals need.
class slot_table {
 public:
  explicit slot_table(int slots) : holds_(static_cast<std::size_t>(slots), 0) {}
  int take(int c, micro_batch_id id, const std::function<int()>& grow) {
    if (of_.count(id)) throw std::logic_error("a second slot for " + describe(c, id));
    auto it = std::find(holds_.begin(), holds_.end(), 0);
    if (it == holds_.end()) {
      const int now = grow();
      if (now != static_cast<int>(holds_.size()) + 1)
        throw std::logic_error("chunk " + std::to_string(c) + " grew to " + std::to_string(now) +
                               " slots from " + std::to_string(holds_.size()));
      holds_.push_back(0);
      it = holds_.end() - 1;
    }
    *it = 1;
    const int s = static_cast<int>(it - holds_.begin());
    of_.emplace(id, s);
    return s;
  }
  int find(int c, micro_batch_id id) const {
    const auto it = of_.find(id);
    if (it == of_.end()) throw std::logic_error("no slot for " + describe(c, id));
    return it->second;
  }
  void hold(int c, micro_batch_id id) { ++holds_.at(static_cast<std::size_t>(find(c, id))); }
  // Whether this freed the slot.
  bool drop(int c, micro_batch_id id) {
    const int s = find(c, id);
    if (--holds_.at(static_cast<std::size_t>(s)) > 0) return false;
    of_.erase(id);
    return true;
  }

 private:
  std::vector<int> holds_;
  std::map<micro_batch_id, int> of_;
};

class device_rank_chunks final : public rank_chunks {
 public:
  device_rank_chunks(const chunk_factory& factory, const gpt_config& model,
                     const std::vector<chunk_range>& ranges, tensor_shard shard,
                     const chunk_init& init, int B, int T, int slots, int rank, int lane,
                     std::shared_ptr<group_member> tp_member, bool optimizer_state)
      : kind_(factory.name), B_(B), T_(T) {
    for (const auto& range : ranges) {
      gpt_chunk host(model, range, shard);
      init(host);
      chunks_.push_back(
          factory.make_chunk(host, B, T, slots, rank, lane, tp_member, optimizer_state));
      slots_.emplace_back(slots);
      blocks_.push_back(chunk_grad_blocks(host));
      losses_.emplace_back();
      lengths_.emplace_back();
    }
  }

  std::string kind() const override { return kind_; }
  int chunk_count() const override { return static_cast<int>(chunks_.size()); }
  const chunk_range& range(int c) const override { return chunk(c).range(); }
  const std::vector<parameter_info>& layout(int c) const override { return chunk(c).layout(); }
  std::int64_t parameter_count(int c) const override { return chunk(c).parameter_count(); }
  const std::vector<grad_block>& grad_blocks(int c) const override {
    return blocks_.at(static_cast<std::size_t>(c));
  }
  float* gradients(int c) override { return chunk(c).device_gradients(); }
  gpt_chunk* cpu_chunk(int) override { return nullptr; }
  device_chunk* device(int c) override { return &chunk(c); }
  std::vector<float> parameters(int c) const override { return chunk(c).parameters(); }

  bool host_payloads() const override { return false; }
  void* receive_buffer(int c, micro_batch_id id, payload_kind kind, int B, int T) override {
    if (kind == payload_kind::activation) {
      check_shape(c, id, B, T);
      const int s = take(c, id);
      length(c)[id] = T;
      return chunk(c).input(s);
    }
    if (B != B_ || T != length_of(c, id))
      throw std::runtime_error("the gradient of " + describe(c, id) + " is " + std::to_string(B) +
                               " x " + std::to_string(T) + " tokens; its activation was " +
                               std::to_string(B_) + " x " + std::to_string(length_of(c, id)));
    return chunk(c).output_gradient(table(c).find(c, id));
  }
  const void* send_buffer(int c, micro_batch_id id, payload_kind kind) override {
    const int s = table(c).find(c, id);
    return kind == payload_kind::activation ? chunk(c).output(s) : chunk(c).input_gradient(s);
  }
  std::size_t payload_bytes(int c, micro_batch_id id) const override {
    return chunk(c).activation_bytes() / static_cast<std::size_t>(T_) *
           static_cast<std::size_t>(length_of(c, id));
  }
  int slot_count(int c) const override { return chunk(c).slots(); }
  void hold(int c, micro_batch_id id) override { table(c).hold(c, id); }
  void drop(int c, micro_batch_id id) override {
    if (table(c).drop(c, id)) length(c).erase(id);
  }

  block_pass forward(int c, micro_batch_id id, forward_args args) override {
    check_shape(c, id, args.B, args.T);
    // An embedding chunk's micro-batch starts here; others when their activation arrived.
    int s = 0;
    if (range(c).embedding) {
      s = take(c, id);
      length(c)[id] = args.T;
    } else {
      s = table(c).find(c, id);
      if (length_of(c, id) != args.T)
        throw std::logic_error(describe(c, id) + ": a forward of length " + std::to_string(args.T) +
                               " for an activation of " + std::to_string(length_of(c, id)));
    }
    return forward_pass(c, id, s, std::move(args));
  }
  double loss(int c, micro_batch_id id) const override {
    const auto& l = losses_.at(static_cast<std::size_t>(c));
    const auto it = l.find(id);
    return it == l.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
  }
  const float* output(int c, micro_batch_id id) const override {
    throw std::logic_error("device chunks keep " + describe(c, id) + "'s output on the device");
  }
  std::pair<int, int> shape(int c, micro_batch_id id) const override {
    return {B_, length_of(c, id)};
  }
  block_pass backward(int c, micro_batch_id id, const float*, float*,
                      grad_block_fn on_block_done) override {
    return backward_pass(c, table(c).find(c, id), std::move(on_block_done));
  }
  block_pass backward_input(int c, micro_batch_id id, const float*, float*) override {
    return backward_input_pass(c, table(c).find(c, id));
  }
  block_pass backward_weight(int c, micro_batch_id id, grad_block_fn on_block_done) override {
    return chunk(c).backward_weight_pass(table(c).find(c, id), std::move(on_block_done));
  }
  std::vector<std::vector<int>> stops(int c, pass_kind kind) const override {
    return pass_stops(range(c), kind, chunk(c).recomputes());
  }
  void release(int c, micro_batch_id id) override {
    losses_.at(static_cast<std::size_t>(c)).erase(id);
    if (table(c).drop(c, id)) length(c).erase(id);
  }

  void zero_grad() override {
    for (auto& ch : chunks_) ch->zero_grad();
  }
  double grad_square_sum(int c, bool count_tied_copy) override {
    return chunk(c).grad_square_sum(count_tied_copy);
  }
  double update(int c, const optimizer_config& config, int step, int total_steps, double grad_norm,
                double unscale) override {
    return chunk(c).update(config, step, total_steps, grad_norm, unscale);
  }
  void add_gradients(int c, std::int64_t at, const float* values, std::int64_t n) override {
    chunk(c).add_gradients(at, values, n);
  }
  void copy_gradients(int c, std::int64_t at, const float* values, std::int64_t n) override {
    chunk(c).copy_gradients(at, values, n);
  }
  float* gradient_scratch(int c, std::int64_t n) override { return chunk(c).gradient_scratch(n); }
  void* record_event(int c) override { return chunk(c).record_event(); }
  void wait_event(int c, void* event) override { chunk(c).wait_event(event); }
  void copy_to_host(int c, void* host, const void* memory, std::size_t bytes) override {
    chunk(c).copy_to_host(host, memory, bytes);
  }
  void copy_from_host(int c, void* memory, const void* host, std::size_t bytes) override {
    chunk(c).copy_from_host(memory, host, bytes);
  }

  float* host_parameters(int c) override {
    auto& h = host_copy(c);
    if (!h.params.owns_storage()) {
      h.params = kernels::tensor::mapped_zeros({parameter_count(c)});
      const auto values = chunk(c).parameters();
      std::copy(values.begin(), values.end(), h.params.f32());
    }
    return h.params.f32();
  }
  float* host_gradients(int c) override {
    auto& h = host_copy(c);
    if (!h.grads.owns_storage()) h.grads = kernels::tensor::mapped_zeros({parameter_count(c)});
    return h.grads.f32();
  }
  void gradients_to_host(int c, std::int64_t at, std::int64_t n) override {
    check_span(c, at, n);
    chunk(c).copy_to_host(host_gradients(c) + at, chunk(c).device_gradients() + at,
                          static_cast<std::size_t>(n) * sizeof(float));
  }
  void parameters_from_host(int c, std::int64_t at, std::int64_t n) override {
    check_span(c, at, n);
    chunk(c).load_parameters(at, host_parameters(c) + at, n);
  }
  std::pair<std::vector<float>, std::vector<float>> moments(int c) override {
    return chunk(c).moments();
  }
  void load_moments(int c, const float* m, const float* v) override { chunk(c).load_moments(m, v); }

  std::int64_t optimizer_bytes() const override {
    std::int64_t bytes = 0;
    for (const auto& ch : chunks_) bytes += ch->optimizer_bytes();
    return bytes;
  }
  // Everything the chunks allocated beyond fp32 weights, gradients and moments (16-bit weights,
  // activations, scratch).
  std::int64_t activation_bytes() const override {
    std::int64_t bytes = 0;
    for (const auto& ch : chunks_)
      bytes += std::max<std::int64_t>(
          0, ch->device_bytes() - ch->optimizer_bytes() - ch->owned_parameter_bytes() -
                 2 * ch->parameter_count() * static_cast<std::int64_t>(sizeof(float)));
    return bytes;
  }

 private:
  device_chunk& chunk(int c) const { return *chunks_.at(static_cast<std::size_t>(c)); }
  struct host_buffers {
    kernels::tensor params, grads;
  };
  host_buffers& host_copy(int c) {
    if (host_.empty()) host_.resize(chunks_.size());
    return host_.at(static_cast<std::size_t>(c));
  }
  void check_span(int c, std::int64_t at, std::int64_t n) const {
    if (at < 0 || n < 0 || at + n > parameter_count(c))
      throw std::out_of_range("chunk " + std::to_string(c) + ": floats [" + std::to_string(at) +
                              ", " + std::to_string(at + n) + ") outside its " +
                              std::to_string(parameter_count(c)) + " parameters");
  }
  slot_table& table(int c) { return slots_.at(static_cast<std::size_t>(c)); }
  int take(int c, micro_batch_id id) {
    return table(c).take(c, id, [this, c] { return chunk(c).add_slot(); });
  }

  // Micro-batches of B rows (the chunks') and at most T (their buffers') tokens each.
  void check_shape(int c, micro_batch_id id, int B, int T) const {
    if (B != B_ || T < 1 || T > T_)
      throw std::runtime_error(describe(c, id) + ": a micro-batch of " + std::to_string(B) + " x " +
                               std::to_string(T) + " tokens; the device chunks hold " +
                               std::to_string(B_) + " x 1 to " + std::to_string(T_));
  }
  std::map<micro_batch_id, int>& length(int c) { return lengths_.at(static_cast<std::size_t>(c)); }
  int length_of(int c, micro_batch_id id) const {
    const auto& l = lengths_.at(static_cast<std::size_t>(c));
    const auto it = l.find(id);
    if (it == l.end()) throw std::logic_error("no micro-batch state for " + describe(c, id));
    return it->second;
  }

  // The device chunk's passes, with their stops (args kept here until the pass is done).
  block_pass forward_pass(int c, micro_batch_id id, int s, forward_args args) {
    double l = std::numeric_limits<double>::quiet_NaN();
    block_pass inner = chunk(c).forward_pass(s, args.T, args.tokens, args.targets, args.loss_scale,
                                             args.train, &l);
    while (const auto* stop = inner.next()) co_yield *stop;
    if (range(c).head) losses_.at(static_cast<std::size_t>(c))[id] = l;
  }
  block_pass backward_input_pass(int c, int s) {
    auto& ch = chunk(c);
    return ch.backward_input_pass(s, range(c).embedding ? nullptr : ch.input_gradient(s));
  }
  block_pass backward_pass(int c, int s, grad_block_fn on_block_done) {
    auto& ch = chunk(c);
    return ch.backward_pass(s, range(c).embedding ? nullptr : ch.input_gradient(s),
                            std::move(on_block_done));
  }

  std::string kind_;
  int B_ = 0, T_ = 0;
  std::vector<std::unique_ptr<device_chunk>> chunks_;
  std::vector<slot_table> slots_;
  std::vector<std::vector<grad_block>> blocks_;
  std::vector<std::map<micro_batch_id, double>> losses_;
  std::vector<std::map<micro_batch_id, int>> lengths_;  // by chunk: each micro-batch's T
  std::vector<host_buffers> host_;                      // by chunk: ZeRO's host copies
};

}  // namespace

std::function<rank_chunks::host_state()> rank_chunks::capture_state(int c, bool with_moments) {
  if (auto* d = device(c)) {
    return [copy = d->begin_state_copy(with_moments)] {
      auto s = copy();
      host_state h;
      h.params = s.params;
      h.m = s.m;
      h.v = s.v;
      h.owned_params = std::move(s.owned_params);  // the pointers stay with the moved buffers
      h.owned_m = std::move(s.owned_m);
      h.owned_v = std::move(s.owned_v);
      h.detached = true;
      return h;
    };
  }
  return [this, c, with_moments] { return state_on_host(c, with_moments); };
}

rank_chunks::host_state rank_chunks::state_on_host(int c, bool with_moments) {
  host_state h;
  h.owned_params = parameters(c);
  h.params = h.owned_params.data();
  if (with_moments) {
    std::tie(h.owned_m, h.owned_v) = moments(c);
    h.m = h.owned_m.data();
    h.v = h.owned_v.data();
  }
  return h;
}

std::unique_ptr<rank_chunks> make_cpu_rank_chunks(const gpt_config& model,
                                                  const std::vector<chunk_range>& ranges,
                                                  const chunk_init& init, bool optimizer_state,
                                                  bool recompute, tensor_shard shard,
                                                  std::shared_ptr<tensor_group> group) {
  return std::make_unique<cpu_rank_chunks>(model, ranges, init, optimizer_state, recompute, shard,
                                           std::move(group));
}

std::unique_ptr<rank_chunks> make_device_rank_chunks(
    const chunk_factory& factory, const gpt_config& model, const std::vector<chunk_range>& ranges,
    tensor_shard shard, const chunk_init& init, int B, int T, int slots, int rank, int lane,
    std::shared_ptr<group_member> tp_member, bool optimizer_state) {
  return std::make_unique<device_rank_chunks>(factory, model, ranges, shard, init, B, T, slots,
                                              rank, lane, std::move(tp_member), optimizer_state);
}

}  // namespace troupe::engine
