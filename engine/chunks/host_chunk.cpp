// Host chunks and links (device_chunk.hpp): one chunk of an engine::cpu_chunks behind the
// device contracts, so a device pipeline run on the host computes what the CPU pipeline does,
// bitwise. Every call finishes before it returns: events are nullptr.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>

#include "engine/chunks/cpu_chunks.hpp"
#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/zero_group.hpp"

namespace troupe::engine {
namespace {

class host_chunk final : public device_chunk {
 public:
  host_chunk(const gpt_chunk& weights, int B, int T, int slots, bool recompute,
             std::shared_ptr<tensor_group> group, bool optimizer_state)
      : compute_(weights.config(), {weights.range()}, optimizer_state, recompute, weights.shard(),
                 std::move(group)),
        B_(B),
        T_(T),
        recompute_(recompute) {
    if (slots < 1) throw std::invalid_argument("host_chunk: at least one slot");
    auto& st = compute_.chunk(0);
    std::memcpy(st.params(), weights.params(),
                static_cast<std::size_t>(st.parameter_count()) * sizeof(float));
    st.zero_grad();
    for (int s = 0; s < slots; ++s) add_slot();
  }

  const chunk_range& range() const override { return compute_.chunk(0).range(); }
  int slots() const override { return static_cast<int>(slots_.size()); }
  int add_slot() final {
    auto& s = slots_.emplace_back();
    const std::size_t n = activation_bytes() / sizeof(float);
    if (!range().embedding) s.input.assign(n, 0.0f);
    if (!range().embedding) s.dinput.assign(n, 0.0f);
    if (!range().head) s.doutput.assign(n, 0.0f);
    return slots();
  }
  std::size_t activation_bytes() const override {
    return std::size_t(B_) * std::size_t(T_) * std::size_t(compute_.chunk(0).config().width) *
           sizeof(float);
  }
  void* input(int slot) override {
    if (range().embedding) throw std::logic_error("host_chunk: the embedding chunk takes tokens");
    return at(slot).input.data();
  }
  // Apart from the input: a split backward's W reads the input after B.
  void* input_gradient(int slot) override {
    if (range().embedding) throw std::logic_error("host_chunk: the embedding chunk takes tokens");
    return at(slot).dinput.data();
  }
  block_pass forward_pass(int slot, int seq_len, const std::int32_t* tokens,
                          const std::int32_t* targets, float loss_scale, bool train,
                          double* loss) override {
    auto& s = at(slot);
    if (seq_len < 1 || seq_len > T_)
      throw std::invalid_argument("host_chunk: a micro-batch of sequence length " +
                                  std::to_string(seq_len) + " (the chunk holds 1 to " +
                                  std::to_string(T_) + ")");
    if (s.live) compute_.release(0, id(slot));  // an evaluation's saved activations
    s.T = seq_len;
    cpu_chunks::forward_args args;
    args.B = B_;
    args.T = seq_len;
    // The passes read tokens and targets until backward: the slot keeps copies (as gpu_chunk).
    const std::size_t n = std::size_t(B_) * std::size_t(seq_len);
    if (range().embedding) s.tokens.assign(tokens, tokens + n);
    if (range().head) s.targets.assign(targets, targets + n);
    args.tokens = range().embedding ? s.tokens.data() : nullptr;
    args.input = range().embedding ? nullptr : s.input.data();
    args.targets = range().head ? s.targets.data() : nullptr;
    args.loss_scale = loss_scale;
    args.train = train;
    block_pass inner = compute_.forward(0, id(slot), std::move(args));
    s.live = true;
    while (const auto* stop = inner.next()) co_yield *stop;
    if (loss)
      *loss = range().head ? compute_.loss(0, id(slot)) : std::numeric_limits<double>::quiet_NaN();
  }
  const void* output(int slot) const override { return compute_.output(0, id(slot)); }
  void* output_gradient(int slot) override {
    if (range().head) throw std::logic_error("host_chunk: a head chunk has no output gradient");
    return at(slot).doutput.data();
  }
  block_pass backward_pass(int slot, void* dinput, grad_block_fn on_block_done) override {
    block_pass inner = input_pass(
        slot, dinput, [this, slot, f = std::move(on_block_done)](const float* dout, float* din) {
          return compute_.backward(0, id(slot), dout, din, std::move(f));
        });
    while (const auto* stop = inner.next()) co_yield *stop;
    compute_.release(0, id(slot));
    at(slot).live = false;
  }
  block_pass backward_input_pass(int slot, void* dinput) override {
    return input_pass(slot, dinput, [this, slot](const float* dout, float* din) {
      return compute_.backward_input(0, id(slot), dout, din);
    });
  }
  block_pass backward_weight_pass(int slot, grad_block_fn on_block_done) override {
    if (!at(slot).live) throw std::logic_error("host_chunk: backward of a slot without forward");
    block_pass inner = compute_.backward_weight(0, id(slot), std::move(on_block_done));
    while (const auto* stop = inner.next()) co_yield *stop;
    compute_.release(0, id(slot));
    at(slot).live = false;  // after the stops: slots_ may have grown meanwhile
  }
  bool recomputes() const override { return recompute_; }
  void zero_grad() override { compute_.zero_grad(); }
  double grad_square_sum(bool count_tied_copy) override {
    return engine::grad_square_sum(compute_.chunk(0), count_tied_copy);
  }
  double update(const optimizer_config& config, int step, int total_steps, double grad_norm,
                double unscale) override {
    return compute_.optimizer(0)
        .step_with_norm(compute_.chunk(0), config, step, total_steps, grad_norm, unscale)
        .lr;
  }
  void add_gradients(std::int64_t at, const float* values, std::int64_t n) override {
    float* g = span(at, n);
    for (std::int64_t i = 0; i < n; ++i) g[i] = g[i] + values[i];
  }
  void copy_gradients(std::int64_t at, const float* values, std::int64_t n) override {
    std::memmove(span(at, n), values, static_cast<std::size_t>(n) * sizeof(float));
  }
  float* gradient_scratch(std::int64_t n) override {
    if (received_.empty()) received_.resize(static_cast<std::size_t>(n));
    if (static_cast<std::int64_t>(received_.size()) != n)
      throw std::logic_error("host_chunk: gradient scratch of another size");
    return received_.data();
  }
  float* device_gradients() override { return compute_.chunk(0).grads(); }
  std::int64_t parameter_count() const override { return compute_.chunk(0).parameter_count(); }
  const std::vector<parameter_info>& layout() const override {
    return compute_.chunk(0).parameters();
  }
  std::vector<float> parameters() const override {
    const auto& st = compute_.chunk(0);
    return {st.params(), st.params() + st.parameter_count()};
  }
  void load_parameters(std::int64_t at, const float* host, std::int64_t n) override {
    if (at < 0 || n < 0 || at + n > parameter_count())
      throw std::out_of_range("host_chunk: parameters outside the layout");
    std::memmove(compute_.chunk(0).params() + at, host,
                 static_cast<std::size_t>(n) * sizeof(float));
  }
  std::int64_t device_bytes() const override {
    return 2 * parameter_count() * static_cast<std::int64_t>(sizeof(float)) + optimizer_bytes() +
           owned_parameter_bytes() + compute_.activation_bytes() +
           static_cast<std::int64_t>(received_.size() * sizeof(float));
  }
  std::int64_t owned_parameter_bytes() const override {
    return static_cast<std::int64_t>(params_.size() * sizeof(float));
  }
  std::int64_t optimizer_bytes() const override {
    return compute_.optimizer_bytes() +
           static_cast<std::int64_t>((m_.size() + v_.size()) * sizeof(float));
  }
  std::pair<std::vector<float>, std::vector<float>> moments() override {
    const auto& o = compute_.optimizer(0);
    const float* m = o.first_moment().f32();
    const float* v = o.second_moment().f32();
    const auto n = static_cast<std::size_t>(o.first_moment().numel());
    return {{m, m + n}, {v, v + n}};
  }
  void load_moments(const float* m, const float* v) override {
    compute_.optimizer(0).load_moments(m, v);
  }
  float* device_parameters() override { return compute_.chunk(0).params(); }
  void own(std::vector<shard_segment> segments, bool parameters) override {
    if (!owned_.segments.empty() || compute_.optimizer_bytes() > 0)
      throw std::logic_error("host_chunk: owned segments in a chunk with optimizer state");
    std::int64_t n = 0;
    for (auto& s : segments) {
      s.chunk = 0;
      n = std::max(n, s.at + s.numel);
    }
    owned_.segments = std::move(segments);
    m_.assign(static_cast<std::size_t>(n), 0.0f);
    v_.assign(static_cast<std::size_t>(n), 0.0f);
    if (!parameters) return;
    params_.assign(static_cast<std::size_t>(n), 0.0f);
    const float* flat = compute_.chunk(0).params();
    for (const auto& s : owned_.segments)
      std::copy_n(flat + s.offset, s.numel, params_.begin() + s.at);
  }
  // The host shards' arithmetic (engine::shard_square_sum, shard_adamw_step): bitwise theirs.
  double owned_square_sum(const std::vector<shard_segment>& segments) override {
    bucket_shard b;
    b.segments = segments;
    for (auto& s : b.segments) s.chunk = 0;
    return shard_square_sum(b, views());
  }
  double update_owned(const optimizer_config& config, int step, int total_steps, double grad_norm,
                      double unscale) override {
    auto where = views();
    if (!params_.empty()) where.shard_params = params_.data();  // ZeRO-3: the owned copy
    return shard_adamw_step({owned_}, where, m_.data(), v_.data(), config, step, total_steps,
                            grad_norm, unscale);
  }
  void parameters_changed(std::int64_t, std::int64_t) override {}
  std::pair<std::vector<float>, std::vector<float>> owned_moments() override { return {m_, v_}; }
  void load_owned_moments(const float* m, const float* v) override {
    std::copy(m, m + m_.size(), m_.begin());
    std::copy(v, v + v_.size(), v_.begin());
  }
  void put_owned_parameters(const std::vector<shard_segment>& segments) override {
    if (params_.empty() && !segments.empty())
      throw std::logic_error("host_chunk: owned parameters put before own() with parameters");
    float* flat = compute_.chunk(0).params();
    for (const auto& s : segments) std::copy_n(params_.begin() + s.at, s.numel, flat + s.offset);
  }
  std::vector<float> owned_parameters() override { return params_; }
  // Released pages go back to the kernel (zeroed): the memory a ZeRO-3 stage holds is what its
  // gathered buckets' pages hold. The contract's discipline is checked as a CUDA chunk's paged
  // buffer checks it: a range released overlaps none released, and is acquired whole.
  void release_parameters(std::int64_t at, std::int64_t n) override {
    checked(at, n, "released parameters");
    auto next = released_.lower_bound(at);
    if ((next != released_.end() && next->first < at + n) ||
        (next != released_.begin() && std::prev(next)->second > at))
      throw std::logic_error("host_chunk: parameters [" + std::to_string(at) + ", " +
                             std::to_string(at + n) + ") released twice");
    released_.emplace(at, at + n);
    release_zeroed(compute_.chunk(0).params() + at, n);
  }
  void parameter_round() override {}  // pages go back when released
  void acquire_parameters(std::int64_t at, std::int64_t n) override {
    checked(at, n, "acquired parameters");
    const auto r = released_.find(at);
    if (r == released_.end() || r->second != at + n)
      throw std::logic_error("host_chunk: parameters [" + std::to_string(at) + ", " +
                             std::to_string(at + n) + ") acquired, not released as a whole");
    released_.erase(r);
  }
  void* record_event() override { return nullptr; }
  void wait_event(void*) override {}
  void copy_to_host(void* host, const void* memory, std::size_t bytes) override {
    std::memcpy(host, memory, bytes);
  }
  void copy_from_host(void* memory, const void* host, std::size_t bytes) override {
    std::memcpy(memory, host, bytes);
  }

