// GPT-2 byte-level BPE. See bpe_tokenizer.hpp.
#include "engine/model/bpe_tokenizer.hpp"

#include <locale.h>
#include <wctype.h>

#include <algorithm>
#include <array>
#include <climits>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace troupe::engine {
namespace {

constexpr char32_t malformed = 0xFFFFFFFF;

std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// The code point at text[i] and its length in bytes; (malformed, 1) for a byte that does not
// start a well-formed sequence.
std::pair<char32_t, std::size_t> next_code_point(std::string_view text, std::size_t i) {
  const auto b = static_cast<unsigned char>(text[i]);
  if (b < 0x80) return {b, 1};
  std::size_t len = 0;
  char32_t cp = 0;
  if ((b & 0xE0) == 0xC0) {
    len = 2;
    cp = b & 0x1F;
  } else if ((b & 0xF0) == 0xE0) {
    len = 3;
    cp = b & 0x0F;
  } else if ((b & 0xF8) == 0xF0) {
    len = 4;
    cp = b & 0x07;
  } else {
    return {malformed, 1};
  }
  if (i + len > text.size()) return {malformed, 1};
  for (std::size_t k = 1; k < len; ++k) {
    const auto c = static_cast<unsigned char>(text[i + k]);
    if ((c & 0xC0) != 0x80) return {malformed, 1};
    cp = (cp << 6) | (c & 0x3F);
  }
  constexpr std::array<char32_t, 5> least = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {malformed, 1};
  return {cp, len};
}

// Unicode's White_Space property.
bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

locale_t unicode_ctype() {
  static const locale_t l = newlocale(LC_CTYPE_MASK, "C.UTF-8", locale_t{});
  return l;
}

bool is_letter(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (c == malformed) return false;
  const locale_t l = unicode_ctype();
  return l != locale_t{} && iswalpha_l(static_cast<wint_t>(c), l) != 0;
}

bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  if (c == malformed) return false;
  const locale_t l = unicode_ctype();
  return l != locale_t{} && iswdigit_l(static_cast<wint_t>(c), l) != 0;
}

enum class char_class { letter, number, space, other };

char_class classify(char32_t c) {
  if (c != malformed && is_space(c)) return char_class::space;
  if (is_letter(c)) return char_class::letter;
  if (is_number(c)) return char_class::number;
  return char_class::other;
}

// GPT-2's bytes_to_unicode: the printable Latin-1 bytes stand for themselves, the others for
// 256, 257, ... in byte order.
struct byte_symbols {
  std::array<std::string, 256> symbol;  // UTF-8
  std::array<int, 324> byte_of;         // code point -> byte, -1 for none
  byte_symbols() {
    byte_of.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const int cp = printable ? b : next++;
      symbol[static_cast<std::size_t>(b)] = utf8(static_cast<char32_t>(cp));
      byte_of[static_cast<std::size_t>(cp)] = b;
    }
  }
};

