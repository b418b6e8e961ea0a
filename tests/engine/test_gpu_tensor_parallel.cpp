// Tensor parallelism on GPU chunks (`gpu` suite; exit 77, SKIP, without a device): t shards of
// the whole model, each a gpu_chunk driven from its own thread and joined by a device tensor
// group (one device: the summing kernel; distinct devices: NCCL), give the whole chunk's losses,
// gradients (their slices put back together) and gradient norm, within the dtype's rounding;
// recomputation changes no bit; a shard allocates exactly its memory plan; the group gives
// every member the same bits and names the member a collective waited for in vain; a member
// staged through host memory (a group across processes) gives the summing kernel's bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/chunks/gpu_chunk.hpp"
#include "engine/model/gpt_model.hpp"
#include "kernels/cuda/device_info.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using troupe::engine::test::relative_difference;

namespace {

const gpt_config kConfig{97, 128, 64, 2, 4, 64};  // 2 layers, 4 heads of 16
constexpr int kB = 2, kT = 40, kMicroBatches = 3;

struct run_result {
  std::vector<double> losses;  // per micro-batch
  std::vector<float> grads;    // the whole model's layout (slices put back together)
  double grad_square_sum = 0;  // over the shards, replicated parameters once
};

// The whole model as `t` shards on `devices` (one per shard; all one device is allowed), every
// shard on its own thread, kMicroBatches forward/backward passes accumulating gradients.
run_result run_shards(int t, const std::vector<int>& devices, const gpu_trainer_options& options) {
  const auto whole_range = chunk_range::whole(kConfig);
  std::vector<std::shared_ptr<device_tensor_group>> members;
  if (t > 1) members = make_device_tensor_group("test tp group", devices);
  std::vector<std::vector<double>> losses(static_cast<std::size_t>(t));
  std::vector<std::vector<float>> grads(static_cast<std::size_t>(t));
  std::vector<double> squares(static_cast<std::size_t>(t));
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(t));
  std::vector<std::thread> threads;
  for (int j = 0; j < t; ++j) {
    threads.emplace_back([&, j] {
      const auto at = static_cast<std::size_t>(j);
      try {
        gpt_chunk host(kConfig, whole_range, {j, t});
        host.init_gpt2(5);
        gpu_chunk chunk(host, kB, kT, options, 1, devices[at], t > 1 ? members[at] : nullptr);
        chunk.zero_grad();
        for (int mb = 0; mb < kMicroBatches; ++mb) {
          const auto b =
              test::gpu_test_batch(static_cast<std::uint64_t>(40 + mb), kB, kT, kConfig.vocab_size);
          losses[at].push_back(
              chunk.forward(0, b.inputs.data(), b.targets.data(), 1.0f / kMicroBatches, true));
          chunk.backward(0, nullptr);
        }
        squares[at] = chunk.grad_square_sum();
        grads[at] = chunk.gradients();
      } catch (...) {
        failed[at] = std::current_exception();
        if (t > 1) members[at]->abort("shard " + std::to_string(j) + " failed");
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& f : failed)
    if (f) std::rethrow_exception(f);
  run_result r;
  r.losses = losses[0];
  for (int j = 1; j < t; ++j) CHECK(losses[static_cast<std::size_t>(j)] == r.losses);
  const auto whole_layout = chunk_parameter_layout(kConfig, whole_range);
  r.grads.assign(static_cast<std::size_t>(whole_layout.back().offset + whole_layout.back().numel),
                 0.0f);
  for (int j = 0; j < t; ++j) {
    const auto layout = chunk_parameter_layout(kConfig, whole_range, {j, t});
    for (std::size_t i = 0; i < layout.size(); ++i)
      put_shard(layout[i], {j, t}, grads[static_cast<std::size_t>(j)].data() + layout[i].offset,
                r.grads.data() + whole_layout[i].offset);
    r.grad_square_sum += squares[static_cast<std::size_t>(j)];
  }
  return r;
}

}  // namespace

TEST_CASE("tensor shards of a GPU chunk give the whole chunk's numbers", "[gpu][tensor_parallel]") {
  const int devices = troupe::kernels::cuda_device_count();
  for (auto dtype : {compute_dtype::fp32, compute_dtype::bf16}) {
    const gpu_trainer_options options{dtype, false};
    const auto whole = run_shards(1, {0}, options);
    // fp32: only the order of the partial sums differs. bf16: the row-parallel partial sums are
    // rounded to bf16 before they are added.
    const double loss_tol = dtype == compute_dtype::fp32 ? 1e-5 : 1e-2;
    const double grad_tol = dtype == compute_dtype::fp32 ? 1e-4 : 5e-2;
    std::vector<std::pair<int, std::vector<int>>> layouts = {{2, {0, 0}}, {4, {0, 0, 0, 0}}};
    if (devices >= 2) layouts.push_back({2, {0, 1}});  // NCCL
    for (const auto& [t, on] : layouts) {
      INFO(compute_dtype_name(dtype)
           << ", t = " << t << ", devices " << on.front() << ".." << on.back());
      const auto sharded = run_shards(t, on, options);
      REQUIRE(sharded.losses.size() == whole.losses.size());
      for (std::size_t i = 0; i < whole.losses.size(); ++i)
        CHECK(std::abs(sharded.losses[i] - whole.losses[i]) <= loss_tol * whole.losses[i]);
      CHECK(relative_difference(sharded.grads, whole.grads) <= grad_tol);
      CHECK(std::abs(sharded.grad_square_sum - whole.grad_square_sum) <=
            2 * grad_tol * whole.grad_square_sum);
    }
    if (devices < 2) WARN("one CUDA device: the NCCL tensor group was not exercised");
  }
}

TEST_CASE("tensor shards with activation checkpointing change no bit", "[gpu][tensor_parallel]") {
  const auto plain = run_shards(2, {0, 0}, {compute_dtype::bf16, false});
  const auto recomputed = run_shards(2, {0, 0}, {compute_dtype::bf16, true});
  CHECK(recomputed.losses == plain.losses);
  CHECK(recomputed.grads == plain.grads);
}

TEST_CASE("a tensor shard's GPU chunk allocates exactly its memory plan",
          "[gpu][tensor_parallel]") {
  const auto ranges = partition_layers(kConfig, 2);
  for (const auto& range : {ranges[0], ranges[1], chunk_range::whole(kConfig)}) {
    for (bool recompute : {false, true}) {
      const int t = 2;
      auto members = make_device_tensor_group("plan", {0, 0});
      gpt_chunk host(kConfig, range, {1, t});
      host.init_gpt2(1);
      gpu_chunk chunk(host, kB, kT, {compute_dtype::bf16, recompute}, 2, 0, members[1]);
      CHECK(chunk.device_bytes() ==
            plan_gpu_chunk_memory(kConfig, range, kB, kT, {compute_dtype::bf16, recompute}, 2, t)
                .total());
    }
  }
}

TEST_CASE("a device tensor group gives every member the same bits and names who is missing",
          "[gpu][tensor_parallel]") {
  cudaStream_t streams[2];
  float* buffers[2];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(cudaStreamCreate(&streams[i]) == cudaSuccess);
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&buffers[i]), 3 * sizeof(float)) == cudaSuccess);
  }
  const float values[2][3] = {{1.0f, -2.0f, 0.5f}, {0.25f, 4.0f, -8.0f}};
  for (int i = 0; i < 2; ++i)
    REQUIRE(cudaMemcpy(buffers[i], values[i], sizeof values[i], cudaMemcpyHostToDevice) ==
            cudaSuccess);
  auto members = make_device_tensor_group("pair", {0, 0}, std::chrono::milliseconds(500));
  std::exception_ptr failed[2];
  auto both = [&](auto call) {
    std::thread other([&] {
      try {
        call(1);
      } catch (...) {
        failed[1] = std::current_exception();
      }
    });
    try {
      call(0);
    } catch (...) {
      failed[0] = std::current_exception();
    }
    other.join();
    for (auto& f : failed)
      if (f) std::rethrow_exception(std::exchange(f, nullptr));
  };
  both([&](int i) { members[i]->all_reduce_sum(buffers[i], 3, streams[i]); });
  both([&](int i) { members[i]->all_reduce_max(buffers[i], 2, streams[i]); });
  float got[2][3];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(cudaStreamSynchronize(streams[i]) == cudaSuccess);
    REQUIRE(cudaMemcpy(got[i], buffers[i], sizeof got[i], cudaMemcpyDeviceToHost) == cudaSuccess);
  }
  // The sum (1.25, 2, -7.5), then the max of equal copies: unchanged.
  CHECK(got[0][0] == 1.25f);
  CHECK(got[0][1] == 2.0f);
  CHECK(got[0][2] == -7.5f);
  CHECK(std::equal(got[0], got[0] + 3, got[1]));
  // Shard 1 never comes: shard 0 names it, and the group stays broken.
  CHECK(test::error_message([&] {
          members[0]->all_reduce_sum(buffers[0], 3, streams[0]);
        }).find("for shard 1") != std::string::npos);
  CHECK(test::error_message([&] {
          members[1]->all_reduce_sum(buffers[1], 3, streams[1]);
        }).find("for shard 1") != std::string::npos);
  auto fresh = make_device_tensor_group("aborted", {0, 0});
  fresh[1]->abort("shard 1 stopped");
  CHECK(test::error_message([&] {
          fresh[0]->all_reduce_max(buffers[0], 3, streams[0]);
        }).find("shard 1 stopped") != std::string::npos);
  for (int i = 0; i < 2; ++i) {
    cudaFree(buffers[i]);
    cudaStreamDestroy(streams[i]);
  }
}

