// ZeRO shard arithmetic (engine/parallel/zero.hpp): the shards of d replicas tile a bucket's
// parameters exactly once (no padding, alignment gaps never included), a shard's AdamW step is
// bitwise the full optimizer's on the same elements, a released gradient range reads zero and holds
// no whole pages, a page pool moves released pages under the next acquired range (nothing copied,
// nothing lost, bounded mappings), and ZeRO-3's gather plan (param_residency) holds what each use
// needs, gathers a bucket only when no use holds it, and never holds more than prefetch + 1 uses'
// buckets.
#include <unistd.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/training/optimizer.hpp"
#include "kernels/tensor.hpp"

namespace troupe::engine {
namespace {

gpt_config tiny() {
  gpt_config c;
  c.vocab_size = c.padded_vocab_size = 64;
  c.context = 16;
  c.layers = 3;
  c.heads = 2;
  c.width = 24;
  return c;
}

// The whole stage as one bucket (every block's ranges, merged in offset order).
std::vector<std::pair<std::int64_t, std::int64_t>> all_ranges(const gpt_chunk& st) {
  std::vector<std::pair<std::int64_t, std::int64_t>> r;
  for (const auto& b : chunk_grad_blocks(st))
    for (const auto& x : b.ranges) r.push_back(x);
  std::sort(r.begin(), r.end());
  return r;
}

TEST_CASE("ZeRO shards tile a bucket's parameters once, for any replica count", "[zero]") {
  gpt_chunk st(tiny(), chunk_range{0, 3, true, true});
  const auto ranges = all_ranges(st);
  for (int d = 1; d <= 5; ++d) {
    std::vector<int> covered(static_cast<std::size_t>(st.parameter_count()), 0);
    std::int64_t at = 0, owned = 0;
    for (int r = 0; r < d; ++r) {
      const auto b = make_bucket_shard(st, 0, ranges, r, d, at);
      REQUIRE(b.at == at);
      owned += b.end - b.begin;
      for (const auto& s : b.segments) {
        REQUIRE(s.at >= b.at);
        REQUIRE(s.at + s.numel <= b.at + (b.end - b.begin));
        for (std::int64_t i = 0; i < s.numel; ++i)
          ++covered[static_cast<std::size_t>(s.offset + i)];
      }
      at += b.end - b.begin;
    }
    std::int64_t total = 0;
    for (const auto& x : ranges) total += x.second;
    REQUIRE(owned == total);
    // Every parameter element exactly once; nothing outside a parameter (alignment gaps).
    std::vector<int> want(covered.size(), 0);
    for (const auto& p : st.parameters())
      for (std::int64_t i = 0; i < p.numel; ++i) want[static_cast<std::size_t>(p.offset + i)] = 1;
    INFO("d=" << d);
    REQUIRE(covered == want);
  }
}

TEST_CASE("a shard's AdamW step is bitwise the full optimizer's", "[zero]") {
  gpt_chunk full(tiny(), chunk_range{0, 3, true, true});
  gpt_chunk sharded(tiny(), chunk_range{0, 3, true, true});
  full.init_gpt2(5);
  sharded.init_gpt2(5);
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0, 0.05f);
  for (const auto& p : full.parameters())
    for (std::int64_t i = 0; i < p.numel; ++i) full.grads()[p.offset + i] = g(rng);
  optimizer_config c;
  c.grad_clip = 0.5f;  // the norm is above it: clipping is exercised
  c.warmup_steps = 1;
  const int d = 3;
  const auto ranges = all_ranges(full);
  std::vector<bucket_shard> shards;
  std::int64_t at = 0;
  for (int r = 0; r < d; ++r) {
    shards.push_back(make_bucket_shard(sharded, 0, ranges, r, d, at));
    at += shards.back().end - shards.back().begin;
  }
  std::vector<float> m(static_cast<std::size_t>(at)), v(static_cast<std::size_t>(at));
  adamw_optimizer opt(full);
  for (int step = 0; step < 3; ++step) {
    const double norm = std::sqrt(grad_square_sum(full));
    std::memcpy(sharded.grads(), full.grads(), full.parameter_count() * sizeof(float));
    shard_views views;
    views.params = {sharded.params()};
    views.grads = {sharded.grads()};
    double sq = 0;
    for (const auto& b : shards) sq += shard_square_sum(b, views);
    REQUIRE(std::abs(std::sqrt(sq) - norm) <= 1e-9 * norm);
    shard_adamw_step(shards, views, m.data(), v.data(), c, step, 10, norm);
    opt.step_with_norm(full, c, step, 10, norm);
    REQUIRE(std::memcmp(full.params(), sharded.params(), full.parameter_count() * sizeof(float)) ==
            0);
    // the next step's gradients: the same for both
    for (const auto& p : full.parameters())
      for (std::int64_t i = 0; i < p.numel; ++i) full.grads()[p.offset + i] = g(rng);
  }
}

TEST_CASE("a released gradient range reads zero and gives its whole pages back", "[zero]") {
  const std::int64_t n = 1 << 20;  // 4 MiB
  std::vector<float> buf(static_cast<std::size_t>(n), 1.5f);
  REQUIRE(resident_bytes(buf.data(), n * 4) >= n * 4);
  const std::int64_t lo = 1001, count = n - 3000;  // unaligned both ends
  release_zeroed(buf.data() + lo, count);
  // Only the partial pages at the edges stay (checked before reading: a read maps zero pages).
  REQUIRE(resident_bytes(buf.data(), n * 4) <= 4 * 4096 + (n * 4 - count * 4));
  for (std::int64_t i = 0; i < n; ++i) {
    const bool inside = i >= lo && i < lo + count;
    if (buf[static_cast<std::size_t>(i)] != (inside ? 0.0f : 1.5f)) FAIL("element " << i);
  }
}

int mapping_count() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) ++n;
  return n;
}

