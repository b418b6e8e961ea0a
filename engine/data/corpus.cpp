// token_corpus storage (owned vector or mapped shards), text/shard loaders and the split.
// Invariant: storage segments are laid end to end (segment k starts where k-1 ends), and a
// view [begin_, end_) always lies inside [0, total tokens of the storage].
#include "engine/data/corpus.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "engine/data/byte_tokenizer.hpp"

namespace troupe::engine::data {

struct token_corpus::storage {
  struct segment {
    std::span<const std::uint16_t> tokens;
    std::string name;
    std::int64_t start = 0;  // position of tokens[0] in the concatenation
  };
  std::vector<std::uint16_t> owned;
  std::vector<token_shard> shards;
  std::vector<segment> segments;
  std::int64_t total = 0;
};

token_corpus::token_corpus() : st_(std::make_shared<const storage>()) {}

token_corpus::token_corpus(std::vector<std::uint16_t> tokens, std::string source) {
  auto st = std::make_shared<storage>();
  st->owned = std::move(tokens);
  st->total = static_cast<std::int64_t>(st->owned.size());
  st->segments.push_back({std::span<const std::uint16_t>(st->owned), std::move(source), 0});
  end_ = st->total;
  st_ = std::move(st);
}

token_corpus::token_corpus(std::vector<token_shard> shards) {
  auto st = std::make_shared<storage>();
  st->shards = std::move(shards);
  for (const token_shard& s : st->shards) {
    st->segments.push_back({s.tokens(), s.path().string(), st->total});
    st->total += s.size();
  }
  end_ = st->total;
  st_ = std::move(st);
}

token_corpus::token_corpus(std::shared_ptr<const storage> st, std::int64_t begin, std::int64_t end)
    : st_(std::move(st)), begin_(begin), end_(end) {}

std::size_t token_corpus::segment_of(std::int64_t global) const {
  const auto& segs = st_->segments;
  // Last segment whose start <= global (empty segments are skipped by upper_bound semantics).
  auto it = std::upper_bound(segs.begin(), segs.end(), global,
                             [](std::int64_t g, const storage::segment& s) { return g < s.start; });
  std::size_t k = static_cast<std::size_t>(std::distance(segs.begin(), it)) - 1;
  return k;
}

std::uint16_t token_corpus::at(std::int64_t i) const {
  if (i < 0 || i >= size()) {
    throw std::out_of_range("token_corpus::at: index " + std::to_string(i) + " outside corpus of " +
                            std::to_string(size()) + " tokens");
  }
  const std::int64_t g = begin_ + i;
  const auto& seg = st_->segments[segment_of(g)];
  return seg.tokens[static_cast<std::size_t>(g - seg.start)];
}

template <typename Out>
void token_corpus::read_impl(std::int64_t offset, std::int64_t count, Out* out) const {
  if (offset < 0 || count < 0 || offset > size() || count > size() - offset) {
    throw std::out_of_range("token_corpus::read: range [" + std::to_string(offset) + ", " +
                            std::to_string(offset + count) + ") outside corpus of " +
                            std::to_string(size()) + " tokens (" + source() + ")");
  }
  if (count == 0) return;
  std::int64_t g = begin_ + offset;
  std::size_t k = segment_of(g);
  while (count > 0) {
    const auto& seg = st_->segments[k];
    const std::int64_t local = g - seg.start;
    const std::int64_t avail = static_cast<std::int64_t>(seg.tokens.size()) - local;
    const std::int64_t n = std::min(avail, count);
    const std::uint16_t* src = seg.tokens.data() + local;
    std::copy(src, src + n, out);
    out += n;
    g += n;
    count -= n;
    ++k;
  }
}

void token_corpus::read(std::int64_t offset, std::int64_t count, std::int32_t* out) const {
  read_impl(offset, count, out);
}

void token_corpus::read(std::int64_t offset, std::int64_t count, std::uint16_t* out) const {
  read_impl(offset, count, out);
}

std::vector<std::uint16_t> token_corpus::to_vector() const {
  std::vector<std::uint16_t> v(static_cast<std::size_t>(size()));
  read(0, size(), v.data());
  return v;
}

std::span<const std::uint16_t> token_corpus::contiguous() const {
  if (empty()) return {};
  const std::size_t k = segment_of(begin_);
  const auto& seg = st_->segments[k];
  const std::int64_t local = begin_ - seg.start;
  if (local + size() > static_cast<std::int64_t>(seg.tokens.size())) return {};
  return seg.tokens.subspan(static_cast<std::size_t>(local), static_cast<std::size_t>(size()));
}

token_corpus token_corpus::slice(std::int64_t begin, std::int64_t end) const {
  if (begin < 0 || end < begin || end > size()) {
    throw std::out_of_range("token_corpus::slice: [" + std::to_string(begin) + ", " +
                            std::to_string(end) + ") outside corpus of " + std::to_string(size()) +
                            " tokens");
  }
  return token_corpus(st_, begin_ + begin, begin_ + end);
}

std::int32_t token_corpus::vocab_max() const {
  std::int32_t best = -1;
  for (const auto& seg : st_->segments) {
    const std::int64_t lo = std::max(begin_, seg.start);
    const std::int64_t hi =
        std::min(end_, seg.start + static_cast<std::int64_t>(seg.tokens.size()));
    if (lo >= hi) continue;
    const std::uint16_t* p = seg.tokens.data() + (lo - seg.start);
    const std::uint16_t m = *std::max_element(p, p + (hi - lo));
    best = std::max(best, static_cast<std::int32_t>(m));
  }
  return best;
}

void token_corpus::check_vocab(std::int32_t vocab_size) const {
  for (const auto& seg : st_->segments) {
    const std::int64_t lo = std::max(begin_, seg.start);
    const std::int64_t hi =
        std::min(end_, seg.start + static_cast<std::int64_t>(seg.tokens.size()));
    for (std::int64_t g = lo; g < hi; ++g) {
      const std::int32_t id = seg.tokens[static_cast<std::size_t>(g - seg.start)];
      if (id >= vocab_size) {
        throw std::runtime_error(seg.name + ": token " + std::to_string(id) + " at index " +
                                 std::to_string(g - seg.start) + " is >= model vocab_size " +
                                 std::to_string(vocab_size));
      }
    }
  }
}

std::string token_corpus::source() const {
  std::vector<const std::string*> names;
  for (const auto& seg : st_->segments) {
    const std::int64_t seg_end = seg.start + static_cast<std::int64_t>(seg.tokens.size());
    const bool overlaps = seg.start < end_ && seg_end > begin_;
    if (overlaps || (begin_ == end_ && names.empty())) names.push_back(&seg.name);
  }
  if (names.empty()) return "<empty corpus>";
  if (names.size() == 1) return *names.front();
  return *names.front() + " .. " + *names.back() + " (" + std::to_string(names.size()) + " shards)";
}

std::string token_corpus::source_of(std::int64_t i) const {
  if (i < 0 || i >= size()) return source();
  return st_->segments[segment_of(begin_ + i)].name;
}

token_corpus load_text_corpus(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) {
    throw std::runtime_error(path.string() + ": text corpus not found");
  }

