// A whole training run on the actor engine: builds the actors of a recipe (tracer, schedule,
// coordinator, p x d stages, reducers when d > 1, d data loaders), wires them, drives the run as
// the coordinator's client and tears everything down. `troupe train` calls this; tests call it
// with hooks.
//
// In one process everything is local. When the process is one of several of a job (options.launch
// with world > 1: troupe launch, srun, mpirun, torchrun), each process joins the rendezvous at rank
// 0, connects UCX endpoints to every peer, spawns only its own actors (topology/placement.hpp) and
// a proxy for every other one, and starts its gateway (actors/gateway.hpp). Rank 0 drives the run
// and writes metrics, weights and the trace; the others serve until rank 0 ends the job.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/training/trainer.hpp"
#include "transport/launch_env.hpp"

namespace caf {
class actor;
class actor_system;
}  // namespace caf

namespace troupe::engine {
struct chunk_factory;
}  // namespace troupe::engine

namespace troupe::actors {

// The actors of a running job, for hooks (tests, embedding).
struct run_handles {
  const caf::actor& coordinator;
  const std::vector<std::vector<caf::actor>>& stages;  // [replica][rank]
};

struct run_options {
  std::string trace_path;       // write a Chrome trace-event file here ("" = no tracing)
  std::vector<int> seq_lens;    // per micro-batch sequence lengths, cycled; empty: batch.seq_len
  int compute_threads = 0;      // BLAS/OpenMP threads per stage; 0: cores / (pp * dp), >= 1
  bool check_replicas = false;  // compare every replica's final parameters bitwise
  // Take the final parameters into run_result::parameters even when no weights file is written.
  // ZeRO-3 gathers them whole on every replica for it, which a memory measurement may not want.
  bool collect_parameters = true;
  // Test hook: the handle a stage uses to reach a peer stage; return a relay in front of it.
  std::function<caf::actor(caf::actor_system&, const caf::actor& target)> link_relay;
  // Called in the driving thread after every step (1-based), e.g. to swap the schedule.
  std::function<void(caf::actor_system&, const run_handles&, int step)> after_step;
  // Stages on device chunks and links of this kind instead of CPU chunks (actors/stage.hpp);
  // recipe device "cuda" sets CUDA ones. Tests pass engine::host_chunks.
  std::shared_ptr<const engine::chunk_factory> device_chunks;
  // This process's place in a multi-process job; world 1 (the default): everything in-process.
  transport::launch_env launch;
  std::chrono::milliseconds rendezvous_timeout{120000};
  std::chrono::milliseconds peer_timeout{10000};  // a silent peer is lost after this
  // Resume from a checkpoint (docs/checkpoints.md): a step directory, or a checkpoint root (its
  // newest committed checkpoint that verifies). Empty: a fresh run.
  std::string resume;
  // Resuming: the trajectory keys (and global_batch) the recipe may change against the
  // checkpoint's, each recorded; and whether newer checkpoints of checkpoint.dir than the one
  // resumed are moved aside (set-aside-<step>-<time>/) rather than refused.
  std::vector<std::string> allow_change;
  bool set_aside_newer = false;
  // Testing the watchdog: the first action of step test_stall_step (0-based) of the stage of
  // pipeline rank test_stall_rank (replica 0) never ends.
  int test_stall_rank = -1, test_stall_step = -1;
  // Testing checkpoints: every stage's copy of a captured state starts this much later (so the
  // next step's update has to wait for it).
  int test_capture_delay_ms = 0;
  // An embedding's pacing: steps to run before the coordinator pauses (-1: all); and a
  // checkpoint writer even without checkpoint.every (checkpoints taken on request).
  int step_limit = -1;
  bool checkpoint_writer = false;
};

struct run_result {
  int rank = 0;  // this process; only rank 0's result carries metrics and parameters
  engine::train_summary summary;
  std::vector<engine::step_metrics> steps;
  std::map<std::string, std::vector<float>> parameters;  // replica 0, by Hugging Face name
};

// A job of this process in steps, for run_training and an embedding (include/troupe/trainer.hpp):
//  - made: bad input throws engine::recipe_error (nothing written), the outputs are opened and a
//    multi-process job's processes joined;
//  - spawn: its actors in `sys`, wired, with `client` receiving step_report, training_paused and
//    run_finished; the control process's coordinator starts;
//  - record: each step_report's metrics into the metrics file and the result;
//  - finish: after run_finished, every checkpoint begun is committed, the final weights (and
//    trace) collected and written, this process's actors stopped; returns the failure, or "".
class training_job {
 public:
  training_job(engine::recipe recipe, engine::train_callbacks callbacks, run_options options);
  ~training_job();
  training_job(const training_job&) = delete;
  training_job& operator=(const training_job&) = delete;
  void spawn(caf::actor_system& sys, const caf::actor& client);
  void record(const engine::step_metrics& m);
  std::string finish(caf::actor_system& sys, std::string failure);
  const caf::actor& coordinator() const;
  const caf::actor& checkpointer() const;  // unset without checkpoints
  const std::vector<std::vector<caf::actor>>& stages() const;
  bool control() const;  // this process runs the coordinator
  const engine::recipe& recipe() const;
  int start_step() const;  // the steps done before this run (a checkpoint's, resuming)
  const run_result& result() const;

 private:
  struct state;
  std::unique_ptr<state> s_;
};

// Throws engine::recipe_error for bad input (nothing written) and std::runtime_error naming
// the actor that failed.
run_result run_training(const engine::recipe& recipe, const engine::train_callbacks& callbacks,
                        const run_options& options = {});

}  // namespace troupe::actors
