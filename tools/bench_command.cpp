// `troupe bench train-step [--json]`: Troupe's train step next to PyTorch eager (same model,
// same thread count, measured in the same run), with the ratio and each one's share of the
// machine's measured FP32 peak; `bench pipeline`, `bench transport` and `bench zero` (ZeRO vs
// DDP, bench/zero_bench.hpp). Benchmarks: they print, they assert nothing.
#include <omp.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/checkpoint_bench.hpp"
#include "bench/gpu_train_step.hpp"
#include "bench/peak_flops.hpp"
#include "bench/peer_process.hpp"
#include "bench/pipeline_bench.hpp"
#include "bench/train_step.hpp"
#include "bench/transport_bench.hpp"
#include "bench/zero_bench.hpp"
#include "engine/training/recipe.hpp"
#include "tools/commands.hpp"

namespace troupe::tools {
namespace {

using nlohmann::json;

struct bench_options {
  bool json_output = false;
  bool no_peer = false;
  std::string python;
  std::string device = "cpu";
  bench::gpu_train_step_options gpu;
  int steps = 5;
  int warmup = 2;
  int pipeline_steps = 4;
  bool quick = false;
  bench::transport_peer_options transport_peer;
  int zero_steps = 10;
  int transport_repeats = 0;
  std::string transport_source = "engine";
  std::vector<std::string> transport_only;
  std::string zero_recipe = TROUPE_SOURCE_DIR "/examples/default.toml";
  std::vector<int> zero_levels = {0, 1, 2, 3};
  std::vector<int> zero_dps = {2, 4};
  bench::checkpoint_bench_options checkpoint{TROUPE_SOURCE_DIR "/examples/default.toml"};
  std::string checkpoint_device = "cpu";
  bench::checkpoint_device_options checkpoint_gpu;
  std::vector<int> checkpoint_every;
};

std::string find_python(const bench_options& o) {
  if (!o.python.empty()) return o.python;
  std::fprintf(stderr, "bench: preparing the PyTorch peer venv (tests/oracle/venv.sh)...\n");
  std::string venv;
  try {
    venv = bench::source_file("tests/oracle/venv.sh");
  } catch (const std::runtime_error& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    return "";
  }
  auto out = bench::capture_command("bash '" + venv + "'");
  if (!out) return "";
  while (!out->empty() && (out->back() == '\n' || out->back() == ' ')) out->pop_back();
  return *out;
}

std::optional<json> run_peer(const std::string& python, const bench::train_step_case& c,
                             int threads, const bench_options& o) {
  std::string script;
  try {
    script = bench::source_file("bench/pytorch_train_step.py");
  } catch (const std::runtime_error& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    return std::nullopt;
  }
  char cmd[2048];
  std::snprintf(cmd, sizeof cmd,
                "OMP_NUM_THREADS=%d '%s' '%s' --layers %d --heads %d --width %d --vocab %d "
                "--context %d --batch %d --seq %d --steps %d --warmup %d --threads %d",
                threads, python.c_str(), script.c_str(), c.model.layers, c.model.heads,
                c.model.width, c.model.vocab_size, c.model.context, c.batch, c.seq_len, o.steps,
                o.warmup, threads);
  auto out = bench::capture_command(cmd);
  if (!out) return std::nullopt;
  return bench::last_json_object(*out);
}

std::vector<bench::train_step_case> cases(const bench_options& o) {
  bench::train_step_case small;
  small.name = "default (4L, width 256, vocab 256, B8 T128)";
  small.model = engine::gpt_config{256, 256, 128, 4, 4, 256};
  small.batch = 8;
  small.seq_len = 128;
  bench::train_step_case gpt2;
  gpt2.name = "gpt2-small shape, 2 layers (width 768, vocab 50257, B4 T64)";
  gpt2.model = engine::gpt_config{50257, 50304, 1024, 2, 12, 768};
  gpt2.batch = 4;
  gpt2.seq_len = 64;
  for (auto* c : {&small, &gpt2}) {
    c->steps = o.steps;
    c->warmup = o.warmup;
  }
  return {small, gpt2};
}

int run_bench(const bench_options& o) {
  const int threads = omp_get_max_threads();
  const bench::peak_result peak = bench::measure_fp32_peak();
  std::string python;
  if (!o.no_peer) {
    python = find_python(o);
    if (python.empty())
      std::fprintf(stderr, "bench: PyTorch peer unavailable (venv could not be built)\n");
  }
  json report = {{"threads", threads},
                 {"peak_flops_per_s", peak.flops_per_s},
                 {"peak_isa", peak.isa},
                 {"cases", json::array()}};
  if (!o.json_output) {
    std::printf("FP32 peak (measured, %s, %d threads): %.1f GFLOP/s\n", peak.isa.c_str(),
                peak.threads, peak.flops_per_s / 1e9);
    std::printf("%-60s %12s %12s %7s %8s %8s\n", "case", "troupe tok/s", "torch tok/s", "ratio",
                "troupe%", "torch%");
  }
  for (const auto& c : cases(o)) {
    const auto mine = bench::measure_troupe_train_step(c);
    std::optional<json> peer;
    if (!python.empty()) peer = run_peer(python, c, threads, o);
    json entry = {{"case", c.name},
                  {"parameters", mine.parameters},
                  {"troupe_tokens_per_s", mine.tokens_per_s},
                  {"troupe_step_ms", mine.step_ms_median},
                  {"troupe_peak_share", mine.flops_per_s / peak.flops_per_s}};
    double peer_tps = 0;
    if (peer && peer->contains("tokens_per_s")) {
      peer_tps = (*peer)["tokens_per_s"].get<double>();
      const double peer_flops = peer_tps * c.model.train_flops_per_token(c.seq_len);
      entry["pytorch"] = *peer;
      entry["pytorch_tokens_per_s"] = peer_tps;
      entry["pytorch_peak_share"] = peer_flops / peak.flops_per_s;
      entry["ratio"] = mine.tokens_per_s / peer_tps;
    }
    report["cases"].push_back(entry);
    if (!o.json_output) {
      if (peer_tps > 0) {
        std::printf("%-60s %12.0f %12.0f %6.2fx %7.1f%% %7.1f%%\n", c.name.c_str(),
                    mine.tokens_per_s, peer_tps, mine.tokens_per_s / peer_tps,
                    100 * mine.flops_per_s / peak.flops_per_s,
                    100 * entry["pytorch_peak_share"].get<double>());
      } else {
        std::printf("%-60s %12.0f %12s %7s %7.1f%% %8s\n", c.name.c_str(), mine.tokens_per_s, "n/a",
                    "n/a", 100 * mine.flops_per_s / peak.flops_per_s, "n/a");
      }
      std::fflush(stdout);
    }
  }
  if (o.json_output) std::printf("%s\n", report.dump(2).c_str());
  return exit_ok;
}

}  // namespace

int run_pipeline(const bench_options& o) {
  bench::pipeline_bench_options po;
  po.steps = o.pipeline_steps;
  std::fprintf(stderr, "troupe bench pipeline: %d steps per case\n", po.steps);
  const auto report = bench::run_pipeline_bench(po);
  std::fputs(
      (o.json_output ? bench::report_json(report) + "\n" : bench::format_report(report)).c_str(),
      stdout);
  return exit_ok;
}

// The running binary, which `bench transport` runs again as its peer process.
std::string self_exe() {
  std::array<char, 4096> path{};
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  return n > 0 ? std::string(path.data(), static_cast<std::size_t>(n)) : std::string();
}

int run_transport(const bench_options& o) {
  bench::transport_bench_options to;
  to.quick = o.quick;
  to.repeats = o.transport_repeats;
  to.source = o.transport_source;
  to.only = o.transport_only;
  to.self_exe = self_exe();
  bench::transport_bench_report report;
  try {
    report = bench::run_transport_bench(to);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe bench transport: %s\n", e.what());
    return exit_failure;
  }
  std::fputs((o.json_output ? bench::transport_report_json(report) + "\n"
                            : bench::format_transport_report(report))
                 .c_str(),
             stdout);
  return exit_ok;
}

int run_zero(const bench_options& o) {
  bench::zero_bench_options zo;
  zo.recipe = o.zero_recipe;
  zo.steps = o.quick ? 4 : o.zero_steps;
  zo.warmup = o.quick ? 1 : std::min(2, zo.steps - 1);
  zo.dps = o.quick ? std::vector<int>{2} : o.zero_dps;
  zo.levels = o.zero_levels;
  zo.self_exe = self_exe();
  const auto joined = [](const std::vector<int>& values) {
    std::string text;
    for (const int v : values) text += (text.empty() ? "" : ",") + std::to_string(v);
    return text;
  };
  std::fprintf(stderr, "troupe bench zero: %d steps per run, dp %s, zero %s\n", zo.steps,
               joined(zo.dps).c_str(), joined(zo.levels).c_str());
  bench::zero_bench_report report;
  try {
    report = bench::run_zero_bench(zo);
  } catch (const engine::recipe_error& e) {
    std::fprintf(stderr, "troupe bench zero: %s\n", e.what());
    return exit_bad_input;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe bench zero: %s\n", e.what());
    return exit_failure;
  }
  std::fputs(
      (o.json_output ? bench::zero_report_json(report) + "\n" : bench::format_zero_report(report))
          .c_str(),
      stdout);
  return exit_ok;
}

int run_checkpoint(const bench_options& o) {
  if (o.checkpoint_device == "cuda") {
    std::vector<bench::checkpoint_device_run> runs;
    auto d = o.checkpoint_gpu;
    d.recipe = o.checkpoint.recipe;
    if (!o.checkpoint_every.empty()) d.every = o.checkpoint_every;
    try {
      runs = bench::run_checkpoint_device_bench(d);
    } catch (const engine::recipe_error& e) {
      std::fprintf(stderr, "troupe bench checkpoint: %s\n", e.what());
      return exit_bad_input;
    }
    std::fputs((o.json_output ? bench::checkpoint_device_report_json(runs) + "\n"
                              : bench::format_checkpoint_device_report(runs))
                   .c_str(),
               stdout);
    return runs.empty() || !runs.front().error.empty() ? exit_failure : exit_ok;
  }
  if (o.checkpoint_every.size() > 1) {
    std::fprintf(stderr, "troupe bench checkpoint: --every takes one value on the CPU\n");
    return exit_bad_input;
  }
  auto c = o.checkpoint;
  if (!o.checkpoint_every.empty()) c.every = o.checkpoint_every.front();
  std::vector<bench::checkpoint_case> cases;
  try {
    cases = bench::run_checkpoint_bench(c);
  } catch (const engine::recipe_error& e) {
    std::fprintf(stderr, "troupe bench checkpoint: %s\n", e.what());
    return exit_bad_input;
  }
  std::fputs((o.json_output ? bench::checkpoint_report_json(cases) + "\n"
                            : bench::format_checkpoint_report(cases))
                 .c_str(),
             stdout);
  return exit_ok;
}

std::function<int()> add_bench_command(CLI::App& app) {
  auto opts = std::make_shared<bench_options>();
  auto* bench = app.add_subcommand("bench", "Benchmarks against peers measured in the same run");
  bench->require_subcommand(1);
  auto* step =
      bench->add_subcommand("train-step", "Forward + backward + AdamW tokens/s vs PyTorch eager");
  step->add_flag("--json", opts->json_output, "Print one JSON report");
  step->add_flag("--no-peer", opts->no_peer, "Skip the PyTorch peer");
  step->add_option("--python", opts->python,
                   "Python with torch for the peer (default: the oracle venv; cuda: python3)");
  auto* steps =
      step->add_option("--steps", opts->steps, "Timed steps per case")->check(CLI::PositiveNumber);
  auto* warmup = step->add_option("--warmup", opts->warmup, "Untimed warm-up steps per case")
                     ->check(CLI::NonNegativeNumber);
  step->add_option("--device", opts->device,
                   "cpu (small models vs PyTorch eager on the CPU) or cuda (GPT-2 small on GPU 0 "
                   "vs PyTorch eager and torch.compile)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  step->add_option("--dtype", opts->gpu.dtype, "cuda: bf16 (fp32 master weights) or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  step->add_option("--batch", opts->gpu.batches, "cuda: sequences per step, e.g. 16,32,64")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  step->add_option("--attention", opts->gpu.attention,
                   "cuda: the attention kernels to run, fused, materialized and/or cudnn "
                   "(default cudnn)")
      ->delimiter(',')
      ->check(CLI::IsMember({"fused", "materialized", "cudnn"}));
  step->add_flag("--fast-paths,!--no-fast-paths", opts->gpu.fast_paths,
                 "cuda: the newer kernels of the rest of the step (recipe key kernels.fast_paths; "
                 "on by default)");
  step->add_flag("--breakdown", opts->gpu.breakdown,
                 "cuda: where the step goes, device time per op family from CUDA events");
  step->add_option("--seq", opts->gpu.seq_len, "cuda: tokens per sequence")
      ->check(CLI::Range(1, 1024));
  step->add_option("--layers", opts->gpu.layers, "cuda: transformer blocks (GPT-2 small: 12)")
      ->check(CLI::Range(1, 48));
  auto* pipe = bench->add_subcommand(
      "pipeline", "Measured pipeline bubble vs theory, actor dispatch share, DP overlap");
  pipe->add_flag("--json", opts->json_output, "Print one JSON report");
  pipe->add_option("--steps", opts->pipeline_steps, "Steps per case (the first is a warm-up)")
      ->check(CLI::Range(2, 1000));
  auto* transport = bench->add_subcommand(
      "transport", "UCX frames between two processes vs ucx_perftest (bandwidth, latency)");
  transport->add_flag("--json", opts->json_output, "Print one JSON report");
  transport->add_flag("--quick", opts->quick,
                      "Fewer frames, one ucx_perftest run per row (development)");
  transport
      ->add_option("--repeats", opts->transport_repeats,
                   "ucx_perftest runs per row, each between two of ours (default 7)")
      ->check(CLI::Range(1, 100));
  transport
      ->add_option("--only", opts->transport_only,
                   "Rows to run: shm, tcp, bandwidth, latency, latency-wait, 64KiB, 1MiB, "
                   "16MiB (a row runs if it matches every given kind)")
      ->delimiter(',');
  transport
      ->add_option("--source", opts->transport_source,
                   "The bandwidth rows' tensor: engine (written as ucx_perftest's send buffer is "
                   "over shared memory, in the engine's payload storage, huge pages where the "
                   "kernel gives them; never written over tcp, as ucx_perftest's), as-peer (as "
                   "ucx_perftest's buffer, its 4 KiB pages too) or written (in 4 KiB pages "
                   "everywhere) (default engine)")
      ->check(CLI::IsMember({"as-peer", "written", "engine"}));
  auto* zero = bench->add_subcommand(
      "zero", "ZeRO-1/2/3 vs DDP: step time, model state and measured peak RSS per rank");
  zero->add_flag("--json", opts->json_output, "Print one JSON report");
  zero->add_flag("--quick", opts->quick, "4 steps, dp=2 only (development)");
  zero->add_option("--steps", opts->zero_steps,
                   "Steps per run (the first 2, or 1 of 2 steps, are a warm-up, left out of the "
                   "step time)")
      ->check(CLI::Range(2, 10000));
  zero->add_option("--zero-levels", opts->zero_levels, "parallel.zero values, e.g. 0,1,2,3")
      ->delimiter(',')
      ->check(CLI::Range(0, 3));
  zero->add_option("--dp", opts->zero_dps, "Data-parallel widths, e.g. 2,4")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  zero->add_option("--recipe", opts->zero_recipe, "Recipe (default: examples/default.toml)")
      ->check(CLI::ExistingFile);
  auto* ckpt = bench->add_subcommand("checkpoint",
                                     "Step time with checkpoints against none; time to resume");
  ckpt->add_flag("--json", opts->json_output, "Print one JSON report");
  ckpt->add_option("--steps", opts->checkpoint.steps, "Steps per run of the recipe's shape")
      ->check(CLI::Range(3, 10000));
  ckpt->add_option("--gpt2-steps", opts->checkpoint.gpt2_steps,
                   "Steps per run of the GPT-2 small shape (0: skip it)")
      ->check(CLI::Range(0, 10000));
  ckpt->add_option("--rounds", opts->checkpoint.rounds,
                   "Runs of each kind (without, with checkpoints), alternating")
      ->check(CLI::Range(1, 100));
  ckpt->add_option("--recipe", opts->checkpoint.recipe, "Recipe (default: examples/default.toml)")
      ->check(CLI::ExistingFile);
  ckpt->add_option("--device", opts->checkpoint_device,
                   "cpu (the recipe's shape and GPT-2 small, a checkpoint every step) or cuda "
                   "(GPT-2 small on one GPU, a checkpoint every --every steps)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  ckpt->add_option("--every", opts->checkpoint_every,
                   "checkpoint.every of the runs with checkpoints (default: 1 on the CPU; 10,100 "
                   "with --device cuda, which takes several)")
      ->delimiter(',')
      ->check(CLI::Range(1, 100000));
  ckpt->add_option("--batch", opts->checkpoint_gpu.batch, "--device cuda: the micro-batch")
      ->check(CLI::Range(1, 1024));
  ckpt->add_option("--data", opts->checkpoint_gpu.data,
                   "--device cuda: data.train instead of the recipe's")
      ->check(CLI::ExistingFile);
  // Hidden (empty group): the peer process that `bench transport` starts.
  auto* peer = bench->add_subcommand("transport-peer", "The peer process of bench transport");
  peer->group("");
  peer->add_option("--fd", opts->transport_peer.fd, "Socket to the measuring process")->required();
  peer->add_option("--transports", opts->transport_peer.transports, "UCX_TLS");
  peer->add_option("--mode", opts->transport_peer.mode, "bandwidth, latency or latency-wait")
      ->required();
  peer->add_option("--warmup", opts->transport_peer.warmup, "Untimed frames (bandwidth)");
  peer->add_option("--frames", opts->transport_peer.frames, "Timed frames (bandwidth)");
  return [opts, step, steps, warmup, pipe, transport, zero, ckpt, peer]() {
    if (pipe->parsed()) return run_pipeline(*opts);
    if (zero->parsed()) return run_zero(*opts);
    if (ckpt->parsed()) return run_checkpoint(*opts);
    if (transport->parsed()) return run_transport(*opts);
    if (peer->parsed()) return bench::run_transport_peer(opts->transport_peer);
    if (opts->device == "cuda") {
      auto g = opts->gpu;
      if (steps->count() > 0) g.steps = opts->steps;
      if (warmup->count() > 0) g.warmup = opts->warmup;
      if (!opts->python.empty()) g.python = opts->python;
      g.no_peer = opts->no_peer;
      g.json_output = opts->json_output;
      return bench::run_gpu_train_step_bench(g);
    }
    (void)step;
    return run_bench(*opts);
  };
}

}  // namespace troupe::tools
