// Ring collectives: the message-driven ring all-reduce gives bitwise the in-process ring-order
// mean for every replica count, bucket layout and delivery order; both are the mean. The host
// zero group (ZeRO through the devices, on host chunks) reduce-scatters and all-gathers bitwise
// as the ring does.
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <deque>
#include <functional>
#include <random>
#include <thread>

#include "engine/chunks/zero_group.hpp"
#include "topology/collectives.hpp"
#include "topology/zero_exchange.hpp"

using namespace troupe::topology;

namespace {

// d replicas' buffers of one bucket laid out as `pieces` ranges.
struct replicas {
  std::vector<std::vector<float>> data;
  std::vector<float_ranges> ranges;
  replicas(int d, const std::vector<std::int64_t>& pieces, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::int64_t n = 0;
    for (auto k : pieces) n += k;
    data.resize(static_cast<std::size_t>(d));
    for (auto& v : data) {
      v.resize(static_cast<std::size_t>(n));
      for (auto& x : v) x = dist(rng) * 1e3f;
    }
    for (auto& v : data) {
      float_ranges r;
      std::int64_t at = 0;
      for (auto k : pieces) {
        r.emplace_back(v.data() + at, k);
        at += k;
      }
      ranges.push_back(r);
    }
  }
};

struct in_flight {
  int to, phase, chunk;
  std::shared_ptr<troupe::messages::payload<float>> data;
};

// Runs the ring with messages delivered in a random order that keeps each link FIFO.
void run_ring(replicas& r, std::uint32_t seed, ring_kind kind = ring_kind::all_reduce) {
  const int d = static_cast<int>(r.data.size());
  std::vector<ring_allreduce> ring;
  for (int i = 0; i < d; ++i) ring.emplace_back(r.ranges[static_cast<std::size_t>(i)], i, d, kind);
  std::vector<std::deque<in_flight>> links(static_cast<std::size_t>(d));  // into replica i
  auto post = [&](int from, std::vector<ring_allreduce::send> sends) {
    const int to = (from + 1) % d;
    for (auto& s : sends)
      links[static_cast<std::size_t>(to)].push_back({to, s.phase, s.chunk, std::move(s.data)});
  };
  for (int i = 0; i < d; ++i) post(i, ring[static_cast<std::size_t>(i)].start());
  std::mt19937 rng(seed);
  for (;;) {
    std::vector<int> ready;
    for (int i = 0; i < d; ++i)
      if (!links[static_cast<std::size_t>(i)].empty()) ready.push_back(i);
    if (ready.empty()) break;
    const int i = ready[rng() % ready.size()];
    auto m = std::move(links[static_cast<std::size_t>(i)].front());
    links[static_cast<std::size_t>(i)].pop_front();
    post(i, ring[static_cast<std::size_t>(i)].receive(m.phase, m.chunk, m.data->data(),
                                                      static_cast<std::int64_t>(m.data->size())));
  }
  for (const auto& x : ring) REQUIRE(x.done());
}

}  // namespace

TEST_CASE("ring all-reduce equals the in-process ring-order mean bitwise", "[unit]") {
  const std::vector<std::vector<std::int64_t>> layouts = {
      {1}, {2}, {7}, {1000}, {3, 0, 5, 11}, {256, 1, 255, 64}, {4097}};
  for (int d = 1; d <= 5; ++d) {
    for (std::size_t l = 0; l < layouts.size(); ++l) {
      const auto seed = static_cast<std::uint32_t>(d * 100 + l);
      replicas ring(d, layouts[l], seed), ref(d, layouts[l], seed);
      REQUIRE(ring.data == ref.data);
      const auto original = ref.data;
      run_ring(ring, seed + 7);
      ring_order_mean(ref.ranges);
      INFO("d=" << d << " layout " << l);
      for (int i = 0; i < d; ++i) {
        // bitwise: compare the representations, NaN-free inputs
        REQUIRE(ring.data[static_cast<std::size_t>(i)] == ref.data[static_cast<std::size_t>(i)]);
        REQUIRE(ring.data[static_cast<std::size_t>(i)] == ring.data[0]);
      }
      // and it is the mean
      for (std::size_t k = 0; k < original[0].size(); ++k) {
        double m = 0;
        for (int i = 0; i < d; ++i) m += original[static_cast<std::size_t>(i)][k];
        m /= d;
        REQUIRE(std::abs(ring.data[0][k] - m) <= 1e-3 * (1 + std::abs(m)));
      }
    }
  }
}

