// Tests for the byte tokenizer and the llm.c token-shard writer/reader: round trips, atomic
// writes, and one-line errors naming the file for each kind of corrupt shard.
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <numeric>
#include <vector>

#include "engine/data/byte_tokenizer.hpp"
#include "engine/data/token_shard.hpp"
#include "tests/data/temp_dir.hpp"

using namespace troupe::engine::data;
using troupe::engine::data::test::temp_dir;
using troupe::engine::data::test::write_file;

namespace {

// Raw shard bytes with an arbitrary header, for corruption tests.
std::string raw_shard(std::int32_t magic, std::int32_t version, std::int32_t ntokens,
                      std::size_t payload_tokens) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = ntokens;
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(payload_tokens * 2, '\x01');
  return bytes;
}

std::string error_of(const std::filesystem::path& p) {
  try {
    token_shard s(p);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("byte tokenizer round trips every byte", "[data][tokenizer]") {
  byte_tokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  all += "héllo, wörld\n";
  const auto ids = tok.encode(all);
  REQUIRE(ids.size() == all.size());
  CHECK(ids[0] == 0);
  CHECK(ids[255] == 255);
  CHECK(ids[256] == 'h');
  CHECK(tok.decode(std::span<const std::uint16_t>(ids)) == all);
  CHECK(tok.encode("").empty());
  CHECK(byte_tokenizer::vocab_size == 256);

  std::vector<std::int32_t> wide(ids.begin(), ids.end());
  CHECK(tok.decode(std::span<const std::int32_t>(wide)) == all);
}

TEST_CASE("byte tokenizer rejects ids outside the byte vocab", "[data][tokenizer]") {
  byte_tokenizer tok;
  const std::vector<std::uint16_t> bad{65, 66, 300};
  REQUIRE_THROWS_WITH(tok.decode(std::span<const std::uint16_t>(bad)),
                      Catch::Contains("300") && Catch::Contains("position 2"));
  const std::vector<std::int32_t> neg{-1};
  REQUIRE_THROWS_AS(tok.decode(std::span<const std::int32_t>(neg)), std::runtime_error);
  const std::vector<std::uint16_t> edge{256};
  REQUIRE_THROWS(tok.decode(std::span<const std::uint16_t>(edge)));
}

TEST_CASE("token shard write/read round trip", "[data][shard]") {
  temp_dir dir;
  const auto path = dir / "x.bin";
  std::vector<std::uint16_t> tokens(5000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(i * 37);
  write_token_shard(path, tokens);
  CHECK(std::filesystem::file_size(path) == 1024 + 2 * tokens.size());

  // Header is little-endian int32 {magic, version, ntokens}.
  std::ifstream in(path, std::ios::binary);
  std::int32_t hdr[3];
  in.read(reinterpret_cast<char*>(hdr), sizeof hdr);
  CHECK(hdr[0] == 20240520);
  CHECK(hdr[1] == 1);
  CHECK(hdr[2] == 5000);

  token_shard shard(path);
  REQUIRE(shard.size() == 5000);
  CHECK(std::equal(tokens.begin(), tokens.end(), shard.tokens().begin(), shard.tokens().end()));
  CHECK(shard.path() == path);

  // Move keeps the mapping valid; the moved-from shard is empty.
  token_shard moved(std::move(shard));
  CHECK(moved.size() == 5000);
  CHECK(moved.tokens()[4999] == tokens[4999]);
  CHECK(shard.size() == 0);  // NOLINT(bugprone-use-after-move)

  // Empty shard is valid.
  write_token_shard(dir / "empty.bin", {});
  token_shard empty(dir / "empty.bin");
  CHECK(empty.size() == 0);
  CHECK(empty.tokens().empty());
}

TEST_CASE("token shard write is atomic and overwrites", "[data][shard]") {
  temp_dir dir;
  const auto path = dir / "y.bin";
  write_token_shard(path, std::vector<std::uint16_t>{1, 2, 3});
  write_token_shard(path, std::vector<std::uint16_t>{9, 8});
  CHECK_FALSE(std::filesystem::exists(dir / "y.bin.tmp"));
  token_shard s(path);
  REQUIRE(s.size() == 2);
  CHECK(s.tokens()[0] == 9);
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  CHECK(entries == 1);

  // Writing into a missing directory fails cleanly and leaves nothing behind.
  REQUIRE_THROWS_WITH(write_token_shard(dir / "nope" / "z.bin", std::vector<std::uint16_t>{1}),
                      Catch::Contains("z.bin.tmp"));
  CHECK_FALSE(std::filesystem::exists(dir / "nope"));
}

TEST_CASE("corrupt token shards give errors naming the file", "[data][shard]") {
  temp_dir dir;
  SECTION("bad magic") {
    const auto p = dir / "magic.bin";
    write_file(p, raw_shard(12345, 1, 4, 4));
    const auto msg = error_of(p);
    CHECK_THAT(msg, Catch::Contains(p.string()) && Catch::Contains("bad magic 12345") &&
                        Catch::Contains("20240520"));
  }
  SECTION("bad version") {
    const auto p = dir / "version.bin";
    write_file(p, raw_shard(20240520, 2, 4, 4));
    CHECK_THAT(error_of(p), Catch::Contains(p.string()) && Catch::Contains("version 2"));
  }
  SECTION("truncated payload") {
    const auto p = dir / "trunc.bin";
    write_file(p, raw_shard(20240520, 1, 10, 7));
    CHECK_THAT(error_of(p), Catch::Contains(p.string()) && Catch::Contains("truncated") &&
                                Catch::Contains("1044"));
  }
  SECTION("truncated header") {
    const auto p = dir / "short.bin";
    write_file(p, "abc");
    CHECK_THAT(error_of(p), Catch::Contains(p.string()) && Catch::Contains("truncated"));
  }
  SECTION("too long") {
    const auto p = dir / "long.bin";
    write_file(p, raw_shard(20240520, 1, 4, 5));
    CHECK_THAT(error_of(p), Catch::Contains(p.string()) && Catch::Contains("too long"));
  }
  SECTION("negative count") {
    const auto p = dir / "neg.bin";
    write_file(p, raw_shard(20240520, 1, -3, 0));
    CHECK_THAT(error_of(p), Catch::Contains(p.string()) && Catch::Contains("negative"));
  }
  SECTION("missing file") {
    const auto p = dir / "missing.bin";
    CHECK_THAT(error_of(p), Catch::Contains(p.string()));
  }
  SECTION("messages are one line") {
    const auto p = dir / "magic.bin";
    write_file(p, raw_shard(7, 1, 0, 0));
    CHECK(error_of(p).find('\n') == std::string::npos);
  }
}
