// The single-process training loop (no actors): data -> forward -> loss -> backward ->
// clip -> AdamW, gradient accumulation, periodic validation, metrics, final weights.
// Invariants: every input is loaded and checked before anything is written (a bad corpus or
// init fails with recipe_error and no output); micro-batch i of step s is sampler index
// s * grad_accum + a, so runs are reproducible and replayable from the recipe alone.
#pragma once

#include <functional>
#include <string>

#include "engine/data/sampler.hpp"
#include "engine/training/metrics.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::engine {

struct train_callbacks {
  std::function<void(const step_metrics&)> on_step;    // after every step
  std::function<void(const std::string&)> on_message;  // one-off lines (start, summary)
};

struct train_summary {
  int steps = 0;
  double final_loss = 0;
  double final_val_loss = 0;   // NaN when no validation ran
  double unigram_entropy = 0;  // of the training corpus, nats per token
  double seconds = 0;
  double tokens_per_s = 0;  // over the whole run
  std::int64_t parameters = 0;
};

// The serial reference loop: one whole-model stage, grad_accum micro-batches per step. The
// actor engine (actors/pipeline_run.hpp) must match it step for step.
train_summary train(const recipe& r, const train_callbacks& callbacks);

// Shared by both engines: the corpora of a recipe (recipe_error naming data.train / data.val)
// and a sampler over one of them with sequence length T.
struct training_data {
  data::token_corpus train, val;
};
training_data load_training_data(const recipe& r);
data::batch_sampler make_batch_sampler(const data::token_corpus& corpus, const recipe& r,
                                       data::sample_order order, int T, const char* key);

}  // namespace troupe::engine