 private:
  struct slot_state {
    std::vector<float> input, dinput, doutput;
    std::vector<std::int32_t> tokens, targets;
    int T = 0;          // its micro-batch's sequence length
    bool live = false;  // holds a forward's saved activations
  };
  static micro_batch_id id(int slot) { return {0, slot}; }
  shard_views views() {
    shard_views v;
    v.params = {compute_.chunk(0).params()};
    v.grads = {compute_.chunk(0).grads()};
    return v;
  }
  slot_state& at(int slot) {
    if (slot < 0 || static_cast<std::size_t>(slot) >= slots_.size())
      throw std::out_of_range("host_chunk: slot " + std::to_string(slot));
    return slots_[static_cast<std::size_t>(slot)];
  }
  std::int64_t checked(std::int64_t at, std::int64_t n, const char* what) const {
    if (at < 0 || n < 0 || at + n > parameter_count())
      throw std::out_of_range(std::string("host_chunk: ") + what + " outside the layout");
    return at;
  }
  float* span(std::int64_t at, std::int64_t n) {
    return compute_.chunk(0).grads() + checked(at, n, "gradients");
  }
  // The backward pass make(doutput, din) of slot's micro-batch, writing the input's gradient
  // to `dinput`: through a scratch when that is input(slot), which the pass reads.
  template <class Make>
  block_pass input_pass(int slot, void* dinput, Make make) {
    auto& s = at(slot);
    if (!s.live) throw std::logic_error("host_chunk: backward of a slot without forward");
    const float* dout = range().head ? nullptr : s.doutput.data();
    float* din = range().embedding ? nullptr : static_cast<float*>(dinput);
    if (din && din == s.input.data()) {
      scratch_.resize(activation_bytes() / sizeof(float));
      din = scratch_.data();
    }
    block_pass inner = make(dout, din);
    while (const auto* stop = inner.next()) co_yield *stop;
    if (din && din != dinput)  // at(slot) again: slots_ may have grown meanwhile
      std::memcpy(dinput, din, activation_bytes() / std::size_t(T_) * std::size_t(at(slot).T));
  }

