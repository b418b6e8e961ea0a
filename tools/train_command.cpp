// `troupe train RECIPE.toml [--set key=value ...] [--trace FILE] [--engine actors|serial]
// [--device cpu|cuda]`: the actor engine (pipeline stages, schedule, data loaders, coordinator) by
// default on the CPU, or the serial loop (the reference, and the whole model on one GPU with
// --device cuda and parallel.pp = 1; a GPU pipeline, pp > 1, runs device stage actors). A process
// started by `troupe launch`, srun, mpirun or a torchrun-style environment joins its job from the
// environment (transport/launch_env.hpp); rank 0 prints. With --report-peak-rss every process,
// whatever its rank, ends a successful run with one JSON line on stderr:
// {"rank":R,"world":W,"peak_rss_bytes":N} (`troupe bench zero` reads it). Exit 2 with one line
// naming the key or file on bad input (nothing written), 1 on a failed run.
#include <sys/resource.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>

#include "actors/pipeline_run.hpp"
#include "engine/chunks/device_chunk.hpp"
#include "engine/parallel/memory_plan.hpp"
#include "engine/parallel/support.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/trainer.hpp"
#include "kernels/cpu_threads.hpp"
#include "tools/commands.hpp"
#include "tools/progress.hpp"
#include "transport/launch_env.hpp"

