// The ZeRO benchmark. See zero_bench.hpp and docs/benchmarks.md.
#include "bench/zero_bench.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "actors/pipeline_run.hpp"
#include "engine/parallel/memory_plan.hpp"
#include "engine/training/recipe.hpp"

namespace troupe::bench {
namespace {

constexpr double mib = 1024.0 * 1024.0;

std::string zero_name(int zero) { return zero == 0 ? "DDP" : "ZeRO-" + std::to_string(zero); }

// The recipe overrides of one configuration; the in-process and the multi-process runs use the
// same ones, so both train the same job.
std::vector<std::string> overrides(const zero_bench_options& o, int dp, int zero,
                                   const std::filesystem::path& dir) {
  return {"steps=" + std::to_string(o.steps),
          "eval_interval=0",
          "parallel.pp=1",
          "parallel.dp=" + std::to_string(dp),
          "parallel.zero=" + std::to_string(zero),
          "output.dir=" + dir.string(),
          "output.weights=\"\""};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// One process, every replica: step time and the memory the actors report.
void run_in_process(const zero_bench_options& o, const std::vector<std::string>& sets,
                    zero_case& c) {
  try {
    const engine::recipe r = engine::load_recipe(o.recipe, sets);
    const auto res = actors::run_training(r, {}, {});
    const std::size_t skip = res.steps.size() > static_cast<std::size_t>(o.warmup)
                                 ? static_cast<std::size_t>(o.warmup)
                                 : 0;
    std::vector<double> ms;
    double tokens = 0, seconds = 0;
    for (std::size_t i = skip; i < res.steps.size(); ++i) {
      ms.push_back(res.steps[i].step_ms);
      tokens += res.steps[i].tokens_per_s * res.steps[i].step_ms / 1e3;
      seconds += res.steps[i].step_ms / 1e3;
    }
    c.step_ms = median(ms);
    c.tokens_per_s = seconds > 0 ? tokens / seconds : 0;
    c.final_loss = res.summary.final_loss;
    if (!res.steps.empty())
      for (const auto& m : res.steps.back().memory)
        if (m.model_state() + m.buffers + m.pooled >
            c.memory.model_state() + c.memory.buffers + c.memory.pooled)
          c.memory = m;
  } catch (const std::exception& e) {
    c.error = e.what();
  }
}

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char ch : text) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// The same job as dp processes, one rank each; every process prints its peak RSS as one JSON
// line ({"rank":R,"world":W,"peak_rss_bytes":N}, `troupe train --report-peak-rss`).
void measure_peak_rss(const zero_bench_options& o, const std::vector<std::string>& sets,
                      zero_case& c) {
  if (o.self_exe.empty()) {
    c.rss_error = "no troupe binary to launch";
    return;
  }
  std::string cmd = "timeout -k 10 600 " + shell_quote(o.self_exe) + " launch --nproc " +
                    std::to_string(c.dp) + " --grace 10 -- train " + shell_quote(o.recipe);
  for (const auto& s : sets) cmd += " --set " + shell_quote(s);
  cmd += " --report-peak-rss 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(cmd.c_str(), "r"), ::pclose);
  if (!pipe) {
    c.rss_error = "cannot start troupe launch";
    return;
  }
  std::vector<std::string> lines;
  std::string line;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), pipe.get())) {
    line += buf.data();
    if (line.empty() || line.back() != '\n') continue;
    line.pop_back();
    lines.push_back(std::move(line));
    line.clear();
  }
  const int status = ::pclose(pipe.release());
  c.peak_rss.assign(static_cast<std::size_t>(c.dp), -1);
  int reported = 0;
  for (const auto& l : lines) {
    if (l.find("\"peak_rss_bytes\"") == std::string::npos) continue;
    try {
      const auto j = nlohmann::json::parse(l.substr(l.find('{')));
      const int rank = j.at("rank").get<int>();
      if (rank >= 0 && rank < c.dp) {
        c.peak_rss[static_cast<std::size_t>(rank)] = j.at("peak_rss_bytes").get<std::int64_t>();
        ++reported;
      }
    } catch (const nlohmann::json::exception&) {
    }
  }
  if (status != 0) {
    std::string why = "troupe launch exited " + std::to_string(WEXITSTATUS(status));
    for (auto it = lines.rbegin(); it != lines.rend(); ++it)
      if (it->rfind("troupe", 0) == 0 && it->rfind("troupe launch", 0) != 0) {
        why = *it;
        break;
      }
    c.rss_error = why;
  } else if (reported != c.dp) {
    c.rss_error = std::to_string(reported) + " of " + std::to_string(c.dp) + " ranks reported";
  }
}

