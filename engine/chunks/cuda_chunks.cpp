// The CUDA kind of device_chunk (a gpu_chunk) and of chunk_link (kernels::cuda::activation_link):
// see device_chunk.hpp. Built only with CUDA; gpu_chunk_stub.cpp says why not otherwise.
#include <algorithm>
#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/gpu_chunk.hpp"
#include "engine/chunks/zero_group.hpp"
#include "kernels/cuda/activation_link.hpp"
#include "kernels/cuda/device_info.hpp"
#include "kernels/cuda/nccl_group.hpp"

namespace troupe::engine {
namespace {

namespace cu = kernels::cuda;

// How long a communicator's join, and its first connection, wait for the other ranks.
constexpr std::chrono::seconds kJoinTimeout{120};

class cuda_chunk final : public device_chunk {
 public:
  cuda_chunk(const gpt_chunk& weights, int B, int T, const gpu_trainer_options& options, int slots,
             int device, std::shared_ptr<device_tensor_group> group)
      : s_(weights, B, T, options, slots, device, std::move(group)),
        T_(T),
        pinned_copy_(options.pinned_state_copy) {}

  const chunk_range& range() const override { return s_.range(); }
  int slots() const override { return s_.slots(); }
  int add_slot() override { return s_.add_slot(); }
  std::size_t activation_bytes() const override { return s_.activation_bytes(); }
  void* input(int slot) override { return s_.input(slot); }
  void* input_gradient(int slot) override { return s_.input_gradient(slot); }
  block_pass forward_pass(int slot, int seq_len, const std::int32_t* tokens,
                          const std::int32_t* targets, float loss_scale, bool train,
                          double* loss) override {
    lengths_[slot] = seq_len;
    return s_.forward_pass(slot, tokens, targets, loss_scale, train, seq_len, loss);
  }
  const void* output(int slot) const override { return s_.output(slot); }
  void* output_gradient(int slot) override { return s_.output_gradient(slot); }
  block_pass backward_pass(int slot, void* dinput, grad_block_fn on_block_done) override {
    return to_input_gradient(
        slot, dinput,
        [this, slot, f = std::move(on_block_done)](const void* dout, const void** d) mutable {
          return s_.backward_pass(slot, dout, std::move(f), d);
        });
  }
  block_pass backward_input_pass(int slot, void* dinput) override {
    return to_input_gradient(slot, dinput, [this, slot](const void* dout, const void** d) {
      return s_.backward_input_pass(slot, dout, d);
    });
  }
  // The backward pass make(doutput, &d) of slot's micro-batch, then its input's gradient (at d)
  // copied where the caller wants it, if backward wrote it elsewhere.
  template <class Make>
  block_pass to_input_gradient(int slot, void* dinput, Make make) {
    const void* d = nullptr;
    block_pass inner = make(range().head ? nullptr : s_.output_gradient(slot), &d);
    while (const auto* stop = inner.next()) co_yield *stop;
    if (d && dinput && dinput != d)
      s_.copy(dinput, d,
              activation_bytes() / static_cast<std::size_t>(T_) *
                  static_cast<std::size_t>(lengths_.at(slot)));
  }
  block_pass backward_weight_pass(int slot, grad_block_fn on_block_done) override {
    return s_.backward_weight_pass(slot, std::move(on_block_done));
  }
  bool recomputes() const override { return s_.recomputes(); }
  void zero_grad() override { s_.zero_grad(); }
  double grad_square_sum(bool count_tied_copy) override {
    return s_.grad_square_sum(count_tied_copy);
  }
  // As the CPU's step_with_norm, with unscaling and clipping folded into one multiplier.
  double update(const optimizer_config& config, int step, int total_steps, double grad_norm,
                double unscale) override {
    return adamw_step(config, step, total_steps, grad_norm, unscale, &gpu_chunk::adamw);
  }
  void add_gradients(std::int64_t at, const float* values, std::int64_t n) override {
    s_.add_gradients(at, values, n);
  }
  void copy_gradients(std::int64_t at, const float* values, std::int64_t n) override {
    s_.copy_gradients(at, values, n);
  }
  float* gradient_scratch(std::int64_t n) override { return s_.gradient_scratch(n); }
  float* device_gradients() override { return s_.device_gradients(); }
  std::int64_t parameter_count() const override { return s_.parameter_count(); }
  const std::vector<parameter_info>& layout() const override { return s_.layout(); }
  std::vector<float> parameters() const override { return s_.parameters(); }
  void load_parameters(std::int64_t at, const float* host, std::int64_t n) override {
    s_.load_parameters(at, host, n);
  }
  std::int64_t device_bytes() const override { return s_.device_bytes(); }
  std::int64_t optimizer_bytes() const override { return s_.optimizer_bytes(); }
  std::pair<std::vector<float>, std::vector<float>> moments() override { return s_.moments(); }
  void load_moments(const float* m, const float* v) override { s_.load_moments(m, v); }
  // checkpoint.pinned_copy: into pinned memory while the chunk goes on, given as views of it;
  // otherwise copied now.
  std::function<state_copy()> begin_state_copy(bool with_moments) override {
    if (!pinned_copy_) {
      auto s = std::make_shared<state_copy>(device_chunk::begin_state_copy(with_moments)());
      return [s] { return std::move(*s); };
    }
    return [view = s_.begin_state_copy(with_moments), P = s_.parameter_count(), with_moments] {
      state_copy s;
      s.params = view();
      if (with_moments) {
        s.m = s.params + P;
        s.v = s.params + 2 * P;
      }
      return s;
    };
  }
  float* device_parameters() override { return s_.device_parameters(); }
  void own(std::vector<shard_segment> segments, bool parameters) override {
    s_.own(std::move(segments), parameters);
  }
  double owned_square_sum(const std::vector<shard_segment>& segments) override {
    return s_.owned_square_sum(segments);
  }
  // As update(), over the owned segments.
  double update_owned(const optimizer_config& config, int step, int total_steps, double grad_norm,
                      double unscale) override {
    return adamw_step(config, step, total_steps, grad_norm, unscale, &gpu_chunk::adamw_owned);
  }
  void parameters_changed(std::int64_t at, std::int64_t n) override {
    s_.parameters_changed(at, n);
  }
  std::pair<std::vector<float>, std::vector<float>> owned_moments() override {
    return s_.owned_moments();
  }
  void load_owned_moments(const float* m, const float* v) override { s_.load_owned_moments(m, v); }
  void put_owned_parameters(const std::vector<shard_segment>& segments) override {
    s_.put_owned_parameters(segments);
  }
  std::vector<float> owned_parameters() override { return s_.owned_parameters(); }
  std::int64_t owned_parameter_bytes() const override { return s_.owned_parameter_bytes(); }
  void parameter_round() override { s_.parameter_round(); }
  void release_parameters(std::int64_t at, std::int64_t n) override {
    s_.release_parameters(at, n);
  }
  void acquire_parameters(std::int64_t at, std::int64_t n) override {
    s_.acquire_parameters(at, n);
  }
  void* record_event() override { return s_.record_event(); }
  void wait_event(void* event) override { s_.wait_event(event); }
  void copy_to_host(void* host, const void* memory, std::size_t bytes) override {
    s_.copy_to_host(host, memory, bytes);
  }
  void copy_from_host(void* memory, const void* host, std::size_t bytes) override {
    s_.copy_from_host(memory, host, bytes);
  }