  std::vector<fs::path> files;
  if (fs::is_directory(status)) {
    for (const fs::directory_entry& e : fs::directory_iterator(path)) {
      if (e.is_symlink()) continue;  // e.g. fortunes' "name.u8" links
      if (!e.is_regular_file()) continue;
      if (e.path().extension() == ".dat") continue;  // strfile indexes
      files.push_back(e.path());
    }
    std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
      return a.filename().native() < b.filename().native();
    });
    if (files.empty()) {
      throw std::runtime_error(path.string() +
                               ": directory holds no regular text files (symlinks and *.dat are "
                               "skipped)");
    }
  } else if (fs::is_regular_file(status)) {
    files.push_back(path);
  } else {
    throw std::runtime_error(path.string() + ": not a regular file or directory");
  }

  std::string text;
  for (std::size_t k = 0; k < files.size(); ++k) {
    std::ifstream in(files[k], std::ios::binary);
    if (!in) throw std::runtime_error(files[k].string() + ": cannot open text file");
    if (k > 0) text.push_back('\n');
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) throw std::runtime_error(files[k].string() + ": read error");
  }
  return token_corpus(byte_tokenizer{}.encode(text), path.string());
}

token_corpus load_shard_corpus(const std::filesystem::path& path) {
  return load_shard_corpus(std::vector<std::filesystem::path>{path});
}

token_corpus load_shard_corpus(const std::vector<std::filesystem::path>& paths) {
  if (paths.empty()) throw std::runtime_error("load_shard_corpus: no shard files given");
  std::vector<token_shard> shards;
  shards.reserve(paths.size());
  for (const auto& p : paths) shards.emplace_back(p);
  return token_corpus(std::move(shards));
}

corpus_split split_validation(const token_corpus& corpus, double val_fraction) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
    throw std::runtime_error("split_validation: val_fraction " + std::to_string(val_fraction) +
                             " must be in [0, 1)");
  }
  const std::int64_t n = corpus.size();
  const auto n_val = std::min<std::int64_t>(
      n, static_cast<std::int64_t>(std::llround(static_cast<double>(n) * val_fraction)));
  return {corpus.slice(0, n - n_val), corpus.slice(n - n_val, n)};
}

}  // namespace troupe::engine::data
