// Tensor groups of device chunks (gpu_chunk.hpp: make_device_tensor_group): NCCL between
// distinct devices, an in-place summing kernel between the members' streams on one device.
// Built only with CUDA; gpu_chunk_stub.cpp says why not otherwise.
//
// Invariants:
//  - A member's collective reads its buffer after everything its chunk's stream enqueued before
//    the call (an event recorded then), and the stream's later work waits for the result (an
//    event of the group's stream): the chunk never reads a half-reduced buffer.
//  - One device: the last member to arrive enqueues the reduction of every member's buffer, in
//    member order, on the group's stream, so all members get the same bits. Until then the
//    others wait on the host, up to the deadline; whoever times out names the member missing.
//  - abort() by any member (its actor stopped) wakes the waiting members with the reason, and
//    for NCCL tears down every member's communicator (ncclCommAbort), which also ends kernels
//    waiting for a peer that will not come.
//  - Staged (a host group across processes): the buffer reaches the host after the chunk's work
//    so far (a copy on its stream, then a wait for the stream), is reduced as fp32 values in
//    member order (16-bit values widened, the sum rounded once, as the one-device kernel), and
//    the copy back is on the chunk's stream before its later work.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/nccl_group.hpp"

namespace troupe::engine {
namespace {

namespace cu = kernels::cuda;
using element = cu::nccl_group::element;
using reduction = cu::nccl_group::reduction;

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw cu::cuda_error(what + ": " + cudaGetErrorString(e));
}

element element_of(compute_dtype d) {
  switch (d) {
    case compute_dtype::bf16:
      return element::bf16;
    case compute_dtype::fp16:
      return element::f16;
    case compute_dtype::fp32:
      break;
  }
  return element::f32;
}

// A member's event, recorded on its chunk's stream when a collective starts.
class member_event {
 public:
  explicit member_event(int device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~member_event() {
    if (e_) cudaEventDestroy(e_);
  }
  member_event(const member_event&) = delete;
  member_event& operator=(const member_event&) = delete;
  cudaEvent_t record(void* stream) {
    check(cudaEventRecord(e_, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
    return e_;
  }

 private:
  cudaEvent_t e_ = nullptr;
};

// ---- distinct devices: a communicator rank per member --------------------------------------
struct nccl_state {
  std::mutex m;
  std::string name;
  // By member: this process's members' ranks (null: a member in another process).
  std::vector<std::unique_ptr<cu::nccl_group>> comms;
  std::string aborted;  // non-empty: every call throws this
};

class nccl_member final : public device_tensor_group {
 public:
  nccl_member(std::shared_ptr<nccl_state> s, int rank, int device)
      : s_(std::move(s)), rank_(rank), ready_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(s_->comms.size()); }
  void all_reduce_sum(void* data, std::int64_t n, compute_dtype dtype, void* stream) override {
    run(data, n, element_of(dtype), reduction::sum, stream);
  }
  void all_reduce_sum(float* data, std::int64_t n, void* stream) override {
    run(data, n, element::f32, reduction::sum, stream);
  }
  void all_reduce_max(float* data, std::int64_t n, void* stream) override {
    run(data, n, element::f32, reduction::max, stream);
  }
  void abort(const std::string& why) override {
    std::lock_guard lk(s_->m);
    if (!s_->aborted.empty()) return;
    s_->aborted = s_->name + ": " + why;
    for (auto& c : s_->comms)
      if (c) c->abort(s_->aborted);
  }
  std::string describe() const override {
    const bool spans = std::any_of(s_->comms.begin(), s_->comms.end(), [](auto& c) { return !c; });
    return "NCCL group " + s_->name + " of " + std::to_string(size()) +
           (spans ? " devices in as many processes" : " devices");
  }

 private:
  void run(void* data, std::int64_t n, element type, reduction op, void* stream) {
    std::lock_guard lk(s_->m);
    if (!s_->aborted.empty()) throw std::runtime_error(s_->aborted);
    auto& g = *s_->comms[static_cast<std::size_t>(rank_)];
    g.all_reduce(data, n, type, op, ready_.record(stream));
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), g.done(), 0),
          "cudaStreamWaitEvent");
  }

  std::shared_ptr<nccl_state> s_;
  int rank_ = 0;
  member_event ready_;
};

