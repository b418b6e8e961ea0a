// The single-process training loop. See trainer.hpp.
#include "engine/training/trainer.hpp"

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "engine/data/sampler.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/training/gpu_trainer.hpp"
#include "engine/training/run_lock.hpp"
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

namespace {

// What the serial loop needs of the model: the CPU stage (kernels/cpu) or the whole model on one
// GPU (gpu_trainer). Gradients accumulate across forward_backward calls until zero_grad.
class serial_model {
 public:
  virtual ~serial_model() = default;
  virtual void zero_grad() = 0;
  // One micro-batch; backward seeded with `seed` (loss scale / micro-batches). The mean loss.
  virtual double forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                                  float seed) = 0;
  virtual double evaluate(const std::int32_t* inputs, const std::int32_t* targets) = 0;
  // The global norm of the gradients as held (still carrying the loss scale).
  virtual double grad_norm() = 0;
  // AdamW on gradients unscaled by `unscale` and clipped by the unscaled `norm`; the lr.
  virtual double update(const optimizer_config& c, int step, int total_steps, double norm,
                        double unscale) = 0;
  virtual void save(const std::filesystem::path& file) = 0;
};

class cpu_model final : public serial_model {
 public:
  cpu_model(gpt_chunk model, const recipe& r)
      : model_(std::move(model)),
        optimizer_(model_),
        acts_(model_, r.batch.micro_batch, r.batch.seq_len,
              r.activation_checkpoint.full()
                  ? std::make_shared<block_scratch>(r.model, r.batch.micro_batch, r.batch.seq_len)
                  : nullptr) {}
  void zero_grad() override { model_.zero_grad(); }
  double forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                          float seed) override {
    chunk_forward(model_, acts_, inputs, nullptr);
    const double loss = chunk_loss_backward_start(model_, acts_, targets, seed).mean();
    chunk_backward(model_, acts_, nullptr, nullptr);
    return loss;
  }
  double evaluate(const std::int32_t* inputs, const std::int32_t* targets) override {
    chunk_forward(model_, acts_, inputs, nullptr);
    return chunk_loss(model_, acts_, targets).mean();
  }
  double grad_norm() override {
    const kernels::gradient_span all{model_.grads(), model_.parameter_count()};
    return kernels::global_grad_norm({&all, 1});
  }
  double update(const optimizer_config& c, int step, int total_steps, double norm,
                double unscale) override {
    return optimizer_.step_with_norm(model_, c, step, total_steps, norm, unscale).lr;
  }
  void save(const std::filesystem::path& file) override { save_hf_weights(model_, file); }

 private:
  gpt_chunk model_;
  adamw_optimizer optimizer_;
  gpt_activations acts_;
};

class gpu_model final : public serial_model {
 public:
  gpu_model(gpt_chunk host, const recipe& r)
      : host_(std::move(host)), gpu_(host_, r.batch.micro_batch, r.batch.seq_len, gpu_options(r)) {}
  void zero_grad() override { gpu_.zero_grad(); }
  double forward_backward(const std::int32_t* inputs, const std::int32_t* targets,
                          float seed) override {
    return gpu_.forward_backward(inputs, targets, seed);
  }
  double evaluate(const std::int32_t* inputs, const std::int32_t* targets) override {
    return gpu_.evaluate(inputs, targets);
  }
  double grad_norm() override { return std::sqrt(gpu_.grad_square_sum()); }
  double update(const optimizer_config& c, int step, int total_steps, double norm,
                double unscale) override {
    return gpu_.update(c, step, total_steps, unscale * clip_coefficient(norm, c.grad_clip));
  }
  void save(const std::filesystem::path& file) override {
    gpu_.copy_parameters_to(host_);
    save_hf_weights(host_, file);
  }
  const gpu_trainer& trainer() const { return gpu_; }

 private:
  gpt_chunk host_;  // the initial weights, then the copy that is saved
  gpu_trainer gpu_;
};

}  // namespace

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
  gpt_chunk weights(r.model, chunk_range::whole(r.model));
  if (r.init.empty()) {
    weights.init_gpt2(seed);
  } else {
    try {
      load_hf_weights(weights, r.init);
    } catch (const std::exception& e) {
      throw recipe_error(std::string("key init: ") + e.what());
    }
  }
  // The step's micro-batches over every replica and pipeline pass: the same step as the actor
  // engine's on any layout, on one stage.
  const int B = r.batch.micro_batch, T = r.batch.seq_len, accum = r.micro_batches_per_step();
  std::unique_ptr<serial_model> model;
  if (r.device == "cuda") {
    auto gpu = std::make_unique<gpu_model>(std::move(weights), r);
    say("device: " + gpu->trainer().device_name() + ", " + r.precision.dtype + " compute, " +
        std::to_string(gpu->trainer().device_bytes() >> 20) + " MiB allocated");
    model = std::move(gpu);
  } else {
    model = std::make_unique<cpu_model>(std::move(weights), r);
  }
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(B) * T), targets(inputs.size());

  // 2. Outputs, in a directory no other job holds (run_lock.hpp).
  run_lock_options lock_options;
  lock_options.notice = say;
  const run_lock lock({{r.output.dir, "output.dir"}}, lock_options);
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
      sum += model->evaluate(inputs.data(), targets.data());
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
    model->zero_grad();
    const double scale = guard.loss_scale();
    const float seed = static_cast<float>(scale) / float(accum);
    double loss_sum = 0;
    for (int a = 0; a < accum; ++a) {
      train_sampler.fill(std::int64_t{s} * accum + a, inputs.data(), targets.data());
      loss_sum += model->forward_backward(inputs.data(), targets.data(), seed);
    }
    // The guard decides on the unscaled norm (exact for the power-of-two scales of dynamic loss
    // scaling) whether the update applies; the optimizer unscales the gradients as it clips.
    const double norm = model->grad_norm() / scale;
    const guard_decision decision = guard.decide(loss_sum / accum, norm);
    double lr = learning_rate(r.optimizer, s, r.steps);
    if (decision.apply) lr = model->update(r.optimizer, s, r.steps, norm, 1.0 / scale);
    const auto t1 = clock_type::now();
    const double step_s = std::chrono::duration<double>(t1 - t0).count();
    const std::int64_t step_tokens = std::int64_t{B} * T * accum;
    tokens += step_tokens;

    step_metrics m;
    m.step = s + 1;
    m.total_steps = r.steps;
    m.loss = loss_sum / accum;
    m.lr = lr;
    m.grad_norm = norm;
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
    model->save(w);
    say("wrote " + w.string());
  }
  return summary;
}

}  // namespace troupe::engine
