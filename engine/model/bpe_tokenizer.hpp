// GPT-2's byte-level BPE tokenizer, read from a Hugging Face tokenizer directory: vocab.json
// (symbol -> id) and merges.txt (one "left right" pair a line, highest priority first; an
// optional "#version" first line). `troupe sample --tokenizer DIR` uses it for models whose
// vocabulary is not the 256 bytes of engine/data/byte_tokenizer.hpp.
//
// How it encodes (as OpenAI's encoder.py and Hugging Face's GPT2Tokenizer): the text is split
// into pieces by GPT-2's pattern ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
// \s+(?!\S)|\s+); each piece's bytes become printable symbols (bytes_to_unicode); the adjacent
// pair whose merge comes first in merges.txt is joined, everywhere in the piece, until no pair
// has a merge; each final symbol is looked up in vocab.json.
//
// Invariants:
//  - decode(encode(s)) == s for every byte string s whose symbols the vocabulary holds (every
//    single byte's symbol is in GPT-2's vocabulary, so for GPT-2: every s).
//  - The split is exact for ASCII text. Outside ASCII, letters and numbers are told apart by the
//    C library's Unicode tables (C.UTF-8), which count non-Latin digits, letter-like numbers
//    and some combining marks as letters and some numbers (², ½) as neither: there the pieces,
//    and so the tokens, can differ from GPT-2's, but the round trip holds.
//  - Loading refuses, naming the file and line, anything it cannot read as this format.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace troupe::engine {

class bpe_tokenizer {
 public:
  // vocab: symbol -> id (ids distinct, >= 0); merges: in priority order. Throws
  // std::invalid_argument on a repeated id or a negative one.
  bpe_tokenizer(const std::unordered_map<std::string, std::int32_t>& vocab,
                const std::vector<std::pair<std::string, std::string>>& merges);

  // Reads dir/vocab.json and dir/merges.txt; throws std::runtime_error naming the file.
  static bpe_tokenizer load(const std::filesystem::path& dir);

  // One more than the largest id.
  std::int32_t vocab_size() const { return vocab_size_; }

  // Throws std::runtime_error naming the symbol when the vocabulary has no id for it.
  std::vector<std::int32_t> encode(std::string_view text) const;
  // Throws std::runtime_error naming an id the vocabulary does not hold.
  std::string decode(std::span<const std::int32_t> tokens) const;
  std::string decode(std::int32_t token) const;

 private:
  std::vector<std::string> merge_piece(std::string_view piece) const;

  std::unordered_map<std::string, std::int32_t> ids_;
  std::vector<std::string> symbols_;                 // by id; "" for ids not in the vocabulary
  std::vector<bool> known_;                          // by id
  std::unordered_map<std::string, int> merge_rank_;  // "left right" -> priority (0 first)
  std::int32_t vocab_size_ = 0;
};

// GPT-2's pre-tokenizer: the pieces of text (UTF-8; a malformed byte counts as one symbol that
// is neither a letter, a number nor a space). Their concatenation is the text.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

}  // namespace troupe::engine