TEST_CASE("ring chunks tile the bucket", "[unit]") {
  for (std::int64_t n : {0, 1, 5, 64, 1001})
    for (int d = 1; d <= 6; ++d) {
      std::int64_t at = 0;
      for (int c = 0; c < d; ++c) {
        const auto [b, e] = ring_chunk_bounds(n, d, c);
        REQUIRE(b == at);
        REQUIRE(e >= b);
        at = e;
      }
      REQUIRE(at == n);
    }
}

TEST_CASE("ring all-reduce refuses chunks it does not expect", "[unit]") {
  std::vector<float> a(10, 1.0f);
  ring_allreduce r({{a.data(), 10}}, 1, 3);
  const auto first = r.start();
  REQUIRE(first.size() == 1);
  REQUIRE(first[0].chunk == 1);
  std::vector<float> c(4, 2.0f);
  // replica 1 expects chunk 0 first (from replica 0), of 3 floats (10 cut in 3: 3, 3, 4)
  REQUIRE_THROWS_WITH(r.receive(0, 2, c.data(), 4), Catch::Contains("expected 0"));
  REQUIRE_THROWS_WITH(r.receive(1, 1, c.data(), 3), Catch::Contains("before reduce-scatter"));
  REQUIRE_THROWS_WITH(r.receive(0, 0, c.data(), 4), Catch::Contains("has 4 floats"));
  REQUIRE_NOTHROW(r.receive(0, 0, c.data(), 3));
  REQUIRE(a[0] == 3.0f);  // received + own
}

TEST_CASE("ring-order mean refuses replicas of different sizes", "[unit]") {
  std::vector<float> a(4), b(5);
  REQUIRE_THROWS_AS(ring_order_mean({{{a.data(), 4}}, {{b.data(), 5}}}), std::logic_error);
}

TEST_CASE("ring reduce-scatter leaves each owner the all-reduce's chunk; all-gather completes it",
          "[unit]") {
  const std::vector<std::vector<std::int64_t>> layouts = {{1}, {7}, {3, 0, 5, 11}, {4097}};
  for (int d = 1; d <= 5; ++d) {
    for (std::size_t l = 0; l < layouts.size(); ++l) {
      const auto seed = static_cast<std::uint32_t>(d * 31 + l);
      replicas rs(d, layouts[l], seed), ref(d, layouts[l], seed);
      run_ring(rs, seed + 3, ring_kind::reduce_scatter);
      ring_order_mean(ref.ranges);
      const auto n = static_cast<std::int64_t>(ref.data[0].size());
      INFO("d=" << d << " layout " << l);
      for (int i = 0; i < d; ++i) {
        const auto [b, e] = ring_chunk_bounds(n, d, ring_owned_chunk(i, d));
        for (std::int64_t k = b; k < e; ++k)  // bitwise the all-reduce's value
          REQUIRE(rs.data[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)] ==
                  ref.data[0][static_cast<std::size_t>(k)]);
      }
      // All-gather from the owners' chunks: every replica ends with the whole mean.
      for (int i = 0; i < d; ++i)
        for (int c = 0; c < d; ++c) {
          if (c == ring_owned_chunk(i, d)) continue;
          const auto [b, e] = ring_chunk_bounds(n, d, c);
          for (std::int64_t k = b; k < e; ++k)
            rs.data[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)] = -1.0f;
        }
      run_ring(rs, seed + 5, ring_kind::all_gather);
      for (int i = 0; i < d; ++i) REQUIRE(rs.data[static_cast<std::size_t>(i)] == ref.data[0]);
    }
  }
}