// ---- one device: the members meet on the host, the last one enqueues the reduction ----------
struct local_state {
  local_state(std::string name_, int size_, int device_, std::chrono::milliseconds deadline_)
      : name(std::move(name_)),
        size(size_),
        device(device_),
        deadline(deadline_),
        data(static_cast<std::size_t>(size_)),
        ready(static_cast<std::size_t>(size_)),
        present(static_cast<std::size_t>(size_), false) {
    if (size > cu::kMaxLocalReplicas)
      throw std::runtime_error("parallel.tp: " + std::to_string(size) +
                               " tensor shards on one device (at most " +
                               std::to_string(cu::kMaxLocalReplicas) + ")");
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    if (const cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
        e != cudaSuccess) {
      cudaStreamDestroy(stream);
      check(e, "cudaEventCreate");
    }
  }
  ~local_state() {
    cudaSetDevice(device);
    cudaEventDestroy(done);
    cudaStreamDestroy(stream);
  }
  local_state(const local_state&) = delete;
  local_state& operator=(const local_state&) = delete;

  std::mutex m;
  std::condition_variable cv;
  std::string name;
  int size = 1, device = 0;
  std::chrono::milliseconds deadline;
  cudaStream_t stream = nullptr;  // where the reductions run
  cudaEvent_t done = nullptr;     // after the latest reduction
  // The collective being gathered: its kind and length, and who has arrived with what.
  std::vector<void*> data;
  std::vector<cudaEvent_t> ready;
  std::vector<bool> present;
  int arrived = 0;
  std::int64_t n = 0;
  int kind = 0;
  std::uint64_t generation = 0;
  std::string aborted;
};

class local_member final : public device_tensor_group {
 public:
  local_member(std::shared_ptr<local_state> s, int rank)
      : s_(std::move(s)), rank_(rank), ready_(s_->device) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  void all_reduce_sum(void* data, std::int64_t n, compute_dtype dtype, void* stream) override {
    run(data, n, static_cast<int>(element_of(dtype)), stream);
  }
  void all_reduce_sum(float* data, std::int64_t n, void* stream) override {
    run(data, n, static_cast<int>(element::f32), stream);
  }
  void all_reduce_max(float* data, std::int64_t n, void* stream) override {
    run(data, n, kMax, stream);
  }
  void abort(const std::string& why) override {
    std::lock_guard lk(s_->m);
    fail(s_->name + ": " + why);
  }
  std::string describe() const override {
    return "summing kernel of " + std::to_string(s_->size) + " shards on device " +
           std::to_string(s_->device);
  }

 private:
  static constexpr int kMax = 100;  // beside the element kinds of a sum

  void fail(const std::string& why) {  // with the lock held
    if (s_->aborted.empty()) s_->aborted = why;
    s_->cv.notify_all();
  }

