// See gpu_train_step.hpp.
#include "bench/gpu_train_step.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <vector>

#include "bench/peer_process.hpp"
#include "engine/model/random.hpp"
#include "engine/training/gpu_trainer.hpp"

namespace troupe::bench {
namespace {

using nlohmann::json;

// Dense peaks of an H100/H200 SXM (the vendor's datasheet): bf16 tensor cores, and plain fp32.
constexpr double kPeakBf16 = 989e12;
constexpr double kPeakFp32 = 67e12;
constexpr int kBreakdownSteps = 5;

engine::gpt_config gpt2_small(const gpu_train_step_options& o) {
  return engine::gpt_config{50257, 50304, 1024, o.layers, 12, 768};
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Troupe at one batch size with one attention kernel: the median step of `steps` after
// `warmup`, then (with breakdown) kBreakdownSteps more with every op timed by CUDA events.
json measure_troupe(const gpu_train_step_options& o, int B, const std::string& attention) {
  const auto config = gpt2_small(o);
  engine::gpu_trainer_options options;
  options.dtype = o.dtype == "bf16" ? engine::compute_dtype::bf16 : engine::compute_dtype::fp32;
  options.attention = engine::parse_attention_kernel(attention);
  options.fast_kernels = o.fast_paths;
  engine::gpu_trainer trainer(config, B, o.seq_len, options, 1234);
  const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(o.seq_len);
  std::vector<std::vector<std::int32_t>> batches(4, std::vector<std::int32_t>(n + 1));
  for (std::size_t b = 0; b < batches.size(); ++b)
    for (std::size_t i = 0; i <= n; ++i)
      batches[b][i] = static_cast<std::int32_t>(engine::splitmix64(b * (n + 1) + i) % 50257);
  engine::optimizer_config oc;
  oc.lr = 1e-4f;
  oc.warmup_steps = 0;
  oc.decay = "constant";
  const int total = o.warmup + o.steps + (o.breakdown ? kBreakdownSteps : 0);
  double loss = 0;
  auto step = [&](int s) {
    const auto& b = batches[static_cast<std::size_t>(s) % batches.size()];
    const auto t0 = std::chrono::steady_clock::now();
    loss = trainer.train_step(b.data(), b.data() + 1, oc, s, total).loss;
    trainer.synchronize();
    return seconds_since(t0);
  };
  std::vector<double> times;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const double dt = step(s);
    if (s >= o.warmup) times.push_back(dt);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  json r = {{"attention", attention},
            {"fast_paths", o.fast_paths},
            {"tokens_per_s", double(n) / median},
            {"step_ms_median", median * 1e3},
            {"step_ms_min", times.front() * 1e3},
            {"last_loss", loss},
            {"device", trainer.device_name()},
            {"device_bytes", trainer.device_bytes()}};
  if (!o.breakdown) return r;
  // Per family, summed over the timed steps, then per step. The events cost host time, so
  // these steps are not among the timed ones above.
  std::map<std::string, std::pair<double, int>> sums;
  double timed_seconds = 0;
  trainer.chunk().set_kernel_timing(true);
  for (int s = 0; s < kBreakdownSteps; ++s) {
    timed_seconds += step(o.warmup + o.steps + s);
    for (const auto& t : trainer.chunk().take_kernel_times()) {
      sums[t.family].first += t.ms;
      sums[t.family].second += t.calls;
    }
  }
  trainer.chunk().set_kernel_timing(false);
  json families = json::array();
  double sum = 0;
  for (const auto& [family, v] : sums) {
    families.push_back({{"family", family},
                        {"ms_per_step", v.first / kBreakdownSteps},
                        {"calls_per_step", v.second / kBreakdownSteps}});
    sum += v.first / kBreakdownSteps;
  }
  std::sort(families.begin(), families.end(), [](const json& a, const json& b) {
    return a["ms_per_step"].get<double>() > b["ms_per_step"].get<double>();
  });
  const double step_ms = timed_seconds * 1e3 / kBreakdownSteps;
  r["breakdown"] = {{"steps", kBreakdownSteps},
                    {"step_ms", step_ms},
                    {"families", families},
                    {"outside_ops_ms", step_ms - sum}};
  return r;
}

std::optional<json> measure_peer(const gpu_train_step_options& o, const std::string& script, int B,
                                 bool compile) {
  char cmd[2048];
  std::snprintf(cmd, sizeof cmd,
                "'%s' '%s' --device cuda --dtype %s%s --layers %d --heads 12 --width 768 "
                "--vocab 50257 --context 1024 --batch %d --seq %d --steps %d --warmup %d",
                o.python.c_str(), script.c_str(), o.dtype.c_str(), compile ? " --compile" : "",
                o.layers, B, o.seq_len, o.steps, o.warmup + (compile ? 3 : 0));
  auto out = capture_command(cmd);
  if (!out) return std::nullopt;
  return last_json_object(*out);
}

double gib(const json& bytes) { return bytes.get<double>() / (1024.0 * 1024.0 * 1024.0); }

void print_run(const json& run) {
  std::printf("\nB=%d\n", run["batch"].get<int>());
  std::printf("%-24s %12s %10s %7s %11s %14s\n", "run", "tokens/s", "step ms", "MFU", "device GiB",
              "best troupe/x");
  for (const auto& t : run["troupe"]) {
    const std::string name = "troupe (" + t["attention"].get<std::string>() +
                             (t.value("fast_paths", false) ? ", fast" : "") + ")";
    if (t.contains("error")) {
      std::printf("%-24s %s\n", name.c_str(), t["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("%-24s %12.0f %10.2f %6.1f%% %11.2f\n", name.c_str(),
                t["tokens_per_s"].get<double>(), t["step_ms_median"].get<double>(),
                100 * t["mfu"].get<double>(), gib(t["device_bytes"]));
  }
  for (const auto& p : run["peers"]) {
    const std::string name = p["name"].get<std::string>();
    if (!p.contains("tokens_per_s")) {
      std::printf("%-24s %s\n", name.c_str(), p["error"].get<std::string>().c_str());
      continue;
    }
    const auto& r = p["result"];
    std::printf("%-24s %12.0f %10.2f %6.1f%% %11.2f %13.2fx\n", name.c_str(),
                p["tokens_per_s"].get<double>(), r["step_ms_median"].get<double>(),
                100 * p["mfu"].get<double>(),
                r.contains("peak_device_bytes") ? gib(r["peak_device_bytes"]) : 0.0,
                p.contains("ratio") ? p["ratio"].get<double>() : 0.0);
  }
  for (const auto& t : run["troupe"]) {
    if (!t.contains("breakdown")) continue;
    const auto& b = t["breakdown"];
    const double step_ms = b["step_ms"].get<double>();
    std::printf("where troupe's step goes (%s attention; CUDA events over %d steps):\n",
                t["attention"].get<std::string>().c_str(), b["steps"].get<int>());
    std::printf("  %-44s %9s %6s %10s\n", "op family", "ms/step", "share", "calls/step");
    for (const auto& f : b["families"])
      std::printf("  %-44s %9.2f %5.1f%% %10d\n", f["family"].get<std::string>().c_str(),
                  f["ms_per_step"].get<double>(), 100 * f["ms_per_step"].get<double>() / step_ms,
                  f["calls_per_step"].get<int>());
    std::printf("  %-44s %9.2f %5.1f%%\n", "outside the ops (collectives, copies, gaps)",
                b["outside_ops_ms"].get<double>(),
                100 * b["outside_ops_ms"].get<double>() / step_ms);
    std::printf("  %-44s %9.2f\n", "step, timed with events", step_ms);
  }
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
  for (const auto& a : o.attention) {
    try {
      engine::parse_attention_kernel(a);
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "troupe bench train-step: --attention %s\n", e.what());
      return 2;
    }
  }
  std::string script;
  if (!o.no_peer) {
    try {
      script = source_file("bench/pytorch_train_step.py");
    } catch (const std::runtime_error& e) {
      std::fprintf(stderr, "troupe bench train-step --device cuda: the PyTorch peer: %s\n",
                   e.what());
      return 1;
    }
  }
  const auto config = gpt2_small(o);
  const double flops_per_token = config.train_flops_per_token(o.seq_len);
  const double peak = o.dtype == "bf16" ? kPeakBf16 : kPeakFp32;
  json report = {{"model", "gpt2-small"},
                 {"layers", o.layers},
                 {"seq_len", o.seq_len},
                 {"dtype", o.dtype},
                 {"flops_per_token", flops_per_token},
                 {"peak_flops_per_s", peak},
                 {"runs", json::array()}};
  int troupe_ran = 0;
  std::string device;
  for (const int B : o.batches) {
    json run = {{"batch", B}, {"troupe", json::array()}, {"peers", json::array()}};
    double best = 0;
    for (const auto& attention : o.attention) {
      json t;
      try {
        t = measure_troupe(o, B, attention);
        t["mfu"] = t["tokens_per_s"].get<double>() * flops_per_token / peak;
        best = std::max(best, t["tokens_per_s"].get<double>());
        device = t["device"].get<std::string>();
        ++troupe_ran;
      } catch (const std::exception& e) {  // e.g. out of device memory at this batch size
        t = {{"attention", attention}, {"error", e.what()}};
      }
      run["troupe"].push_back(t);
    }
    if (!o.no_peer) {
      for (const bool compile : {false, true}) {
        auto peer = measure_peer(o, script, B, compile);
        json entry = {{"name", compile ? "torch.compile" : "torch eager"}};
        if (peer && peer->contains("tokens_per_s")) {
          const double tps = (*peer)["tokens_per_s"].get<double>();
          entry["result"] = *peer;
          entry["tokens_per_s"] = tps;
          entry["mfu"] = tps * flops_per_token / peak;
          if (best > 0) entry["ratio"] = best / tps;
        } else {
          entry["error"] = "the peer did not run (is torch with CUDA in " + o.python +
                           "? out of memory at this batch size?)";
        }
        run["peers"].push_back(entry);
      }
    }
    report["runs"].push_back(run);
  }
  if (o.json_output) {
    std::printf("%s\n", report.dump(2).c_str());
  } else {
    std::printf(
        "GPT-2 small shape, %d layers, T=%d, %s, on %s; MFU against %.0f TFLOP/s; device GiB: "
        "Troupe's allocation, PyTorch's peak\n",
        o.layers, o.seq_len, o.dtype.c_str(), device.c_str(), peak / 1e12);
    for (const auto& run : report["runs"]) print_run(run);
  }
  if (troupe_ran == 0) {
    std::fprintf(stderr, "troupe bench train-step --device cuda: no Troupe run succeeded\n");
    return 1;
  }
  return 0;
}

}  // namespace troupe::bench
