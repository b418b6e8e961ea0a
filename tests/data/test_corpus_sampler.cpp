// Tests for token_corpus (text and shard loading, multi-shard reads, split, vocab checks) and
// batch_sampler (sequential offset formula with wrap-around and DP sharding, random-order
// determinism and bounds, size errors, resume via set_position).
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "engine/data/byte_tokenizer.hpp"
#include "engine/data/corpus.hpp"
#include "engine/data/sampler.hpp"
#include "engine/data/token_shard.hpp"
#include "tests/data/temp_dir.hpp"

using namespace troupe::engine::data;
using troupe::engine::data::test::temp_dir;
using troupe::engine::data::test::write_file;

namespace {

// Corpus whose token at position p is p (so a batch's values are its offsets).
token_corpus iota_corpus(std::int64_t n) {
  std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), std::uint16_t{0});
  return token_corpus(std::move(v), "iota");
}

struct batch {
  std::vector<std::int32_t> x, y;
};

batch fill(const batch_sampler& s, std::int64_t i) {
  const auto bt = static_cast<std::size_t>(s.batch_tokens());
  batch b{std::vector<std::int32_t>(bt), std::vector<std::int32_t>(bt)};
  s.fill(i, b.x.data(), b.y.data());
  return b;
}

}  // namespace

TEST_CASE("text corpus from a directory skips .dat and symlinks, sorted by name",
          "[data][corpus]") {
  temp_dir dir;
  write_file(dir / "b", "bravo");
  write_file(dir / "a", "alpha");
  write_file(dir / "a.dat", "INDEX");
  write_file(dir / "c", "charlie");
  std::filesystem::create_symlink(dir / "a", dir / "a.u8");
  std::filesystem::create_directory(dir / "sub");
  write_file(dir / "sub" / "z", "nested");

  const token_corpus c = load_text_corpus(dir.path());
  const auto v = c.to_vector();
  CHECK(byte_tokenizer{}.decode(std::span<const std::uint16_t>(v)) == "alpha\nbravo\ncharlie");
  CHECK(c.vocab_max() == 'v');  // max byte of "alpha bravo charlie"
  CHECK(c.source() == dir.path().string());
  CHECK(c.contiguous().size() == v.size());

  // A single file.
  const token_corpus one = load_text_corpus(dir / "c");
  CHECK(one.size() == 7);
  CHECK(one.at(0) == 'c');

  // Errors.
  REQUIRE_THROWS_WITH(load_text_corpus(dir / "missing"), Catch::Contains("missing"));
  std::filesystem::create_directory(dir / "emptydir");
  write_file(dir / "emptydir" / "x.dat", "idx");
  REQUIRE_THROWS_WITH(load_text_corpus(dir / "emptydir"), Catch::Contains("emptydir"));
}

TEST_CASE("shard corpus concatenates shards and reads across boundaries", "[data][corpus]") {
  temp_dir dir;
  std::vector<std::uint16_t> a{10, 11, 12}, b{}, c{13, 14, 15, 16};
  write_token_shard(dir / "a.bin", a);
  write_token_shard(dir / "b.bin", b);
  write_token_shard(dir / "c.bin", c);
  const token_corpus corpus = load_shard_corpus(
      std::vector<std::filesystem::path>{dir / "a.bin", dir / "b.bin", dir / "c.bin"});
  REQUIRE(corpus.size() == 7);
  std::vector<std::int32_t> out(5);
  corpus.read(1, 5, out.data());
  CHECK(out == std::vector<std::int32_t>{11, 12, 13, 14, 15});
  CHECK(corpus.at(6) == 16);
  CHECK(corpus.contiguous().empty());  // spans two shards
  CHECK(corpus.slice(3, 7).contiguous().size() == 4);
  CHECK(corpus.vocab_max() == 16);
  CHECK(corpus.source_of(0) == (dir / "a.bin").string());
  CHECK(corpus.source_of(3) == (dir / "c.bin").string());
  REQUIRE_THROWS_AS(corpus.read(5, 3, out.data()), std::out_of_range);
  REQUIRE_THROWS_AS(corpus.at(7), std::out_of_range);

  // check_vocab names the offending file and position.
  REQUIRE_NOTHROW(corpus.check_vocab(17));
  REQUIRE_THROWS_WITH(corpus.check_vocab(15), Catch::Contains((dir / "c.bin").string()) &&
                                                  Catch::Contains("token 15 at index 2"));

  // Single path overload; errors propagate with the file name.
  CHECK(load_shard_corpus(dir / "a.bin").size() == 3);
  write_file(dir / "bad.bin", "not a shard");
  REQUIRE_THROWS_WITH(
      load_shard_corpus(std::vector<std::filesystem::path>{dir / "a.bin", dir / "bad.bin"}),
      Catch::Contains("bad.bin"));
  REQUIRE_THROWS(load_shard_corpus(std::vector<std::filesystem::path>{}));
}