  void run(void* data, std::int64_t n, int kind, void* stream) {
    auto& s = *s_;
    const cudaEvent_t ready = ready_.record(stream);
    std::unique_lock lk(s.m);
    if (!s.aborted.empty()) throw std::runtime_error(s.aborted);
    if (s.arrived == 0) {
      s.n = n;
      s.kind = kind;
    } else if (s.n != n || s.kind != kind) {
      fail(s.name + ": shard " + std::to_string(rank_) + " called another collective (" +
           std::to_string(n) + " values) than its peers (" + std::to_string(s.n) + ")");
      throw std::runtime_error(s.aborted);
    }
    const auto at = static_cast<std::size_t>(rank_);
    s.data[at] = data;
    s.ready[at] = ready;
    s.present[at] = true;
    const std::uint64_t generation = s.generation;
    if (++s.arrived == s.size) {
      try {
        reduce();
      } catch (const std::exception& e) {
        fail(s.name + ": " + e.what());
        throw;
      }
      s.arrived = 0;
      std::fill(s.present.begin(), s.present.end(), false);
      ++s.generation;
      s.cv.notify_all();
    } else if (!s.cv.wait_for(lk, s.deadline,
                              [&] { return s.generation != generation || !s.aborted.empty(); })) {
      const auto missing = std::find(s.present.begin(), s.present.end(), false) - s.present.begin();
      fail(s.name + ": shard " + std::to_string(rank_) + " waited " +
           std::to_string(s.deadline.count()) + " ms in a collective for shard " +
           std::to_string(missing));
    }
    if (s.generation == generation) throw std::runtime_error(s.aborted);
    // The chunk's later work waits for the reduction (before the next one re-records `done`:
    // that needs every member, this one included, to have arrived again).
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), s.done, 0), "cudaStreamWaitEvent");
  }

  // Every member's buffer after its event, reduced in place on the group's stream.
  void reduce() {
    auto& s = *s_;
    for (cudaEvent_t e : s.ready) check(cudaStreamWaitEvent(s.stream, e, 0), "cudaStreamWaitEvent");
    auto as = [&s](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      std::vector<T*> copies;
      for (void* p : s.data) copies.push_back(static_cast<T*>(p));
      return copies;
    };
    if (s.kind == kMax) {
      cu::local_max(s.stream, as(static_cast<float*>(nullptr)).data(), s.size, s.n);
    } else if (s.kind == static_cast<int>(element::bf16)) {
      cu::local_sum(s.stream, as(static_cast<cu::bf16*>(nullptr)).data(), s.size, s.n);
    } else if (s.kind == static_cast<int>(element::f16)) {
      cu::local_sum(s.stream, as(static_cast<cu::fp16*>(nullptr)).data(), s.size, s.n);
    } else {
      cu::local_sum(s.stream, as(static_cast<float*>(nullptr)).data(), s.size, s.n);
    }
    check(cudaEventRecord(s.done, s.stream), "cudaEventRecord");
  }

  std::shared_ptr<local_state> s_;
  int rank_ = 0;
  member_event ready_;
};

// ---- across processes: through pinned host memory and a host tensor group -------------------
class staged_member final : public device_tensor_group {
 public:
  staged_member(std::shared_ptr<tensor_group> host, int device)
      : host_(std::move(host)), device_(device) {}
  ~staged_member() override {
    if (pinned_) cudaFreeHost(pinned_);
  }
  staged_member(const staged_member&) = delete;
  staged_member& operator=(const staged_member&) = delete;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  void all_reduce_sum(void* data, std::int64_t n, compute_dtype dtype, void* stream) override {
    switch (dtype) {
      case compute_dtype::bf16:  // the conversions of the one-device kernel (cuda_common.cuh)
        return narrow<__nv_bfloat16>(
            data, n, stream, [](__nv_bfloat16 x) { return __bfloat162float(x); },
            [](float x) { return __float2bfloat16(x); });
      case compute_dtype::fp16:
        return narrow<__half>(
            data, n, stream, [](__half x) { return __half2float(x); },
            [](float x) { return __float2half(x); });
      case compute_dtype::fp32:
        break;
    }
    all_reduce_sum(static_cast<float*>(data), n, stream);
  }
  void all_reduce_sum(float* data, std::int64_t n, void* stream) override {
    float* host = to_host<float>(data, n, stream);
    host_->all_reduce_sum(std::span<float>(host, static_cast<std::size_t>(n)));
    back(data, n * std::int64_t{sizeof(float)}, stream);
  }
  void all_reduce_max(float* data, std::int64_t n, void* stream) override {
    float* host = to_host<float>(data, n, stream);
    host_->all_reduce_max(std::span<float>(host, static_cast<std::size_t>(n)));
    back(data, n * std::int64_t{sizeof(float)}, stream);
  }
  void abort(const std::string& why) override { host_->abort(why); }
  std::string describe() const override {
    return "host-staged group of " + std::to_string(size()) + " shards (member " +
           std::to_string(rank()) + " on device " + std::to_string(device_) + ")";
  }