const byte_symbols& bytes_to_unicode() {
  static const byte_symbols table;
  return table;
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path.string() + ": cannot read");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  const std::size_t n = text.size();
  // The end of the run of characters of class `cls` starting at i.
  auto run_end = [&](std::size_t i, char_class cls) {
    while (i < n) {
      const auto [cp, len] = next_code_point(text, i);
      if (classify(cp) != cls) break;
      i += len;
    }
    return i;
  };
  std::size_t pos = 0;
  while (pos < n) {
    std::size_t end = pos;
    for (const std::string_view s : {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"}) {
      if (text.substr(pos).starts_with(s)) {
        end = pos + s.size();
        break;
      }
    }
    if (end == pos) {
      // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one class.
      const std::size_t start = text[pos] == ' ' && pos + 1 < n ? pos + 1 : pos;
      const char_class cls = classify(next_code_point(text, start).first);
      if (cls != char_class::space) {
        end = run_end(start, cls);
      } else {
        // `\s+(?!\S)|\s+`: a run of spaces, less its last character when a non-space follows
        // and the run is longer than one character.
        std::size_t last = pos;  // the start of the run's last character
        end = pos;
        while (end < n) {
          const auto [cp, len] = next_code_point(text, end);
          if (classify(cp) != char_class::space) break;
          last = end;
          end += len;
        }
        if (end < n && last > pos) end = last;
      }
    }
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return pieces;
}

bpe_tokenizer::bpe_tokenizer(const std::unordered_map<std::string, std::int32_t>& vocab,
                             const std::vector<std::pair<std::string, std::string>>& merges)
    : ids_(vocab) {
  for (const auto& [symbol, id] : vocab) {
    if (id < 0)
      throw std::invalid_argument("bpe_tokenizer: symbol '" + symbol + "' has a negative id");
    vocab_size_ = std::max(vocab_size_, id + 1);
  }
  symbols_.assign(static_cast<std::size_t>(vocab_size_), std::string());
  known_.assign(static_cast<std::size_t>(vocab_size_), false);
  for (const auto& [symbol, id] : vocab) {
    const auto i = static_cast<std::size_t>(id);
    if (known_[i])
      throw std::invalid_argument("bpe_tokenizer: id " + std::to_string(id) + " is given to '" +
                                  symbols_[i] + "' and '" + symbol + "'");
    symbols_[i] = symbol;
    known_[i] = true;
  }
  for (std::size_t r = 0; r < merges.size(); ++r)
    merge_rank_.emplace(merges[r].first + " " + merges[r].second, static_cast<int>(r));
}

bpe_tokenizer bpe_tokenizer::load(const std::filesystem::path& dir) {
  const auto vocab_path = dir / "vocab.json";
  const auto merges_path = dir / "merges.txt";
  std::unordered_map<std::string, std::int32_t> vocab;
  {
    const std::string text = read_text(vocab_path);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(vocab_path.string() + ": not JSON (" + e.what() + ")");
    }
    if (!j.is_object() || j.empty())
      throw std::runtime_error(vocab_path.string() + ": expected an object of symbol -> id");
    for (const auto& [symbol, id] : j.items()) {
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
          id.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max() - 1)
        throw std::runtime_error(vocab_path.string() + ": the id of '" + symbol +
                                 "' is not an integer in [0, 2^31 - 1)");
      vocab.emplace(symbol, id.get<std::int32_t>());
    }
  }
  std::vector<std::pair<std::string, std::string>> merges;
  {
    const std::string text = read_text(merges_path);
    std::size_t pos = 0;
    for (int line_no = 1; pos < text.size(); ++line_no) {
      std::size_t eol = text.find('\n', pos);
      if (eol == std::string::npos) eol = text.size();
      std::string_view line(text.data() + pos, eol - pos);
      pos = eol + 1;
      if (line.ends_with('\r')) line.remove_suffix(1);
      if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
      const std::size_t space = line.find(' ');
      if (space == 0 || space == std::string_view::npos || space + 1 == line.size() ||
          line.find(' ', space + 1) != std::string_view::npos)
        throw std::runtime_error(merges_path.string() + ":" + std::to_string(line_no) +
                                 ": expected two symbols separated by one space");
      merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
    }
  }
  try {
    return bpe_tokenizer(vocab, merges);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(vocab_path.string() + ": " + e.what());
  }
}

std::vector<std::string> bpe_tokenizer::merge_piece(std::string_view piece) const {
  const auto& table = bytes_to_unicode();
  std::vector<std::string> word;
  word.reserve(piece.size());
  for (const char c : piece) word.push_back(table.symbol[static_cast<unsigned char>(c)]);
  while (word.size() > 1) {
    int best = INT_MAX;
    std::size_t at = 0;
    for (std::size_t i = 0; i + 1 < word.size(); ++i) {
      const auto it = merge_rank_.find(word[i] + " " + word[i + 1]);
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == INT_MAX) break;
    const std::string left = word[at], right = word[at + 1];
    std::vector<std::string> merged;
    merged.reserve(word.size());
    for (std::size_t i = 0; i < word.size(); ++i) {
      if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
        merged.push_back(left + right);
        ++i;
      } else {
        merged.push_back(word[i]);
      }
    }
    word = std::move(merged);
  }
  return word;
}

std::vector<std::int32_t> bpe_tokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  for (const std::string_view piece : gpt2_pretokenize(text)) {
    for (const std::string& symbol : merge_piece(piece)) {
      const auto it = ids_.find(symbol);
      if (it == ids_.end())
        throw std::runtime_error("bpe_tokenizer: the vocabulary has no id for the symbol '" +
                                 symbol + "'");
      out.push_back(it->second);
    }
  }
  return out;
}

std::string bpe_tokenizer::decode(std::int32_t token) const {
  if (token < 0 || token >= vocab_size_ || !known_[static_cast<std::size_t>(token)])
    throw std::runtime_error("bpe_tokenizer: token id " + std::to_string(token) +
                             " is not in the vocabulary");
  const std::string& symbol = symbols_[static_cast<std::size_t>(token)];
  const auto& table = bytes_to_unicode();
  std::string out;
  for (std::size_t i = 0; i < symbol.size();) {
    const auto [cp, len] = next_code_point(symbol, i);
    if (cp >= table.byte_of.size() || table.byte_of[cp] < 0)
      throw std::runtime_error("bpe_tokenizer: token id " + std::to_string(token) + " ('" + symbol +
                               "') is not made of byte symbols");
    out += static_cast<char>(table.byte_of[cp]);
    i += len;
  }
  return out;
}

std::string bpe_tokenizer::decode(std::span<const std::int32_t> tokens) const {
  std::string out;
  for (const std::int32_t t : tokens) out += decode(t);
  return out;
}

}  // namespace troupe::engine