// Bytes of the whole blocks (of `block` bytes) inside [data, data + n).
std::int64_t whole_bytes(const float* data, std::int64_t n, std::int64_t block) {
  const auto begin = reinterpret_cast<std::intptr_t>(data);
  const auto end = begin + n * 4;
  return std::max<std::int64_t>(0, end / block * block - (begin + block - 1) / block * block);
}

TEST_CASE("a page pool moves a released range's pages under the next acquired range", "[zero]") {
  const std::int64_t n = 1 << 20;  // 4 MiB
  auto arena = kernels::tensor::mapped_zeros({n});
  float* a = arena.f32();
  std::fill(a, a + n, 1.5f);
  page_pool pool(n * 4);
  const std::int64_t block = pool.block_bytes();
  REQUIRE(block >= ::sysconf(_SC_PAGESIZE));
  const std::int64_t lo = 1001, count = 300000;  // unaligned both ends
  pool.release(a + lo, count);
  REQUIRE(pool.pooled_bytes() == whole_bytes(a + lo, count, block));
  // The released range holds only its edge pages and reads zero.
  REQUIRE(resident_bytes(a + lo, count * 4) <= 2 * 4096);
  for (std::int64_t i = lo; i < lo + count; ++i)
    if (a[i] != 0.0f) FAIL("released element " << i);
  // A range elsewhere takes the pooled pages: resident before anything writes it.
  const std::int64_t at = 600000, m = 200000;
  pool.release(a + at, m);
  const std::int64_t pooled = pool.pooled_bytes();
  REQUIRE(resident_bytes(a + at, m * 4) <= 2 * 4096);
  pool.acquire(a + at, m);
  REQUIRE(pool.pooled_bytes() == pooled - whole_bytes(a + at, m, block));
  REQUIRE(resident_bytes(a + at, m * 4) >= whole_bytes(a + at, m, block));
  for (std::int64_t i = at; i < at + m; ++i) a[i] = float(i);
  // Nothing outside the two ranges moved or changed.
  for (std::int64_t i = 0; i < n; ++i) {
    const float want = i >= at && i < at + m ? float(i) : i >= lo && i < lo + count ? 0.0f : 1.5f;
    if (a[i] != want) FAIL("element " << i << ": " << a[i] << " vs " << want);
  }
}

TEST_CASE("a page pool holds at most its capacity; the rest goes back to the kernel", "[zero]") {
  const std::int64_t n = 1 << 20;
  auto arena = kernels::tensor::mapped_zeros({n});
  float* a = arena.f32();
  std::fill(a, a + n, 2.0f);
  page_pool pool(64 * 4096);
  pool.release(a, n);
  REQUIRE(pool.pooled_bytes() == 64 * 4096);
  REQUIRE(pool.pooled_bytes() % pool.block_bytes() == 0);
  REQUIRE(resident_bytes(a, n * 4) == 0);
  for (std::int64_t i = 0; i < n; ++i)
    if (a[i] != 0.0f) FAIL("element " << i);
}