std::string format(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, value);
  return buf;
}

}  // namespace

double step_time_goal(int zero) { return zero == 0 ? 0 : zero == 3 ? 1.3 : 1.1; }

zero_bench_report run_zero_bench(const zero_bench_options& o) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("troupe-bench-zero-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct remove_at_exit {
    std::filesystem::path dir;
    ~remove_at_exit() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  zero_bench_report rep;
  rep.recipe = o.recipe;
  rep.steps = o.steps;
  rep.warmup = o.warmup;
  for (const int dp : o.dps) {
    // psi from the DDP form of the recipe: every level has the same parameters.
    const engine::recipe ddp = engine::load_recipe(o.recipe, overrides(o, dp, 0, dir));
    const std::int64_t psi = engine::plan_memory(ddp).at(0).parameters;
    rep.parameters.push_back(psi);
    double ddp_step_ms = 0;
    for (const int zero : o.levels) {
      zero_case c;
      c.dp = dp;
      c.zero = zero;
      c.formula =
          engine::zero_formula(static_cast<engine::zero_stage>(zero), static_cast<double>(psi), dp);
      const auto sets =
          overrides(o, dp, zero, dir / (zero_name(zero) + "-dp" + std::to_string(dp)));
      std::fprintf(stderr, "  dp=%d %-6s in one process...", dp, zero_name(zero).c_str());
      run_in_process(o, sets, c);
      if (!c.error.empty()) {
        std::fprintf(stderr, " failed: %s\n", c.error.c_str());
        rep.cases.push_back(c);
        continue;
      }
      std::fprintf(stderr, " %.1f ms/step; %d processes...", c.step_ms, dp);
      measure_peak_rss(o, sets, c);
      if (c.rss_error.empty()) {
        const auto peak = *std::max_element(c.peak_rss.begin(), c.peak_rss.end());
        std::fprintf(stderr, " peak RSS up to %.1f MiB\n", static_cast<double>(peak) / mib);
      } else {
        std::fprintf(stderr, " %s\n", c.rss_error.c_str());
      }
      if (zero == 0) ddp_step_ms = c.step_ms;
      rep.cases.push_back(c);
    }
    for (auto& c : rep.cases)
      if (c.dp == dp && c.error.empty() && ddp_step_ms > 0) c.step_vs_ddp = c.step_ms / ddp_step_ms;
  }
  return rep;
}