// A tensor group across processes (a host group) serves CUDA chunks through pinned host memory:
// its sums and maxima are bitwise the one-device summing kernel's, in fp32, bf16 and fp16, when
// the buffers are written by work still queued on the members' streams, over collectives of
// growing size (the pinned buffer grows and is reused).
TEST_CASE("a host-staged tensor group member gives the one-device kernel's bits",
          "[gpu][tensor_parallel]") {
  constexpr int kMembers = 3;
  const std::int64_t sizes[] = {5, 4099, 70001};  // not multiples of any vector width
  // Member m's value i: finite numbers of mixed signs and magnitudes, as the dtype's bits.
  auto values = [](compute_dtype dtype, int m, std::int64_t n) {
    const std::size_t width = dtype == compute_dtype::fp32 ? 4 : 2;
    std::vector<unsigned char> bytes(static_cast<std::size_t>(n) * width);
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = std::ldexp(static_cast<float>((i * 7919 + m * 104729) % 2001) - 1000.0f,
                                 static_cast<int>((i + m) % 13) - 16);
      if (dtype == compute_dtype::fp32) {
        std::memcpy(bytes.data() + 4 * i, &x, 4);
      } else {
        const std::uint16_t h = dtype == compute_dtype::bf16
                                    ? __bfloat16_as_ushort(__float2bfloat16(x))
                                    : __half_as_ushort(__float2half(x));
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
    return bytes;
  };
  // Every size in turn on the same members, each member on its own stream and thread; each
  // buffer is uploaded asynchronously on the member's stream right before its collective.
  // Returns, by size, each member's result.
  using results = std::vector<std::vector<std::vector<unsigned char>>>;
  auto run = [&](const std::vector<std::shared_ptr<device_tensor_group>>& members,
                 compute_dtype dtype, bool max) {
    std::vector<cudaStream_t> streams(kMembers);
    for (auto& s : streams) REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
    results out;
    for (const std::int64_t n : sizes) {
      std::vector<std::vector<unsigned char>> host(kMembers);
      std::vector<void*> buffers(kMembers);
      for (int m = 0; m < kMembers; ++m) {
        host[m] = values(dtype, m, n);
        REQUIRE(cudaMalloc(&buffers[m], host[m].size()) == cudaSuccess);
      }
      std::vector<std::thread> threads;
      std::vector<std::exception_ptr> failed(kMembers);
      for (int m = 0; m < kMembers; ++m) {
        threads.emplace_back([&, m] {
          try {
            if (cudaMemsetAsync(buffers[m], 0xff, host[m].size(), streams[m]) != cudaSuccess ||
                cudaMemcpyAsync(buffers[m], host[m].data(), host[m].size(), cudaMemcpyHostToDevice,
                                streams[m]) != cudaSuccess)
              throw std::runtime_error("upload failed");
            if (max)
              members[m]->all_reduce_max(static_cast<float*>(buffers[m]), n, streams[m]);
            else
              members[m]->all_reduce_sum(buffers[m], n, dtype, streams[m]);
          } catch (...) {
            failed[m] = std::current_exception();
          }
        });
      }
      for (auto& t : threads) t.join();
      for (auto& f : failed)
        if (f) std::rethrow_exception(f);
      auto& got = out.emplace_back(kMembers);
      for (int m = 0; m < kMembers; ++m) {
        got[m].resize(host[m].size());
        REQUIRE(cudaStreamSynchronize(streams[m]) == cudaSuccess);
        REQUIRE(cudaMemcpy(got[m].data(), buffers[m], got[m].size(), cudaMemcpyDeviceToHost) ==
                cudaSuccess);
        cudaFree(buffers[m]);
      }
    }
    for (auto& s : streams) cudaStreamDestroy(s);
    return out;
  };
  auto staged = [] {
    std::vector<std::shared_ptr<device_tensor_group>> members;
    for (auto& h : make_local_tensor_group(kMembers, "staged"))
      members.push_back(make_staged_tensor_member(h, 0));
    return members;
  };
  for (const compute_dtype dtype :
       {compute_dtype::fp32, compute_dtype::bf16, compute_dtype::fp16}) {
    INFO("dtype " << static_cast<int>(dtype));
    const auto kernel = run(make_device_tensor_group("kernel", {0, 0, 0}), dtype, false);
    const auto host_staged = run(staged(), dtype, false);
    REQUIRE(kernel.size() == host_staged.size());
    for (std::size_t k = 0; k < kernel.size(); ++k) {
      INFO("collective " << k);
      for (int m = 0; m < kMembers; ++m) {
        CHECK(kernel[k][m] == kernel[k][0]);
        CHECK(host_staged[k][m] == kernel[k][0]);
      }
    }
  }
  CHECK(run(staged(), compute_dtype::fp32, true) ==
        run(make_device_tensor_group("max", {0, 0, 0}), compute_dtype::fp32, true));
}
