// GPT-2's byte-level BPE (engine/model/bpe_tokenizer.hpp) on a tiny hand-written vocabulary:
// GPT-2's pre-tokenizer pieces, merges applied in merges.txt's order (not left to right), the byte
// symbols of space and newline, decode(encode(s)) == s (for every byte string once every byte
// has a symbol), and vocab.json / merges.txt read from a directory, bad files refused naming
// them.
#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "engine/model/bpe_tokenizer.hpp"
#include "tests/engine/engine_test_util.hpp"

using namespace troupe::engine;
using namespace troupe::engine::test;

namespace {

// "Ġ" is the byte symbol of a space (U+0120), "Ċ" of a newline (U+010A).
const std::unordered_map<std::string, std::int32_t> tiny_vocab = {
    {"h", 0},  {"e", 1},    {"l", 2},     {"o", 3},         {"\xc4\xa0", 4}, {"ll", 5},
    {"he", 6}, {"hell", 7}, {"hello", 8}, {"\xc4\xa0h", 9}, {"el", 10},      {"\xc4\x8a", 11},
};
const std::vector<std::pair<std::string, std::string>> tiny_merges = {
    {"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {"\xc4\xa0", "h"}, {"e", "l"},
};

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (const auto p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

}  // namespace

TEST_CASE("GPT-2 pre-tokenizer: contractions, words with their space, numbers, spaces",
          "[unit][bpe]") {
  using v = std::vector<std::string>;
  CHECK(pieces("Hello world's  end\n\n x 42!") ==
        v{"Hello", " world", "'s", " ", " end", "\n\n", " x", " 42", "!"});
  CHECK(pieces("I'll don't we've") == v{"I", "'ll", " don", "'t", " we", "'ve"});
  CHECK(pieces("a  ") == v{"a", "  "});
  CHECK(pieces("a1b2 ...?! x") == v{"a", "1", "b", "2", " ...?!", " x"});
  CHECK(pieces("  \tz") == v{"  ", "\t", "z"});
  CHECK(pieces("caf\xc3\xa9 na\xc3\xafve") == v{"caf\xc3\xa9", " na\xc3\xafve"});  // café naïve
  CHECK(pieces("").empty());
  // The pieces always make up the text, malformed UTF-8 included.
  std::mt19937 rng(5);
  for (int round = 0; round < 200; ++round) {
    std::string s(rng() % 40, '\0');
    for (char& ch : s) ch = static_cast<char>(rng() % 256);
    std::string joined;
    for (const auto& p : gpt2_pretokenize(s)) {
      CHECK(!p.empty());
      joined += p;
    }
    CHECK(joined == s);
  }
}

TEST_CASE("BPE merges by priority, not left to right", "[unit][bpe]") {
  const bpe_tokenizer tok(tiny_vocab, tiny_merges);
  CHECK(tok.vocab_size() == 12);
  using ids = std::vector<std::int32_t>;
  CHECK(tok.encode("hello") == ids{8});
  // "l l" (rank 0) before "e l" (rank 5): e + ll, never el + l.
  CHECK(tok.encode("ell") == ids{1, 5});
  // "h e" (rank 1) before "Ġ h" (rank 4): the space stays alone.
  CHECK(tok.encode(" hell") == ids{4, 7});
  CHECK(tok.encode("hello hello\n") == ids{8, 4, 8, 11});
  CHECK(tok.encode("oh") == ids{3, 0});
  CHECK(tok.encode("") == ids{});
  for (const std::string s : {"hello hell", "ell", "oh", " hello\n\nhe", "lol  leo"})
    CHECK(tok.decode(tok.encode(s)) == s);
  CHECK(tok.decode(ids{9, 10}) == " hel");
  CHECK(error_message<std::runtime_error>([&] { tok.encode("hex"); }).find("'x'") !=
        std::string::npos);
  CHECK(error_message<std::runtime_error>([&] { tok.decode(ids{12}); }).find("12") !=
        std::string::npos);
}

TEST_CASE("BPE round trip over every byte once each byte has a symbol", "[unit][bpe]") {
  // GPT-2's bytes_to_unicode, written out again: printable Latin-1 bytes stand for themselves,
  // the others for U+0100, U+0101, ... in byte order.
  std::unordered_map<std::string, std::int32_t> vocab;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab.emplace(s, b);
  }
  CHECK(next == 256 + 68);
  vocab.emplace("\xc4\xa0t", 256);  // " t"
  vocab.emplace("he", 257);
  vocab.emplace("\xc4\xa0the", 258);  // " the"
  const bpe_tokenizer tok(vocab, {{"\xc4\xa0", "t"}, {"h", "e"}, {"\xc4\xa0t", "he"}});
  using ids = std::vector<std::int32_t>;
  CHECK(tok.encode(" the") == ids{258});
  CHECK(tok.encode("A\n") == ids{65, 10});  // a byte's id is the byte here
  std::mt19937 rng(9);
  for (int round = 0; round < 200; ++round) {
    std::string s(rng() % 50, '\0');
    for (char& ch : s) ch = static_cast<char>(rng() % 256);
    CHECK(tok.decode(tok.encode(s)) == s);
  }
}

TEST_CASE("BPE files: vocab.json and merges.txt read from a directory, bad ones named",
          "[unit][bpe]") {
  temp_dir dir;
  write_file(dir / "vocab.json",
             R"({"h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "ll": 5, "he": 6, "hell": 7,)"
             R"( "hello": 8, "\u0120h": 9, "el": 10, "\u010a": 11})");
  write_file(dir / "merges.txt", "#version: 0.2\nl l\nh e\nhe ll\nhell o\n\xc4\xa0 h\ne l\n");
  const bpe_tokenizer tok = bpe_tokenizer::load(dir.path());
  const bpe_tokenizer same(tiny_vocab, tiny_merges);
  for (const std::string s : {"hello hell", "ell", " hell", "hello\n"}) {
    CHECK(tok.encode(s) == same.encode(s));
    CHECK(tok.decode(tok.encode(s)) == s);
  }

  write_file(dir / "merges.txt", "#version: 0.2\nl l\nhe\n");
  CHECK(error_message<std::runtime_error>([&] {
          bpe_tokenizer::load(dir.path());
        }).find("merges.txt:3: expected two symbols") != std::string::npos);
  write_file(dir / "merges.txt", "l l\n");
  write_file(dir / "vocab.json", R"({"h": "zero"})");
  CHECK(error_message<std::runtime_error>([&] {
          bpe_tokenizer::load(dir.path());
        }).find("vocab.json: the id of 'h'") != std::string::npos);
  write_file(dir / "vocab.json", R"({"h": 0, "e": 0})");
  CHECK(error_message<std::runtime_error>([&] {
          bpe_tokenizer::load(dir.path());
        }).find("vocab.json: bpe_tokenizer: id 0 is given to") != std::string::npos);
  write_file(dir / "vocab.json", "[1, 2");
  CHECK(error_message<std::runtime_error>([&] {
          bpe_tokenizer::load(dir.path());
        }).find("vocab.json: not JSON") != std::string::npos);
  CHECK(error_message<std::runtime_error>([&] {
          bpe_tokenizer::load(dir / "missing");
        }).find("missing/vocab.json: cannot read") != std::string::npos);
}