std::string format_zero_report(const zero_bench_report& r) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line,
                "troupe bench zero: %s, pp=1, %d steps per run (step time: median of the last "
                "%d)\n",
                r.recipe.c_str(), r.steps, std::max(1, r.steps - r.warmup));
  out += line;
  out +=
      "goals: step time <= 1.1x DDP for ZeRO-1/2, <= 1.3x for ZeRO-3; model state per rank "
      "16Ψ (DDP), 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N\n"
      "memory in MiB: what the actors report (largest rank), the formula, and the peak RSS "
      "measured in each process of a --nproc N run\n";
  std::size_t group = 0;
  int last_dp = -1;
  for (const auto& c : r.cases) {
    if (c.dp != last_dp) {
      last_dp = c.dp;
      const double psi = group < r.parameters.size() ? double(r.parameters[group++]) : 0;
      std::snprintf(line, sizeof line,
                    "\ndp=%d: Ψ = %.3f M parameters per rank (16Ψ = %.1f MiB)\n"
                    "zero     step ms   tok/s  vs DDP  goal             loss  params  grads  "
                    "optim  state formula buffers pooled  peak RSS per rank\n",
                    c.dp, psi / 1e6, 16 * psi / mib);
      out += line;
    }
    if (!c.error.empty()) {
      std::snprintf(line, sizeof line, "%-7s error: ", zero_name(c.zero).c_str());
      out += line + c.error + "\n";
      continue;
    }
    std::string goal = "-";
    if (c.zero > 0 && c.step_vs_ddp > 0)
      goal = format("<=%.1fx ", step_time_goal(c.zero)) +
             (c.step_vs_ddp <= step_time_goal(c.zero) ? "met" : "missed");
    std::string rss;
    if (!c.rss_error.empty()) {
      rss = "n/a: " + c.rss_error;
    } else {
      for (const auto b : c.peak_rss) rss += format(" %.1f", static_cast<double>(b) / mib);
      rss.erase(0, 1);
    }
    std::snprintf(line, sizeof line,
                  "%-7s %8.1f %7.0f %6s  %-13s %7.4f %7.2f %6.2f %6.2f %6.2f %7.2f %7.2f %6.2f  ",
                  zero_name(c.zero).c_str(), c.step_ms, c.tokens_per_s,
                  c.step_vs_ddp > 0 ? format("%.2fx", c.step_vs_ddp).c_str() : "-", goal.c_str(),
                  c.final_loss, static_cast<double>(c.memory.parameters) / mib,
                  static_cast<double>(c.memory.gradients) / mib,
                  static_cast<double>(c.memory.optimizer) / mib,
                  static_cast<double>(c.memory.model_state()) / mib, c.formula.total() / mib,
                  static_cast<double>(c.memory.buffers) / mib,
                  static_cast<double>(c.memory.pooled) / mib);
    out += line + rss + "\n";
  }
  return out;
}

std::string zero_report_json(const zero_bench_report& r) {
  using nlohmann::json;
  json cases = json::array();
  for (const auto& c : r.cases) {
    json j = {{"dp", c.dp}, {"zero", c.zero}};
    if (!c.error.empty()) {
      j["error"] = c.error;
      cases.push_back(j);
      continue;
    }
    j["step_ms"] = c.step_ms;
    j["tokens_per_s"] = c.tokens_per_s;
    j["step_time_vs_ddp"] = c.step_vs_ddp > 0 ? json(c.step_vs_ddp) : json(nullptr);
    j["step_time_goal"] = c.zero > 0 ? json(step_time_goal(c.zero)) : json(nullptr);
    j["final_loss"] = c.final_loss;
    j["memory"] = {{"replica", c.memory.replica},       {"rank", c.memory.rank},
                   {"parameters", c.memory.parameters}, {"gradients", c.memory.gradients},
                   {"optimizer", c.memory.optimizer},   {"buffers", c.memory.buffers},
                   {"pooled", c.memory.pooled},         {"model_state", c.memory.model_state()}};
    j["formula"] = {{"parameters", c.formula.parameters},
                    {"gradients", c.formula.gradients},
                    {"optimizer", c.formula.optimizer},
                    {"total", c.formula.total()}};
    if (c.rss_error.empty())
      j["peak_rss_bytes"] = c.peak_rss;
    else
      j["peak_rss_error"] = c.rss_error;
    cases.push_back(j);
  }
  const json j = {{"recipe", r.recipe},
                  {"pp", 1},
                  {"steps", r.steps},
                  {"warmup", r.warmup},
                  {"parameters_per_rank", r.parameters},
                  {"cases", cases}};
  return j.dump(2, ' ', false, json::error_handler_t::replace);
}

}  // namespace troupe::bench
