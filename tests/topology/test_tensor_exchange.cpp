// Tensor groups across processes (topology/tensor_exchange.hpp): every collective gives bitwise
// what the in-process group gives, whether the members share a "process" or reach each other
// through a transport that delivers late and out of order; a missing member, an aborted member
// and a member reducing another length are each reported by name, and nobody waits forever.
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "engine/chunks/tensor_group.hpp"
#include "topology/tensor_exchange.hpp"

using namespace troupe;
using topology::exchange_member;

namespace {

// A transport between two "processes": messages are delivered on a thread of their own, after a
// random delay and out of order across members (in order per sender and receiver, as UCX keeps).
class slow_transport {
 public:
  explicit slow_transport(std::uint32_t seed) : rng_(seed), thread_([this] { run(); }) {}
  ~slow_transport() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void send(std::function<void()> deliver) {
    {
      std::lock_guard lk(m_);
      queue_.push_back(std::move(deliver));
    }
    cv_.notify_all();
  }

 private:
  void run() {
    std::unique_lock lk(m_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto next = std::move(queue_.front());
      queue_.pop_front();
      const auto pause = std::chrono::microseconds(rng_() % 300);
      lk.unlock();
      std::this_thread::sleep_for(pause);
      next();
      lk.lock();
    }
  }
  std::mt19937 rng_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

// t members of one group, member j in "process" j % processes: each process's members are made
// by make_exchange_group with a remote route through the transport.
struct spanning_group {
  std::vector<std::shared_ptr<exchange_member>> members;
  spanning_group(int t, int processes, slow_transport& net, std::chrono::milliseconds deadline) {
    members.resize(static_cast<std::size_t>(t));
    auto all = std::make_shared<std::vector<std::weak_ptr<exchange_member>>>(t);
    for (int p = 0; p < processes; ++p) {
      std::vector<bool> here(static_cast<std::size_t>(t));
      for (int j = 0; j < t; ++j) here[static_cast<std::size_t>(j)] = j % processes == p;
      auto mine = topology::make_exchange_group(
          "tp group of stage 0 · dp 0", here,
          [all, &net](int to, messages::tensor_exchange m) {
            net.send([all, to, m = std::move(m)]() mutable {
              if (auto peer = all->at(static_cast<std::size_t>(to)).lock())
                peer->deliver(std::move(m));
            });
          },
          deadline);
      for (int j = 0; j < t; ++j)
        if (mine[static_cast<std::size_t>(j)]) {
          REQUIRE(here[static_cast<std::size_t>(j)]);
          members[static_cast<std::size_t>(j)] = mine[static_cast<std::size_t>(j)];
          (*all)[static_cast<std::size_t>(j)] = mine[static_cast<std::size_t>(j)];
        } else {
          REQUIRE_FALSE(here[static_cast<std::size_t>(j)]);
        }
    }
  }
};

// Each member's thread runs `body(member, rank)`; returns what each threw ("" if nothing).
template <class Member, class Body>
std::vector<std::string> on_threads(const std::vector<std::shared_ptr<Member>>& members,
                                    Body body) {
  std::vector<std::string> errors(members.size());
  std::vector<std::thread> threads;
  for (std::size_t j = 0; j < members.size(); ++j)
    threads.emplace_back([&, j] {
      try {
        body(*members[j], static_cast<int>(j));
      } catch (const engine::tensor_group_error& e) {
        errors[j] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  return errors;
}

// Three rounds of every collective over random data of several lengths (0 included); returns
// every member's results, in order.
template <class Member>
std::vector<std::vector<double>> run_collectives(
    const std::vector<std::shared_ptr<Member>>& members) {
  std::vector<std::vector<double>> out(members.size());
  const auto errors = on_threads(members, [&](engine::tensor_group& g, int rank) {
    std::mt19937 rng(static_cast<std::uint32_t>(100 + rank));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (int round = 0; round < 3; ++round) {
      for (std::size_t n : {std::size_t{1000}, std::size_t{0}, std::size_t{7}}) {
        std::vector<float> f(n);
        for (auto& x : f) x = dist(rng) * 1e3f;
        std::vector<double> d(n);
        for (auto& x : d) x = double(dist(rng)) * 1e-3 + 1.0;
        std::vector<float> mx = f;
        g.all_reduce_sum(std::span<float>(f));
        g.all_reduce_sum(std::span<double>(d));
        g.all_reduce_max(std::span<float>(mx));
        auto& o = out[static_cast<std::size_t>(rank)];
        o.insert(o.end(), f.begin(), f.end());
        o.insert(o.end(), d.begin(), d.end());
        o.insert(o.end(), mx.begin(), mx.end());
      }
    }
  });
  for (const auto& e : errors) REQUIRE(e.empty());
  return out;
}

}  // namespace

TEST_CASE("a group across processes reduces bitwise as the in-process group", "[topology][tp]") {
  for (const int t : {2, 3, 4}) {
    for (const int processes : {1, 2, t}) {
      DYNAMIC_SECTION(t << " members in " << processes << " processes") {
        slow_transport net(static_cast<std::uint32_t>(t * 10 + processes));
        spanning_group spanning(t, processes, net, std::chrono::seconds(60));
        const auto got = run_collectives(spanning.members);
        const auto want = run_collectives(engine::make_local_tensor_group(t, "local"));
        for (int j = 0; j < t; ++j) {
          INFO("member " << j);
          REQUIRE(got[static_cast<std::size_t>(j)] == want[static_cast<std::size_t>(j)]);
          REQUIRE(got[static_cast<std::size_t>(j)] == got[0]);  // every member the same bits
        }
      }
    }
  }
}

TEST_CASE("a group across processes names what went wrong and never waits forever",
          "[topology][tp]") {
  slow_transport net(7);
  SECTION("a member that never comes: the deadline names it") {
    spanning_group g(2, 2, net, std::chrono::milliseconds(200));
    std::vector<float> v(4, 1.0f);
    REQUIRE_THROWS_WITH(g.members[0]->all_reduce_sum(std::span<float>(v)),
                        "tp group of stage 0 · dp 0: member 0 waited 200 ms for member 1 at a "
                        "collective");
  }
  SECTION("a member that stops: the others throw its reason") {
    spanning_group g(3, 3, net, std::chrono::seconds(60));
    const auto errors = on_threads(g.members, [](engine::tensor_group& m, int rank) {
      std::vector<float> v(16, 1.0f);
      m.all_reduce_sum(std::span<float>(v));
      if (rank == 2) {
        m.abort("stage 0 · dp 0 · tp 2 stopped");
        return;
      }
      m.all_reduce_sum(std::span<float>(v));  // waits for member 2, which has stopped
    });
    for (int j : {0, 1})
      CHECK(errors[static_cast<std::size_t>(j)] ==
            "tp group of stage 0 · dp 0: stage 0 · dp 0 · tp 2 stopped");
    std::vector<float> v(1);
    CHECK_THROWS_AS(g.members[0]->all_reduce_sum(std::span<float>(v)), engine::tensor_group_error);
  }
  SECTION("members reducing different lengths") {
    spanning_group g(2, 2, net, std::chrono::seconds(60));
    const auto errors = on_threads(g.members, [](engine::tensor_group& m, int rank) {
      std::vector<float> v(static_cast<std::size_t>(3 + rank), 1.0f);
      m.all_reduce_sum(std::span<float>(v));
    });
    CHECK(errors[0] ==
          "tp group of stage 0 · dp 0: member 1 sent a float sum of 4 floats where member 0 "
          "reduces a float sum of 3");
    CHECK(errors[1] ==
          "tp group of stage 0 · dp 0: member 0 sent a float sum of 3 floats where member 1 "
          "reduces a float sum of 4");
  }
  SECTION("a closed member throws and tells no one") {
    spanning_group g(2, 2, net, std::chrono::milliseconds(300));
    g.members[1]->close("the job ended");
    g.members[1]->abort("stage stopped");  // sends nothing: member 0 times out, not aborted
    std::vector<float> v(2, 1.0f);
    CHECK_THROWS_WITH(g.members[1]->all_reduce_sum(std::span<float>(v)),
                      "tp group of stage 0 · dp 0: the job ended");
    CHECK_THROWS_WITH(g.members[0]->all_reduce_sum(std::span<float>(v)),
                      Catch::Contains("waited 300 ms for member 1"));
  }
}
