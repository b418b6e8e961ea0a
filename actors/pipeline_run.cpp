// Building, wiring, driving and tearing down the actors of one run. See pipeline_run.hpp.
#include "actors/pipeline_run.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <thread>

#include "actors/coordinator.hpp"
#include "actors/data_loader.hpp"
#include "actors/dp_reducer.hpp"
#include "actors/pipeline_stage.hpp"
#include "actors/schedule_actor.hpp"
#include "actors/tracer.hpp"
#include "engine/gpt_weights.hpp"

namespace troupe::actors {
namespace {

using namespace messages;
namespace trace = engine::trace;

struct run_actors {
  tracer_actor tracer;
  schedule_actor schedule;
  coordinator_actor coordinator;
  std::vector<std::vector<stage_actor>> stages;  // [replica][rank]
  std::vector<reducer_actor> reducers;           // by rank
  std::vector<loader_actor> loaders;             // by replica
  std::vector<caf::actor> all;
  std::vector<caf::actor> relays;  // test hooks' relays, stopped with the run
  std::vector<std::string> names;
  std::vector<trace::track> tracks;
};

struct build_inputs {
  const engine::recipe& r;
  const run_options& o;
  engine::pipeline_layout layout;
  engine::training_data data;
  std::vector<int> seq_lens;
  trace::trace_clock::time_point origin;
  std::vector<std::shared_ptr<const engine::data::batch_sampler>> train{};  // by seq_lens
  std::shared_ptr<const engine::data::batch_sampler> val{};
};

trace::recorder add_track(run_actors& a, const build_inputs& in, std::string name, std::string role,
                          int rank, int replica) {
  const int id = static_cast<int>(a.tracks.size()) + 1;
  a.tracks.push_back({id, std::move(name), std::move(role), rank, replica});
  return trace::recorder(!in.o.trace_path.empty(), in.origin, id);
}

void remember(run_actors& a, const caf::actor& h, const std::string& name) {
  a.all.push_back(h);
  a.names.push_back(name);
}

int compute_threads(const engine::recipe& r, const run_options& o) {
  if (o.compute_threads > 0) return o.compute_threads;
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, cores / (r.parallel.pp * r.parallel.dp));
}

std::int64_t tokens_per_step(const build_inputs& in) {
  const auto& r = in.r;
  std::int64_t t = 0;
  const int per_replica = r.batch.grad_accum * r.parallel.micro_batches;
  for (int i = 0; i < per_replica; ++i)
    t += std::int64_t{r.batch.micro_batch} *
         in.seq_lens[static_cast<std::size_t>(i) % in.seq_lens.size()];
  return t * r.parallel.dp;
}

void spawn_stages(caf::actor_system& sys, run_actors& a, const build_inputs& in) {
  const auto& r = in.r;
  for (int d = 0; d < r.parallel.dp; ++d) {
    a.stages.emplace_back();
    for (int p = 0; p < r.parallel.pp; ++p) {
      stage_config c;
      c.rank = p;
      c.replica = d;
      c.replicas = r.parallel.dp;
      c.model = r.model;
      c.layout = in.layout;
      c.seed = static_cast<std::uint64_t>(r.seed);
      c.init = r.init;
      c.optimizer = r.optimizer;
      c.total_steps = r.steps;
      c.link_credits =
          r.parallel.link_credits > 0 ? r.parallel.link_credits : r.parallel.micro_batches;
      c.bucket_layers = r.parallel.bucket_layers;
      c.compute_threads = compute_threads(r, in.o);
      const std::string name = "stage " + std::to_string(p) + " · dp " + std::to_string(d);
      c.trace = add_track(a, in, name, "stage", p, d);
      a.stages.back().push_back(spawn_pipeline_stage(sys, std::move(c)));
      remember(a, caf::actor_cast<caf::actor>(a.stages.back().back()), name);
    }
  }
  if (r.parallel.dp > 1) {
    for (int p = 0; p < r.parallel.pp; ++p) {
      const std::string name = "dp reducer " + std::to_string(p);
      reducer_config c{p, r.parallel.dp, add_track(a, in, name, "collective", p, -1)};
      std::vector<caf::actor> replicas;
      for (const auto& row : a.stages)
        replicas.push_back(caf::actor_cast<caf::actor>(row[static_cast<std::size_t>(p)]));
      a.reducers.push_back(
          spawn_dp_reducer(sys, std::move(c), caf::actor_cast<caf::actor>(a.tracer), replicas));
      remember(a, caf::actor_cast<caf::actor>(a.reducers.back()), name);
    }
  }
}

// Samplers are built before anything is written: a corpus too small for the batch shape is bad
// input (recipe_error naming data.train / data.val).
void make_samplers(build_inputs& in) {
  const auto& r = in.r;
  const auto order = engine::data::parse_sample_order(r.data.order);
  for (int T : in.seq_lens)
    in.train.push_back(std::make_shared<engine::data::batch_sampler>(
        engine::make_batch_sampler(in.data.train, r, order, T, "data.train")));
  if (!in.data.val.empty() && r.eval_interval > 0)
    in.val = std::make_shared<engine::data::batch_sampler>(engine::make_batch_sampler(
        in.data.val, r, engine::data::sample_order::sequential, r.batch.seq_len, "data.val"));
}

void spawn_loaders(caf::actor_system& sys, run_actors& a, const build_inputs& in) {
  const auto& r = in.r;
  const auto& train = in.train;
  const auto& val = in.val;
  for (int d = 0; d < r.parallel.dp; ++d) {
    loader_config c;
    c.replica = d;
    c.replicas = r.parallel.dp;
    c.rounds = r.batch.grad_accum;
    c.micro_batches = r.parallel.micro_batches;
    c.steps = r.steps;
    c.prefetch = r.parallel.prefetch;
    c.B = r.batch.micro_batch;
    c.seq_lens = in.seq_lens;
    c.train = train;
    c.val = val;
    const std::string name = "data loader · dp " + std::to_string(d);
    c.trace = add_track(a, in, name, "loader", -1, d);
    a.loaders.push_back(spawn_data_loader(sys, std::move(c)));
    remember(a, caf::actor_cast<caf::actor>(a.loaders.back()), name);
  }
}

void wire(caf::actor_system& sys, run_actors& a, const build_inputs& in, caf::actor client) {
  const auto& r = in.r;
  const int p = r.parallel.pp;
  auto untyped = [](const auto& h) { return caf::actor_cast<caf::actor>(h); };
  for (int d = 0; d < r.parallel.dp; ++d) {
    auto& row = a.stages[static_cast<std::size_t>(d)];
    for (int k = 0; k < p; ++k) {
      stage_wiring w;
      for (int j = 0; j < p; ++j) {
        caf::actor target = untyped(row[static_cast<std::size_t>(j)]);
        if (in.o.link_relay && j != k) {
          a.relays.push_back(in.o.link_relay(sys, target));
          target = a.relays.back();
        }
        w.ranks.push_back(std::move(target));
      }
      w.loader = untyped(a.loaders[static_cast<std::size_t>(d)]);
      w.coordinator = untyped(a.coordinator);
      if (!a.reducers.empty()) w.reducer = untyped(a.reducers[static_cast<std::size_t>(k)]);
      w.tracer = untyped(a.tracer);
      const int partner =
          k == in.layout.embedding_rank() ? in.layout.head_rank() : in.layout.embedding_rank();
      w.tied_partner = untyped(row[static_cast<std::size_t>(partner)]);
      caf::anon_send(row[static_cast<std::size_t>(k)], std::move(w));
    }
    caf::anon_send(a.loaders[static_cast<std::size_t>(d)],
                   loader_wiring{untyped(row[0]),
                                 untyped(row[static_cast<std::size_t>(in.layout.head_rank())]),
                                 untyped(a.tracer)});
  }
  schedule_wiring sw;
  for (const auto& row : a.stages) {
    sw.stages.emplace_back();
    for (const auto& s : row) sw.stages.back().push_back(untyped(s));
  }
  coordinator_wiring cw;
  cw.stages = sw.stages;
  caf::anon_send(a.schedule, std::move(sw));
  cw.schedule = untyped(a.schedule);
  cw.tracer = untyped(a.tracer);
  cw.client = std::move(client);
  for (const auto& l : a.loaders) cw.loaders.push_back(untyped(l));
  cw.watched = a.all;
  cw.watched_names = a.names;
  caf::anon_send(a.coordinator, std::move(cw));
}

}  // namespace

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
  engine::gpt_stage whole(r.model, engine::stage_range::whole(r.model));
  for (const auto& p : whole.parameters()) {
    const auto& v = res.parameters.at(p.name);
    std::memcpy(whole.params() + p.offset, v.data(), v.size() * sizeof(float));
  }
  engine::save_hf_weights(whole, path);
}

}  // namespace

