// See activation_link.hpp.
#include "kernels/cuda/activation_link.hpp"

#include <algorithm>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/nccl_group.hpp"

namespace troupe::kernels::cuda {
namespace {

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw cuda_error(what + ": " + cudaGetErrorString(e));
}

cudaEvent_t new_event() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}

// Both ends in this process. Every copy runs on the link's stream (on the sending device), in
// call order: a payload's staging copy is always enqueued before its receive copy, and a
// staging buffer goes back to the free list only once its receive copy is enqueued, so a later
// send that reuses it is ordered after that copy.
class local_link final : public activation_link {
 public:
  local_link(int send_device, int receive_device)
      : send_device_(send_device), receive_device_(receive_device) {
    check(cudaSetDevice(send_device_), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    released_ = new_event();
    arrived_ = new_event();
  }
  ~local_link() override {
    cudaSetDevice(send_device_);
    cudaStreamSynchronize(stream_);
    for (auto& s : queue_) cudaFree(s.buffer);
    for (auto& [buffer, capacity] : free_) cudaFree(buffer);
    cudaEventDestroy(released_);
    cudaEventDestroy(arrived_);
    cudaStreamDestroy(stream_);
  }

  cudaEvent_t send(const void* data, std::size_t bytes, cudaEvent_t ready) override {
    std::lock_guard lock(mutex_);
    check(cudaSetDevice(send_device_), "cudaSetDevice");
    staged s{nullptr, 0, bytes};
    // The smallest free staging buffer that fits, else a new one.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second >= bytes && (best == free_.end() || it->second < best->second)) best = it;
    if (best != free_.end()) {
      s.buffer = best->first;
      s.capacity = best->second;
      free_.erase(best);
    } else {
      check(cudaMalloc(&s.buffer, std::max<std::size_t>(bytes, 1)), describe() + ": cudaMalloc");
      s.capacity = bytes;
    }
    if (ready) check(cudaStreamWaitEvent(stream_, ready, 0), describe() + ": cudaStreamWaitEvent");
    check(cudaMemcpyAsync(s.buffer, data, bytes, cudaMemcpyDeviceToDevice, stream_),
          describe() + ": staging copy");
    check(cudaEventRecord(released_, stream_), describe() + ": cudaEventRecord");
    queue_.push_back(s);
    return released_;
  }

  cudaEvent_t receive(void* data, std::size_t bytes, cudaEvent_t ready) override {
    std::lock_guard lock(mutex_);
    if (queue_.empty())
      throw std::logic_error(describe() + ": receive of " + std::to_string(bytes) +
                             " bytes with nothing sent");
    const staged s = queue_.front();
    if (s.bytes != bytes)
      throw std::invalid_argument(describe() + ": receive of " + std::to_string(bytes) +
                                  " bytes where " + std::to_string(s.bytes) + " were sent");
    queue_.pop_front();
    check(cudaSetDevice(send_device_), "cudaSetDevice");
    if (ready) check(cudaStreamWaitEvent(stream_, ready, 0), describe() + ": cudaStreamWaitEvent");
    if (send_device_ == receive_device_)
      check(cudaMemcpyAsync(data, s.buffer, bytes, cudaMemcpyDeviceToDevice, stream_),
            describe() + ": copy");
    else
      check(cudaMemcpyPeerAsync(data, receive_device_, s.buffer, send_device_, bytes, stream_),
            describe() + ": peer copy");
    check(cudaEventRecord(arrived_, stream_), describe() + ": cudaEventRecord");
    free_.emplace_back(s.buffer, s.capacity);
    return arrived_;
  }

  std::string describe() const override {
    return "local link, device " + std::to_string(send_device_) + " -> device " +
           std::to_string(receive_device_);
  }

 private:
  struct staged {
    void* buffer;
    std::size_t capacity, bytes;
  };
  int send_device_, receive_device_;
  std::mutex mutex_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t released_ = nullptr, arrived_ = nullptr;
  std::deque<staged> queue_;                         // sent, not yet received
  std::vector<std::pair<void*, std::size_t>> free_;  // (buffer, capacity)
};

// This process's end of a link over an NCCL group. The group's stream runs its operations in
// order, so each direction of a pipeline link needs a group of its own: with one group, a
// stage's send of the next activation would queue behind its receive of a gradient that the
// peer sends only after receiving that activation.
class nccl_link final : public activation_link {
 public:
  nccl_link(nccl_group& group, int peer) : group_(group), peer_(peer) {
    if (peer < 0 || peer >= group.size() || peer == group.rank())
      throw std::invalid_argument("nccl group " + group.name() + ": no peer " +
                                  std::to_string(peer) + " for a link from rank " +
                                  std::to_string(group.rank()));
    sent_ = new_event();
    arrived_ = new_event();
  }
  ~nccl_link() override {
    cudaEventDestroy(sent_);
    cudaEventDestroy(arrived_);
  }

  cudaEvent_t send(const void* data, std::size_t bytes, cudaEvent_t ready) override {
    group_.send(data, bytes, peer_, ready);
    check(cudaEventRecord(sent_, group_.stream()), describe() + ": cudaEventRecord");
    return sent_;
  }
  cudaEvent_t receive(void* data, std::size_t bytes, cudaEvent_t ready) override {
    group_.recv(data, bytes, peer_, ready);
    check(cudaEventRecord(arrived_, group_.stream()), describe() + ": cudaEventRecord");
    return arrived_;
  }
  std::string describe() const override {
    return "nccl group " + group_.name() + ", rank " + std::to_string(group_.rank()) + " <-> " +
           std::to_string(peer_);
  }

 private:
  nccl_group& group_;
  int peer_;
  cudaEvent_t sent_ = nullptr, arrived_ = nullptr;
};

}  // namespace

std::shared_ptr<activation_link> make_local_link(int send_device, int receive_device) {
  return std::make_shared<local_link>(send_device, receive_device);
}

std::shared_ptr<activation_link> make_nccl_link(nccl_group& group, int peer) {
  return std::make_shared<nccl_link>(group, peer);
}

}  // namespace troupe::kernels::cuda
