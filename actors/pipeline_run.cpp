// Building, driving and tearing down a run (its actors are spawned and wired in
// pipeline_wiring.cpp). See pipeline_run.hpp.
#include "actors/pipeline_run.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include <unistd.h>

#include "actors/checkpoint_writer.hpp"
#include "actors/coordinator.hpp"
#include "actors/error_text.hpp"
#include "actors/gateway.hpp"
#include "actors/pipeline_wiring.hpp"
#include "actors/schedule_actor.hpp"
#include "actors/tracer.hpp"
#include "engine/chunks/device_chunk.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/parallel/memory_plan.hpp"
#include "engine/parallel/support.hpp"
#include "engine/training/checkpoint_identity.hpp"
#include "engine/training/resume_check.hpp"
#include "engine/training/run_lock.hpp"
#include "topology/placement.hpp"
#include "transport/rendezvous.hpp"
#include "transport/ucx_transport.hpp"

namespace troupe::actors {

using namespace messages;
namespace trace = engine::trace;

namespace {

trace::metadata trace_metadata(const engine::recipe& r, const engine::pipeline_plan& plan) {
  trace::metadata m;
  m.schedule = r.parallel.schedule;
  m.ranks = r.parallel.pp;
  m.micro_batches = r.parallel.micro_batches;
  m.virtual_stages = r.parallel.virtual_stages;
  m.replicas = r.parallel.dp;
  std::istringstream lines(engine::format_plan(plan));
  for (std::string line; std::getline(lines, line);) m.plan.push_back(line);
  return m;
}

void write_final_weights(const engine::recipe& r, const run_result& res) {
  const auto path = r.weights_path();
  if (path.empty()) return;
  engine::gpt_chunk whole(r.model, engine::chunk_range::whole(r.model));
  for (const auto& p : whole.parameters()) {
    const auto& v = res.parameters.at(p.name);
    std::memcpy(whole.params() + p.offset, v.data(), v.size() * sizeof(float));
  }
  engine::save_hf_weights(whole, path);
}

}  // namespace

namespace {

// Joins the job: rendezvous at rank 0 and a UCX endpoint to every peer. device: this process's
// CUDA device ("" for none); nccl_ids: rank 0's offer of NCCL ids, one per link between
// processes. The welcome comes back in *w. Throws std::runtime_error naming the rendezvous
// address or the peer.
std::unique_ptr<remote_mesh> join_job(const engine::recipe& r, const run_options& o,
                                      const topology::job_placement& pl, std::string device,
                                      std::vector<std::vector<std::uint8_t>> nccl_ids,
                                      std::string resume, welcome* w) {
  const auto& env = o.launch;
  auto transport = std::make_unique<transport::ucx_transport>(env.rank);
  hello h;
  h.job_token = env.job_token;
  h.coords = {env.rank, env.world, 0, 0};
  for (int d = 0; d < r.parallel.dp; ++d)
    for (int k = r.parallel.pp - 1; k >= 0; --k)
      for (int j = r.parallel.tp - 1; j >= 0; --j)
        if (pl.process_of_stage(d, k, j) == env.rank) h.coords = {env.rank, env.world, d, k};
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  h.host = host;
  h.worker_address = transport->address();
  h.device = std::move(device);
  h.resume = std::move(resume);
  if (env.rank == 0) h.nccl_ids = std::move(nccl_ids);
  transport::rendezvous_options ro{env.master_addr, env.master_port, o.rendezvous_timeout};
  *w = env.rank == 0 ? transport::rendezvous_serve(ro, h) : transport::rendezvous_join(ro, h);
  gateway_config gc;
  gc.rank = env.rank;
  gc.world = env.world;
  gc.limits = wire::limits_for(r);
  gc.peer_timeout = o.peer_timeout;
  gc.hosts.resize(static_cast<std::size_t>(env.world));
  for (const auto& peer : w->peers) {
    gc.hosts.at(static_cast<std::size_t>(peer.rank)) = peer.host;
    // Peers on other hosts get UCX's peer error handling (a lost peer is reported, and UCX 1.13
    // cannot abort this process while wiring up tcp); peers on this host keep shared memory,
    // which that mode would turn off, and are watched by heartbeats (docs/transport.md).
    if (peer.rank != env.rank)
      transport->connect(peer.rank, peer.worker_address, peer.host != h.host);
  }
  return std::make_unique<remote_mesh>(std::move(transport), std::move(gc));
}

// What the job combines that is not built, refused before anything is written
// (engine/parallel/support.hpp), and a chunk kind without tensor groups asked for tensor shards.
void check_job(const engine::recipe& r, const run_options& o,
               const std::shared_ptr<const engine::chunk_factory>& chunks) {
  engine::job_shape job;
  job.r = &r;
  job.processes = o.launch.world;
  job.device_chunks = r.device == "cuda" || chunks;
  engine::check_support(job);
  if (r.parallel.tp > 1 && chunks && !chunks->make_tensor_group)
    throw engine::recipe_error("key parallel.tp: tensor parallelism on " + chunks->name +
                               " chunks: not built");
  if (r.parallel.tp > 1 && o.launch.world > 1 && chunks && !chunks->host_tensor_groups)
    throw engine::recipe_error("key parallel.tp: tensor shards of " + chunks->name +
                               " chunks in a job of several processes: not built");
}

// Resuming (docs/checkpoints.md, "Resume"): the recipe against the checkpoint's, key by key, its
// tensors against the model, and the checkpoint.dir's committed checkpoints newer than the one
// resumed, refused or (rank 0,
// --set-aside-newer) moved aside. Returns the trajectory changes allowed now.
std::vector<engine::recipe_change> check_resume(
    const engine::recipe& r, const run_options& o, const std::filesystem::path& dir,
    const engine::checkpoint_state& saved, int rank,
    const std::function<void(const std::string&)>& say) {
  std::vector<engine::recipe_change> allowed;
  if (const auto before = engine::saved_recipe(saved, dir)) {
    auto review = engine::review_resume(*before, r, saved.step, o.allow_change);
    for (const auto& m : review.mesh) say("resharding: " + m);
    for (const auto& c : review.allowed)
      say("changed with --allow-change: " + c.key + " " + c.from + " -> " + c.to);
    allowed = std::move(review.allowed);
  } else if (!o.allow_change.empty()) {
    throw engine::recipe_error("--allow-change: checkpoint " + dir.string() +
                               " holds no recipe to compare with");
  }
  try {
    engine::check_checkpoint_model(dir, r.model);
  } catch (const std::exception& e) {
    throw engine::recipe_error(e.what());
  }
  if (rank != 0 && o.set_aside_newer) return allowed;  // rank 0 moves them
  const auto newer = engine::newer_checkpoints(r.checkpoint_path(), saved.step);
  if (newer.empty()) return allowed;
  std::string names;
  for (const auto& e : newer) names += (names.empty() ? "" : ", ") + e.dir.filename().string();
  if (!o.set_aside_newer)
    throw engine::recipe_error("key checkpoint.dir: " + r.checkpoint_path().string() +
                               " holds checkpoints newer than " + dir.filename().string() + " (" +
                               names +
                               "): resume the newest, or --set-aside-newer to move them "
                               "aside");
  const auto aside = engine::set_aside_checkpoints(r.checkpoint_path(), newer, saved.step);
  say("set aside " + names + " into " + aside.string());
  return allowed;
}

}  // namespace

struct training_job::state {
  engine::recipe r;
  engine::train_callbacks cb;
  run_options o;
  bool multi = false;
  int my_rank = 0;
  std::unique_ptr<build_inputs> in_ptr;
  std::optional<engine::run_lock> lock;  // rank 0: its directories, until after the metrics
  std::optional<engine::jsonl_writer> metrics;
  run_result res;
  std::unique_ptr<remote_mesh> mesh;
  run_actors a;
  // Resuming: every trajectory change allowed in this run's history (the next checkpoint keeps
  // them), and this resume's, for the first step's metrics line.
  std::vector<engine::recipe_change> recipe_changes, changes_to_note;
  void say(const std::string& s) const {
    if (cb.on_message && my_rank == 0) cb.on_message(s);
  }
  // One job per directory: rank 0 locks output.dir, and checkpoint.dir where this job writes or
  // moves checkpoints, before it writes there (engine/training/run_lock.hpp).
  void take_lock() {
    if (lock) return;
    std::vector<engine::run_lock::directory> dirs{{r.output.dir, "output.dir"}};
    if (r.checkpoint.every > 0 || o.checkpoint_writer || o.set_aside_newer)
      dirs.push_back({r.checkpoint_path(), "checkpoint.dir"});
    engine::run_lock_options options;
    options.notice = [this](const std::string& s) { say(s); };
    lock.emplace(dirs, options);
  }
};

training_job::training_job(engine::recipe recipe, engine::train_callbacks callbacks,
                           run_options options)
    : s_(std::make_unique<state>()) {
  s_->r = std::move(recipe);
  s_->cb = std::move(callbacks);
  s_->o = std::move(options);
  const auto& r = s_->r;
  const auto& o = s_->o;
  const bool multi = s_->multi = o.launch.world > 1;
  const int my_rank = s_->my_rank = multi ? o.launch.rank : 0;
  auto say = [this](const std::string& text) { s_->say(text); };
  s_->in_ptr = std::make_unique<build_inputs>(
      build_inputs{r, o, {}, engine::load_training_data(r), o.seq_lens, trace::trace_clock::now()});
  auto& in = *s_->in_ptr;
  auto& metrics = s_->metrics;
  auto& res = s_->res;
  auto& mesh = s_->mesh;
  // 1. Everything that can fail on bad input, before anything is written or spawned.
  if (!o.resume.empty()) {
    try {
      in.resume_dir = engine::find_checkpoint(o.resume, say);
      in.resumed = engine::read_checkpoint_state(in.resume_dir);
    } catch (const engine::recipe_error&) {
      throw;
    } catch (const std::exception& e) {
      throw engine::recipe_error(e.what());
    }
    if (in.resumed.step > r.steps)
      throw engine::recipe_error("key steps: " + std::to_string(r.steps) + ", but checkpoint " +
                                 in.resume_dir.string() + " has done " +
                                 std::to_string(in.resumed.step) + " steps: nothing to run");
    if (my_rank == 0 && o.set_aside_newer) s_->take_lock();  // before checkpoints move aside
    s_->changes_to_note = check_resume(r, o, in.resume_dir, in.resumed, my_rank, say);
    s_->recipe_changes = in.resumed.recipe_changes;
    s_->recipe_changes.insert(s_->recipe_changes.end(), s_->changes_to_note.begin(),
                              s_->changes_to_note.end());
    say("resuming from " + in.resume_dir.string() + " after step " +
        std::to_string(in.resumed.step) +
        (in.resumed.step == r.steps
             ? ": all " + std::to_string(r.steps) + " steps are done; the final weights are its own"
             : ""));
  } else if ((r.checkpoint.every > 0 || o.checkpoint_writer) && my_rank == 0) {
    // A fresh run never writes over another run's checkpoints (nor does a trainer, which can
    // take one whenever asked).
    // A job that holds them now is named first (the lock, released as this throws).
    for (const auto& e : engine::list_checkpoints(r.checkpoint_path()))
      if (e.committed) {
        s_->take_lock();
        throw engine::recipe_error("key checkpoint.dir: " + r.checkpoint_path().string() +
                                   " holds checkpoints (newest " + e.dir.filename().string() +
                                   "): resume them with --resume, or choose another " +
                                   "checkpoint.dir or output.dir");
      }
  }
  if (in.seq_lens.empty()) in.seq_lens.push_back(r.batch.seq_len);
  in.chunks = o.device_chunks;
  check_job(r, o, in.chunks);
  for (int T : in.seq_lens)
    if (T < 1 || T > r.model.context)
      throw engine::recipe_error("sequence length " + std::to_string(T) + " is outside [1, " +
                                 "model.context]");
  try {
    in.layout = engine::make_pipeline_layout(r.model, r.parallel.pp, r.parallel.virtual_stages,
                                             r.parallel.layer_split);
  } catch (const std::invalid_argument& e) {
    throw engine::recipe_error(std::string("key parallel.layer_split: ") + e.what());
  }
  try {
    in.placement = topology::job_placement(r.parallel.pp, r.parallel.dp, multi ? o.launch.world : 1,
                                           r.parallel.tp);
  } catch (const std::invalid_argument& e) {
    throw engine::recipe_error(std::string("keys parallel.pp, parallel.dp") +
                               (r.parallel.tp > 1 ? ", parallel.tp: " : ": ") + e.what());
  }
  in.rank = my_rank;
  make_samplers(in);
  if (r.device == "cuda" && !in.chunks) {  // throws saying why without CUDA
    // Across processes each process uses device LOCAL_RANK mod the devices it sees.
    auto options = engine::gpu_options(r);
    options.split_backward = engine::splits_backward(r);  // a zero-bubble schedule's B and W
    in.chunks = std::make_shared<engine::chunk_factory>(engine::cuda_chunks(
        options, r.parallel.pp, r.parallel.tp, multi ? o.launch.local_rank : -1));
  }
  // 2. Outputs (rank 0 only).
  if (my_rank == 0) {
    s_->take_lock();  // before anything is written there
    std::error_code ec;
    std::filesystem::create_directories(r.output.dir, ec);
    if (ec)
      throw engine::recipe_error("key output.dir: cannot create " + r.output.dir + ": " +
                                 ec.message());
    // Resuming: the metrics of the steps the checkpoint holds stay, later ones go.
    metrics.emplace(r.metrics_path(), in.resume_dir.empty() ? -1 : in.resumed.step);
  }
  res.rank = my_rank;
  res.summary.parameters = r.model.parameter_count();
  res.summary.unigram_entropy = engine::unigram_entropy(in.data.train, r.model.vocab_size);
  res.summary.final_val_loss = std::numeric_limits<double>::quiet_NaN();
  say("model: " + std::to_string(res.summary.parameters) + " parameters; train corpus " +
      std::to_string(in.data.train.size()) + " tokens, validation " +
      std::to_string(in.data.val.size()) + " tokens; unigram entropy " +
      std::to_string(res.summary.unigram_entropy) + " nats/token");
  say("actors: pp " + std::to_string(r.parallel.pp) + " x dp " + std::to_string(r.parallel.dp) +
      (r.parallel.tp > 1 ? " x tp " + std::to_string(r.parallel.tp) : "") + ", schedule " +
      r.parallel.schedule + ", " + std::to_string(r.parallel.micro_batches) + " micro-batches x " +
      std::to_string(r.batch.grad_accum) + " rounds per step" +
      (multi ? ", " + std::to_string(o.launch.world) + " processes (" + o.launch.describe() + ")"
             : ""));

  if (in.chunks)
    say("device stages: " + in.chunks->name + " chunks, " + r.precision.dtype + " compute, " +
        attention_kernel_for(r) + " attention" +
        (r.activation_checkpoint.full() ? ", every block recomputed" : ""));

  // 3. The job's processes.
  if (multi) {
    // Device payloads between processes by NCCL (parallel.nccl_links): each process offers its
    // device, rank 0 an id per communicator of nccl_plan (pipeline and tied wte links,
    // data-parallel and tensor groups between processes); the welcome keeps the ids only where
    // every process has a device of its own.
    const bool nccl = in.chunks && r.parallel.nccl_links && in.chunks->make_process_link;
    nccl_communicators plan;
    std::vector<std::vector<std::uint8_t>> offered;
    std::string no_ids;  // why rank 0 offers none
    if (nccl) {
      plan = nccl_plan(in);
      if (plan.size() > transport::max_nccl_ids) {
        no_ids = std::to_string(plan.size()) + " communicators, more than " +
                 std::to_string(transport::max_nccl_ids);
      } else if (my_rank == 0) {
        try {
          offered = in.chunks->new_link_ids(plan.size());
        } catch (const std::exception& e) {
          no_ids = std::string("NCCL made no ids: ") + e.what();
        }
      }
    }
    welcome w;
    // Every process must resume the same checkpoint: the rendezvous compares their choices.
    mesh =
        join_job(r, o, in.placement, nccl ? in.chunks->device_identity() : "", std::move(offered),
                 in.resume_dir.empty() ? "" : engine::checkpoint_identity(in.resume_dir), &w);
    in.mesh = mesh.get();
    in.origin = trace::trace_clock::now();  // all processes leave the rendezvous together
    in.nccl_ids = std::move(w.nccl_ids);
    say("rendezvous: " + std::to_string(o.launch.world) + " processes joined");
    if (!in.nccl_ids.empty() && in.nccl_ids.size() != plan.size())  // before any waits on one
      throw std::runtime_error("rendezvous: " + std::to_string(in.nccl_ids.size()) +
                               " NCCL ids for " + plan.describe() +
                               " between processes (parallel.nccl_links differs between the "
                               "processes' recipes?)");
    if (nccl && plan.size() > 0) {
      const std::string obstacle = transport::nccl_obstacle(w.peers);
      say(!in.nccl_ids.empty() ? "device payloads between processes: NCCL (" + plan.describe() + ")"
                               : "device payloads between processes: staged through host memory (" +
                                     (!obstacle.empty() ? obstacle
                                      : !no_ids.empty() ? no_ids
                                                        : "rank 0 offered no NCCL ids") +
                                     ")");
    }
  }

  // 4. The actors, watched (engine/training/watchdog.hpp): a stage stuck in one action ends this
  // process, which ends the job (its peers lose it) and lets a launcher restart it.
  in.watchdog = std::make_shared<engine::action_watchdog>(
      std::chrono::duration<double>(r.watchdog.action_timeout),
      [multi, my_rank](const std::string& report) {
        const std::string who = multi ? "rank " + std::to_string(my_rank) + ": " : "";
        std::fprintf(stderr, "troupe train: %serror: watchdog: %s; ending this process\n",
                     who.c_str(), report.c_str());
        std::fflush(stderr);
        std::_Exit(1);
      });
}

training_job::~training_job() = default;

void training_job::spawn(caf::actor_system& sys, const caf::actor& client) {
  const auto& r = s_->r;
  auto& in = *s_->in_ptr;
  auto& a = s_->a;
  const int my_rank = s_->my_rank;
  auto& mesh = s_->mesh;
  const auto& pl = in.placement;
  const int control = topology::job_placement::control_process;
  a.tracer = place(sys, a, in, pl.tracer_id, control, "tracer", [&] { return spawn_tracer(sys); });
  a.schedule = place(sys, a, in, pl.schedule_id, control, "schedule", [&] {
    // Device chunks keep a split backward's buffers only when made for one (the recipe's
    // schedule): no swap to a schedule with W actions then.
    return spawn_schedule_actor(
        sys, {r.parallel.schedule,
              {r.parallel.pp, r.parallel.micro_batches, r.parallel.virtual_stages},
              r.parallel.dp,
              !in.chunks || engine::splits_backward(r)});
  });
  coordinator_config cc;
  cc.steps = r.steps;
  cc.rounds = r.batch.grad_accum;
  cc.ranks = r.parallel.pp;
  cc.replicas = r.parallel.dp * r.parallel.tp;  // lanes
  cc.tp = r.parallel.tp;
  cc.sharded_grads = r.parallel.zero > 0;
  const bool has_val = !in.data.val.empty() && r.eval_interval > 0;
  cc.eval_interval = has_val ? r.eval_interval : 0;
  cc.eval_batches = has_val ? r.eval_batches : 0;
  cc.tokens_per_step = tokens_per_step(in);
  cc.flops_per_token = r.model.train_flops_per_token(r.batch.seq_len);
  cc.trace = add_track(a, in, "coordinator", "coordinator", -1, -1);
  cc.guard = r.guard;
  cc.scaling = r.precision.scaling();
  cc.checkpoint_every = r.checkpoint.every;
  cc.step_limit = s_->o.step_limit;
  cc.micro_batches_per_step = r.micro_batches_per_step();
  if (!in.resume_dir.empty()) {
    cc.start_step = in.resumed.step;
    cc.start_tokens = in.resumed.tokens;
    cc.start_micro_batches = in.resumed.micro_batches;
    cc.guard_state = in.resumed.guard;
  }
  a.coordinator = place(sys, a, in, pl.coordinator_id, control, "coordinator",
                        [&] { return spawn_coordinator(sys, std::move(cc)); });
  spawn_stages(sys, a, in);
  spawn_loaders(sys, a, in);
  if ((r.checkpoint.every > 0 || s_->o.checkpoint_writer) && my_rank == control) {
    checkpoint_writer_config wc;
    wc.model = r.model;
    wc.pp = r.parallel.pp;
    wc.dp = r.parallel.dp;
    wc.tp = r.parallel.tp;
    wc.zero = r.parallel.zero > 0;
    wc.root = r.checkpoint_path();
    wc.keep = r.checkpoint.keep;
    wc.parts = r.checkpoint.parts(s_->o.launch.world);
    const auto& p = r.parallel;
    wc.mesh = {p.pp,
               p.dp,
               p.tp,
               p.zero,
               p.virtual_stages,
               p.micro_batches,
               r.batch.grad_accum,
               r.batch.micro_batch};
    wc.schedule = p.schedule;
    wc.recipe_text = r.source_text;
    wc.overrides = r.overrides;
    wc.recipe_changes = s_->recipe_changes;
    wc.stages = a.stages;
    wc.trace = add_track(a, in, "checkpoint writer", "checkpoint", -1, -1);
    wc.tracer = a.tracer;
    a.checkpointer = caf::actor_cast<caf::actor>(spawn_checkpoint_writer(sys, std::move(wc)));
    a.local.push_back(a.checkpointer);
  }
  wire_actors(sys, a, in, client);
  if (mesh) mesh->start(sys, client);
  if (my_rank == control) caf::anon_send(a.coordinator, start_run{});
}

const caf::actor& training_job::coordinator() const { return s_->a.coordinator; }
const caf::actor& training_job::checkpointer() const { return s_->a.checkpointer; }
const std::vector<std::vector<caf::actor>>& training_job::stages() const { return s_->a.stages; }
bool training_job::control() const {
  return s_->my_rank == topology::job_placement::control_process;
}
const engine::recipe& training_job::recipe() const { return s_->r; }
int training_job::start_step() const { return s_->in_ptr->resumed.step; }

void training_job::record(const engine::step_metrics& m) {
  auto& res = s_->res;
  if (s_->metrics) s_->metrics->write(m, std::exchange(s_->changes_to_note, {}));
  res.steps.push_back(m);
  if (s_->cb.on_step) s_->cb.on_step(m);
  res.summary.final_loss = m.loss;
  if (m.val_loss) res.summary.final_val_loss = *m.val_loss;
  res.summary.steps = m.step;
  res.summary.tokens_per_s = double(m.tokens) / m.elapsed_s;
  res.summary.seconds = m.elapsed_s;
}

std::string training_job::finish(caf::actor_system& sys, std::string failure) {
  const auto& r = s_->r;
  const auto& o = s_->o;
  auto& a = s_->a;
  auto& res = s_->res;
  auto& mesh = s_->mesh;
  const int my_rank = s_->my_rank;
  const int control = topology::job_placement::control_process;
  auto say = [this](const std::string& text) { s_->say(text); };
  {
    caf::scoped_actor client{sys};
    if (a.checkpointer) {               // every checkpoint begun is committed before the job ends
      client->monitor(a.checkpointer);  // why it stopped, should it have (a failed write)
      client->request(a.checkpointer, caf::infinite, checkpoint_flush{!failure.empty()})
          .receive([](bool) {},
                   [&](caf::error& e) {
                     if (!failure.empty()) return;
                     failure = "checkpoint writer: " + to_string(e);
                     client->receive(
                         [&](caf::down_msg& d) {
                           const auto why = error_text(d.reason);
                           if (!d.reason) return;
                           failure = why.rfind("checkpoint writer", 0) == 0
                                         ? why
                                         : "checkpoint writer: " + why;
                         },
                         caf::after(std::chrono::seconds(5)) >> [] {});
                   });
      client->demonitor(a.checkpointer);
    }
    const bool collect = o.collect_parameters || o.check_replicas || !r.weights_path().empty();
    if (failure.empty() && my_rank == control && collect) {
      // ZeRO-3 stages answer after gathering their parameters from every replica (a
      // collective): ask every replica at once, before waiting for any answer.
      // Tensor shards answer with their slices: a replica's parameters are its lanes' slices
      // put back together.
      const int asked = o.check_replicas || r.parallel.zero == 3 ? r.parallel.dp : 1;
      const int tp = r.parallel.tp;
      std::vector<
          std::vector<decltype(client->request(a.stages[0][0], caf::infinite, snapshot_request{}))>>
          answers(static_cast<std::size_t>(asked * tp));
      for (int lane = 0; lane < asked * tp; ++lane)
        for (const auto& st : a.stages[static_cast<std::size_t>(lane)])
          answers[static_cast<std::size_t>(lane)].push_back(
              client->request(st, std::chrono::seconds(120), snapshot_request{}));
      for (int d = 0; d < asked; ++d) {
        std::map<std::string, std::vector<float>> params;
        for (int j = 0; j < tp; ++j) {
          std::map<std::string, const engine::parameter_info*> info;
          const auto layout =
              engine::chunk_parameter_layout(r.model, engine::chunk_range::whole(r.model), {j, tp});
          for (const auto& p : layout) info[p.name] = &p;
          for (auto& answer : answers[static_cast<std::size_t>(d * tp + j)]) {
            answer.receive(
                [&](stage_snapshot& s) {
                  for (auto& [name, v] : s.parameters) {
                    if (tp == 1) {
                      params.emplace(name, std::move(v));
                      continue;
                    }
                    const auto& p = *info.at(name);
                    auto& whole = params[name];
                    whole.resize(static_cast<std::size_t>(kernels::shape_numel(p.full_shape)));
                    engine::put_shard(p, {j, tp}, v.data(), whole.data());
                  }
                },
                [&](caf::error& e) { failure = "snapshot failed: " + to_string(e); });
          }
        }
        if (!o.check_replicas && d > 0) continue;
        if (d == 0) {
          res.parameters = std::move(params);
        } else if (params != res.parameters) {
          failure = "data-parallel replica " + std::to_string(d) +
                    " ended with parameters different from replica 0";
        }
      }
    }
    if (!o.trace_path.empty() && failure.empty() && my_rank == control) {
      auto plan = std::make_shared<const engine::pipeline_plan>(
          engine::make_plan(r.parallel.schedule,
                            {r.parallel.pp, r.parallel.micro_batches, r.parallel.virtual_stages}));
      client
          ->request(a.tracer, caf::infinite,
                    trace_write{o.trace_path, {trace_metadata(r, *plan), a.tracks, plan}})
          .receive([&](std::string& err) { failure = err; },
                   [&](caf::error& e) { failure = "trace: " + to_string(e); });
      if (failure.empty()) say("wrote trace " + o.trace_path);
    }
    // A stage waiting in a collective for a shard in a process that failed: it stops now.
    if (!failure.empty())
      for (const auto& m : a.spanning_members) m->abort("the job failed: " + failure);
    if (mesh) mesh->shutdown(failure.empty(), failure);
    // The gateway has stopped: a stage stopping from now on tells its group's other processes
    // nothing.
    for (const auto& m : a.spanning_members) m->close("the job ended");
    for (const auto& h : a.local) client->send_exit(h, caf::exit_reason::user_shutdown);
    for (const auto& h : a.relays) client->send_exit(h, caf::exit_reason::user_shutdown);
  }
  a = {};  // the handles go, so the actor system can destroy the actors it stopped
  if (!failure.empty() || my_rank != 0) return failure;
  write_final_weights(r, res);
  if (!r.weights_path().empty()) say("wrote " + r.weights_path().string());
  return failure;
}

const run_result& training_job::result() const { return s_->res; }

namespace {
// A process of a failed job ends within kTeardownLimit even if its teardown cannot finish: a
// peer that stopped (SIGSTOP, a hung machine) may never drain what this process sends it, a stage
// waiting on its device for a peer process that died (an NCCL transfer or collective) never
// returns, and a launcher restarts the job only once every process has ended.
constexpr std::chrono::seconds kTeardownLimit{30};
void arm_teardown_deadline(const std::string& failure, int rank) {
  std::thread([failure, rank] {
    std::this_thread::sleep_for(kTeardownLimit);
    std::fprintf(stderr,
                 "troupe train: rank %d: error: %s; the teardown did not finish in %lld s (a peer "
                 "may be stopped, or a stage stuck waiting for one); ending this process\n",
                 rank, failure.c_str(), static_cast<long long>(kTeardownLimit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
}
}  // namespace

run_result run_training(const engine::recipe& r, const engine::train_callbacks& cb,
                        const run_options& o) {
  caf::actor_system_config cfg;
  // The scheduled (non-detached) actors are light; their worker threads must not poll and
  // steal cycles from the stages' compute threads.
  cfg.set("scheduler.max-threads", 1);
  cfg.set("work-stealing.aggressive-poll-attempts", 0);
  cfg.set("work-stealing.moderate-poll-attempts", 0);
  caf::actor_system sys{cfg};
  training_job job(r, cb, o);  // destroyed before the system: its handles go first
  std::string failure, unrecorded;
  {
    caf::scoped_actor client{sys};
    job.spawn(sys, caf::actor_cast<caf::actor>(client));
    const run_handles handles{job.coordinator(), job.stages()};
    bool running = true;
    while (running) {
      client->receive(
          [&](step_report& rep) {
            if (!unrecorded.empty()) return;
            try {
              job.record(rep.metrics);
            } catch (const std::exception& e) {
              // A metrics line that cannot be written (a full disk, ulimit -f) stops the job
              // after the step in flight, and fails it.
              unrecorded = e.what();
              caf::anon_send(job.coordinator(), stop_run{});
              return;
            }
            if (o.after_step) o.after_step(sys, handles, rep.metrics.step);
          },
          [&](training_paused&) {},
          [&](run_finished& f) {
            running = false;
            if (!f.ok) failure = job.control() ? f.message : "job ended: " + f.message;
          });
    }
    if (!unrecorded.empty()) failure = unrecorded;
  }
  if (!failure.empty() && o.launch.world > 1) arm_teardown_deadline(failure, o.launch.rank);
  failure = job.finish(sys, failure);
  if (!failure.empty()) throw std::runtime_error(failure);
  return job.result();
}

}  // namespace troupe::actors