run_result run_training(const engine::recipe& r, const engine::train_callbacks& cb,
                        const run_options& o) {
  auto say = [&](const std::string& s) {
    if (cb.on_message) cb.on_message(s);
  };
  // 1. Everything that can fail on bad input, before anything is written or spawned.
  build_inputs in{r, o, {}, engine::load_training_data(r), o.seq_lens, trace::trace_clock::now()};
  if (in.seq_lens.empty()) in.seq_lens.push_back(r.batch.seq_len);
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
  make_samplers(in);
  // 2. Outputs.
  std::error_code ec;
  std::filesystem::create_directories(r.output.dir, ec);
  if (ec)
    throw engine::recipe_error("key output.dir: cannot create " + r.output.dir + ": " +
                               ec.message());
  engine::jsonl_writer metrics(r.metrics_path());
  run_result res;
  res.summary.parameters = r.model.parameter_count();
  res.summary.unigram_entropy = engine::unigram_entropy(in.data.train, r.model.vocab_size);
  res.summary.final_val_loss = std::numeric_limits<double>::quiet_NaN();
  say("model: " + std::to_string(res.summary.parameters) + " parameters; train corpus " +
      std::to_string(in.data.train.size()) + " tokens, validation " +
      std::to_string(in.data.val.size()) + " tokens; unigram entropy " +
      std::to_string(res.summary.unigram_entropy) + " nats/token");
  say("actors: pp " + std::to_string(r.parallel.pp) + " x dp " + std::to_string(r.parallel.dp) +
      ", schedule " + r.parallel.schedule + ", " + std::to_string(r.parallel.micro_batches) +
      " micro-batches x " + std::to_string(r.batch.grad_accum) + " rounds per step");

  // 3. The actors.
  caf::actor_system_config cfg;
  // The scheduled (non-detached) actors are light; their worker threads must not poll and
  // steal cycles from the stages' compute threads.
  cfg.set("scheduler.max-threads", 1);
  cfg.set("work-stealing.aggressive-poll-attempts", 0);
  cfg.set("work-stealing.moderate-poll-attempts", 0);
  caf::actor_system sys{cfg};
  run_actors a;
  std::string failure;
  {
    caf::scoped_actor client{sys};
    a.tracer = spawn_tracer(sys);
    remember(a, caf::actor_cast<caf::actor>(a.tracer), "tracer");
    a.schedule = spawn_schedule_actor(
        sys, {r.parallel.schedule,
              {r.parallel.pp, r.parallel.micro_batches, r.parallel.virtual_stages},
              r.parallel.dp});
    remember(a, caf::actor_cast<caf::actor>(a.schedule), "schedule");
    coordinator_config cc;
    cc.steps = r.steps;
    cc.rounds = r.batch.grad_accum;
    cc.ranks = r.parallel.pp;
    cc.replicas = r.parallel.dp;
    const bool has_val = !in.data.val.empty() && r.eval_interval > 0;
    cc.eval_interval = has_val ? r.eval_interval : 0;
    cc.eval_batches = has_val ? r.eval_batches : 0;
    cc.tokens_per_step = tokens_per_step(in);
    cc.flops_per_token = r.model.train_flops_per_token(r.batch.seq_len);
    cc.trace = add_track(a, in, "coordinator", "coordinator", -1, -1);
    a.coordinator = spawn_coordinator(sys, std::move(cc));
    remember(a, caf::actor_cast<caf::actor>(a.coordinator), "coordinator");
    spawn_stages(sys, a, in);
    spawn_loaders(sys, a, in);
    wire(sys, a, in, caf::actor_cast<caf::actor>(client));
    std::vector<std::vector<caf::actor>> stage_handles;
    for (const auto& row : a.stages) {
      stage_handles.emplace_back();
      for (const auto& st : row) stage_handles.back().push_back(caf::actor_cast<caf::actor>(st));
    }
    const caf::actor coordinator_handle = caf::actor_cast<caf::actor>(a.coordinator);
    const run_handles handles{coordinator_handle, stage_handles};
    client->send(a.coordinator, start_run{});
    bool running = true;
    while (running) {
      client->receive(
          [&](step_report& rep) {
            metrics.write(rep.metrics);
            res.steps.push_back(rep.metrics);
            if (cb.on_step) cb.on_step(rep.metrics);
            res.summary.final_loss = rep.metrics.loss;
            if (rep.metrics.val_loss) res.summary.final_val_loss = *rep.metrics.val_loss;
            res.summary.steps = rep.metrics.step;
            res.summary.tokens_per_s = double(rep.metrics.tokens) / rep.metrics.elapsed_s;
            res.summary.seconds = rep.metrics.elapsed_s;
            if (o.after_step) o.after_step(sys, handles, rep.metrics.step);
          },
          [&](run_finished& f) {
            running = false;
            if (!f.ok) failure = f.message;
          });
    }
    if (failure.empty()) {
      for (int d = 0; d < (o.check_replicas ? r.parallel.dp : 1); ++d) {
        std::map<std::string, std::vector<float>> params;
        for (const auto& st : a.stages[static_cast<std::size_t>(d)]) {
          client->request(st, caf::infinite, snapshot_request{})
              .receive(
                  [&](stage_snapshot& s) {
                    for (auto& [name, v] : s.parameters) params.emplace(name, std::move(v));
                  },
                  [&](caf::error& e) { failure = "snapshot failed: " + to_string(e); });
        }
        if (d == 0) {
          res.parameters = std::move(params);
        } else if (params != res.parameters) {
          failure = "data-parallel replica " + std::to_string(d) +
                    " ended with parameters different from replica 0";
        }
      }
    }
    if (!o.trace_path.empty() && failure.empty()) {
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
    for (const auto& h : a.all) client->send_exit(h, caf::exit_reason::user_shutdown);
    for (const auto& h : a.relays) client->send_exit(h, caf::exit_reason::user_shutdown);
  }
  if (!failure.empty()) throw std::runtime_error(failure);
  write_final_weights(r, res);
  if (!r.weights_path().empty()) say("wrote " + r.weights_path().string());
  return res;
}

}  // namespace troupe::actors
