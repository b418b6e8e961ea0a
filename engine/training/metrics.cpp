// JSONL metrics and corpus statistics. See metrics.hpp.
#include "engine/training/metrics.hpp"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

namespace troupe::engine {

namespace {

// The lines of `path` whose "step" is at most `step` (none when the file does not exist).
std::string lines_through(const std::filesystem::path& path, int step) {
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int>() <= step)
      kept += line + "\n";
  }
  return kept;
}

}  // namespace

jsonl_writer::jsonl_writer(const std::filesystem::path& path, int keep_through_step) : path_(path) {
  const std::string kept = keep_through_step >= 0 ? lines_through(path, keep_through_step) : "";
  out_.open(path, std::ios::trunc);
  if (!out_) throw std::runtime_error(path.string() + ": cannot open for writing");
  out_ << kept;
  out_.flush();
}

void jsonl_writer::write(const step_metrics& m) {
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
  for (const auto& r : m.memory)
    j["memory"].push_back({{"replica", r.replica},
                           {"rank", r.rank},
                           {"parameters", r.parameters},
                           {"gradients", r.gradients},
                           {"optimizer", r.optimizer},
                           {"buffers", r.buffers},
                           {"pooled", r.pooled},
                           {"activations", r.activations}});
  out_ << j.dump() << '\n';
  out_.flush();
  if (!out_) throw std::runtime_error(path_.string() + ": write failed");
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
