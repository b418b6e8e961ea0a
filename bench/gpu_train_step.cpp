// See gpu_train_step.hpp.
#include "bench/gpu_train_step.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "bench/peer_process.hpp"
#include "engine/gpu_trainer.hpp"
#include "engine/random.hpp"

namespace troupe::bench {
namespace {

using nlohmann::json;

// Dense peaks of an H100/H200 SXM (the vendor's datasheet): bf16 tensor cores, and plain fp32.
constexpr double kPeakBf16 = 989e12;
constexpr double kPeakFp32 = 67e12;

engine::gpt_config gpt2_small(const gpu_train_step_options& o) {
  return engine::gpt_config{50257, 50304, 1024, o.layers, 12, 768};
}

json measure_troupe(const gpu_train_step_options& o) {
  const auto config = gpt2_small(o);
  engine::gpu_trainer trainer(
      config, o.batch, o.seq_len,
      o.dtype == "bf16" ? engine::compute_dtype::bf16 : engine::compute_dtype::fp32, 1234);
  const std::size_t n = static_cast<std::size_t>(o.batch) * static_cast<std::size_t>(o.seq_len);
  std::vector<std::vector<std::int32_t>> batches(4, std::vector<std::int32_t>(n + 1));
  for (std::size_t b = 0; b < batches.size(); ++b)
    for (std::size_t i = 0; i <= n; ++i)
      batches[b][i] = static_cast<std::int32_t>(engine::splitmix64(b * (n + 1) + i) % 50257);
  engine::optimizer_config oc;
  oc.lr = 1e-4f;
  oc.warmup_steps = 0;
  oc.decay = "constant";
  std::vector<double> times;
  double loss = 0;
  const int total = o.warmup + o.steps;
  for (int s = 0; s < total; ++s) {
    const auto& b = batches[static_cast<std::size_t>(s) % batches.size()];
    const auto t0 = std::chrono::steady_clock::now();
    loss = trainer.train_step(b.data(), b.data() + 1, oc, s, total).loss;
    trainer.synchronize();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= o.warmup) times.push_back(dt);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  return {{"tokens_per_s", double(n) / median}, {"step_ms_median", median * 1e3},
          {"step_ms_min", times.front() * 1e3}, {"last_loss", loss},
          {"device", trainer.device_name()},    {"device_bytes", trainer.device_bytes()}};
}

std::optional<json> measure_peer(const gpu_train_step_options& o, bool compile) {
  char cmd[1024];
  std::snprintf(cmd, sizeof cmd,
                "'%s' '" TROUPE_SOURCE_DIR
                "/bench/pytorch_train_step.py' --device cuda --dtype %s%s --layers %d --heads 12 "
                "--width 768 --vocab 50257 --context 1024 --batch %d --seq %d --steps %d "
                "--warmup %d",
                o.python.c_str(), o.dtype.c_str(), compile ? " --compile" : "", o.layers, o.batch,
                o.seq_len, o.steps, o.warmup + (compile ? 3 : 0));
  auto out = capture_command(cmd);
  if (!out) return std::nullopt;
  return last_json_object(*out);
}

}  // namespace

int run_gpu_train_step_bench(const gpu_train_step_options& o) {
  std::string why;
  if (!engine::cuda_training_available(&why)) {
    std::fprintf(stderr, "troupe bench train-step --device cuda: %s\n", why.c_str());
    return 1;
  }
  if (o.dtype != "bf16" && o.dtype != "fp32") {
    std::fprintf(stderr, "troupe bench train-step: --dtype %s: expected bf16 or fp32\n",
                 o.dtype.c_str());
    return 2;
  }
  const auto config = gpt2_small(o);
  const double flops_per_token = config.train_flops_per_token(o.seq_len);
  const double peak = o.dtype == "bf16" ? kPeakBf16 : kPeakFp32;
  json report = {{"model", "gpt2-small"},   {"layers", o.layers},
                 {"batch", o.batch},        {"seq_len", o.seq_len},
                 {"dtype", o.dtype},        {"flops_per_token", flops_per_token},
                 {"peak_flops_per_s", peak}};
  json troupe;
  try {
    troupe = measure_troupe(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe bench train-step --device cuda: %s\n", e.what());
    return 1;
  }
  const double mine = troupe["tokens_per_s"].get<double>();
  troupe["mfu"] = mine * flops_per_token / peak;
  report["troupe"] = troupe;
  report["peers"] = json::array();
  if (!o.no_peer) {
    for (const bool compile : {false, true}) {
      auto peer = measure_peer(o, compile);
      json entry = {{"name", compile ? "torch.compile" : "torch eager"}};
      if (peer && peer->contains("tokens_per_s")) {
        const double tps = (*peer)["tokens_per_s"].get<double>();
        entry["result"] = *peer;
        entry["tokens_per_s"] = tps;
        entry["mfu"] = tps * flops_per_token / peak;
        entry["ratio"] = mine / tps;
      } else {
        entry["error"] = "the peer did not run (is torch with CUDA in " + o.python + "?)";
      }
      report["peers"].push_back(entry);
    }
  }
  if (o.json_output) {
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }
  std::printf("GPT-2 small shape, %d layers, B=%d T=%d, %s, on %s; MFU against %.0f TFLOP/s\n",
              o.layers, o.batch, o.seq_len, o.dtype.c_str(),
              troupe["device"].get<std::string>().c_str(), peak / 1e12);
  std::printf("%-16s %14s %10s %7s %8s\n", "run", "tokens/s", "step ms", "MFU", "troupe/x");
  std::printf("%-16s %14.0f %10.2f %6.1f%% %8s\n", "troupe", mine,
              troupe["step_ms_median"].get<double>(), 100 * troupe["mfu"].get<double>(), "");
  for (const auto& p : report["peers"]) {
    if (p.contains("tokens_per_s")) {
      std::printf("%-16s %14.0f %10.2f %6.1f%% %7.2fx\n", p["name"].get<std::string>().c_str(),
                  p["tokens_per_s"].get<double>(), p["result"]["step_ms_median"].get<double>(),
                  100 * p["mfu"].get<double>(), p["ratio"].get<double>());
    } else {
      std::printf("%-16s %s\n", p["name"].get<std::string>().c_str(),
                  p["error"].get<std::string>().c_str());
    }
  }
  return 0;
}

}  // namespace troupe::bench
