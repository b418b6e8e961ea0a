// `troupe bench checkpoint`. See checkpoint_bench.hpp.
#include "bench/checkpoint_bench.hpp"

#include <unistd.h>

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

checkpoint_case measure(const std::string& shape, engine::recipe r, int steps, int warmup,
                        int rounds) {
  checkpoint_case c;
  c.shape = shape;
  c.steps = steps;
  c.rounds = rounds;
  c.parameters = r.model.parameter_count();
  char tmpl[] = "/tmp/troupe-bench-ckpt-XXXXXX";
  const fs::path dir = ::mkdtemp(tmpl);
  try {
    r.steps = steps;
    r.eval_interval = 0;
    r.output.weights = "";
    r.checkpoint.keep = 1;
    std::vector<double> without, every;
    for (int k = 0; k < rounds; ++k) {
      std::fprintf(stderr, "  %s, round %d of %d: %d steps without checkpoints...", shape.c_str(),
                   k + 1, rounds, steps);
      r.checkpoint.every = 0;
      r.output.dir = (dir / ("without-" + std::to_string(k))).string();
      step_times_ms(run(r), warmup, without);
      std::fprintf(stderr, " with one after every step...\n");
      r.checkpoint.every = 1;
      r.output.dir = (dir / "every").string();
      fs::remove_all(r.output.dir);
      step_times_ms(run(r), warmup, every);
    }
    c.step_ms_without = median(without);
    c.step_ms_every = median(every);
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

}  // namespace

std::vector<checkpoint_case> run_checkpoint_bench(const checkpoint_bench_options& o) {
  std::vector<checkpoint_case> out;
  const engine::recipe base = engine::load_recipe(o.recipe, {});
  out.push_back(measure("recipe", base, o.steps, o.warmup, o.rounds));
  if (o.gpt2_steps > 0) {
    engine::recipe g = base;  // GPT-2 small on the recipe's data, pipeline and micro-batches
    g.model.vocab_size = 50257;
    g.model.padded_vocab_size = 50304;
    g.model.layers = 12;
    g.model.heads = 12;
    g.model.width = 768;
    g.model.context = std::max(g.model.context, g.batch.seq_len);
    engine::validate_recipe(g);
    out.push_back(measure("GPT-2 small", g, o.gpt2_steps, 1, o.rounds));
  }
  return out;
}

std::string format_checkpoint_report(const std::vector<checkpoint_case>& cases) {
  std::string s =
      "troupe bench checkpoint: median wall time of a step without checkpoints and with one "
      "after every step (one process, the recipe's pipeline; runs of the two kinds alternating, "
      "the first steps of each left out), the checkpoint's size, and the time from a run's "
      "start to its first step, fresh and resumed\n";
  char line[320];
  std::snprintf(line, sizeof line, "%-12s %12s %6s %6s %12s %12s %9s %10s %9s %9s\n", "shape",
                "parameters", "steps", "rounds", "ms/step", "ms/step ckpt", "overhead",
                "checkpoint", "1st step", "resumed");
  s += line;
  for (const auto& c : cases) {
    if (!c.error.empty()) {
      s += c.shape + ": failed: " + c.error + "\n";
      continue;
    }
    std::snprintf(
        line, sizeof line, "%-12s %12lld %6d %6d %12.1f %12.1f %8.1f%% %8.1f MB %8.2fs %8.2fs\n",
        c.shape.c_str(), static_cast<long long>(c.parameters), c.steps, c.rounds, c.step_ms_without,
        c.step_ms_every, c.overhead * 100, static_cast<double>(c.checkpoint_bytes) / 1e6,
        c.first_step_fresh_s, c.first_step_resume_s);
    s += line;
  }
  s += "goal: overhead < 5% with a checkpoint every step\n";
  return s;
}

std::string checkpoint_report_json(const std::vector<checkpoint_case>& cases) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& c : cases) {
    nlohmann::json x = {
        {"shape", c.shape}, {"parameters", c.parameters}, {"steps", c.steps}, {"rounds", c.rounds}};
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
