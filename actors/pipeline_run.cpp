// Building, wiring, driving and tearing down the actors of one run. See pipeline_run.hpp.
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

#include <unistd.h>

#include "actors/checkpoint_writer.hpp"
#include "actors/coordinator.hpp"
#include "actors/data_loader.hpp"
#include "actors/dp_reducer.hpp"
#include "actors/gateway.hpp"
#include "actors/ring_reducer.hpp"
#include "actors/schedule_actor.hpp"
#include "actors/stage.hpp"
#include "actors/tracer.hpp"
#include "actors/zero_shard.hpp"
#include "engine/chunks/device_chunk.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/parallel/memory_plan.hpp"
#include "engine/parallel/support.hpp"
#include "topology/placement.hpp"
#include "topology/tensor_exchange.hpp"
#include "transport/rendezvous.hpp"
#include "transport/ucx_transport.hpp"

namespace troupe::actors {
namespace {

using namespace messages;
namespace trace = engine::trace;

// A lane is one tensor shard of one data-parallel replica: lane d * tp + j is shard j of
// replica d (without tensor parallelism, lanes are replicas). Each lane is a pipeline of its own
// towards its neighbours and its data loader; the tp lanes of a replica meet in their ranks'
// tensor groups, the dp lanes of a shard in their ranks' reducers.
struct run_actors {
  caf::actor tracer, schedule, coordinator;       // local, or proxies on ranks other than 0
  caf::actor checkpointer;                        // rank 0, with checkpoint.every > 0
  std::vector<std::vector<caf::actor>> stages;    // [lane][rank]
  std::vector<std::vector<caf::actor>> reducers;  // [lane][rank] ring reducers or zero
                                                  // shards, or [0][rank * tp + shard]
  std::vector<caf::actor> loaders;                // by lane
  // This process's members of tensor groups that span processes, aborted when the job fails.
  std::vector<std::shared_ptr<topology::exchange_member>> spanning_members;
  std::vector<caf::actor> all;    // every actor and proxy of this process (the coordinator watches)
  std::vector<caf::actor> local;  // this process's own actors, stopped at the end
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
  topology::job_placement placement{1, 1, 1};
  int rank = 0;
  remote_mesh* mesh = nullptr;                            // set when the job spans processes
  std::shared_ptr<const engine::chunk_factory> chunks{};  // device stages
  // Resuming: the checkpoint and its trainer state.
  std::filesystem::path resume_dir{};
  engine::checkpoint_state resumed{};
  std::shared_ptr<engine::action_watchdog> watchdog{};  // this process's
};

trace::recorder add_track(run_actors& a, const build_inputs& in, std::string name, std::string role,
                          int rank, int replica) {
  const int id = static_cast<int>(a.tracks.size()) + 1;
  a.tracks.push_back({id, std::move(name), std::move(role), rank, replica});
  return trace::recorder(!in.o.trace_path.empty(), in.origin, id);
}

// The actor `id` of process `process`: spawned here by `spawn` if it lives here, else a proxy.
template <class Spawn>
caf::actor place(caf::actor_system& sys, run_actors& a, const build_inputs& in, std::uint32_t id,
                 int process, const std::string& name, Spawn&& spawn) {
  caf::actor h;
  if (!in.mesh || process == in.rank) {
    h = caf::actor_cast<caf::actor>(spawn());
    a.local.push_back(h);
    if (in.mesh) in.mesh->add_local(id, h, name);
  } else {
    h = in.mesh->make_proxy(sys, id, process, name);
  }
  a.all.push_back(h);
  a.names.push_back(name);
  return h;
}

int compute_threads(const build_inputs& in) {
  if (in.o.compute_threads > 0) return in.o.compute_threads;
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  const int here = in.mesh ? in.placement.stages_per_process() * in.o.launch.local_world
                           : in.r.parallel.pp * in.r.parallel.dp * in.r.parallel.tp;
  return std::max(1, cores / here);
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

// The links of a device pipeline, by (lane, sending rank, receiving rank): both directions
// between the ranks of neighbouring virtual stages (a rank with itself when neighbouring chunks
// share it), and, apart, between the embedding's rank and the head's for the tied wte. Only
// between ranks of this process: a pair across processes has no link, and its payloads are
// staged through host memory inside the messages.
using link_map = std::map<std::tuple<int, int, int>, std::shared_ptr<engine::chunk_link>>;
struct device_links {
  link_map pipeline, tied;
};
device_links make_links(const build_inputs& in) {
  device_links links;
  if (!in.chunks) return links;
  const auto& L = in.layout;
  const int embedding = L.rank_of(0), head = L.rank_of(L.stage_count() - 1);
  for (int d = 0; d < in.r.parallel.dp * in.r.parallel.tp; ++d) {
    const int replica = d / in.r.parallel.tp;
    auto here = [&](int rank) {
      return in.placement.process_of_stage(replica, rank, d % in.r.parallel.tp) == in.rank;
    };
    for (int s = 0; s + 1 < L.stage_count(); ++s) {
      const int a = L.rank_of(s), b = L.rank_of(s + 1);
      if (!here(a) || !here(b)) continue;
      for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
        auto& l = links.pipeline[{d, from, to}];
        if (!l) l = in.chunks->make_link(from, to, d);
      }
    }
    if (embedding == head || !here(embedding) || !here(head)) continue;
    for (auto [from, to] : {std::pair{embedding, head}, std::pair{head, embedding}})
      links.tied[{d, from, to}] = in.chunks->make_link(from, to, d);
  }
  return links;
}

// A device stage's chunks and its ends of the lane's links.
std::shared_ptr<const device_chunks_config> device_config(const build_inputs& in,
                                                          const device_links& links,
                                                          const stage_config& c) {
  auto dc = std::make_shared<device_chunks_config>();
  dc->factory = in.chunks;
  dc->B = in.r.batch.micro_batch;
  // The longest micro-batch: of the training lengths, and evaluation's (batch.seq_len).
  dc->T = std::max(*std::max_element(in.seq_lens.begin(), in.seq_lens.end()), in.r.batch.seq_len);
  dc->slots = engine::device_stage_slots(in.r, c.rank);
  dc->stage_buckets = in.mesh && in.r.parallel.dp > 1;  // a ring reducer across processes
  const int lane = c.replica * c.tp + c.tp_rank;
  for (const auto& [key, link] : links.pipeline) {
    const auto [d, from, to] = key;
    if (d != lane) continue;
    if (from == c.rank) dc->send_links[to] = link;
    if (to == c.rank) dc->receive_links[from] = link;
  }
  for (const auto& [key, link] : links.tied) {
    const auto [d, from, to] = key;
    if (d != lane) continue;
    if (from == c.rank) dc->tied_send = link;
    if (to == c.rank) dc->tied_receive = link;
  }
  return dc;
}

// The tensor group of (replica d, rank p) whose shards live in several processes: this process's
// members (null for the others), each reached by the others through the gateways as a sink of
// its own (placement's tensor_member_id).
std::vector<std::shared_ptr<engine::group_member>> spanning_group(run_actors& a,
                                                                  const build_inputs& in,
                                                                  const std::string& name, int d,
                                                                  int p) {
  const auto& pl = in.placement;
  const int tp = in.r.parallel.tp;
  std::vector<bool> here(static_cast<std::size_t>(tp));
  for (int j = 0; j < tp; ++j)
    here[static_cast<std::size_t>(j)] = pl.process_of_stage(d, p, j) == in.rank;
  remote_mesh* mesh = in.mesh;
  const int from = in.rank;
  auto members = topology::make_exchange_group(
      name, here, [mesh, pl, d, p, from](int to, messages::tensor_exchange m) {
        mesh->post(
            pl.process_of_stage(d, p, to),
            messages::wire::envelope{pl.tensor_member_id(d, p, to), from, 0, false, std::move(m)});
      });
  std::vector<std::shared_ptr<engine::group_member>> out(members.begin(), members.end());
  for (int j = 0; j < tp; ++j) {
    const auto& member = members[static_cast<std::size_t>(j)];
    if (!member) continue;
    mesh->add_sink(
        pl.tensor_member_id(d, p, j),
        [member](messages::wire::body&& b) {
          if (auto* x = std::get_if<messages::tensor_exchange>(&b)) member->deliver(std::move(*x));
        },
        name + " · member " + std::to_string(j));
    a.spanning_members.push_back(member);
  }
  return out;
}

void spawn_stages(caf::actor_system& sys, run_actors& a, const build_inputs& in) {
  const auto& r = in.r;
  const auto& pl = in.placement;
  const device_links links = make_links(in);
  const int tp = r.parallel.tp;
  // The tensor group of each (replica, rank): its tp shards, one member each (on the host, or
  // the device chunks' kind).
  std::map<std::pair<int, int>, std::vector<std::shared_ptr<engine::group_member>>> groups;
  for (int lane = 0; lane < r.parallel.dp * tp; ++lane) {
    const int d = lane / tp, j = lane % tp;
    a.stages.emplace_back();
    for (int p = 0; p < r.parallel.pp; ++p) {
      stage_config c;
      c.rank = p;
      c.replica = d;
      c.replicas = r.parallel.dp;
      c.tp_rank = j;
      c.tp = tp;
      if (tp > 1) {
        auto& members = groups[{d, p}];
        if (members.empty()) {
          const std::string group =
              "tp group of stage " + std::to_string(p) + " · dp " + std::to_string(d);
          if (in.mesh && pl.tensor_group_spans(d, p)) {  // its members in several processes
            members = spanning_group(a, in, group, d, p);
          } else if (in.chunks) {
            members = in.chunks->make_tensor_group(p, d, tp);
          } else {
            auto host = engine::make_local_tensor_group(tp, group);
            members.assign(host.begin(), host.end());
          }
        }
        c.tp_member = members.at(static_cast<std::size_t>(j));
      }
      c.model = r.model;
      c.layout = in.layout;
      c.seed = static_cast<std::uint64_t>(r.seed);
      c.init = r.init;
      if (!in.resume_dir.empty()) {
        c.init = (in.resume_dir / "model.safetensors").string();
        c.resume = in.resume_dir.string();
      }
      c.optimizer = r.optimizer;
      c.total_steps = r.steps;
      c.link_credits =
          r.parallel.link_credits > 0 ? r.parallel.link_credits : r.parallel.micro_batches;
      c.bucket_layers = r.parallel.bucket_layers;
      c.zero_prefetch = r.parallel.zero_prefetch;
      c.recompute = r.activation_checkpoint.full();
      c.zero = static_cast<engine::zero_stage>(r.parallel.zero);
      c.compute_threads = compute_threads(in);
      c.watchdog = in.watchdog;
      if (p == in.o.test_stall_rank && lane == 0) c.test_stall_step = in.o.test_stall_step;
      std::string name = "stage " + std::to_string(p) + " · dp " + std::to_string(d);
      if (tp > 1) name += " · tp " + std::to_string(j);
      c.trace = add_track(a, in, name, "stage", p, lane);
      a.stages.back().push_back(
          place(sys, a, in, pl.stage_id(d, p, j), pl.process_of_stage(d, p, j), name, [&] {
            if (in.chunks) c.device = device_config(in, links, c);
            return spawn_stage(sys, std::move(c));
          }));
    }
  }
  if (r.parallel.zero > 0) {  // ZeRO: a shard actor per stage (of every lane), in a ring over
                              // the replicas of its tensor shard
    for (int lane = 0; lane < r.parallel.dp * tp; ++lane) {
      const int d = lane / tp, j = lane % tp;
      a.reducers.emplace_back();
      for (int p = 0; p < r.parallel.pp; ++p) {
        std::string name = "zero shard " + std::to_string(p) + " · dp " + std::to_string(d);
        if (tp > 1) name += " · tp " + std::to_string(j);
        zero_shard_config c;
        c.rank = p;
        c.replica = d;
        c.replicas = r.parallel.dp;
        c.zero = static_cast<engine::zero_stage>(r.parallel.zero);
        c.optimizer = r.optimizer;
        c.total_steps = r.steps;
        c.trace = add_track(a, in, name, "collective", p, lane);
        a.reducers.back().push_back(place(sys, a, in, pl.reducer_id(d, p, j),
                                          pl.process_of_stage(d, p, j), name,
                                          [&] { return spawn_zero_shard(sys, std::move(c)); }));
      }
    }
    return;
  }
  if (r.parallel.dp == 1) return;
  if (!in.mesh) {  // in-process: one reducer per rank and tensor shard sees every replica's
    a.reducers.emplace_back();
    for (int p = 0; p < r.parallel.pp; ++p) {
      for (int j = 0; j < tp; ++j) {
        std::string name = "dp reducer " + std::to_string(p);
        if (tp > 1) name += " · tp " + std::to_string(j);
        reducer_config c{p, r.parallel.dp, add_track(a, in, name, "collective", p, -1), nullptr};
        if (in.chunks && in.chunks->make_group)
          c.group = in.chunks->make_group(p, j, r.parallel.dp);
        std::vector<caf::actor> replicas;
        for (int d = 0; d < r.parallel.dp; ++d)
          replicas.push_back(
              a.stages[static_cast<std::size_t>(d * tp + j)][static_cast<std::size_t>(p)]);
        a.reducers[0].push_back(place(sys, a, in, 0, 0, name, [&] {
          return spawn_dp_reducer(sys, std::move(c), a.tracer, replicas);
        }));
      }
    }
    return;
  }
  // Across processes: a ring reducer per stage (of every lane), over the replicas of its shard.
  for (int lane = 0; lane < r.parallel.dp * tp; ++lane) {
    const int d = lane / tp, j = lane % tp;
    a.reducers.emplace_back();
    for (int p = 0; p < r.parallel.pp; ++p) {
      std::string name = "ring reducer " + std::to_string(p) + " · dp " + std::to_string(d);
      if (tp > 1) name += " · tp " + std::to_string(j);
      ring_reducer_config c{p, d, r.parallel.dp, add_track(a, in, name, "collective", p, lane)};
      a.reducers.back().push_back(place(sys, a, in, pl.reducer_id(d, p, j),
                                        pl.process_of_stage(d, p, j), name,
                                        [&] { return spawn_ring_reducer(sys, std::move(c)); }));
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
  const int tp = r.parallel.tp;
  for (int lane = 0; lane < r.parallel.dp * tp; ++lane) {  // tensor shards read the same data
    const int d = lane / tp;
    loader_config c;
    c.replica = d;
    c.replicas = r.parallel.dp;
    c.rounds = r.batch.grad_accum;
    c.micro_batches = r.parallel.micro_batches;
    c.steps = r.steps;
    c.start_step = in.resumed.step;
    c.start_micro_batches = in.resumed.micro_batches;
    c.prefetch = r.parallel.prefetch;
    c.B = r.batch.micro_batch;
    c.seq_lens = in.seq_lens;
    c.train = in.train;
    c.val = in.val;
    std::string name = "data loader · dp " + std::to_string(d);
    if (tp > 1) name += " · tp " + std::to_string(lane % tp);
    c.trace = add_track(a, in, name, "loader", -1, lane);
    a.loaders.push_back(place(sys, a, in, in.placement.loader_id(lane),
                              in.placement.process_of_loader(lane), name,
                              [&] { return spawn_data_loader(sys, std::move(c)); }));
  }
}

bool is_local(const run_actors& a, const caf::actor& h) {
  return std::find(a.local.begin(), a.local.end(), h) != a.local.end();
}

// Sends every local actor its peers (local actors or proxies).
void wire_actors(caf::actor_system& sys, run_actors& a, const build_inputs& in, caf::actor client) {
  const auto& r = in.r;
  const int p = r.parallel.pp, tp = r.parallel.tp;
  for (int lane = 0; lane < r.parallel.dp * tp; ++lane) {
    const int d = lane / tp, j = lane % tp;
    auto& row = a.stages[static_cast<std::size_t>(lane)];
    for (int k = 0; k < p; ++k) {
      if (!is_local(a, row[static_cast<std::size_t>(k)])) continue;
      stage_wiring w;
      for (int j = 0; j < p; ++j) {
        caf::actor target = row[static_cast<std::size_t>(j)];
        if (in.o.link_relay && j != k) {
          a.relays.push_back(in.o.link_relay(sys, target));
          target = a.relays.back();
        }
        w.ranks.push_back(std::move(target));
      }
      w.loader = a.loaders[static_cast<std::size_t>(lane)];
      w.coordinator = a.coordinator;
      // Ring reducers (tp = 1) and zero shards: one per lane and rank.
      const bool per_lane = in.mesh || r.parallel.zero > 0;
      if (!a.reducers.empty())
        w.reducer = per_lane
                        ? a.reducers[static_cast<std::size_t>(lane)][static_cast<std::size_t>(k)]
                        : a.reducers[0][static_cast<std::size_t>(k * tp + j)];
      w.tracer = a.tracer;
      const int partner =
          k == in.layout.embedding_rank() ? in.layout.head_rank() : in.layout.embedding_rank();
      w.tied_partner = row[static_cast<std::size_t>(partner)];
      caf::anon_send(row[static_cast<std::size_t>(k)], std::move(w));
      // Ring reducers and zero shards learn their stage and the next replica's (same tensor
      // shard).
      if ((in.mesh && r.parallel.dp > 1) || r.parallel.zero > 0) {
        const auto next = static_cast<std::size_t>(((d + 1) % r.parallel.dp) * tp + j);
        caf::anon_send(a.reducers[static_cast<std::size_t>(lane)][static_cast<std::size_t>(k)],
                       ring_wiring{row[static_cast<std::size_t>(k)],
                                   a.reducers[next][static_cast<std::size_t>(k)], a.tracer});
      }
    }
    if (is_local(a, a.loaders[static_cast<std::size_t>(lane)]))
      caf::anon_send(
          a.loaders[static_cast<std::size_t>(lane)],
          loader_wiring{row[0], row[static_cast<std::size_t>(in.layout.head_rank())], a.tracer});
  }
  if (in.rank != topology::job_placement::control_process) return;
  schedule_wiring sw;
  sw.stages = a.stages;
  caf::anon_send(a.schedule, std::move(sw));
  coordinator_wiring cw;
  cw.stages = a.stages;
  cw.schedule = a.schedule;
  cw.tracer = a.tracer;
  cw.client = std::move(client);
  cw.loaders = a.loaders;
  cw.watched = a.all;
  cw.watched_names = a.names;
  cw.checkpointer = a.checkpointer;
  if (a.checkpointer) {
    cw.watched.push_back(a.checkpointer);
    cw.watched_names.push_back("checkpoint writer");
  }
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
  engine::gpt_chunk whole(r.model, engine::chunk_range::whole(r.model));
  for (const auto& p : whole.parameters()) {
    const auto& v = res.parameters.at(p.name);
    std::memcpy(whole.params() + p.offset, v.data(), v.size() * sizeof(float));
  }
  engine::save_hf_weights(whole, path);
}

}  // namespace

namespace {

// Joins the job: rendezvous at rank 0 and a UCX endpoint to every peer. Throws
// std::runtime_error naming the rendezvous address or the peer.
std::unique_ptr<remote_mesh> join_job(const engine::recipe& r, const run_options& o,
                                      const topology::job_placement& pl) {
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
  transport::rendezvous_options ro{env.master_addr, env.master_port, o.rendezvous_timeout};
  const welcome w =
      env.rank == 0 ? transport::rendezvous_serve(ro, h) : transport::rendezvous_join(ro, h);
  gateway_config gc;
  gc.rank = env.rank;
  gc.world = env.world;
  gc.limits = wire::limits_for(r);
  gc.peer_timeout = o.peer_timeout;
  gc.hosts.resize(static_cast<std::size_t>(env.world));
  for (const auto& peer : w.peers) {
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

}  // namespace

struct training_job::state {
  engine::recipe r;
  engine::train_callbacks cb;
  run_options o;
  bool multi = false;
  int my_rank = 0;
  std::unique_ptr<build_inputs> in_ptr;
  std::optional<engine::jsonl_writer> metrics;
  run_result res;
  std::unique_ptr<remote_mesh> mesh;
  run_actors a;
  void say(const std::string& s) const {
    if (cb.on_message && my_rank == 0) cb.on_message(s);
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
      engine::check_hf_weights(r.model, in.resume_dir / "model.safetensors");
    } catch (const engine::recipe_error&) {
      throw;
    } catch (const std::exception& e) {
      throw engine::recipe_error(e.what());
    }
    if (in.resumed.step >= r.steps)
      throw engine::recipe_error("key steps: " + std::to_string(r.steps) + ", but checkpoint " +
                                 in.resume_dir.string() + " has done " +
                                 std::to_string(in.resumed.step) + " steps: nothing to run");
    say("resuming from " + in.resume_dir.string() + " after step " +
        std::to_string(in.resumed.step));
  } else if ((r.checkpoint.every > 0 || o.checkpoint_writer) && my_rank == 0) {
    // A fresh run never writes over another run's checkpoints (nor does a trainer, which can
    // take one whenever asked).
    for (const auto& e : engine::list_checkpoints(r.checkpoint_path()))
      if (e.committed)
        throw engine::recipe_error("key checkpoint.dir: " + r.checkpoint_path().string() +
                                   " holds checkpoints (newest " + e.dir.filename().string() +
                                   "): resume them with --resume, or choose another " +
                                   "checkpoint.dir or output.dir");
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
    mesh = join_job(r, o, in.placement);
    in.mesh = mesh.get();
    in.origin = trace::trace_clock::now();  // all processes leave the rendezvous together
    say("rendezvous: " + std::to_string(o.launch.world) + " processes joined");
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
  if (s_->metrics) s_->metrics->write(m);
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
    if (a.checkpointer) {  // every checkpoint begun is committed before the job ends
      client->request(a.checkpointer, caf::infinite, checkpoint_flush{!failure.empty()})
          .receive([](bool) {},
                   [&](caf::error& e) {
                     if (failure.empty()) failure = "checkpoint writer: " + to_string(e);
                   });
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
// peer that stopped (SIGSTOP, a hung machine) may never drain what this process sends it, and a
// launcher restarts the job only once every process has ended.
constexpr std::chrono::seconds kTeardownLimit{30};
void arm_teardown_deadline(const std::string& failure, int rank) {
  std::thread([failure, rank] {
    std::this_thread::sleep_for(kTeardownLimit);
    std::fprintf(stderr,
                 "troupe train: rank %d: error: %s; the teardown did not finish in %lld s (a peer "
                 "may be stopped); ending this process\n",
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
  std::string failure;
  {
    caf::scoped_actor client{sys};
    job.spawn(sys, caf::actor_cast<caf::actor>(client));
    const run_handles handles{job.coordinator(), job.stages()};
    bool running = true;
    while (running) {
      client->receive(
          [&](step_report& rep) {
            job.record(rep.metrics);
            if (o.after_step) o.after_step(sys, handles, rep.metrics.step);
          },
          [&](training_paused&) {},
          [&](run_finished& f) {
            running = false;
            if (!f.ok) failure = job.control() ? f.message : "job ended: " + f.message;
          });
    }
  }
  if (!failure.empty() && o.launch.world > 1) arm_teardown_deadline(failure, o.launch.rank);
  failure = job.finish(sys, failure);
  if (!failure.empty()) throw std::runtime_error(failure);
  return job.result();
}

}  // namespace troupe::actors
