// Activation links between GPU pipeline chunks (`gpu` suite, in test_nccl_group's runner: SKIP
// without a GPU; the NCCL link needs two GPUs, one per rank, and is left out, saying so, on a
// one-GPU machine).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <thread>
#include <vector>

#include "kernels/cuda/activation_link.hpp"
#include "kernels/cuda/nccl_group.hpp"

namespace cu = troupe::kernels::cuda;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t kFloats = 1 << 18;  // 1 MiB payloads

struct device_floats {
  float* p = nullptr;
  explicit device_floats(std::size_t n) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)) == cudaSuccess);
  }
  ~device_floats() { cudaFree(p); }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
};

struct stream_and_event {
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  stream_and_event() {
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess);
  }
  ~stream_and_event() {
    cudaEventDestroy(event);
    cudaStreamDestroy(stream);
  }
  stream_and_event(const stream_and_event&) = delete;
  stream_and_event& operator=(const stream_and_event&) = delete;
  cudaEvent_t record() {
    REQUIRE(cudaEventRecord(event, stream) == cudaSuccess);
    return event;
  }
  void fill(float* p, float value) {
    std::vector<float> host(kFloats, value);
    REQUIRE(cudaMemcpyAsync(p, host.data(), kFloats * sizeof(float), cudaMemcpyHostToDevice,
                            stream) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);  // the host vector goes away
  }
  std::vector<float> download(const float* p) {
    std::vector<float> out(kFloats);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    REQUIRE(cudaMemcpy(out.data(), p, kFloats * sizeof(float), cudaMemcpyDeviceToHost) ==
            cudaSuccess);
    return out;
  }
};

}  // namespace

TEST_CASE("a local link delivers payloads in send order, staged away from the sender's buffer",
          "[link]") {
  auto link = cu::make_local_link(0, 0);
  stream_and_event producer, consumer;
  device_floats a(kFloats), b(kFloats), x(kFloats), y(kFloats);
  const std::size_t bytes = kFloats * sizeof(float);
  producer.fill(a.p, 1.0f);
  producer.fill(b.p, 2.0f);
  // Two sends before any receive; the producer overwrites `a` as soon as the link released it.
  REQUIRE(cudaStreamWaitEvent(producer.stream, link->send(a.p, bytes, producer.record()), 0) ==
          cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(producer.stream, link->send(b.p, bytes, producer.record()), 0) ==
          cudaSuccess);
  producer.fill(a.p, 9.0f);
  REQUIRE(cudaStreamWaitEvent(consumer.stream, link->receive(x.p, bytes, consumer.record()), 0) ==
          cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(consumer.stream, link->receive(y.p, bytes, consumer.record()), 0) ==
          cudaSuccess);
  CHECK(consumer.download(x.p) == std::vector<float>(kFloats, 1.0f));
  CHECK(consumer.download(y.p) == std::vector<float>(kFloats, 2.0f));
  // A receive needs a send of the same size before it.
  CHECK_THROWS_WITH(link->receive(x.p, bytes, nullptr), Catch::Contains("nothing sent"));
  link->send(a.p, bytes, nullptr);
  CHECK_THROWS_WITH(link->receive(x.p, bytes / 2, nullptr),
                    Catch::Contains("local link") && Catch::Contains("were sent"));
  CHECK(link->describe() == "local link, device 0 -> device 0");
}

TEST_CASE("NCCL links, one group per direction, carry a 1F1B exchange without deadlock",
          "[link][multi-gpu]") {
  const auto forward_id = cu::nccl_new_id(), backward_id = cu::nccl_new_id();
  constexpr int kMicroBatches = 4;
  std::vector<std::vector<float>> gradients(kMicroBatches);
  auto rank_main = [&](int rank) {
    REQUIRE(cudaSetDevice(rank) == cudaSuccess);
    cu::nccl_group forward("pp 0->1", forward_id, 2, rank, rank, 60s);
    cu::nccl_group backward("pp 1->0", backward_id, 2, rank, rank, 60s);
    auto activations = cu::make_nccl_link(forward, 1 - rank);
    auto grads = cu::make_nccl_link(backward, 1 - rank);
    stream_and_event compute;
    device_floats in(kFloats), out(kFloats);
    const std::size_t bytes = kFloats * sizeof(float);
    if (rank == 0) {  // F0 F1 B0 F2 B1 F3 B2 B3
      auto send = [&](int mb) {
        compute.fill(out.p, static_cast<float>(mb + 1));
        REQUIRE(cudaStreamWaitEvent(compute.stream,
                                    activations->send(out.p, bytes, compute.record()),
                                    0) == cudaSuccess);
      };
      auto receive = [&](int mb) {
        REQUIRE(cudaStreamWaitEvent(compute.stream, grads->receive(in.p, bytes, compute.record()),
                                    0) == cudaSuccess);
        gradients[static_cast<std::size_t>(mb)] = compute.download(in.p);
      };
      send(0);
      send(1);
      for (int mb = 0; mb < kMicroBatches; ++mb) {
        receive(mb);
        if (mb + 2 < kMicroBatches) send(mb + 2);
      }
    } else {  // F0 B0 F1 B1 ...: each activation goes back as its gradient
      for (int mb = 0; mb < kMicroBatches; ++mb) {
        REQUIRE(cudaStreamWaitEvent(compute.stream,
                                    activations->receive(in.p, bytes, compute.record()),
                                    0) == cudaSuccess);
        REQUIRE(cudaStreamWaitEvent(compute.stream, grads->send(in.p, bytes, compute.record()),
                                    0) == cudaSuccess);
      }
      REQUIRE(cudaStreamSynchronize(compute.stream) == cudaSuccess);
    }
    forward.wait(60s, "activations");
    backward.wait(60s, "gradients");
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  for (int mb = 0; mb < kMicroBatches; ++mb)
    CHECK(gradients[static_cast<std::size_t>(mb)] ==
          std::vector<float>(kFloats, static_cast<float>(mb + 1)));
}
