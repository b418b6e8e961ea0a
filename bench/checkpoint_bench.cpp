// `troupe bench checkpoint`. See checkpoint_bench.hpp.
#include "bench/checkpoint_bench.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "actors/pipeline_run.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::bench {
namespace {

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

// Wall seconds from the run's start to each step's end (metrics elapsed_s counts only from the
// coordinator's start; this includes setup).
struct timed_run {
  std::vector<double> step_end_s;
};

timed_run run(const engine::recipe& r, const std::string& resume = "") {
  timed_run t;
  engine::train_callbacks cb;
  const auto start = clock_type::now();
  cb.on_step = [&](const engine::step_metrics&) {
    t.step_end_s.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
  };
  actors::run_options o;
  o.collect_parameters = false;
  o.resume = resume;
  actors::run_training(r, cb, o);
  return t;
}

// Each step's wall time after the first `warmup` steps, in ms, added to `out`.
void step_times_ms(const timed_run& t, int warmup, std::vector<double>& out) {
  const auto n = static_cast<int>(t.step_end_s.size());
  for (int i = std::max(1, std::min(warmup, n - 1) + 1); i < n; ++i)
    out.push_back((t.step_end_s[static_cast<std::size_t>(i)] -
                   t.step_end_s[static_cast<std::size_t>(i - 1)]) *
                  1e3);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (const double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

checkpoint_case measure(const std::string& shape, engine::recipe r, int steps, int warmup,
                        int rounds, int every) {
  checkpoint_case c;
  c.shape = shape;
  c.steps = steps;
  c.rounds = rounds;
  c.every = every;
  c.parameters = r.model.parameter_count();
  if (steps <= std::max(every, warmup + 1)) {
    c.error = std::to_string(steps) + " steps hold no checkpoint after the warm-up at " +
              std::to_string(every) + " steps apart: more steps, or a smaller --every";
    return c;
  }
  char tmpl[] = "/tmp/troupe-bench-ckpt-XXXXXX";
  const fs::path dir = ::mkdtemp(tmpl);
  try {
    r.steps = steps;
    r.eval_interval = 0;
    r.output.weights = "";
    r.checkpoint.keep = 1;
    std::vector<double> without, with;
    for (int k = 0; k < rounds; ++k) {
      std::fprintf(stderr, "  %s, round %d of %d: %d steps without checkpoints...", shape.c_str(),
                   k + 1, rounds, steps);
      r.checkpoint.every = 0;
      r.output.dir = (dir / ("without-" + std::to_string(k))).string();
      step_times_ms(run(r), warmup, without);
      std::fprintf(stderr, " with one every %d...\n", every);
      r.checkpoint.every = every;
      r.output.dir = (dir / "every").string();
      fs::remove_all(r.output.dir);
      step_times_ms(run(r), warmup, with);
    }
    c.step_ms_without = every == 1 ? median(without) : mean(without);
    c.step_ms_every = every == 1 ? median(with) : mean(with);
    c.overhead = c.step_ms_without > 0 ? c.step_ms_every / c.step_ms_without - 1 : 0;
    const auto last = engine::list_checkpoints(r.checkpoint_path()).at(0).dir;
    for (const auto& f : fs::directory_iterator(last)) c.checkpoint_bytes += f.file_size();
    std::fprintf(stderr, "  %s: resuming...\n", shape.c_str());
    engine::recipe one = r;
    one.steps = steps + 1;
    one.checkpoint.every = 0;
    one.output.dir = (dir / "resumed").string();
    c.first_step_resume_s = run(one, last.string()).step_end_s.at(0);
    one.steps = 1;
    one.output.dir = (dir / "fresh").string();
    c.first_step_fresh_s = run(one).step_end_s.at(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, " failed\n");
    c.error = e.what();
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return c;
}

// GPT-2 small's model (12 layers, width 768, 50257 tokens) in recipe `r`.
void gpt2_small(engine::recipe& r) {
  r.model.vocab_size = 50257;
  r.model.padded_vocab_size = 50304;
  r.model.layers = 12;
  r.model.heads = 12;
  r.model.width = 768;
}

}  // namespace

std::vector<checkpoint_case> run_checkpoint_bench(const checkpoint_bench_options& o) {
  std::vector<checkpoint_case> out;
  const engine::recipe base = engine::load_recipe(o.recipe, {});
  out.push_back(measure("recipe", base, o.steps, o.warmup, o.rounds, o.every));
  if (o.gpt2_steps > 0) {
    engine::recipe g = base;  // GPT-2 small on the recipe's data, pipeline and micro-batches
    gpt2_small(g);
    g.model.context = std::max(g.model.context, g.batch.seq_len);
    engine::validate_recipe(g);
    out.push_back(measure("GPT-2 small", g, o.gpt2_steps, 1, o.rounds, o.every));
  }
  return out;
}

std::string format_checkpoint_report(const std::vector<checkpoint_case>& cases) {
  std::string s =
      "troupe bench checkpoint: wall time of a step without checkpoints and with one every "
      "`every` steps (the median with one every step, else the mean; one process, the recipe's "
      "pipeline; runs of the two kinds alternating, the first steps of each left out), the "
      "checkpoint's size, and the time from a run's start to its first step, fresh and resumed\n";
  char line[320];
  std::snprintf(line, sizeof line, "%-12s %12s %6s %6s %6s %12s %12s %9s %10s %9s %9s\n", "shape",
                "parameters", "steps", "every", "rounds", "ms/step", "ms/step ckpt", "overhead",
                "checkpoint", "1st step", "resumed");
  s += line;
  for (const auto& c : cases) {
    if (!c.error.empty()) {
      s += c.shape + ": failed: " + c.error + "\n";
      continue;
    }
    std::snprintf(line, sizeof line,
                  "%-12s %12lld %6d %6d %6d %12.1f %12.1f %8.1f%% %8.1f MB %8.2fs %8.2fs\n",
                  c.shape.c_str(), static_cast<long long>(c.parameters), c.steps, c.every, c.rounds,
                  c.step_ms_without, c.step_ms_every, c.overhead * 100,
                  static_cast<double>(c.checkpoint_bytes) / 1e6, c.first_step_fresh_s,
                  c.first_step_resume_s);
    s += line;
  }
  s += "goal: overhead < 5% with a checkpoint every 10 steps\n";
  return s;
}

namespace {

// A run of `steps` steps on the GPU; the step times (ms) after the warm-up, by step (1-based),
// zero before it.
std::vector<double> device_step_ms(const engine::recipe& r) {
  const auto t = run(r).step_end_s;
  std::vector<double> ms(t.size() + 1, 0.0);
  for (std::size_t i = 1; i < t.size(); ++i) ms[i + 1] = (t[i] - t[i - 1]) * 1e3;
  return ms;
}

double mean_of(const std::vector<double>& ms, int from, int to) {
  double sum = 0;
  for (int i = from; i <= to; ++i) sum += ms[static_cast<std::size_t>(i)];
  return to >= from ? sum / (to - from + 1) : 0;
}

std::vector<double> slice(const std::vector<double>& ms, int from, int to) {
  return {ms.begin() + from, ms.begin() + to + 1};
}

}  // namespace

std::vector<checkpoint_device_run> run_checkpoint_device_bench(const checkpoint_device_options& o) {
  std::vector<std::string> overrides;
  if (!o.data.empty()) overrides.push_back("data.train=" + o.data);
  engine::recipe g = engine::load_recipe(o.recipe, overrides);
  g.device = "cuda";
  gpt2_small(g);
  g.model.context = 1024;
  g.batch.seq_len = 1024;
  g.batch.micro_batch = o.batch;
  g.batch.grad_accum = 1;
  g.parallel.pp = 1;
  g.parallel.dp = 1;
  g.parallel.micro_batches = 1;
  g.precision.dtype = "bf16";
  g.kernels.attention = "cudnn";
  g.kernels.fast_paths = true;
  g.eval_interval = 0;
  g.output.weights = "";
  g.checkpoint.keep = 1;
  engine::validate_recipe(g);
  const int smallest = *std::min_element(o.every.begin(), o.every.end());
  auto steps_for = [&](int every) {
    return std::max(o.checkpoints * smallest, 2 * every) + o.window;
  };
  int longest = 0;
  for (const int e : o.every) longest = std::max(longest, steps_for(e));
  char tmpl[] = "/tmp/troupe-bench-ckpt-XXXXXX";
  const fs::path dir = ::mkdtemp(tmpl);
  std::vector<checkpoint_device_run> out;
  std::vector<double> without;
  auto measure_run = [&](const std::string& copy, int every) {
    checkpoint_device_run x;
    x.copy = copy;
    x.every = every;
    x.steps = every > 0 ? steps_for(every) : longest;
    std::fprintf(
        stderr, "  %d steps, %s...\n", x.steps,
        every > 0 ? ("a checkpoint every " + std::to_string(every) + ", " + copy + " copy").c_str()
                  : "no checkpoints");
    try {
      engine::recipe r = g;
      r.steps = x.steps;
      r.checkpoint.every = every;
      r.checkpoint.pinned_copy = copy != "pageable";
      r.output.dir = (dir / (copy + std::to_string(every))).string();
      const auto ms = device_step_ms(r);
      const int from = o.warmup + 1, to = x.steps;
      x.step_ms_median = median(slice(ms, from, to));
      x.step_ms_mean = mean_of(ms, from, to);
      if (every == 0) {
        without = ms;
      } else {
        const double base = mean_of(without, from, to);
        x.overhead = base > 0 ? x.step_ms_mean / base - 1 : 0;
        for (int s = every; s + o.window <= to; s += every) {
          if (s < from) continue;
          double extra = 0;
          for (int i = s + 1; i <= s + o.window; ++i)
            extra += ms[static_cast<std::size_t>(i)] - x.step_ms_median;
          x.stall_ms.push_back(extra);
        }
        x.stall_ms_median = median(x.stall_ms);
        const double step = median(slice(without, from, to));
        x.stall_steps = step > 0 ? x.stall_ms_median / step : 0;
        const auto last = engine::list_checkpoints(r.checkpoint_path()).at(0).dir;
        for (const auto& f : fs::directory_iterator(last)) x.checkpoint_bytes += f.file_size();
      }
    } catch (const std::exception& e) {
      x.error = e.what();
    }
    std::error_code ec;
    fs::remove_all(dir / (copy + std::to_string(every)), ec);
    out.push_back(x);
  };
  measure_run("", 0);
  if (!out.back().error.empty()) return out;
  for (const int e : o.every)
    for (const char* copy : {"pinned", "pageable"}) measure_run(copy, e);
  std::error_code ec;
  fs::remove_all(dir, ec);
  return out;
}

std::string format_checkpoint_device_report(const std::vector<checkpoint_device_run>& runs) {
  std::string s =
      "troupe bench checkpoint --device cuda: GPT-2 small on one GPU, one process; the median "
      "step, the mean step against the run without checkpoints, and each checkpoint's stall "
      "(the steps after it beyond the median step), in ms and in steps\n";
  char line[400];
  std::snprintf(line, sizeof line, "%-9s %6s %6s %10s %10s %9s %11s %7s %10s  %s\n", "copy",
                "every", "steps", "ms/step", "mean ms", "overhead", "stall ms", "steps",
                "checkpoint", "stall per checkpoint (ms)");
  s += line;
  for (const auto& x : runs) {
    const std::string copy = x.every > 0 ? x.copy : "none";
    if (!x.error.empty()) {
      s += (x.every > 0 ? copy + " copy, a checkpoint every " + std::to_string(x.every)
                        : std::string("the run without checkpoints")) +
           ": failed: " + x.error + "\n";
      continue;
    }
    std::string each;
    for (const double v : x.stall_ms) {
      char b[32];
      std::snprintf(b, sizeof b, "%s%.0f", each.empty() ? "" : " ", v);
      each += b;
    }
    std::snprintf(line, sizeof line,
                  "%-9s %6d %6d %10.2f %10.2f %8.1f%% %11.1f %7.2f %7.0f MB  %s\n", copy.c_str(),
                  x.every, x.steps, x.step_ms_median, x.step_ms_mean, x.overhead * 100,
                  x.stall_ms_median, x.stall_steps, static_cast<double>(x.checkpoint_bytes) / 1e6,
                  each.c_str());
    s += line;
  }
  s += "goal: a checkpoint stalls the run at most one step\n";
  return s;
}

std::string checkpoint_device_report_json(const std::vector<checkpoint_device_run>& runs) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& x : runs) {
    nlohmann::json r = {{"copy", x.copy}, {"every", x.every}, {"steps", x.steps}};
    if (!x.error.empty()) {
      r["error"] = x.error;
    } else {
      r["step_ms_median"] = x.step_ms_median;
      r["step_ms_mean"] = x.step_ms_mean;
      r["overhead"] = x.overhead;
      r["stall_ms"] = x.stall_ms;
      r["stall_ms_median"] = x.stall_ms_median;
      r["stall_steps"] = x.stall_steps;
      r["checkpoint_bytes"] = x.checkpoint_bytes;
    }
    j.push_back(r);
  }
  return nlohmann::json{
      {"benchmark", "checkpoint"}, {"device", "cuda"}, {"goal_stall_steps", 1}, {"runs", j}}
      .dump();
}

std::string checkpoint_report_json(const std::vector<checkpoint_case>& cases) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& c : cases) {
    nlohmann::json x = {{"shape", c.shape},
                        {"parameters", c.parameters},
                        {"steps", c.steps},
                        {"every", c.every},
                        {"rounds", c.rounds}};
    if (!c.error.empty()) {
      x["error"] = c.error;
    } else {
      x["step_ms_without"] = c.step_ms_without;
      x["step_ms_every"] = c.step_ms_every;
      x["overhead"] = c.overhead;
      x["checkpoint_bytes"] = c.checkpoint_bytes;
      x["first_step_fresh_s"] = c.first_step_fresh_s;
      x["first_step_resume_s"] = c.first_step_resume_s;
    }
    j.push_back(x);
  }
  return nlohmann::json{{"benchmark", "checkpoint"}, {"goal_overhead", 0.05}, {"cases", j}}.dump();
}

}  // namespace troupe::bench
