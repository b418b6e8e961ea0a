// JSONL metrics and corpus statistics. See metrics.hpp.
#include "engine/training/metrics.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

namespace troupe::engine {

namespace {

// The lines of `path` (none when the file does not exist): those of steps after `step`, and the
// others.
struct split_lines {
  std::string kept, later;
};
split_lines lines_through(const std::filesystem::path& path, int step) {
  std::ifstream in(path);
  split_lines out;
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // a last line without its newline is torn (a crash in it): dropped
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool later = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                       j["step"].get<int>() > step;
    (later ? out.later : out.kept) += line + "\n";
  }
  return out;
}

// Writes text to path through a temporary name (path is whole or untouched).
void write_whole(const std::filesystem::path& path, const std::string& text) {
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw std::runtime_error(tmp.string() + ": cannot write");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw std::runtime_error(path.string() + ": cannot write: " + ec.message());
}

}  // namespace

std::string set_aside_name(const std::filesystem::path& dir, int step, const std::string& prefix) {
  char when[32] = "";
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(when, sizeof when, "%Y%m%dT%H%M%SZ", &utc);
  char steps[16];
  std::snprintf(steps, sizeof steps, "%08d", step);
  const std::string base = prefix + "set-aside-" + steps + "-" + when;
  std::string name = base;
  std::error_code ec;
  for (int n = 2; std::filesystem::exists(dir / name, ec); ++n)
    name = base + "-" + std::to_string(n);
  return name;
}

jsonl_writer::jsonl_writer(const std::filesystem::path& path, int keep_through_step) : path_(path) {
  if (keep_through_step >= 0) {
    const auto lines = lines_through(path, keep_through_step);
    if (!lines.later.empty()) {
      const auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
      set_aside_ = dir / set_aside_name(dir, keep_through_step, path.filename().string() + ".");
      write_whole(set_aside_, lines.later);
    }
    write_whole(path, lines.kept);
  }
  fd_ = ::open(path.c_str(),
               O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (keep_through_step >= 0 ? 0 : O_TRUNC),
               0644);
  if (fd_ < 0)
    throw std::runtime_error(path.string() + ": cannot open for writing: " + std::strerror(errno));
}

jsonl_writer::~jsonl_writer() {
  if (fd_ >= 0) ::close(fd_);
}

void jsonl_writer::append(const std::string& text) {
  // One write(2) of the whole text: a kill leaves all of it or none. A short write (file size
  // limit, full disk) is followed by one for the rest, which says why it stopped, and is cut off
  // again, so the file still ends at a whole line.
  struct stat st {};
  const off_t before = ::fstat(fd_, &st) == 0 ? st.st_size : -1;
  std::size_t done = 0;
  errno = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  if (done == text.size()) return;
  const std::string why = errno != 0 ? std::strerror(errno) : "nothing written";
  if (done > 0 && before >= 0) {
    [[maybe_unused]] const int rc = ::ftruncate(fd_, before);
  }
  throw std::runtime_error(path_.string() + ": write failed: " + why);
}

void jsonl_writer::write(const step_metrics& m, const std::vector<recipe_change>& changes) {
  nlohmann::json j = {
      {"step", m.step},
      {"loss", m.loss},
      {"lr", m.lr},
      {"grad_norm", m.grad_norm},
      {"tokens_per_s", m.tokens_per_s},
      {"step_ms", m.step_ms},
      {"elapsed_s", m.elapsed_s},
      {"tokens", m.tokens},
      {"flops_per_s", m.flops_per_s},
  };
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  if (!m.skipped.empty()) j["skipped"] = m.skipped;
  if (m.loss_scale) j["loss_scale"] = *m.loss_scale;
  for (const auto& c : changes)
    j["recipe_changes"].push_back(
        {{"step", c.step}, {"key", c.key}, {"from", c.from}, {"to", c.to}});
  for (const auto& r : m.memory)
    j["memory"].push_back({{"replica", r.replica},
                           {"rank", r.rank},
                           {"parameters", r.parameters},
                           {"gradients", r.gradients},
                           {"optimizer", r.optimizer},
                           {"buffers", r.buffers},
                           {"pooled", r.pooled},
                           {"activations", r.activations}});
  append(j.dump() + "\n");
}

double unigram_entropy(const data::token_corpus& corpus, int vocab_size) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(vocab_size), 0);
  const std::int64_t n = corpus.size();
  std::vector<std::uint16_t> chunk(1 << 16);
  for (std::int64_t off = 0; off < n; off += static_cast<std::int64_t>(chunk.size())) {
    const std::int64_t k = std::min<std::int64_t>(static_cast<std::int64_t>(chunk.size()), n - off);
    corpus.read(off, k, chunk.data());
    for (std::int64_t i = 0; i < k; ++i) {
      if (chunk[static_cast<std::size_t>(i)] < vocab_size)
        ++counts[chunk[static_cast<std::size_t>(i)]];
    }
  }
  double h = 0;
  for (auto c : counts) {
    if (c == 0) continue;
    const double p = double(c) / double(n);
    h -= p * std::log(p);
  }
  return h;
}

}  // namespace troupe::engine
