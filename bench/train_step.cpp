// Troupe train-step benchmark. See train_step.hpp.
#include "bench/train_step.hpp"

#include <algorithm>
#include <chrono>
#include <vector>

#include "engine/model/random.hpp"
#include "engine/training/optimizer.hpp"

namespace troupe::bench {

train_step_result measure_troupe_train_step(const train_step_case& c) {
  using namespace troupe::engine;
  gpt_chunk model(c.model, chunk_range::whole(c.model));
  model.init_gpt2(1234);
  adamw_optimizer optimizer(model);
  optimizer_config oc;
  gpt_activations acts(model, c.batch, c.seq_len);
  const std::size_t n = static_cast<std::size_t>(c.batch) * c.seq_len;
  std::vector<std::int32_t> inputs(n), targets(n);
  for (std::size_t i = 0; i < n; ++i) {
    inputs[i] =
        static_cast<std::int32_t>(splitmix64(i) % static_cast<std::uint64_t>(c.model.vocab_size));
    targets[i] = static_cast<std::int32_t>(splitmix64(i + n) %
                                           static_cast<std::uint64_t>(c.model.vocab_size));
  }
  std::vector<double> times;
  for (int s = 0; s < c.warmup + c.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    chunk_forward(model, acts, inputs.data(), nullptr);
    chunk_loss_backward_start(model, acts, targets.data(), 1.0f);
    chunk_backward(model, acts, nullptr, nullptr);
    optimizer.step(model, oc, s, c.warmup + c.steps);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= c.warmup) times.push_back(dt);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  train_step_result r;
  r.step_ms_median = median * 1e3;
  r.tokens_per_s = double(n) / median;
  r.flops_per_s = r.tokens_per_s * c.model.train_flops_per_token(c.seq_len);
  r.parameters = c.model.parameter_count();
  return r;
}

}  // namespace troupe::bench