 private:
  // The schedule's lr and one gradient multiplier (unscaling times clipping) into `adamw`.
  double adamw_step(const optimizer_config& config, int step, int total_steps, double grad_norm,
                    double unscale,
                    void (gpu_chunk::*adamw)(const kernels::adamw_hparams&, int, float)) {
    const double lr = learning_rate(config, step, total_steps);
    const double multiplier = unscale * clip_coefficient(grad_norm, config.grad_clip);
    (s_.*adamw)(adamw_hparams_at(config, lr), step + 1, static_cast<float>(multiplier));
    return lr;
  }

  gpu_chunk s_;
  int T_ = 0;
  bool pinned_copy_ = false;
  std::map<int, int> lengths_;  // by slot: its micro-batch's sequence length
};

// A link on one device (or between devices by a staged copy): kernels::cuda's local link.
class local_link final : public chunk_link {
 public:
  local_link(int from, int to) : link_(cu::make_local_link(from, to)) {}
  void* send(const void* data, std::size_t bytes, void* ready) override {
    return link_->send(data, bytes, static_cast<cudaEvent_t>(ready));
  }
  void* receive(void* data, std::size_t bytes, void* ready) override {
    return link_->receive(data, bytes, static_cast<cudaEvent_t>(ready));
  }
  std::string describe() const override { return link_->describe(); }

