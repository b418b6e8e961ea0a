// Per-step training metrics, their JSONL form, and the arithmetic behind them (throughput,
// model FLOPs utilisation, corpus unigram entropy).
// Invariants: one JSON object per line, each written whole by one write(2) to an O_APPEND
// descriptor (a line a failed write left short is cut off again), so a crash or a kill loses at
// most the step in progress, never leaves part of a line; field names are stable (docs/train.md
// lists them).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "engine/data/corpus.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::engine {

// Memory one (replica, pipeline rank) holds at the end of a step, as measured by the actors that
// hold it (bytes). Model state = parameters + gradients + optimizer.
struct memory_report {
  int replica = 0, rank = 0;
  std::int64_t parameters = 0;   // parameter buffers
  std::int64_t gradients = 0;    // gradients kept across the step (full, or a ZeRO shard)
  std::int64_t optimizer = 0;    // AdamW moments
  std::int64_t buffers = 0;      // temporary: resident pages of a released gradient-accumulation
                                 // buffer, collective chunks in flight
  std::int64_t pooled = 0;       // freed pages kept for reuse (engine::page_pool), not returned
  std::int64_t activations = 0;  // every micro-batch's activations the rank allocated (in flight
                                 // or pooled) and the checkpointing scratch
  std::int64_t model_state() const { return parameters + gradients + optimizer; }
};

struct step_metrics {
  int step = 0;  // 1-based: steps completed
  int total_steps = 0;
  double loss = 0;  // mean over the step's micro-batches
  std::optional<double> val_loss;
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double tokens_per_s = 0;
  double step_ms = 0;
  double elapsed_s = 0;               // since training began
  std::int64_t tokens = 0;            // tokens processed so far
  double flops_per_s = 0;             // model FLOPs (6N + attention) per second
  std::vector<memory_report> memory;  // actor engine: every (replica, rank), replica-major
  std::string skipped;                // why the update was skipped (update_guard); "" = applied
  std::optional<double> loss_scale;   // dynamic loss scaling: the scale the step carried
};

class jsonl_writer {
 public:
  // Truncates; throws naming the file. keep_through_step >= 0 (a resumed run): the file's lines
  // of steps up to it stay, and its later lines (trained again) are kept aside, never lost, in
  // a file beside it, PATH.set-aside-<step>-<UTC time> (set_aside()), written before PATH is
  // replaced. A torn last line (no newline: a crash in the middle of it) is dropped.
  explicit jsonl_writer(const std::filesystem::path& path, int keep_through_step = -1);
  ~jsonl_writer();
  jsonl_writer(const jsonl_writer&) = delete;
  jsonl_writer& operator=(const jsonl_writer&) = delete;
  // Appends one step's line; throws naming the file when it cannot (the file then still ends at
  // a whole line). `changes` (the first step after a resume that changed trajectory keys with
  // --allow-change) go into it as "recipe_changes": [{"step", "key", "from", "to"}, ...].
  void write(const step_metrics& m, const std::vector<recipe_change>& changes = {});
  // The file the later lines went to; empty when there were none.
  const std::filesystem::path& set_aside() const { return set_aside_; }

 private:
  void append(const std::string& text);
  std::filesystem::path path_, set_aside_;
  int fd_ = -1;
};

// A name under dir not taken yet: PREFIX + "set-aside-<step, 8 digits>-<UTC time>", with "-2",
// "-3", ... added where it is.
std::string set_aside_name(const std::filesystem::path& dir, int step,
                           const std::string& prefix = "");

// Shannon entropy of the corpus's token frequencies, in nats per token: the loss of the best
// model that ignores context. A trained model must end well below it.
double unigram_entropy(const data::token_corpus& corpus, int vocab_size);

}  // namespace troupe::engine
