// NCCL groups (`gpu` suite). Its own runner: exit 77 (SKIP) without a GPU; the two-rank
// collectives need two GPUs (NCCL refuses two ranks of a communicator on one device) and are
// left out, saying so, on a one-GPU machine.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/cuda/device_info.hpp"
#include "kernels/cuda/nccl_group.hpp"

namespace cu = troupe::kernels::cuda;
using namespace std::chrono_literals;

namespace {

std::vector<float> download(const float* p, std::size_t n) {
  std::vector<float> out(n);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaMemcpy(out.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

}  // namespace

TEST_CASE("a one-rank NCCL group runs collectives ordered after the compute stream", "[nccl]") {
  const auto id = cu::nccl_new_id();
  cu::nccl_group group("dp", id, 1, 0, 0, 30s);
  CHECK(group.size() == 1);
  cu::context compute;
  const std::size_t n = 1 << 20;
  float *data = nullptr, *gathered = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&gathered), n * sizeof(float)) == cudaSuccess);
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000) * 0.5f;
  // The compute stream produces the data; the collective waits for it by event.
  REQUIRE(cudaMemcpyAsync(data, host.data(), n * sizeof(float), cudaMemcpyHostToDevice,
                          compute.stream()) == cudaSuccess);
  cudaEvent_t produced = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventRecord(produced, compute.stream()) == cudaSuccess);
  group.all_reduce_sum(data, static_cast<std::int64_t>(n), produced);
  group.all_gather(data, gathered, static_cast<std::int64_t>(n), nullptr);
  REQUIRE(cudaStreamWaitEvent(compute.stream(), group.done(), 0) == cudaSuccess);
  group.wait(30s, "all_reduce + all_gather");
  CHECK(download(data, n) == host);  // the sum over one rank
  CHECK(download(gathered, n) == host);
  cudaEventDestroy(produced);
  cudaFree(data);
  cudaFree(gathered);
}

TEST_CASE("an NCCL group whose peer never joins is aborted at its deadline", "[nccl]") {
  const auto id = cu::nccl_new_id();
  // Rank 1 of 2 never comes: the join must not hang; it aborts and names the group.
  CHECK_THROWS_WITH(cu::nccl_group("pp link 0-1", id, 2, 0, 0, 3s),
                    Catch::Contains("pp link 0-1") && Catch::Contains("join did not complete") &&
                        Catch::Contains("aborted"));
}

TEST_CASE("two ranks on two GPUs all-reduce and exchange activations", "[nccl][multi-gpu]") {
  const auto id = cu::nccl_new_id();
  std::vector<std::vector<float>> sums(2), received(2);
  auto rank_main = [&](int rank) {
    REQUIRE(cudaSetDevice(rank) == cudaSuccess);
    cu::nccl_group group("dp", id, 2, rank, rank, 60s);
    const std::size_t n = 4096;
    float *data = nullptr, *in = nullptr;
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(float)) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&in), n * sizeof(float)) == cudaSuccess);
    std::vector<float> host(n, static_cast<float>(rank + 1));
    REQUIRE(cudaMemcpy(data, host.data(), n * sizeof(float), cudaMemcpyHostToDevice) ==
            cudaSuccess);
    if (rank == 0) {
      group.send(data, n * sizeof(float), 1, nullptr);  // rank 0's activation: 1.0
    } else {
      group.recv(in, n * sizeof(float), 0, nullptr);
    }
    group.wait(60s, "send/recv");
    group.all_reduce_sum(data, static_cast<std::int64_t>(n), nullptr);
    group.wait(60s, "all_reduce");
    sums[static_cast<std::size_t>(rank)] = download(data, n);
    if (rank == 1) received[1] = download(in, n);
    cudaFree(data);
    cudaFree(in);
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  CHECK(sums[0] == std::vector<float>(4096, 3.0f));
  CHECK(sums[1] == std::vector<float>(4096, 3.0f));
  CHECK(received[1] == std::vector<float>(4096, 1.0f));
}

TEST_CASE("one thread drives a rank per GPU: the mean of several ranges in one group call",
          "[nccl][multi-gpu]") {
  const auto id = cu::nccl_new_id();
  const int ranks = 2;
  std::vector<std::unique_ptr<cu::nccl_group>> groups(ranks);
  {  // each join waits for the other rank
    std::vector<std::thread> joins;
    for (int r = 0; r < ranks; ++r)
      joins.emplace_back([&, r] {
        groups[static_cast<std::size_t>(r)] =
            std::make_unique<cu::nccl_group>("dp-0", id, ranks, r, r, 60s);
      });
    for (auto& t : joins) t.join();
  }
  const std::size_t n = 3000;
  std::vector<float*> data(ranks);
  std::vector<cu::nccl_group::float_ranges> ranges(ranks);
  std::vector<cudaEvent_t> after(ranks, nullptr);
  std::vector<cu::nccl_group*> all;
  for (int r = 0; r < ranks; ++r) {
    REQUIRE(cudaSetDevice(r) == cudaSuccess);
    float*& p = data[static_cast<std::size_t>(r)];
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)) == cudaSuccess);
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>((r + 1) * (i % 7));
    REQUIRE(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    // Two ranges of one bucket, the second not right after the first.
    ranges[static_cast<std::size_t>(r)] = {{p, 1000}, {p + 2000, 1000}};
    all.push_back(groups[static_cast<std::size_t>(r)].get());
  }
  cu::nccl_group::all_reduce_mean(all, ranges, after);
  for (int r = 0; r < ranks; ++r) {
    REQUIRE(cudaSetDevice(r) == cudaSuccess);
    all[static_cast<std::size_t>(r)]->wait(60s, "all_reduce_mean");
    const auto got = download(data[static_cast<std::size_t>(r)], n);
    for (std::size_t i = 0; i < n; ++i) {
      INFO("rank " << r << " value " << i);
      const float own = static_cast<float>((r + 1) * (i % 7));
      const float mean = static_cast<float>(1.5 * (i % 7));  // (1 + 2) / 2 times i % 7
      REQUIRE(got[i] == (i >= 1000 && i < 2000 ? own : mean));
    }
    cudaFree(data[static_cast<std::size_t>(r)]);
  }
}

int main(int argc, char** argv) {
  const int devices = troupe::kernels::cuda_device_count();
  if (devices == 0) {
    std::printf("SKIP: no usable CUDA device\n");
    return 77;
  }
  std::printf("NCCL %s, %d device(s)\n", cu::nccl_version().c_str(), devices);
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (devices < 2) {
    std::printf("not run: [multi-gpu] (one GPU; NCCL needs a device per rank)\n");
    session.configData().testsOrTags.push_back("~[multi-gpu]");
  }
  return session.run();
}
