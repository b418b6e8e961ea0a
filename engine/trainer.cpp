// The single-process training loop. See trainer.hpp.
#include "engine/trainer.hpp"

#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/data/sampler.hpp"
#include "engine/gpt_weights.hpp"
#include "kernels/cpu_ops.hpp"

namespace troupe::engine {
namespace {

using clock_type = std::chrono::steady_clock;

data::token_corpus load_corpus(const data_config& d, const std::string& path) {
  if (d.format == "text") return data::load_text_corpus(path);
  return data::load_shard_corpus(std::filesystem::path(path));
}

}  // namespace

training_data load_training_data(const recipe& r) {
  training_data out;
  if (!r.data.val.empty()) {
    try {
      out.val = load_corpus(r.data, r.data.val);
      out.val.check_vocab(r.model.vocab_size);
    } catch (const std::exception& e) {
      throw recipe_error(std::string("key data.val: ") + e.what());
    }
  }
  try {
    data::token_corpus all = load_corpus(r.data, r.data.train);
    all.check_vocab(r.model.vocab_size);
    if (!r.data.val.empty()) {
      out.train = all;
    } else if (r.data.val_fraction > 0) {
      auto split = data::split_validation(all, r.data.val_fraction);
      out.train = split.train;
      out.val = split.val;
    } else {
      out.train = all;
    }
  } catch (const recipe_error&) {
    throw;
  } catch (const std::exception& e) {
    throw recipe_error(std::string("key data.train: ") + e.what());
  }
  return out;
}

data::batch_sampler make_batch_sampler(const data::token_corpus& corpus, const recipe& r,
                                       data::sample_order order, int T, const char* key) {
  data::sampler_config sc;
  sc.B = r.batch.micro_batch;
  sc.T = T;
  const auto seed = static_cast<std::uint64_t>(r.seed);
  sc.order = order;
  sc.seed = seed;
  try {
    return data::batch_sampler(corpus, sc);
  } catch (const std::exception& e) {
    throw recipe_error(std::string("key ") + key + ": " + e.what());
  }
}

train_summary train(const recipe& r, const train_callbacks& cb) {
  auto say = [&](const std::string& s) {
    if (cb.on_message) cb.on_message(s);
  };
  // 1. Everything that can fail on bad input, before anything is written.
  training_data ds = load_training_data(r);
  const auto seed = static_cast<std::uint64_t>(r.seed);
  data::batch_sampler train_sampler = make_batch_sampler(
      ds.train, r, data::parse_sample_order(r.data.order), r.batch.seq_len, "data.train");
  std::optional<data::batch_sampler> val_sampler;
  if (!ds.val.empty() && r.eval_interval > 0) {
    val_sampler.emplace(
        make_batch_sampler(ds.val, r, data::sample_order::sequential, r.batch.seq_len, "data.val"));
  }
  gpt_stage model(r.model, stage_range::whole(r.model));
  if (r.init.empty()) {
    model.init_gpt2(seed);
  } else {
    try {
      load_hf_weights(model, r.init);
    } catch (const std::exception& e) {
      throw recipe_error(std::string("key init: ") + e.what());
    }
  }
  adamw_optimizer optimizer(model);
  const int B = r.batch.micro_batch, T = r.batch.seq_len, accum = r.batch.grad_accum;
  gpt_activations acts(
      model, B, T,
      r.activation_checkpoint.full() ? std::make_shared<block_scratch>(r.model, B, T) : nullptr);
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(B) * T), targets(inputs.size());

  // 2. Outputs.
  std::error_code ec;
  std::filesystem::create_directories(r.output.dir, ec);
  if (ec) throw recipe_error("key output.dir: cannot create " + r.output.dir + ": " + ec.message());
  jsonl_writer metrics(r.metrics_path());

  train_summary summary;
  summary.parameters = r.model.parameter_count();
  summary.unigram_entropy = unigram_entropy(ds.train, r.model.vocab_size);
  summary.final_val_loss = std::numeric_limits<double>::quiet_NaN();
  say("model: " + std::to_string(summary.parameters) + " parameters; train corpus " +
      std::to_string(ds.train.size()) + " tokens, validation " + std::to_string(ds.val.size()) +
      " tokens; unigram entropy " + std::to_string(summary.unigram_entropy) + " nats/token");

  auto evaluate = [&]() {
    double sum = 0;
    int n = 0;
    for (int j = 0; j < r.eval_batches; ++j) {
      val_sampler->fill(j, inputs.data(), targets.data());
      stage_forward(model, acts, inputs.data(), nullptr);
      sum += stage_loss(model, acts, targets.data()).mean();
      ++n;
    }
    return sum / n;
  };

  const auto start = clock_type::now();
  const double flops_per_token = r.model.train_flops_per_token(T);
  std::int64_t tokens = 0;
  update_guard guard(r.guard, r.precision.scaling());
  for (int s = 0; s < r.steps; ++s) {
    const auto t0 = clock_type::now();
    model.zero_grad();
    const double scale = guard.loss_scale();
    const float seed = static_cast<float>(scale) / float(accum);
    double loss_sum = 0;
    for (int a = 0; a < accum; ++a) {
      train_sampler.fill(std::int64_t{s} * accum + a, inputs.data(), targets.data());
      stage_forward(model, acts, inputs.data(), nullptr);
      loss_sum += stage_loss_backward_start(model, acts, targets.data(), seed).mean();
      stage_backward(model, acts, nullptr, nullptr);
    }
    // The guard decides on the unscaled norm (exact for the power-of-two scales of dynamic loss
    // scaling) whether the update applies; the optimizer unscales the gradients as it clips.
    const kernels::gradient_span all{model.grads(), model.parameter_count()};
    const double norm = kernels::global_grad_norm({&all, 1}) / scale;
    const guard_decision decision = guard.decide(loss_sum / accum, norm);
    adamw_optimizer::step_result opt{norm, learning_rate(r.optimizer, s, r.steps)};
    if (decision.apply)
      opt = optimizer.step_with_norm(model, r.optimizer, s, r.steps, norm, 1.0 / scale);
    const auto t1 = clock_type::now();
    const double step_s = std::chrono::duration<double>(t1 - t0).count();
    const std::int64_t step_tokens = std::int64_t{B} * T * accum;
    tokens += step_tokens;

    step_metrics m;
    m.step = s + 1;
    m.total_steps = r.steps;
    m.loss = loss_sum / accum;
    m.lr = opt.lr;
    m.grad_norm = opt.grad_norm;
    m.step_ms = step_s * 1e3;
    m.tokens_per_s = double(step_tokens) / step_s;
    m.flops_per_s = m.tokens_per_s * flops_per_token;
    m.tokens = tokens;
    const bool last = s + 1 == r.steps;
    if (val_sampler && ((s + 1) % r.eval_interval == 0 || last)) {
      m.val_loss = evaluate();
      summary.final_val_loss = *m.val_loss;
    }
    m.elapsed_s = std::chrono::duration<double>(clock_type::now() - start).count();
    m.skipped = decision.skipped;
    if (r.precision.scaling().dynamic) m.loss_scale = decision.loss_scale;
    metrics.write(m);
    if (cb.on_step) cb.on_step(m);
    if (decision.stop) throw std::runtime_error(stop_message(s + 1, decision));
    summary.final_loss = m.loss;
    summary.steps = s + 1;
  }
  summary.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  summary.tokens_per_s = double(tokens) / summary.seconds;
  if (const auto w = r.weights_path(); !w.empty()) {
    save_hf_weights(model, w);
    say("wrote " + w.string());
  }
  return summary;
}

}  // namespace troupe::engine
