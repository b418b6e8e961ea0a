// Byte-level tokenizer: every byte of UTF-8 (or any) text is one token, vocab size 256.
// Invariants: encode is total and lossless; decode(encode(s)) == s for every s;
// decode rejects ids >= 256 with a std::runtime_error naming the id and its position.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::engine::data {

class byte_tokenizer {
 public:
  static constexpr std::int32_t vocab_size = 256;

  // Each byte becomes its own token id (0..255).
  std::vector<std::uint16_t> encode(std::string_view text) const;

  // Inverse of encode. Throws std::runtime_error for any id >= 256.
  std::string decode(std::span<const std::uint16_t> tokens) const;
  std::string decode(std::span<const std::int32_t> tokens) const;
};

}  // namespace troupe::engine::data