namespace troupe::tools {
namespace {

// This process's peak resident set size (getrusage: ru_maxrss is in KiB on Linux); -1 if unknown.
std::int64_t peak_rss_bytes() {
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

}  // namespace

std::function<int()> add_train_command(CLI::App& app) {
  struct options {
    std::string recipe;
    std::vector<std::string> overrides;
    std::string trace;
    std::string engine;  // empty: serial for one GPU stage, else actors
    std::string device;  // empty: the recipe's `device`
    double peer_timeout = 10;
    double rendezvous_timeout = 120;
    int threads = 0;  // 0: the cores / the stages in this process
    bool dry_run = false;
    bool report_peak_rss = false;
    std::string test_chunks;  // "host": stages on device chunks of the host kind
    std::string resume;       // with resume_given: a checkpoint dir; empty: checkpoint.dir
    std::string test_stall;   // "RANK:STEP": that stage's first action of STEP never ends
    std::vector<std::string> allow_change;  // trajectory keys a resume may change
    bool set_aside_newer = false;
  };
  auto opts = std::make_shared<options>();
  auto* cmd = app.add_subcommand(
      "train",
      "Train a model from a recipe: this process, or one process of a job started by troupe "
      "launch, Slurm, mpirun or torchrun-style variables");
  cmd->add_option("recipe", opts->recipe, "Recipe TOML file")->required();
  cmd->add_option("--set", opts->overrides, "Override a recipe key: --set optimizer.lr=3e-4")
      ->take_all()
      ->allow_extra_args(false);
  cmd->add_option("--trace", opts->trace,
                  "Write a Chrome trace-event file of every message and action (Perfetto)");
  cmd->add_option("--engine", opts->engine,
                  "actors (the default, but for one GPU stage) or serial (the reference loop; "
                  "the default for one process with --device cuda, parallel.pp = 1, "
                  "parallel.tp = 1 and no checkpoints)")
      ->check(CLI::IsMember({"actors", "serial"}));
  cmd->add_option("--device", opts->device,
                  "cpu, or cuda: the whole model on one GPU (the recipe key `device`)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--peer-timeout", opts->peer_timeout,
                  "Seconds without a heartbeat after which a peer process counts as lost")
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--rendezvous-timeout", opts->rendezvous_timeout,
                  "Seconds to wait for every process of the job to join")
      ->check(CLI::Range(0.1, 86400.0));
  cmd->add_option("--threads", opts->threads,
                  "BLAS/OpenMP threads per stage (default: this machine's cores / the stages in "
                  "this process). GEMM results can depend on it: runs compared bit for bit should "
                  "use the same count")
      ->check(CLI::Range(1, 1024));
  cmd->add_flag("--dry-run", opts->dry_run,
                "Check the recipe and print the per-rank memory plan; allocate and train nothing");
  cmd->add_flag_callback(
      "--help-support",
      [] {
        std::fputs(engine::format_support_table().c_str(), stdout);
        throw CLI::Success();
      },
      "Print what a job cannot combine on the CPU and on CUDA (a Markdown table; "
      "docs/support.md)");
  cmd->add_flag_callback(
      "--help-keys",
      [] {
        std::fputs(engine::format_recipe_keys().c_str(), stdout);
        throw CLI::Success();
      },
      "Print every recipe key with its type, default and meaning (a Markdown table; "
      "docs/recipe.md)");
  cmd->add_flag_callback(
      "--help-key-classes",
      [] {
        std::fputs(engine::format_key_classes().c_str(), stdout);
        throw CLI::Success();
      },
      "Print every recipe key's class on resume: model, trajectory, mesh or free (a Markdown "
      "table; docs/checkpoints.md)");
  cmd->add_option("--test-chunks", opts->test_chunks,
                  "Testing: stages on device chunks of the host kind, the GPU pipeline's protocol "
                  "(slots, links, payloads staged through host memory across processes) on the "
                  "CPU engine's arithmetic")
      ->check(CLI::IsMember({"host"}));
  cmd->add_option("--test-stall", opts->test_stall,
                  "Testing the watchdog: RANK:STEP, the stage of pipeline rank RANK (replica 0) "
                  "never finishes its first action of step STEP (1-based), unless the job was "
                  "restarted")
      ->group("");
  auto* resume_opt =
      cmd->add_option("--resume", opts->resume,
                      "Continue from a checkpoint: the newest committed one that verifies under "
                      "DIR (a checkpoint directory, or one step-N directory of it); without DIR, "
                      "under the recipe's checkpoint.dir (docs/checkpoints.md)")
          ->expected(0, 1);
  cmd->add_option("--allow-change", opts->allow_change,
                  "Resuming: trajectory keys (or global_batch) that may differ from the "
                  "checkpoint's recipe, comma-separated; each change is recorded in metrics.jsonl "
                  "and the next checkpoint (docs/checkpoints.md)")
      ->delimiter(',');
  cmd->add_flag("--set-aside-newer", opts->set_aside_newer,
                "Resuming an older checkpoint: move the newer ones of checkpoint.dir into "
                "checkpoint.dir/set-aside-STEP-TIME/ instead of refusing");
  cmd->add_flag("--report-peak-rss", opts->report_peak_rss,
                "At the end, every process prints its peak resident memory as one JSON line on "
                "stderr");
  return [opts, resume_opt]() -> int {
    // Past a file size limit (ulimit -f) a write fails with EFBIG, reported naming the file,
    // instead of SIGXFSZ ending the process without a word.
    std::signal(SIGXFSZ, SIG_IGN);
    engine::recipe r;
    try {
      auto overrides = opts->overrides;
      if (!opts->device.empty()) overrides.push_back("device=\"" + opts->device + "\"");
      r = engine::load_recipe(opts->recipe, overrides);
    } catch (const engine::recipe_error& e) {
      std::fprintf(stderr, "troupe train: %s\n", e.what());
      return exit_bad_input;
    }
    const bool gpu = r.device == "cuda";
    if (opts->dry_run) {
      try {
        std::fputs((gpu ? engine::format_gpu_memory_plan(r)
                        : engine::format_memory_plan(r, engine::plan_memory(r)))
                       .c_str(),
                   stdout);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "troupe train: %s\n", e.what());
        return exit_bad_input;
      }
      return exit_ok;
    }
    transport::launch_env launch;
    try {
      launch = transport::detect_launch_env(transport::current_environment());
    } catch (const transport::launch_error& e) {
      std::fprintf(stderr, "troupe train: %s\n", e.what());
      return exit_bad_input;
    }
    // One GPU without pipeline or tensor shards, in one process: the serial trainer
    // (gpu_trainer), else actors.
    bool resume = resume_opt->count() > 0;
    // A job started again (troupe launch --max-restarts, or Slurm's --requeue) goes on from its
    // last committed checkpoint, if it has one.
    const auto env = transport::current_environment();
    for (const char* key : {"TROUPE_RESTART_COUNT", "SLURM_RESTART_COUNT"}) {
      const auto it = env.find(key);
      if (resume || it == env.end() || it->second.empty() || it->second == "0") continue;
      for (const auto& e : engine::list_checkpoints(r.checkpoint_path())) resume |= e.committed;
      if (resume && launch.rank == 0)
        std::fprintf(stderr, "troupe train: restarted (%s=%s): resuming from %s\n", key,
                     it->second.c_str(), r.checkpoint_path().c_str());
    }
    if (!resume && (!opts->allow_change.empty() || opts->set_aside_newer)) {
      std::fprintf(stderr, "troupe train: %s needs --resume\n",
                   opts->set_aside_newer ? "--set-aside-newer" : "--allow-change");
      return exit_bad_input;
    }
    const bool checkpoints = resume || r.checkpoint.every > 0;
    if (opts->engine.empty())
      opts->engine = gpu && r.parallel.pp == 1 && r.parallel.tp == 1 && launch.world == 1 &&
                             opts->test_chunks.empty() && !checkpoints
                         ? "serial"
                         : "actors";
    if (checkpoints && opts->engine == "serial") {
      std::fprintf(stderr,
                   "troupe train: %s needs the actor engine (--engine actors; the serial loop "
                   "writes no checkpoints)\n",
                   resume ? "--resume" : "key checkpoint.every");
      return exit_bad_input;
    }
    if (!opts->test_chunks.empty() && opts->engine == "serial") {
      std::fprintf(stderr,
                   "troupe train: --test-chunks needs the actor engine (--engine actors)\n");
      return exit_bad_input;
    }
    if (launch.world > 1 && opts->engine == "serial") {
      std::fprintf(stderr,
                   "troupe train: --engine serial runs in one process, but this process is "
                   "rank %d of %d (%s)\n",
                   launch.rank, launch.world, launch.describe().c_str());
      return exit_bad_input;
    }
    const bool quiet = launch.rank != 0;
    progress_printer progress(stdout);  // ranks other than 0 get no steps or messages
    engine::train_callbacks cb;
    cb.on_step = [&](const engine::step_metrics& m) { progress.step(m); };
    cb.on_message = [&](const std::string& s) { progress.message(s); };
    engine::train_summary summary;
    try {
      if (opts->engine == "serial") {
        if (!opts->trace.empty())
          throw engine::recipe_error("--trace needs the actor engine (--engine actors)");
        if (opts->threads > 0) kernels::set_compute_threads(opts->threads);
        summary = engine::train(r, cb);
      } else {
        actors::run_options o;
        o.trace_path = opts->trace;
        o.collect_parameters = false;  // only for the weights file (output.weights)
        o.launch = launch;
        o.compute_threads = opts->threads;
        if (resume) o.resume = opts->resume.empty() ? r.checkpoint_path().string() : opts->resume;
        o.allow_change = opts->allow_change;
        o.set_aside_newer = opts->set_aside_newer;
        const auto restarted = env.find("TROUPE_RESTART_COUNT");
        if (!opts->test_stall.empty() && (restarted == env.end() || restarted->second == "0")) {
          const auto colon = opts->test_stall.find(':');
          o.test_stall_rank = std::stoi(opts->test_stall.substr(0, colon));
          o.test_stall_step = std::stoi(opts->test_stall.substr(colon + 1)) - 1;
        }
        if (opts->test_chunks == "host")
          o.device_chunks = std::make_shared<engine::chunk_factory>(
              engine::host_chunks(r.activation_checkpoint.full()));
        o.peer_timeout = std::chrono::milliseconds(static_cast<long>(opts->peer_timeout * 1000));
        o.rendezvous_timeout =
            std::chrono::milliseconds(static_cast<long>(opts->rendezvous_timeout * 1000));
        summary = actors::run_training(r, cb, o).summary;
      }
    } catch (const engine::recipe_error& e) {
      progress.finish();
      std::fprintf(stderr, "troupe train: %s\n", e.what());
      return exit_bad_input;
    } catch (const std::exception& e) {
      progress.finish();
      if (launch.world > 1)
        std::fprintf(stderr, "troupe train: rank %d: error: %s\n", launch.rank, e.what());
      else
        std::fprintf(stderr, "troupe train: error: %s\n", e.what());
      return exit_failure;
    }
    progress.finish();
    if (opts->report_peak_rss) {
      std::fprintf(stderr, "{\"rank\":%d,\"world\":%d,\"peak_rss_bytes\":%lld}\n", launch.rank,
                   launch.world, static_cast<long long>(peak_rss_bytes()));
      std::fflush(stderr);
    }
    if (quiet) return exit_ok;
    char val[48] = "no validation";  // no validation data, or eval_interval = 0
    if (std::isfinite(summary.final_val_loss))
      std::snprintf(val, sizeof val, "val loss %.4f", summary.final_val_loss);
    char line[320];
    std::snprintf(line, sizeof line,
                  "done: %d steps in %s, %.0f tokens/s; final loss %.4f, %s, "
                  "corpus unigram entropy %.4f nats/token",
                  summary.steps, format_duration(summary.seconds).c_str(), summary.tokens_per_s,
                  summary.final_loss, val, summary.unigram_entropy);
    progress.message(line);
    progress.message("metrics: " + r.metrics_path().string());
    return exit_ok;
  };
}

}  // namespace troupe::tools