TEST_CASE("a half collective refuses the other half's chunks", "[unit]") {
  std::vector<float> a(10, 1.0f), c(3, 2.0f);
  ring_allreduce rs({{a.data(), 10}}, 1, 3, ring_kind::reduce_scatter);
  REQUIRE_THROWS_WITH(rs.receive(1, 1, c.data(), 3), Catch::Contains("before reduce-scatter"));
  ring_allreduce ag({{a.data(), 10}}, 1, 3, ring_kind::all_gather);
  const auto first = ag.start();
  REQUIRE(first.size() == 1);
  REQUIRE(first[0].phase == 1);
  REQUIRE(first[0].chunk == 2);  // replica 1 owns chunk 2
  REQUIRE_THROWS_WITH(ag.receive(0, 0, c.data(), 3), Catch::Contains("without that phase"));
  REQUIRE_NOTHROW(ag.receive(1, 1, c.data(), 3));  // replica 0 owns chunk 1
  REQUIRE(a[3] == 2.0f);
}

namespace {

// Over d replicas, each calling group_of(i) from a thread of its own: the reduce-scatters of two
// buckets in flight at once, then the all-gather of the first, each bitwise what the message
// ring leaves (reduce-scatter: every owned chunk; all-gather: everything).
void check_against_ring(int d, const std::vector<std::int64_t>& layout, std::uint32_t seed,
                        const std::function<troupe::engine::zero_group&(int)>& group_of) {
  replicas got(d, layout, seed), want(d, layout, seed);
  replicas other(d, layout, seed + 1), other_want(d, layout, seed + 1);
  std::atomic<int> done{0};
  auto on_every_replica = [&](const std::function<void(int)>& call) {
    std::vector<std::thread> threads;
    for (int i = 0; i < d; ++i) threads.emplace_back([&call, i] { call(i); });
    for (auto& t : threads) t.join();
  };
  auto count = [&done](void* e) {
    CHECK(e == nullptr);
    ++done;
  };
  on_every_replica([&](int i) {
    group_of(i).reduce_scatter(0, 0, i, got.ranges[static_cast<std::size_t>(i)], nullptr, count);
    group_of(i).reduce_scatter(0, 1, i, other.ranges[static_cast<std::size_t>(i)], nullptr, count);
  });
  REQUIRE(done == 2 * d);
  run_ring(want, seed + 3, ring_kind::reduce_scatter);
  run_ring(other_want, seed + 4, ring_kind::reduce_scatter);
  const auto n = static_cast<std::int64_t>(want.data[0].size());
  for (int i = 0; i < d; ++i) {
    const auto [b, e] = ring_chunk_bounds(n, d, ring_owned_chunk(i, d));
    for (std::int64_t k = b; k < e; ++k) {
      const auto at = static_cast<std::size_t>(k), r = static_cast<std::size_t>(i);
      REQUIRE(got.data[r][at] == want.data[r][at]);
      REQUIRE(other.data[r][at] == other_want.data[r][at]);
    }
  }
  // All-gather: every replica ends with every owner's chunk (the rest overwritten).
  for (int i = 0; i < d; ++i)
    for (int c = 0; c < d; ++c) {
      if (c == ring_owned_chunk(i, d)) continue;
      const auto [b, e] = ring_chunk_bounds(n, d, c);
      for (std::int64_t k = b; k < e; ++k) {
        got.data[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)] = -1.0f;
        want.data[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)] = -1.0f;
      }
    }
  on_every_replica([&](int i) {
    group_of(i).all_gather(0, 0, i, got.ranges[static_cast<std::size_t>(i)], nullptr, count);
  });
  REQUIRE(done == 3 * d);
  run_ring(want, seed + 5, ring_kind::all_gather);
  for (int i = 0; i < d; ++i)
    REQUIRE(got.data[static_cast<std::size_t>(i)] == want.data[static_cast<std::size_t>(i)]);
}

const std::vector<std::vector<std::int64_t>> zero_layouts = {{1}, {7}, {3, 0, 5, 11}, {4097}};

}  // namespace