  mutable cpu_chunks compute_;
  int B_ = 0, T_ = 0;
  bool recompute_ = false;
  std::vector<slot_state> slots_;
  std::vector<float> scratch_;
  std::vector<float> received_;  // gradient_scratch
  bucket_shard owned_;           // ZeRO on the device: the owned segments (chunk 0)
  std::vector<float> m_, v_;     // and their moments
  std::vector<float> params_;    // and (ZeRO-3) their master weights
  std::map<std::int64_t, std::int64_t> released_;  // ZeRO-3: released parameters, [at, end)
};

// Payloads queued in host memory, in send order.
class host_link final : public chunk_link {
 public:
  host_link(int from, int to) : from_(from), to_(to) {}
  void* send(const void* data, std::size_t bytes, void*) override {
    const auto* p = static_cast<const std::byte*>(data);
    std::lock_guard lock(mutex_);
    queue_.emplace_back(p, p + bytes);
    return nullptr;
  }
  void* receive(void* data, std::size_t bytes, void*) override {
    std::vector<std::byte> payload;
    {
      std::lock_guard lock(mutex_);
      if (queue_.empty()) throw std::logic_error(describe() + ": a receive with nothing sent");
      payload = std::move(queue_.front());
      queue_.pop_front();
    }
    if (payload.size() != bytes)
      throw std::logic_error(describe() + ": received " + std::to_string(bytes) + " bytes where " +
                             std::to_string(payload.size()) + " were sent");
    std::memcpy(data, payload.data(), bytes);
    return nullptr;
  }
  std::string describe() const override {
    return "host link, rank " + std::to_string(from_) + " -> " + std::to_string(to_);
  }