TEST_CASE("split_validation takes the last fraction as val without copying", "[data][corpus]") {
  const token_corpus c = iota_corpus(1000);
  auto [train, val] = split_validation(c, 0.1);
  CHECK(train.size() == 900);
  CHECK(val.size() == 100);
  CHECK(train.at(0) == 0);
  CHECK(train.at(899) == 899);
  CHECK(val.at(0) == 900);
  CHECK(val.at(99) == 999);
  CHECK(val.contiguous().data() == c.contiguous().data() + 900);  // a view, not a copy
  CHECK(val.vocab_max() == 999);
  CHECK(train.vocab_max() == 899);

  auto [all, none] = split_validation(c, 0.0);
  CHECK(all.size() == 1000);
  CHECK(none.size() == 0);
  CHECK(none.vocab_max() == -1);
  auto [t3, v3] = split_validation(iota_corpus(10), 0.25);
  CHECK(t3.size() + v3.size() == 10);
  CHECK(v3.size() == 3);  // round(2.5) away from zero
  REQUIRE_THROWS(split_validation(c, 1.0));
  REQUIRE_THROWS(split_validation(c, -0.1));
}

TEST_CASE("sample order parsing", "[data][sampler]") {
  CHECK(parse_sample_order("random") == sample_order::random);
  CHECK(parse_sample_order("sequential") == sample_order::sequential);
  CHECK(to_string(sample_order::sequential) == "sequential");
  REQUIRE_THROWS_WITH(parse_sample_order("shuffle"), Catch::Contains("shuffle") &&
                                                         Catch::Contains("random") &&
                                                         Catch::Contains("sequential"));
}

TEST_CASE("sequential sampler follows the offset formula and wraps", "[data][sampler]") {
  const std::int64_t B = 3, T = 4, N = 50;  // n_batches = 49 / 12 = 4
  batch_sampler s(iota_corpus(N), {B, T, sample_order::sequential, 0, 0, 1});
  REQUIRE(s.n_batches() == 4);
  for (std::int64_t i = 0; i < 10; ++i) {
    const batch b = fill(s, i);
    for (std::int64_t r = 0; r < B; ++r) {
      const std::int64_t off = ((i % 4) * B + r) * T;
      CHECK(s.row_offset(i, r) == off);
      for (std::int64_t t = 0; t < T; ++t) {
        CHECK(b.x[static_cast<std::size_t>(r * T + t)] == off + t);
        CHECK(b.y[static_cast<std::size_t>(r * T + t)] == off + t + 1);
      }
    }
  }
  // Wrap: batch 4 == batch 0; the last whole batch reads token index 48 as its final target.
  CHECK(fill(s, 4).x == fill(s, 0).x);
  CHECK(fill(s, 3).y.back() == 48);

  // Exactly B*T+1 tokens: one batch.
  batch_sampler tight(iota_corpus(B * T + 1), {B, T, sample_order::sequential, 0, 0, 1});
  CHECK(tight.n_batches() == 1);
  CHECK(fill(tight, 0).y.back() == B * T);
}

TEST_CASE("sequential DP ranks together cover the single-rank stream", "[data][sampler]") {
  const std::int64_t B = 2, T = 3;
  const token_corpus c = iota_corpus(200);
  batch_sampler one(c, {B, T, sample_order::sequential, 0, 0, 1});
  batch_sampler r0(c, {B, T, sample_order::sequential, 0, 0, 2});
  batch_sampler r1(c, {B, T, sample_order::sequential, 0, 1, 2});
  for (std::int64_t i = 0; i < 40; ++i) {
    CHECK(fill(r0, i).x == fill(one, 2 * i).x);
    CHECK(fill(r1, i).x == fill(one, 2 * i + 1).x);
    CHECK(fill(r1, i).y == fill(one, 2 * i + 1).y);
  }
}

