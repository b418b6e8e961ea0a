// token_corpus: an immutable sequence of uint16 tokens indexed 0..size()-1, either owned
// (a vector, e.g. tokenised text) or borrowed from one or more memory-mapped token shards
// laid end to end. Copies and slices share the storage (no token copying); every view keeps
// its storage alive. Reads that cross a shard boundary are handled by read().
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/data/token_shard.hpp"

namespace troupe::engine::data {

class token_corpus {
 public:
  token_corpus();  // empty corpus
  // Owns `tokens`; `source` names where they came from (used in error messages).
  token_corpus(std::vector<std::uint16_t> tokens, std::string source);
  // Borrows from the mapped shards, concatenated in the given order.
  explicit token_corpus(std::vector<token_shard> shards);

  std::int64_t size() const { return end_ - begin_; }
  bool empty() const { return size() == 0; }

  // Token at position i (0 <= i < size()); throws std::out_of_range otherwise.
  std::uint16_t at(std::int64_t i) const;
  // Copies tokens [offset, offset + count) into `out` widened to int32; throws
  // std::out_of_range if the range is not inside the corpus.
  void read(std::int64_t offset, std::int64_t count, std::int32_t* out) const;
  void read(std::int64_t offset, std::int64_t count, std::uint16_t* out) const;
  std::vector<std::uint16_t> to_vector() const;
  // The tokens as one span when the view lies within a single segment (always true for owned
  // and single-shard corpora); empty span otherwise (check size()).
  std::span<const std::uint16_t> contiguous() const;

  // View of tokens [begin, end) of this corpus, sharing storage.
  token_corpus slice(std::int64_t begin, std::int64_t end) const;

  // Largest token id present, or -1 for an empty corpus. Scans the tokens.
  std::int32_t vocab_max() const;
  // Throws std::runtime_error naming the file (and position) of the first token whose id is
  // >= vocab_size, e.g. "data/x.bin: token 50304 at index 17 is >= model vocab_size 50257".
  void check_vocab(std::int32_t vocab_size) const;

  // The file(s) backing this view, for messages: "a.bin" or "a.bin, b.bin (2 shards)".
  std::string source() const;
  // The file backing corpus position i.
  std::string source_of(std::int64_t i) const;

 private:
  struct storage;
  token_corpus(std::shared_ptr<const storage> st, std::int64_t begin, std::int64_t end);
  std::size_t segment_of(std::int64_t global) const;  // index into storage segments
  template <typename Out>
  void read_impl(std::int64_t offset, std::int64_t count, Out* out) const;

  std::shared_ptr<const storage> st_;
  std::int64_t begin_ = 0;  // in storage coordinates
  std::int64_t end_ = 0;
};

// Text corpus tokenised with the byte tokenizer. `path` is a regular file, or a directory:
// then every regular file directly in it (not symlinks, not subdirectories, not "*.dat") is
// read in byte-wise name order and the contents are joined with "\n". Throws if the path does
// not exist or a directory holds no usable file.
token_corpus load_text_corpus(const std::filesystem::path& path);

// Corpus from llm.c token shards concatenated in the given order (no globbing). Throws if the
// list is empty or any shard is invalid.
token_corpus load_shard_corpus(const std::filesystem::path& path);
token_corpus load_shard_corpus(const std::vector<std::filesystem::path>& paths);

struct corpus_split {
  token_corpus train;
  token_corpus val;
};

// val = the last round(size * val_fraction) tokens, train = everything before; both are views
// sharing `corpus`'s storage. Requires 0 <= val_fraction < 1. Whether each part is big enough
// for a given batch shape is checked by batch_sampler.
corpus_split split_validation(const token_corpus& corpus, double val_fraction);

}  // namespace troupe::engine::data