 private:
  // 16-bit values: widened into fp32, reduced, rounded back once.
  template <class T, class Widen, class Round>
  void narrow(void* data, std::int64_t n, void* stream, Widen widen, Round round) {
    T* host = to_host<T>(data, n, stream);
    wide_.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) wide_[static_cast<std::size_t>(i)] = widen(host[i]);
    host_->all_reduce_sum(std::span<float>(wide_));
    for (std::int64_t i = 0; i < n; ++i) host[i] = round(wide_[static_cast<std::size_t>(i)]);
    back(data, n * std::int64_t{sizeof(T)}, stream);
  }
  // n values of `data` in the pinned buffer, once the chunk's work so far is done. The copy back
  // of the previous collective was enqueued on the same stream before this one, so the buffer is
  // free again when the wait returns.
  template <class T>
  T* to_host(const void* data, std::int64_t n, void* stream) {
    const auto bytes = static_cast<std::size_t>(n) * sizeof(T);
    check(cudaSetDevice(device_), "cudaSetDevice");
    auto s = static_cast<cudaStream_t>(stream);
    if (bytes > capacity_) {
      check(cudaStreamSynchronize(s), "cudaStreamSynchronize");  // the old buffer is unread
      if (pinned_) check(cudaFreeHost(pinned_), "cudaFreeHost");
      pinned_ = nullptr;
      capacity_ = 0;
      check(cudaMallocHost(&pinned_, bytes), "cudaMallocHost");
      capacity_ = bytes;
    }
    if (bytes > 0) {
      check(cudaMemcpyAsync(pinned_, data, bytes, cudaMemcpyDeviceToHost, s),
            "cudaMemcpyAsync(device to host)");
    }
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return static_cast<T*>(pinned_);
  }
  void back(void* data, std::int64_t bytes, void* stream) {
    if (bytes <= 0) return;
    check(cudaMemcpyAsync(data, pinned_, static_cast<std::size_t>(bytes), cudaMemcpyHostToDevice,
                          static_cast<cudaStream_t>(stream)),
          "cudaMemcpyAsync(host to device)");
  }

  std::shared_ptr<tensor_group> host_;
  int device_ = 0;
  void* pinned_ = nullptr;
  std::size_t capacity_ = 0;
  std::vector<float> wide_;
};

}  // namespace

std::shared_ptr<device_tensor_group> make_staged_tensor_member(std::shared_ptr<tensor_group> host,
                                                               int device) {
  if (!host) throw std::invalid_argument("make_staged_tensor_member: no host group member");
  return std::make_shared<staged_member>(std::move(host), device);
}

std::vector<std::shared_ptr<device_tensor_group>> make_device_tensor_group(
    const std::string& name, const std::vector<int>& devices, std::chrono::milliseconds deadline) {
  if (devices.empty()) throw std::invalid_argument("make_device_tensor_group: no members");
  std::vector<std::shared_ptr<device_tensor_group>> members;
  const int n = static_cast<int>(devices.size());
  if (std::all_of(devices.begin(), devices.end(), [&](int d) { return d == devices[0]; })) {
    auto s = std::make_shared<local_state>(name, n, devices[0], deadline);
    for (int i = 0; i < n; ++i) members.push_back(std::make_shared<local_member>(s, i));
    return members;
  }
  auto sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    std::string list;
    for (int d : devices) {
      if (!list.empty()) list += ',';
      list += std::to_string(d);
    }
    throw std::runtime_error("parallel.tp: the tensor shards of " + name + " fall on devices " +
                             list +
                             ": give each shard its own device (pp x dp x tp devices) or put "
                             "them all on one");
  }
  auto s = std::make_shared<nccl_state>();
  s->name = name;
  s->comms = cu::nccl_group::join_all(name, devices, deadline);
  for (int i = 0; i < n; ++i)
    members.push_back(std::make_shared<nccl_member>(s, i, devices[static_cast<std::size_t>(i)]));
  return members;
}

std::shared_ptr<device_tensor_group> join_process_tensor_group(const std::string& name,
                                                               const std::vector<std::uint8_t>& id,
                                                               int rank, int size, int device,
                                                               std::chrono::milliseconds deadline) {
  if (size < 2 || rank < 0 || rank >= size)
    throw std::invalid_argument("join_process_tensor_group " + name + ": member " +
                                std::to_string(rank) + " of " + std::to_string(size));
  auto s = std::make_shared<nccl_state>();
  s->name = name;
  s->comms.resize(static_cast<std::size_t>(size));
  auto& mine = s->comms[static_cast<std::size_t>(rank)];
  mine = std::make_unique<cu::nccl_group>(name, cu::nccl_id_from(name, id), size, rank, device,
                                          deadline);
  mine->connect_collectives(deadline);  // every member's process does at once
  return std::make_shared<nccl_member>(s, rank, device);
}

}  // namespace troupe::engine