TEST_CASE("random sampler is a deterministic, history-free function of (seed, i)",
          "[data][sampler]") {
  const std::int64_t B = 4, T = 8, N = 300;
  const token_corpus c = iota_corpus(N);
  batch_sampler s(c, {B, T, sample_order::random, 1234, 0, 1});
  batch_sampler same(c, {B, T, sample_order::random, 1234, 0, 1});
  batch_sampler other(c, {B, T, sample_order::random, 1235, 0, 1});

  // Same seed and index -> same batch, regardless of call order.
  std::vector<batch> forward;
  for (std::int64_t i = 0; i < 20; ++i) forward.push_back(fill(s, i));
  for (std::int64_t i = 19; i >= 0; --i) {
    CHECK(fill(same, i).x == forward[static_cast<std::size_t>(i)].x);
  }
  CHECK(fill(s, 7).x == forward[7].x);

  // Different seed differs.
  int differing = 0;
  for (std::int64_t i = 0; i < 20; ++i)
    differing += fill(other, i).x != forward[static_cast<std::size_t>(i)].x;
  CHECK(differing >= 19);

  // Offsets within [0, N-T-1], targets shifted by one, and the range is well covered.
  std::set<std::int64_t> seen;
  for (std::int64_t i = 0; i < 500; ++i) {
    const batch b = fill(s, i);
    for (std::int64_t r = 0; r < B; ++r) {
      const std::int64_t off = s.row_offset(i, r);
      REQUIRE(off >= 0);
      REQUIRE(off <= N - T - 1);
      seen.insert(off);
      CHECK(b.x[static_cast<std::size_t>(r * T)] == off);
      CHECK(b.y[static_cast<std::size_t>(r * T + T - 1)] == off + T);
    }
  }
  CHECK(seen.count(0) == 1);
  CHECK(seen.count(N - T - 1) == 1);
  CHECK(seen.size() > 250);  // 2000 draws over 292 values

  // DP: rank k's batch i is the single-rank batch i*dp_size + k.
  batch_sampler r1(c, {B, T, sample_order::random, 1234, 1, 3});
  CHECK(fill(r1, 5).x == forward[16].x);

  // Random order only needs T+1 tokens.
  batch_sampler small(iota_corpus(T + 1), {B, T, sample_order::random, 9, 0, 1});
  CHECK(fill(small, 3).x.front() == 0);
}

TEST_CASE("next/position/set_position resume the stream", "[data][sampler]") {
  batch_sampler s(iota_corpus(500), {2, 5, sample_order::random, 77, 0, 1});
  std::vector<std::int32_t> x(10), y(10);
  for (int k = 0; k < 6; ++k) s.next(x.data(), y.data());
  CHECK(s.position() == 6);
  CHECK(x == fill(s, 5).x);

  batch_sampler resumed(iota_corpus(500), {2, 5, sample_order::random, 77, 0, 1});
  resumed.set_position(6);
  std::vector<std::int32_t> x1(10), y1(10), x2(10), y2(10);
  s.next(x1.data(), y1.data());
  resumed.next(x2.data(), y2.data());
  CHECK(x1 == x2);
  CHECK(y1 == y2);
  REQUIRE_THROWS(resumed.set_position(-1));
}

TEST_CASE("sampler rejects too-small corpora and bad configs", "[data][sampler]") {
  const std::int64_t B = 4, T = 8;
  REQUIRE_THROWS_WITH(
      batch_sampler(iota_corpus(B * T), {B, T, sample_order::sequential, 0, 0, 1}),
      Catch::Contains("iota") && Catch::Contains("has 32 tokens") && Catch::Contains("33"));
  REQUIRE_THROWS_WITH(batch_sampler(iota_corpus(T), {B, T, sample_order::random, 0, 0, 1}),
                      Catch::Contains("has 8 tokens") && Catch::Contains("9"));
  REQUIRE_THROWS_WITH(batch_sampler(token_corpus(), {B, T, sample_order::sequential, 0, 0, 1}),
                      Catch::Contains("has 0 tokens"));
  // The validation split of a small corpus is rejected by the sampler.
  auto [train, val] = split_validation(iota_corpus(100), 0.05);
  REQUIRE_THROWS_WITH(batch_sampler(val, {1, 8, sample_order::random, 0, 0, 1}),
                      Catch::Contains("has 5 tokens"));
  REQUIRE_THROWS(batch_sampler(iota_corpus(100), {0, T, sample_order::random, 0, 0, 1}));
  REQUIRE_THROWS(batch_sampler(iota_corpus(100), {B, T, sample_order::random, 0, 2, 2}));
  REQUIRE_THROWS(batch_sampler(iota_corpus(100), {B, T, sample_order::random, 0, 0, 0}));
}