TEST_CASE("a page pool keeps every held range intact over many cycles, mappings bounded",
          "[zero]") {
  // 24 buckets of uneven sizes; random buckets are released and acquired (then written) as a
  // ZeRO-3 stage does, with at most 6 held at once.
  const std::int64_t n = 3 << 20;
  auto arena = kernels::tensor::mapped_zeros({n});
  float* a = arena.f32();
  std::mt19937 rng(5);
  std::vector<std::int64_t> edges{0};
  for (int b = 0; b < 24; ++b) edges.push_back(edges.back() + 40000 + std::int64_t(rng() % 90000));
  REQUIRE(edges.back() <= n);
  page_pool pool(n * 4);
  std::vector<int> held;
  std::vector<float> stamp(24, 0.0f);
  const int maps_before = mapping_count();
  int most_maps = 0;
  for (int it = 0; it < 3000; ++it) {
    if (held.size() == 6 || (!held.empty() && rng() % 2)) {
      const std::size_t k = rng() % held.size();
      const int b = held[k];
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
      pool.release(a + edges[b], edges[b + 1] - edges[b]);
    } else {
      int b = static_cast<int>(rng() % 24);
      while (std::count(held.begin(), held.end(), b)) b = (b + 1) % 24;
      pool.acquire(a + edges[b], edges[b + 1] - edges[b]);
      stamp[b] = float(it);
      std::fill(a + edges[b], a + edges[b + 1], stamp[b]);
      held.push_back(b);
    }
    for (int b = 0; b < 24; ++b) {  // held buckets read their stamp, the others zero
      const bool is_held = std::count(held.begin(), held.end(), b) > 0;
      const float want = is_held ? stamp[b] : 0.0f;
      for (std::int64_t i = edges[b]; i < edges[b + 1]; i += 997)
        if (a[i] != want) FAIL("iteration " << it << " bucket " << b << " element " << i);
      if (a[edges[b + 1] - 1] != want) FAIL("iteration " << it << " bucket " << b << " end");
    }
    most_maps = std::max(most_maps, mapping_count());
  }
  // Every boundary a move makes is a block boundary of the arena or of the pool's region.
  const std::int64_t bound = 2 * (n * 4 / pool.block_bytes()) + 8;
  INFO("mappings before " << maps_before << ", most " << most_maps << ", bound " << bound);
  REQUIRE(most_maps - maps_before <= bound);
}

TEST_CASE("ZeRO-3 gathers each use's buckets ahead, never a held bucket, within the window",
          "[zero]") {
  const int prefetch = GENERATE(0, 1, 2, 4);
  const unsigned seed = GENERATE(1u, 2u, 3u);
  std::mt19937 rng(seed);
  std::vector<std::vector<int>> uses;
  for (int j = 0; j < 60; ++j) {  // sets of 1 or 2 of 6 buckets, repeats included
    std::vector<int> u{int(rng() % 6)};
    if (rng() % 3 == 0) u.push_back(int(rng() % 6));
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
    uses.push_back(u);
  }
  CAPTURE(prefetch, seed);
  param_residency r;
  std::set<int> held, in_flight;
  int gathers = 0;
  auto apply = [&](const param_residency::changes& ch) {
    for (int b : ch.release) {
      REQUIRE(held.erase(b) == 1);
      REQUIRE(in_flight.count(b) == 0);  // a use finished on it, so its gather had completed
    }
    for (int b : ch.gather) {
      REQUIRE(held.insert(b).second);  // never gathered while held
      in_flight.insert(b);
      ++gathers;
    }
  };
  apply(r.start(uses, prefetch));
  for (int j = 0; j < static_cast<int>(uses.size()); ++j) {
    // The window: exactly the buckets of the issued, unfinished uses are held.
    std::set<int> window;
    for (int k = j; k < std::min<int>(j + prefetch + 1, int(uses.size())); ++k)
      window.insert(uses[std::size_t(k)].begin(), uses[std::size_t(k)].end());
    REQUIRE(held == window);
    // Every gather is asked for once the last use is issued (stage S8's point for ZeRO-3).
    REQUIRE(r.all_issued() == (j + prefetch + 1 >= static_cast<int>(uses.size())));
    const auto& u = uses[std::size_t(j)];
    REQUIRE(r.ready(j) ==
            std::none_of(u.begin(), u.end(), [&](int b) { return in_flight.count(b); }));
    for (int b : in_flight) r.gathered(b);
    in_flight.clear();
    REQUIRE(r.ready(j));
    if (j + 1 < static_cast<int>(uses.size())) {
      REQUIRE_THROWS_AS(r.finished(j + 1), std::logic_error);
    }
    apply(r.finished(j));
  }
  REQUIRE(held.empty());
  REQUIRE(r.holds_nothing());
  // Sharing: fewer gathers than bucket uses whenever a bucket recurs inside the window.
  int bucket_uses = 0;
  for (const auto& u : uses) bucket_uses += static_cast<int>(u.size());
  REQUIRE(gathers <= bucket_uses);
  if (prefetch == 0) {
    int repeats = 0;  // consecutive uses sharing a bucket do not gather it again
    for (std::size_t j = 1; j < uses.size(); ++j)
      for (int b : uses[j]) repeats += std::count(uses[j - 1].begin(), uses[j - 1].end(), b);
    REQUIRE(gathers == bucket_uses - repeats);
  }
}

}  // namespace
}  // namespace troupe::engine
