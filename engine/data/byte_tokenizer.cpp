// Byte-level tokenizer implementation (see byte_tokenizer.hpp).
// Invariant: token id == unsigned byte value, so the mapping is a bijection on [0, 256).
#include "engine/data/byte_tokenizer.hpp"

#include <stdexcept>

namespace troupe::engine::data {

namespace {

template <typename Id>
std::string decode_ids(std::span<const Id> tokens) {
  std::string out;
  out.resize(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const auto id = static_cast<std::int64_t>(tokens[i]);
    if (id < 0 || id >= byte_tokenizer::vocab_size) {
      throw std::runtime_error("byte_tokenizer: token id " + std::to_string(id) + " at position " +
                               std::to_string(i) + " is outside the byte vocabulary [0, 256)");
    }
    out[i] = static_cast<char>(static_cast<unsigned char>(id));
  }
  return out;
}

}  // namespace

std::vector<std::uint16_t> byte_tokenizer::encode(std::string_view text) const {
  std::vector<std::uint16_t> out(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    out[i] = static_cast<std::uint16_t>(static_cast<unsigned char>(text[i]));
  }
  return out;
}

std::string byte_tokenizer::decode(std::span<const std::uint16_t> tokens) const {
  return decode_ids(tokens);
}

std::string byte_tokenizer::decode(std::span<const std::int32_t> tokens) const {
  return decode_ids(tokens);
}

}  // namespace troupe::engine::data