 private:
  int from_, to_;
  std::mutex mutex_;
  std::deque<std::vector<std::byte>> queue_;
};

}  // namespace

chunk_factory host_chunks(bool recompute) {
  chunk_factory f;
  f.name = "host";
  f.host_tensor_groups = true;
  f.host_memory = true;
  f.make_chunk = [recompute](const gpt_chunk& weights, int B, int T, int slots, int, int,
                             std::shared_ptr<group_member> member,
                             bool optimizer_state) -> std::unique_ptr<device_chunk> {
    auto group = std::dynamic_pointer_cast<tensor_group>(member);
    if (member && !group)
      throw std::logic_error("host_chunks: a tensor group member of another kind");
    return std::make_unique<host_chunk>(weights, B, T, slots, recompute, std::move(group),
                                        optimizer_state);
  };
  f.make_link = [](int from, int to, int) -> std::shared_ptr<chunk_link> {
    return std::make_shared<host_link>(from, to);
  };
  f.make_zero_group = [](int rank, int shard, int replicas) {
    return make_host_zero_group(replicas,
                                "zero-" + std::to_string(rank) + "-" + std::to_string(shard));
  };
  f.make_tensor_group = [](int rank, int replica,
                           int tp) -> std::vector<std::shared_ptr<group_member>> {
    auto members = make_local_tensor_group(
        tp, "tp group of stage " + std::to_string(rank) + " · dp " + std::to_string(replica));
    return {members.begin(), members.end()};
  };
  return f;
}

}  // namespace troupe::engine
