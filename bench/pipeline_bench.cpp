// The pipeline benchmark. See pipeline_bench.hpp and docs/benchmarks.md.
#include "bench/pipeline_bench.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "actors/pipeline_run.hpp"
#include "engine/trace/trace_summary.hpp"

namespace troupe::bench {
namespace {

namespace trace = engine::trace;

engine::recipe bench_recipe(const pipeline_bench_options& o, const std::filesystem::path& dir) {
  engine::recipe r;
  r.seed = 1;
  r.steps = o.steps;
  r.eval_interval = 0;
  r.model.layers = 8;
  r.model.width = 128;
  r.model.heads = 4;
  r.model.context = 64;
  r.data.train = o.corpus;
  r.batch.micro_batch = 2;
  r.batch.seq_len = 64;
  r.optimizer.warmup_steps = 1;
  r.output.dir = dir.string();
  r.output.weights = "";
  return r;
}

// Stage time in the pipeline window that is neither compute nor waiting for input: the actor
// machinery (mailbox, handlers, sends, credits) plus any time the OS ran something else.
double dispatch_share(const trace::trace_file& t, int skip) {
  const auto windows = trace::pipeline_windows(t);
  std::map<int, int> role;  // track -> is stage
  for (const auto& tr : t.tracks) role[tr.id] = tr.role == "stage";
  double window = 0, used = 0;
  int counted = 0;
  for (const auto& [step, w] : windows) {
    if (counted++ < skip) continue;
    for (const auto& tr : t.tracks) {
      if (tr.role != "stage") continue;
      window += w.second - w.first;
      for (const auto& e : t.events) {
        if (e.track != tr.id || e.step != step || e.kind != trace::event_kind::span) continue;
        if (e.category != "compute" && !(e.category == "wait" && e.name == "input")) continue;
        const double a = std::max(e.ts_us, w.first), b = std::min(e.ts_us + e.dur_us, w.second);
        if (b > a) used += b - a;
      }
    }
  }
  return window > 0 ? std::max(0.0, 1.0 - used / window) : 0;
}

struct traced_run {
  trace::summary summary;
  double dispatch = 0;
  double tokens_per_s = 0;
};

traced_run run_traced(const engine::recipe& r, const std::filesystem::path& dir) {
  actors::run_options o;
  o.trace_path = (dir / "trace.json").string();
  const auto res = actors::run_training(r, {}, o);
  const auto t = trace::read_json(o.trace_path);
  traced_run out;
  out.summary = trace::summarize(t, 1);
  out.summary.theory_bubble = t.meta.theory_bubble;
  out.dispatch = dispatch_share(t, 1);
  double tokens = 0, seconds = 0;
  for (std::size_t i = 1; i < res.steps.size(); ++i) {
    tokens += res.steps[i].tokens_per_s * res.steps[i].step_ms / 1e3;
    seconds += res.steps[i].step_ms / 1e3;
  }
  out.tokens_per_s = seconds > 0 ? tokens / seconds : 0;
  return out;
}

double serial_tokens_per_s(const engine::recipe& r) {
  double tokens = 0, seconds = 0;
  int seen = 0;
  engine::train_callbacks cb;
  cb.on_step = [&](const engine::step_metrics& m) {
    if (seen++ == 0) return;  // warm-up
    tokens += m.tokens_per_s * m.step_ms / 1e3;
    seconds += m.step_ms / 1e3;
  };
  engine::train(r, cb);
  return seconds > 0 ? tokens / seconds : 0;
}

}  // namespace

pipeline_bench_report run_pipeline_bench(const pipeline_bench_options& o) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("troupe-bench-pipeline-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  pipeline_bench_report rep;
  rep.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const engine::recipe base = bench_recipe(o, dir);
  for (int p : {2, 4}) {
    for (const char* sched : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}) {
      for (int m : {4, 8, 16}) {
        engine::recipe r = base;
        r.parallel.pp = p;
        r.parallel.micro_batches = m;
        r.parallel.schedule = sched;
        r.parallel.virtual_stages = std::string(sched) == "interleaved_1f1b" ? 2 : 1;
        engine::validate_recipe(r);
        const auto run = run_traced(r, dir);
        rep.bubbles.push_back({sched, p, m, r.parallel.virtual_stages, run.summary.measured_bubble,
                               run.summary.theory_bubble, run.dispatch});
        std::fprintf(stderr, "  %-16s p=%d m=%-2d bubble %.3f (theory %.3f)\n", sched, p, m,
                     run.summary.measured_bubble, run.summary.theory_bubble);
      }
    }
  }
  {  // dispatch: one stage actor vs the serial loop, same micro-batches
    engine::recipe r = base;
    r.parallel.micro_batches = 4;
    const auto run = run_traced(r, dir);
    rep.actor_tokens_per_s = run.tokens_per_s;
    rep.actor_dispatch_share = run.dispatch;
    engine::recipe s = r;
    s.batch.grad_accum = 4;
    s.parallel = {};
    rep.serial_tokens_per_s = serial_tokens_per_s(s);
  }
  {  // data parallelism: two replicas, a bucket per layer
    engine::recipe r = base;
    r.parallel.dp = 2;
    r.parallel.micro_batches = 2;
    const auto run = run_traced(r, dir);
    rep.dp_comm_ms = run.summary.dp_comm_us / 1e3;
    rep.dp_exposed_ms = run.summary.dp_exposed_us / 1e3;
    rep.dp_hidden = run.summary.dp_hidden_fraction;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rep;
}

std::string format_report(const pipeline_bench_report& r) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line,
                "pipeline bubble (%d cores: stage threads share them when p > cores)\n"
                "schedule             p   m   measured   theory   diff(pts)   dispatch\n",
                r.cores);
  out += line;
  for (const auto& b : r.bubbles) {
    std::snprintf(line, sizeof line, "%-20s %d  %2d   %7.1f%%  %6.1f%%   %+7.1f   %7.2f%%\n",
                  (b.schedule + (b.v > 1 ? " v=2" : "")).c_str(), b.p, b.m, 100 * b.measured,
                  100 * b.theory, 100 * (b.measured - b.theory), 100 * b.dispatch_share);
    out += line;
  }
  std::snprintf(line, sizeof line,
                "actor dispatch, pp=1 m=4: actor engine %.0f tok/s vs serial loop %.0f tok/s "
                "(ratio %.3f); dispatch share %.2f%% of stage time\n",
                r.actor_tokens_per_s, r.serial_tokens_per_s,
                r.serial_tokens_per_s > 0 ? r.actor_tokens_per_s / r.serial_tokens_per_s : 0,
                100 * r.actor_dispatch_share);
  out += line;
  std::snprintf(line, sizeof line,
                "data parallel, dp=2: communication %.2f ms, exposed %.2f ms, hidden %.1f%%\n",
                r.dp_comm_ms, r.dp_exposed_ms, 100 * r.dp_hidden);
  out += line;
  return out;
}

std::string report_json(const pipeline_bench_report& r) {
  nlohmann::json j;
  j["cores"] = r.cores;
  for (const auto& b : r.bubbles)
    j["bubbles"].push_back({{"schedule", b.schedule},
                            {"p", b.p},
                            {"m", b.m},
                            {"v", b.v},
                            {"measured", b.measured},
                            {"theory", b.theory},
                            {"dispatch_share", b.dispatch_share}});
  j["actor_tokens_per_s"] = r.actor_tokens_per_s;
  j["serial_tokens_per_s"] = r.serial_tokens_per_s;
  j["actor_dispatch_share"] = r.actor_dispatch_share;
  j["dp"] = {{"comm_ms", r.dp_comm_ms}, {"exposed_ms", r.dp_exposed_ms}, {"hidden", r.dp_hidden}};
  return j.dump(2);
}

}  // namespace troupe::bench
