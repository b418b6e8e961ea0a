// set_compute_threads / compute_threads: the setting belongs to the calling thread (and sizes
// its OpenMP regions), and two threads with 1 compute thread each can run sgemm-backed
// linear_forward calls concurrently with the results of the same calls made alone. Every test
// runs its threads under a 60 s watchdog: a hang ends the process with a message instead.
#include <omp.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

#include "kernel_test_util.hpp"
#include "kernels/cpu_ops.hpp"
#include "kernels/cpu_threads.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::test;

namespace {

constexpr auto kWatchdog = std::chrono::seconds(60);

// Runs each body on its own std::thread and joins them all. If they have not all finished
// within kWatchdog, prints which test hung and ends the process (a hung thread cannot be
// joined, and the test must not hang). Exceptions in a body are rethrown here.
void run_threads(const char* what, const std::vector<std::function<void()>>& bodies) {
  std::vector<std::future<void>> done;
  std::vector<std::thread> threads;
  for (const auto& body : bodies) {
    std::packaged_task<void()> task(body);
    done.push_back(task.get_future());
    threads.emplace_back(std::move(task));
  }
  const auto deadline = std::chrono::steady_clock::now() + kWatchdog;
  for (auto& f : done) {
    if (f.wait_until(deadline) != std::future_status::ready) {
      std::fprintf(stderr, "test_compute_threads: '%s' did not finish within 60 s\n", what);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
  for (auto& f : done) f.get();
}

// The number of threads an OpenMP parallel region opened by the calling thread gets.
int region_threads() {
  int n = 0;
#pragma omp parallel
  {
#pragma omp single
    n = omp_get_num_threads();
  }
  return n;
}

struct linear_problem {
  int N, C, OC;
  std::vector<float> inp, weight, bias;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> run_linear(const linear_problem& p) {
  std::vector<float> out(static_cast<std::size_t>(p.N) * p.OC);
  linear_forward(out.data(), p.inp.data(), p.weight.data(), p.bias.data(), p.N, p.C, p.OC);
  return out;
}

}  // namespace

TEST_CASE("set_compute_threads affects only the calling thread", "[threads]") {
  int fresh = 0;  // what a new thread starts with
  run_threads("fresh thread", {[&] { fresh = compute_threads(); }});
  REQUIRE(fresh >= 1);
  const int main_before = compute_threads();

  std::atomic<int> ready{0};
  auto wait_for_both = [&] {
    ++ready;
    while (ready.load() < 2) std::this_thread::yield();
  };
  int one = 0, one_region = 0, two = 0, two_region = 0, two_after = 0;
  run_threads("two settings", {[&] {
                                 set_compute_threads(1);
                                 wait_for_both();  // both have set theirs
                                 one = compute_threads();
                                 one_region = region_threads();
                               },
                               [&] {
                                 set_compute_threads(2);
                                 wait_for_both();
                                 two = compute_threads();
                                 two_region = region_threads();
                                 two_after = compute_threads();
                               }});
  CHECK(one == 1);
  CHECK(one_region == 1);
  CHECK(two == 2);
  CHECK(two_region == 2);  // OMP_DYNAMIC is off by default: the region gets what was asked
  CHECK(two_after == 2);
  CHECK(compute_threads() == main_before);  // the main thread kept its own

  // Nor does a setting made on the main thread reach a new thread.
  set_compute_threads(main_before == 3 ? 4 : 3);
  int seen = 0;
  run_threads("after main set", {[&] { seen = compute_threads(); }});
  CHECK(seen == fresh);
  set_compute_threads(main_before);
  CHECK(compute_threads() == main_before);

  CHECK_THROWS_AS(set_compute_threads(0), std::invalid_argument);
  CHECK_THROWS_AS(set_compute_threads(-2), std::invalid_argument);
  CHECK(compute_threads() == main_before);
}

TEST_CASE("concurrent single-threaded linear_forward calls match the same calls made alone",
          "[threads][linear]") {
  // Large enough for OpenBLAS to thread an sgemm when allowed (M*N*K well above its
  // 65536 * 4 single-thread threshold), different shapes per thread.
  std::mt19937 rng(2024);
  std::vector<linear_problem> problems;
  for (const auto& [N, C, OC] : {std::tuple{64, 128, 192}, std::tuple{96, 64, 256},
                                 std::tuple{40, 256, 96}, std::tuple{128, 96, 128}}) {
    problems.push_back({N, C, OC, random_vec(std::size_t(N) * C, rng),
                        random_vec(std::size_t(OC) * C, rng), random_vec(std::size_t(OC), rng)});
  }
  // The references: each call made alone, on a thread that also uses 1 compute thread.
  std::vector<std::vector<float>> expected(problems.size());
  run_threads("references", {[&] {
                set_compute_threads(1);
                for (std::size_t i = 0; i < problems.size(); ++i)
                  expected[i] = run_linear(problems[i]);
              }});

  constexpr int kRounds = 150;
  std::vector<int> mismatches(2, 0), calls(2, 0), threads_seen(2, 0);
  auto worker = [&](int w) {
    return [&, w] {
      set_compute_threads(1);
      for (int r = 0; r < kRounds; ++r) {
        // Worker 0 walks the problems forwards, worker 1 backwards: different concurrent shapes.
        const std::size_t i = static_cast<std::size_t>(w == 0 ? r % 4 : 3 - r % 4);
        if (!same_bits(run_linear(problems[i]), expected[i])) ++mismatches[std::size_t(w)];
        ++calls[std::size_t(w)];
      }
      threads_seen[std::size_t(w)] = compute_threads();
    };
  };
  run_threads("concurrent linear_forward", {worker(0), worker(1)});
  CHECK(calls == std::vector<int>{kRounds, kRounds});
  CHECK(mismatches == std::vector<int>{0, 0});
  CHECK(threads_seen == std::vector<int>{1, 1});
}