 private:
  std::shared_ptr<cu::activation_link> link_;
};

// A link between two devices by NCCL: a two-rank group (sender rank 0, receiver rank 1) for
// this direction alone, so a link's transfers never queue behind the other direction's.
class nccl_pair_link final : public chunk_link {
 public:
  nccl_pair_link(const std::string& name, int from_device, int to_device) {
    auto groups = cu::nccl_group::join_all(name, {from_device, to_device}, kJoinTimeout);
    sender_group_ = std::move(groups[0]);
    receiver_group_ = std::move(groups[1]);
    sender_ = cu::make_nccl_link(*sender_group_, 1);
    receiver_ = cu::make_nccl_link(*receiver_group_, 0);
    // Both ends connect now, at once (nccl_group::connect_peer): the receiver on a thread.
    std::exception_ptr failed;
    std::thread receiving([this, &failed] {
      try {
        receiver_group_->connect_peer(0, false, kJoinTimeout);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    try {
      sender_group_->connect_peer(1, true, kJoinTimeout);
    } catch (...) {
      receiving.join();  // its wait ends by its own deadline
      throw;
    }
    receiving.join();
    if (failed) std::rethrow_exception(failed);
  }
  ~nccl_pair_link() override {
    sender_.reset();
    receiver_.reset();
  }
  void* send(const void* data, std::size_t bytes, void* ready) override {
    return sender_->send(data, bytes, static_cast<cudaEvent_t>(ready));
  }
  void* receive(void* data, std::size_t bytes, void* ready) override {
    return receiver_->receive(data, bytes, static_cast<cudaEvent_t>(ready));
  }
  std::string describe() const override { return sender_->describe(); }

 private:
  std::unique_ptr<cu::nccl_group> sender_group_, receiver_group_;
  std::shared_ptr<cu::activation_link> sender_, receiver_;
};

// This process's end of a link to another process: a two-rank NCCL group of its own (sender
// rank 0, receiver rank 1), joined with the id the rendezvous carried.
class nccl_process_link final : public chunk_link {
 public:
  nccl_process_link(const std::string& name, const std::vector<std::uint8_t>& id, bool sender,
                    int device)
      : sender_(sender),
        group_(std::make_unique<cu::nccl_group>(name, cu::nccl_id_from(name, id), 2, sender ? 0 : 1,
                                                device, kJoinTimeout)),
        link_(cu::make_nccl_link(*group_, sender ? 1 : 0)) {
    group_->connect_peer(sender ? 1 : 0, sender, kJoinTimeout);  // the other end does at once
  }
  ~nccl_process_link() override { link_.reset(); }
  void* send(const void* data, std::size_t bytes, void* ready) override {
    if (!sender_) throw std::logic_error(describe() + ": send at the receiving end");
    return link_->send(data, bytes, static_cast<cudaEvent_t>(ready));
  }
  void* receive(void* data, std::size_t bytes, void* ready) override {
    if (sender_) throw std::logic_error(describe() + ": receive at the sending end");
    return link_->receive(data, bytes, static_cast<cudaEvent_t>(ready));
  }
  std::string describe() const override { return link_->describe(); }

 private:
  bool sender_;
  std::unique_ptr<cu::nccl_group> group_;
  std::shared_ptr<cu::activation_link> link_;
};

void set_device(int device) {
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    throw cu::cuda_error("cudaSetDevice(" + std::to_string(device) + "): " + cudaGetErrorString(e));
}

// Every rank of a communicator this process holds (rank d on devices[d]), driven by one thread:
// enqueue(groups, after) with each rank after its `ready` event, then by rank the event after
// its part (re-recorded by the next call: a later point).
template <class Enqueue>
std::vector<void*> drive_ranks(const std::vector<std::unique_ptr<cu::nccl_group>>& ranks,
                               const std::vector<int>& devices, const std::vector<void*>& ready,
                               Enqueue enqueue) {
  std::vector<cu::nccl_group*> groups;
  std::vector<cudaEvent_t> after;
  for (std::size_t d = 0; d < ranks.size(); ++d) {
    groups.push_back(ranks[d].get());
    after.push_back(static_cast<cudaEvent_t>(ready.at(d)));
  }
  enqueue(groups, after);
  std::vector<void*> done;
  for (std::size_t d = 0; d < ranks.size(); ++d) {
    set_device(devices[d]);
    done.push_back(ranks[d]->done());
  }
  return done;
}

// The replicas of a pipeline rank on distinct devices: a communicator rank per replica, driven
// by the one thread that calls mean() (the rank's reducer).
class nccl_replica_group final : public replica_group {
 public:
  nccl_replica_group(const std::string& name, std::vector<int> devices)
      : devices_(std::move(devices)), groups_(cu::nccl_group::join_all(name, devices_)) {}
  std::vector<void*> mean(const std::vector<float_ranges>& ranges,
                          const std::vector<void*>& ready) override {
    return drive_ranks(groups_, devices_, ready, [&ranges](const auto& groups, const auto& after) {
      cu::nccl_group::all_reduce_mean(groups, ranges, after);
    });
  }
  std::string describe() const override {
    return "NCCL group " + groups_.front()->name() + " of " + std::to_string(groups_.size()) +
           " devices";
  }

 private:
  std::vector<int> devices_;
  std::vector<std::unique_ptr<cu::nccl_group>> groups_;
};

// This process's replica of a data-parallel group whose replicas each live in a process of
// their own: rank `replica` of a communicator joined with the id the rendezvous carried. mean()
// averages this replica's ranges with the other processes' (ncclAvg, as nccl_replica_group).
class nccl_process_group final : public replica_group, public zero_group {
 public:
  using float_ranges = replica_group::float_ranges;  // zero_group's is the same type
  nccl_process_group(const std::string& name, const std::vector<std::uint8_t>& id, int replica,
                     int replicas, int device)
      : device_(device),
        group_(std::make_unique<cu::nccl_group>(name, cu::nccl_id_from(name, id), replicas, replica,
                                                device, kJoinTimeout)) {
    group_->connect_collectives(kJoinTimeout);  // every replica's process does at once
  }
  std::vector<void*> mean(const std::vector<float_ranges>& ranges,
                          const std::vector<void*>& ready) override {
    if (ranges.size() != 1 || ready.size() != 1)
      throw std::logic_error(describe() + ": mean of " + std::to_string(ranges.size()) +
                             " replicas' ranges in one process");
    cu::nccl_group::all_reduce_mean({group_.get()}, ranges, {static_cast<cudaEvent_t>(ready[0])});
    set_device(device_);
    return {group_->done()};  // re-recorded by the next mean(): a later point
  }
  // ZeRO-1/2: this replica's part of the collective, enqueued at once (every process's replica
  // calls in the same order: its stage's).
  void reduce_scatter(int, int, int replica, const float_ranges& ranges, void* ready,
                      done_fn done) override {
    owned(replica, ranges, ready, cu::nccl_group::owned_op::reduce_mean, done);
  }
  void all_gather(int, int, int replica, const float_ranges& ranges, void* ready,
                  done_fn done) override {
    owned(replica, ranges, ready, cu::nccl_group::owned_op::broadcast, done);
  }
  std::string describe() const override {
    return "NCCL group " + group_->name() + ", replica " + std::to_string(group_->rank()) + " of " +
           std::to_string(group_->size()) + " in as many processes";
  }

 private:
  void owned(int replica, const float_ranges& ranges, void* ready, cu::nccl_group::owned_op op,
             const done_fn& done) {
    if (replica != group_->rank())
      throw std::logic_error(describe() + ": a call for replica " + std::to_string(replica));
    cu::nccl_group::owned_collective({group_.get()}, {ranges}, {static_cast<cudaEvent_t>(ready)},
                                     op);
    set_device(device_);
    done(group_->done());  // re-recorded by the next collective: a later point
  }
  int device_;
  std::unique_ptr<cu::nccl_group> group_;
};

// ZeRO-1/2 over replicas of a pipeline rank on distinct devices of this process: a
// communicator rank per replica, driven by the thread of the replica that calls last.
class nccl_zero_group final : public replicas_zero_group {
 public:
  nccl_zero_group(const std::string& name, std::vector<int> devices)
      : replicas_zero_group(static_cast<int>(devices.size()), name),
        devices_(std::move(devices)),
        groups_(cu::nccl_group::join_all(name, devices_)) {}
  std::string describe() const override {
    return "NCCL ZeRO group " + name() + " of " + std::to_string(groups_.size()) + " devices";
  }

 protected:
  std::vector<void*> run(op o, const std::vector<float_ranges>& ranges,
                         const std::vector<void*>& ready) override {
    const auto kind = o == op::reduce_scatter ? cu::nccl_group::owned_op::reduce_mean
                                              : cu::nccl_group::owned_op::broadcast;
    return drive_ranks(groups_, devices_, ready,
                       [&ranges, kind](const auto& groups, const auto& after) {
                         cu::nccl_group::owned_collective(groups, ranges, after, kind);
                       });
  }

 private:
  std::vector<int> devices_;
  std::vector<std::unique_ptr<cu::nccl_group>> groups_;
};

// The replicas of a pipeline rank on one device (NCCL refuses two ranks of a communicator on
// one device): a mean kernel over their copies on the group's own stream.
class local_replica_group final : public replica_group {
 public:
  local_replica_group(int device, int replicas) : device_(device), replicas_(replicas) {
    if (replicas > cu::kMaxLocalReplicas)
      throw std::runtime_error("parallel.dp: " + std::to_string(replicas) +
                               " replicas on one device (at most " +
                               std::to_string(cu::kMaxLocalReplicas) + ")");
    set_device(device);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    if (const cudaError_t e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
        e != cudaSuccess) {
      cudaStreamDestroy(stream_);
      check(e, "cudaEventCreate");
    }
  }
  ~local_replica_group() override {
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }
  local_replica_group(const local_replica_group&) = delete;
  local_replica_group& operator=(const local_replica_group&) = delete;

  std::vector<void*> mean(const std::vector<float_ranges>& ranges,
                          const std::vector<void*>& ready) override {
    if (static_cast<int>(ranges.size()) != replicas_ || ready.size() != ranges.size())
      throw std::logic_error(describe() + ": ranges or events of another replica count");
    set_device(device_);
    for (void* e : ready)
      if (e)
        check(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(e), 0), "cudaStreamWaitEvent");
    for (std::size_t i = 0; i < ranges[0].size(); ++i) {
      std::vector<float*> copies;
      for (const auto& r : ranges) {
        if (r.size() != ranges[0].size() || r[i].second != ranges[0][i].second)
          throw std::logic_error(describe() + ": replicas disagree on a bucket's ranges");
        copies.push_back(r[i].first);
      }
      cu::replica_mean(stream_, copies.data(), replicas_, ranges[0][i].second);
    }
    check(cudaEventRecord(done_, stream_), "cudaEventRecord");  // a later point next time
    return std::vector<void*>(ranges.size(), done_);
  }
  std::string describe() const override {
    return "mean kernel of " + std::to_string(replicas_) + " replicas on device " +
           std::to_string(device_);
  }
  // For local_zero_group: the group's stream after the replicas' events; n floats copied on it;
  // the event after them (for every replica).
  void order(const std::vector<void*>& ready) {
    for (void* e : ready)
      if (e)
        check(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(e), 0), "cudaStreamWaitEvent");
  }
  void copy(float* to, const float* from, std::int64_t n) {
    check(cudaMemcpyAsync(to, from, static_cast<std::size_t>(n) * sizeof(float),
                          cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpyAsync(gather)");
  }
  std::vector<void*> finish() {
    check(cudaEventRecord(done_, stream_), "cudaEventRecord");
    return std::vector<void*>(static_cast<std::size_t>(replicas_), done_);
  }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw cu::cuda_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
  int device_ = 0, replicas_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

// ZeRO-1/2 over replicas of a pipeline rank on one device: the mean kernel into every copy (a
// reduce-scatter's owners among them), and the owners' chunks copied to the others, on the
// group's own stream.
class local_zero_group final : public replicas_zero_group {
 public:
  local_zero_group(int device, int replicas, const std::string& name)
      : replicas_zero_group(replicas, name), device_(device), mean_(device, replicas) {}
  std::string describe() const override {
    return "ZeRO group " + name() + " of " + std::to_string(replicas()) + " replicas on device " +
           std::to_string(device_);
  }

 protected:
  std::vector<void*> run(op o, const std::vector<float_ranges>& ranges,
                         const std::vector<void*>& ready) override {
    if (o == op::reduce_scatter) return mean_.mean(ranges, ready);
    // After every replica's ready event (the mean group's stream orders them), then each chunk
    // from its owner to the others.
    set_device(device_);
    const int d = replicas();
    std::int64_t n = 0;
    for (const auto& r : ranges[0]) n += r.second;
    mean_.order(ready);
    for (int c = 0; c < d; ++c) {
      const auto [b, e] = owned_chunk_bounds(n, d, c);
      const int owner = chunk_owner(c, d);
      std::vector<std::pair<float*, std::int64_t>> from;
      for_each_piece(ranges[static_cast<std::size_t>(owner)], b, e,
                     [&](float* p, std::int64_t k, std::int64_t) { from.emplace_back(p, k); });
      for (int r = 0; r < d; ++r) {
        if (r == owner) continue;
        std::size_t i = 0;
        for_each_piece(
            ranges[static_cast<std::size_t>(r)], b, e,
            [&](float* p, std::int64_t k, std::int64_t) { mean_.copy(p, from.at(i++).first, k); });
      }
    }
    return mean_.finish();
  }

 private:
  int device_;
  local_replica_group mean_;  // its stream and event
};

}  // namespace

chunk_factory cuda_chunks(const gpu_trainer_options& options, int pp, int tp, int local_rank) {
  const int devices = kernels::cuda_device_count();
  if (devices < 1) throw std::runtime_error("--device cuda: no usable CUDA device");
  // Lane d * tp + j (shard j of replica d): a rank's shards on neighbouring devices; or, in a
  // process of a multi-process job, its local rank's device.
  auto device_of = [devices, pp, tp, local_rank](int rank, int lane) {
    if (local_rank >= 0) return local_rank % devices;
    return ((lane / tp * pp + rank) * tp + lane % tp) % devices;
  };
  chunk_factory f;
  f.name = "cuda";
  f.host_tensor_groups = true;  // a group across processes: staged through host memory
  f.make_chunk = [options, device_of](const gpt_chunk& weights, int B, int T, int slots, int rank,
                                      int lane, std::shared_ptr<group_member> member,
                                      bool optimizer_state) -> std::unique_ptr<device_chunk> {
    const int device = device_of(rank, lane);
    auto group = std::dynamic_pointer_cast<device_tensor_group>(member);
    if (auto host = std::dynamic_pointer_cast<tensor_group>(member))  // across processes
      group = make_staged_tensor_member(std::move(host), device);
    if (member && !group)
      throw std::logic_error("cuda_chunks: a tensor group member of another kind");
    auto o = options;
    o.optimizer_state = optimizer_state;
    return std::make_unique<cuda_chunk>(weights, B, T, o, slots, device, std::move(group));
  };
  f.make_link = [device_of](int from, int to, int lane) -> std::shared_ptr<chunk_link> {
    const int a = device_of(from, lane), b = device_of(to, lane);
    if (a == b) return std::make_shared<local_link>(a, b);
    return std::make_shared<nccl_pair_link>(
        "pp-" + std::to_string(lane) + "-" + std::to_string(from) + "-" + std::to_string(to), a, b);
  };
  f.device_identity = [device_of] {
    return device_identity(kernels::cuda_device_bus_id(device_of(0, 0)), cu::nccl_host_id());
  };
  f.new_link_ids = [](std::size_t n) {
    std::vector<std::vector<std::uint8_t>> ids;
    for (std::size_t i = 0; i < n; ++i) {
      const cu::nccl_id id = cu::nccl_new_id();
      const auto* bytes = reinterpret_cast<const std::uint8_t*>(id.data());
      ids.emplace_back(bytes, bytes + id.size());
    }
    return ids;
  };
  f.make_process_link = [device_of](const std::string& name, const std::vector<std::uint8_t>& id,
                                    int from, int to, int lane,
                                    bool sender) -> std::shared_ptr<chunk_link> {
    return std::make_shared<nccl_process_link>(name, id, sender,
                                               device_of(sender ? from : to, lane));
  };
  f.make_process_group =
      [device_of, tp](const std::string& name, const std::vector<std::uint8_t>& id, int rank,
                      int shard, int replica, int replicas) -> std::shared_ptr<replica_group> {
    return std::make_shared<nccl_process_group>(name, id, replica, replicas,
                                                device_of(rank, replica * tp + shard));
  };
  f.make_process_tensor_member =
      [device_of, tp](const std::string& name, const std::vector<std::uint8_t>& id, int rank,
                      int replica, int shard, int shards) -> std::shared_ptr<group_member> {
    return join_process_tensor_group(name, id, shard, shards,
                                     device_of(rank, replica * tp + shard));
  };
  f.make_tensor_group = [device_of, tp](int rank, int replica,
                                        int shards) -> std::vector<std::shared_ptr<group_member>> {
    if (shards != tp)
      throw std::logic_error("cuda_chunks: a tensor group of " + std::to_string(shards) +
                             " shards in a factory for " + std::to_string(tp));
    std::vector<int> on;
    for (int j = 0; j < tp; ++j) on.push_back(device_of(rank, replica * tp + j));
    auto members =
        make_device_tensor_group("tp-" + std::to_string(replica) + "-" + std::to_string(rank), on);
    return {members.begin(), members.end()};
  };
  f.make_zero_group = [device_of, devices, tp](int rank, int shard,
                                               int replicas) -> std::shared_ptr<zero_group> {
    std::vector<int> on;
    for (int d = 0; d < replicas; ++d) on.push_back(device_of(rank, d * tp + shard));
    const std::string name = "zero-" + std::to_string(rank) + "-" + std::to_string(shard);
    if (std::all_of(on.begin(), on.end(), [&on](int x) { return x == on[0]; }))
      return std::make_shared<local_zero_group>(on[0], replicas, name);
    auto sorted = on;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end())
      return std::make_shared<nccl_zero_group>(name, on);
    throw std::runtime_error("parallel.dp: the replicas of pipeline rank " + std::to_string(rank) +
                             " share some of " + std::to_string(devices) +
                             " devices: give each replica its own device or put them all on one");
  };
  f.make_group = [device_of, devices, tp](int rank, int shard,
                                          int replicas) -> std::shared_ptr<replica_group> {
    std::vector<int> on;
    for (int d = 0; d < replicas; ++d) on.push_back(device_of(rank, d * tp + shard));
    if (std::all_of(on.begin(), on.end(), [&on](int x) { return x == on[0]; }))
      return std::make_shared<local_replica_group>(on[0], replicas);
    auto sorted = on;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end())
      return std::make_shared<nccl_replica_group>(
          "dp-" + std::to_string(rank) + "-" + std::to_string(shard), on);
    std::string list;
    for (int x : on) {
      if (!list.empty()) list += ',';
      list += std::to_string(x);
    }
    throw std::runtime_error(
        "parallel.dp: the replicas of pipeline rank " + std::to_string(rank) + " fall on devices " +
        list + " of " + std::to_string(devices) +
        ": give each replica its own device (pp x dp devices) or put them all on one");
  };
  return f;
}

}  // namespace troupe::engine