TEST_CASE("the host zero group, called from every replica's thread, is the ring bitwise",
          "[unit]") {
  for (int d = 1; d <= 4; ++d) {
    for (std::size_t l = 0; l < zero_layouts.size(); ++l) {
      INFO("d=" << d << " layout " << l);
      auto group = troupe::engine::make_host_zero_group(d, "test");
      check_against_ring(d, zero_layouts[l], static_cast<std::uint32_t>(d * 17 + l),
                         [&group](int) -> troupe::engine::zero_group& { return *group; });
    }
  }
}

TEST_CASE("a zero group refuses replicas calling in different orders, or disagreeing", "[unit]") {
  auto group = troupe::engine::make_host_zero_group(2, "test");
  std::vector<float> a(6, 1.0f), b(5, 1.0f);
  group->reduce_scatter(3, 0, 0, {{a.data(), 6}}, nullptr, [](void*) {});
  group->reduce_scatter(3, 1, 0, {{a.data(), 6}}, nullptr, [](void*) {});
  // Replica 1's first collective is bucket 1's: NCCL would pair it with bucket 0's and hang.
  REQUIRE_THROWS_WITH(group->reduce_scatter(3, 1, 1, {{a.data(), 6}}, nullptr, [](void*) {}),
                      Catch::Contains("reduce-scatter of bucket 1 (step 3), another replica's the "
                                      "reduce-scatter of bucket 0 (step 3)"));
  group = troupe::engine::make_host_zero_group(2, "test");
  group->reduce_scatter(3, 0, 0, {{a.data(), 6}}, nullptr, [](void*) {});
  REQUIRE_THROWS_WITH(group->reduce_scatter(3, 0, 1, {{b.data(), 5}}, nullptr, [](void*) {}),
                      Catch::Contains("disagree"));
  REQUIRE_THROWS_WITH(group->all_gather(3, 0, 2, {{a.data(), 6}}, nullptr, [](void*) {}),
                      Catch::Contains("replica 2 of 2"));
}

TEST_CASE("the zero group across processes exchanges pieces as messages, bitwise the ring",
          "[unit]") {
  for (int d = 1; d <= 4; ++d) {
    for (std::size_t l = 0; l < zero_layouts.size(); ++l) {
      INFO("d=" << d << " layout " << l);
      // Replica r in "process" r % 2: two groups, messages between them posted to the other.
      std::vector<std::shared_ptr<exchange_zero_group>> process(2);
      for (int p = 0; p < 2; ++p) {
        std::vector<bool> here(static_cast<std::size_t>(d));
        for (int r = 0; r < d; ++r) here[static_cast<std::size_t>(r)] = r % 2 == p;
        process[static_cast<std::size_t>(p)] = std::make_shared<exchange_zero_group>(
            "test", 0, here, [&process](int to, troupe::messages::ring_chunk m) {
              process[static_cast<std::size_t>(to % 2)]->deliver(to, std::move(m));
            });
      }
      check_against_ring(d, zero_layouts[l], static_cast<std::uint32_t>(d * 23 + l),
                         [&process](int i) -> troupe::engine::zero_group& {
                           return *process[static_cast<std::size_t>(i % 2)];
                         });
    }
  }
}

TEST_CASE("the zero group across processes refuses replicas calling in different orders",
          "[unit]") {
  std::vector<std::shared_ptr<exchange_zero_group>> process(2);
  for (int p = 0; p < 2; ++p)
    process[static_cast<std::size_t>(p)] = std::make_shared<exchange_zero_group>(
        "test", 1, std::vector<bool>{p == 0, p == 1},
        [&process](int to, troupe::messages::ring_chunk m) {
          process[static_cast<std::size_t>(to)]->deliver(to, std::move(m));
        });
  std::vector<float> a(6, 1.0f), b(6, 2.0f);
  process[0]->reduce_scatter(4, 0, 0, {{a.data(), 6}}, nullptr, [](void*) {});
  // Replica 1's first collective is bucket 1's, replica 0's bucket 0's.
  REQUIRE_THROWS_WITH(
      process[1]->reduce_scatter(4, 1, 1, {{b.data(), 6}}, nullptr, [](void*) {}),
      Catch::Contains("reduce-scatter of bucket 1 (step 4), replica 0's the reduce-scatter of "
                      "bucket 0 (step 4)"));
}
