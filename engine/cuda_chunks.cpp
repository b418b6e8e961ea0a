// The CUDA kind of device_chunk (a gpu_stage) and of chunk_link (kernels::cuda::activation_link):
// see device_chunk.hpp. Built only with CUDA; gpu_stage_stub.cpp says why not otherwise.
#include <chrono>
#include <stdexcept>
#include <thread>

#include "engine/device_chunk.hpp"
#include "engine/gpu_stage.hpp"
#include "kernels/cuda/activation_link.hpp"
#include "kernels/cuda/device_info.hpp"
#include "kernels/cuda/nccl_group.hpp"

namespace troupe::engine {
namespace {

namespace cu = kernels::cuda;

class cuda_chunk final : public device_chunk {
 public:
  cuda_chunk(const gpt_stage& weights, int B, int T, const gpu_trainer_options& options, int slots,
             int device)
      : s_(weights, B, T, options, slots, device) {}

  const stage_range& range() const override { return s_.range(); }
  int slots() const override { return s_.slots(); }
  std::size_t activation_bytes() const override { return s_.activation_bytes(); }
  void* input(int slot) override { return s_.input(slot); }
  double forward(int slot, const std::int32_t* tokens, const std::int32_t* targets,
                 float loss_scale, bool train) override {
    return s_.forward(slot, tokens, targets, loss_scale, train);
  }
  const void* output(int slot) const override { return s_.output(slot); }
  void* output_gradient(int slot) override { return s_.output_gradient(slot); }
  void backward(int slot, void* dinput) override {
    const void* d = s_.backward(slot, range().head ? nullptr : s_.output_gradient(slot));
    if (d && dinput && dinput != d) s_.copy(dinput, d, activation_bytes());
  }
  void zero_grad() override { s_.zero_grad(); }
  double grad_square_sum(bool count_tied_copy) override {
    return s_.grad_square_sum(count_tied_copy);
  }
  // As the CPU's step_with_norm, with unscaling and clipping folded into one multiplier.
  double update(const optimizer_config& config, int step, int total_steps, double grad_norm,
                double unscale) override {
    const double lr = learning_rate(config, step, total_steps);
    const double multiplier = unscale * clip_coefficient(grad_norm, config.grad_clip);
    s_.adamw(adamw_hparams_at(config, lr), step + 1, static_cast<float>(multiplier));
    return lr;
  }
  std::vector<float> read_gradients(std::int64_t at, std::int64_t n) override {
    return s_.read_gradients(at, n);
  }
  void write_gradients(std::int64_t at, const float* values, std::int64_t n) override {
    s_.write_gradients(at, values, n);
  }
  float* device_gradients() override { return s_.device_gradients(); }
  std::int64_t parameter_count() const override { return s_.parameter_count(); }
  const std::vector<parameter_info>& layout() const override { return s_.layout(); }
  std::vector<float> parameters() const override { return s_.parameters(); }
  std::int64_t device_bytes() const override { return s_.device_bytes(); }
  void* record_event() override { return s_.record_event(); }
  void wait_event(void* event) override { s_.wait_event(event); }

 private:
  gpu_stage s_;
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
    const cu::nccl_id id = cu::nccl_new_id();
    constexpr auto join = std::chrono::seconds(120);
    // Each end joins on its own thread: a join waits for the other.
    std::exception_ptr failed;
    std::thread receiver([&] {
      try {
        receiver_group_ = std::make_unique<cu::nccl_group>(name, id, 2, 1, to_device, join);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    try {
      sender_group_ = std::make_unique<cu::nccl_group>(name, id, 2, 0, from_device, join);
    } catch (...) {
      receiver.join();
      throw;
    }
    receiver.join();
    if (failed) std::rethrow_exception(failed);
    sender_ = cu::make_nccl_link(*sender_group_, 1);
    receiver_ = cu::make_nccl_link(*receiver_group_, 0);
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

}  // namespace

chunk_factory cuda_chunks(const gpu_trainer_options& options, int pp) {
  const int devices = kernels::cuda_device_count();
  if (devices < 1) throw std::runtime_error("--device cuda: no usable CUDA device");
  auto device_of = [devices, pp](int rank, int replica) { return (replica * pp + rank) % devices; };
  chunk_factory f;
  f.name = "cuda";
  f.make_chunk = [options, device_of](const gpt_stage& weights, int B, int T, int slots, int rank,
                                      int replica) -> std::unique_ptr<device_chunk> {
    return std::make_unique<cuda_chunk>(weights, B, T, options, slots, device_of(rank, replica));
  };
  f.make_link = [device_of](int from, int to, int replica) -> std::shared_ptr<chunk_link> {
    const int a = device_of(from, replica), b = device_of(to, replica);
    if (a == b) return std::make_shared<local_link>(a, b);
    return std::make_shared<nccl_pair_link>(
        "pp-" + std::to_string(replica) + "-" + std::to_string(from) + "-" + std::to_string(to), a,
        b);
  };
  return f;
}

}  // namespace troupe::engine
