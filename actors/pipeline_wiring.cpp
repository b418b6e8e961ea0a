// Spawning and wiring the actors of one run. See pipeline_wiring.hpp.
#include "actors/pipeline_wiring.hpp"

#include <algorithm>
#include <exception>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>

#include "actors/data_loader.hpp"
#include "actors/dp_reducer.hpp"
#include "actors/ring_reducer.hpp"
#include "actors/stage.hpp"
#include "actors/zero_shard.hpp"
#include "engine/parallel/memory_plan.hpp"
#include "topology/zero_exchange.hpp"

namespace troupe::actors {

using namespace messages;
namespace trace = engine::trace;

trace::recorder add_track(run_actors& a, const build_inputs& in, std::string name, std::string role,
                          int rank, int replica) {
  const int id = static_cast<int>(a.tracks.size()) + 1;
  a.tracks.push_back({id, std::move(name), std::move(role), rank, replica});
  return trace::recorder(!in.o.trace_path.empty(), in.origin, id);
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

std::string nccl_communicators::describe() const {
  auto count = [](std::size_t n, const std::string& what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  return count(links.size(), "pipeline link") + ", " + count(tied_links.size(), "tied wte link") +
         ", " + count(groups.size(), "data-parallel group") + ", " +
         count(tensor_groups.size(), "tensor group");
}

using engine::zero_on_device;

nccl_communicators nccl_plan(const build_inputs& in) {
  nccl_communicators c;
  if (!in.chunks) return c;
  const auto& p = in.r.parallel;
  c.links = topology::process_links(in.layout, in.placement, p.dp, p.tp);
  c.tied_links = topology::process_tied_links(in.layout, in.placement, p.dp, p.tp);
  // ZeRO's host shards ring through host memory; ZeRO through the devices uses the groups.
  if (p.zero == 0 || zero_on_device(in.r))
    c.groups = topology::process_groups(in.placement, p.pp, p.dp, p.tp);
  c.tensor_groups = topology::process_tensor_groups(in.placement, p.pp, p.dp, p.tp);
  return c;
}

namespace {

// Whether an NCCL group averages the buckets of (pipeline rank, tensor shard) between processes
// (in every process alike, whether or not it holds a replica of the group).
bool nccl_reduced(const build_inputs& in, int rank, int shard) {
  if (in.nccl_ids.empty()) return false;
  const auto groups = nccl_plan(in).groups;
  return std::find(groups.begin(), groups.end(), topology::process_group{rank, shard}) !=
         groups.end();
}

// The links of a device pipeline, by (lane, sending rank, receiving rank): both directions
// between the ranks of neighbouring virtual stages (a rank with itself when neighbouring chunks
// share it), and, apart, between the embedding's rank and the head's for the tied wte. Between
// ranks of this process; a neighbouring pair across processes has this process's end of an NCCL
// link where the rendezvous gave ids, else no link, and its payloads are staged through host
// memory inside the messages; likewise the tied wte's pair of ranks. With the ids, too,
// this process's replica of each data-parallel group that spans processes (by pipeline rank and
// tensor shard), and its members of each tensor group that does (by replica and rank: every
// shard's member, null where it lives in another process). The ids open nccl_plan()'s
// communicators in order; a process joins all of its own at once.
using link_map = std::map<std::tuple<int, int, int>, std::shared_ptr<engine::chunk_link>>;
struct device_links {
  link_map pipeline, tied;
  std::map<std::pair<int, int>, std::shared_ptr<engine::replica_group>> groups;
  std::map<std::pair<int, int>, std::vector<std::shared_ptr<engine::group_member>>> tensor_groups;
};
device_links make_links(const build_inputs& in) {
  device_links links;
  if (!in.chunks) return links;
  const auto& L = in.layout;
  const int embedding = L.rank_of(0), head = L.rank_of(L.virtual_stage_count() - 1);
  for (int d = 0; d < in.r.parallel.dp * in.r.parallel.tp; ++d) {
    const int replica = d / in.r.parallel.tp;
    auto here = [&](int rank) {
      return in.placement.process_of_stage(replica, rank, d % in.r.parallel.tp) == in.rank;
    };
    for (int s = 0; s + 1 < L.virtual_stage_count(); ++s) {
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
  if (in.nccl_ids.empty()) return links;
  const int dp = in.r.parallel.dp, tp = in.r.parallel.tp;
  const auto plan = nccl_plan(in);
  auto across = plan.links;  // then the tied wte's, as the ids go
  across.insert(across.end(), plan.tied_links.begin(), plan.tied_links.end());
  const auto& groups = plan.groups;
  const auto& tensor = plan.tensor_groups;
  if (plan.size() != in.nccl_ids.size() || !in.chunks->make_process_link ||
      (!groups.empty() && !in.chunks->make_process_group) ||
      (!tensor.empty() && !in.chunks->make_process_tensor_member))
    throw std::logic_error("make_links: " + std::to_string(in.nccl_ids.size()) + " NCCL ids for " +
                           plan.describe() + " between processes");
  // This process's communicators, joined all at once (a thread each, as nccl_group::join_all
  // joins the ranks of one process): a join waits for its peers alone, never for joins ahead of
  // it in another process, so every process leaves wiring about when the last one arrives.
  std::vector<std::shared_ptr<engine::chunk_link>> made(across.size());
  std::vector<std::shared_ptr<engine::replica_group>> joined(groups.size());
  for (const auto& g : tensor)
    links.tensor_groups[{g.replica, g.rank}].resize(static_cast<std::size_t>(tp));
  std::vector<std::exception_ptr> failed(plan.size());
  std::vector<std::thread> joining;
  struct join_all_at_exit {  // a thread that failed to start leaves the started ones joined
    std::vector<std::thread>& threads;
    ~join_all_at_exit() {
      for (auto& t : threads)
        if (t.joinable()) t.join();
    }
  } joined_at_exit{joining};
  auto join = [&joining, &failed](std::size_t i, auto make) {
    joining.emplace_back([&failed, i, make] {
      try {
        make();
      } catch (...) {
        failed[i] = std::current_exception();
      }
    });
  };
  std::size_t i = 0;  // the id
  for (std::size_t l = 0; l < across.size(); ++l, ++i) {
    const auto& pl = across[l];
    const int replica = pl.lane / tp, shard = pl.lane % tp;
    const bool sends = in.placement.process_of_stage(replica, pl.from, shard) == in.rank;
    const bool receives = in.placement.process_of_stage(replica, pl.to, shard) == in.rank;
    if (!sends && !receives) continue;
    join(i, [&in, &made, &pl, i, l, sends] {
      made[l] =
          in.chunks->make_process_link(pl.name(), in.nccl_ids[i], pl.from, pl.to, pl.lane, sends);
    });
  }
  for (std::size_t k = 0; k < groups.size(); ++k, ++i) {
    const auto& g = groups[k];
    for (int d = 0; d < dp; ++d) {  // this process's replica of the group (one at most)
      if (in.placement.process_of_stage(d, g.rank, g.shard) != in.rank) continue;
      join(i, [&in, &joined, &g, i, k, d, dp] {
        joined[k] = in.chunks->make_process_group(g.name(), in.nccl_ids[i], g.rank, g.shard, d, dp);
      });
    }
  }
  for (std::size_t k = 0; k < tensor.size(); ++k, ++i) {
    const auto& g = tensor[k];
    auto& members = links.tensor_groups[{g.replica, g.rank}];
    for (int j = 0; j < tp; ++j) {  // this process's shard of the group (one at most)
      if (in.placement.process_of_stage(g.replica, g.rank, j) != in.rank) continue;
      auto& member = members[static_cast<std::size_t>(j)];
      join(i, [&in, &member, &g, i, j, tp] {
        member = in.chunks->make_process_tensor_member(g.name(), in.nccl_ids[i], g.rank, g.replica,
                                                       j, tp);
      });
    }
  }
  for (auto& t : joining) t.join();  // a failed join shows once the others have ended
  for (const auto& e : failed)
    if (e) std::rethrow_exception(e);
  for (std::size_t l = 0; l < across.size(); ++l)
    if (made[l])
      (across[l].tied ? links.tied
                      : links.pipeline)[{across[l].lane, across[l].from, across[l].to}] = made[l];
  for (std::size_t k = 0; k < groups.size(); ++k)
    if (joined[k]) links.groups[{groups[k].rank, groups[k].shard}] = joined[k];
  return links;
}

// Whether ZeRO runs through the devices (parallel.zero_on_device) for the replicas of (pipeline
// rank, tensor shard), decided alike in every process: where they all share a process whose
// chunk kind has zero groups, or where an NCCL group spans their processes, or the chunks' memory
// is host memory (their pieces then travel as messages). Otherwise (or without the key) ZeRO's
// host shard actors serve them.
bool zero_through_devices(const build_inputs& in, int rank, int shard) {
  if (!in.chunks || !zero_on_device(in.r)) return false;
  bool together = true;
  for (int d = 1; d < in.r.parallel.dp; ++d)
    together = together && in.placement.process_of_stage(d, rank, shard) ==
                               in.placement.process_of_stage(0, rank, shard);
  if (together) return static_cast<bool>(in.chunks->make_zero_group);
  return nccl_reduced(in, rank, shard) || (in.chunks->host_memory && in.mesh);
}

// The zero group of (pipeline rank p, tensor shard j) whose replicas live in several processes,
// over messages: this process's replicas take theirs as sinks of their reducer ids.
std::shared_ptr<engine::zero_group> exchange_zero_group(const build_inputs& in, int p, int j) {
  const auto& pl = in.placement;
  const int dp = in.r.parallel.dp;
  std::vector<bool> here(static_cast<std::size_t>(dp));
  for (int d = 0; d < dp; ++d)
    here[static_cast<std::size_t>(d)] = pl.process_of_stage(d, p, j) == in.rank;
  const std::string name = "zero group of stage " + std::to_string(p) +
                           (in.r.parallel.tp > 1 ? " · tp " + std::to_string(j) : "");
  remote_mesh* mesh = in.mesh;
  const int from = in.rank;
  auto group = std::make_shared<topology::exchange_zero_group>(
      name, p, here, [mesh, pl, p, j, from](int to, messages::ring_chunk m) {
        mesh->post(pl.process_of_stage(to, p, j),
                   messages::wire::envelope{pl.reducer_id(to, p, j), from, 0, false, std::move(m)});
      });
  for (int d = 0; d < dp; ++d) {
    if (!here[static_cast<std::size_t>(d)]) continue;
    mesh->add_sink(
        pl.reducer_id(d, p, j),
        [group, d](messages::wire::body&& b) {
          if (auto* x = std::get_if<messages::ring_chunk>(&b)) group->deliver(d, std::move(*x));
        },
        name + " · dp " + std::to_string(d));
  }
  return group;
}

// This process's zero_group of each (pipeline rank, tensor shard) whose replicas it holds and
// zero_through_devices serves: one of the chunks' kind when every replica lives here, else this
// process's rank of the NCCL group, or (host memory) an exchange over messages.
using zero_group_map = std::map<std::pair<int, int>, std::shared_ptr<engine::zero_group>>;
zero_group_map make_zero_groups(const build_inputs& in, const device_links& links) {
  zero_group_map out;
  const auto& r = in.r;
  for (int p = 0; p < r.parallel.pp; ++p) {
    for (int j = 0; j < r.parallel.tp; ++j) {
      int here = 0;
      for (int d = 0; d < r.parallel.dp; ++d)
        here += in.placement.process_of_stage(d, p, j) == in.rank ? 1 : 0;
      if (here == 0 || !zero_through_devices(in, p, j)) continue;
      if (here == r.parallel.dp) {
        out[{p, j}] = in.chunks->make_zero_group(p, j, r.parallel.dp);
        continue;
      }
      const auto g = links.groups.find({p, j});
      auto z = g == links.groups.end() ? nullptr
                                       : std::dynamic_pointer_cast<engine::zero_group>(g->second);
      if (!z && g == links.groups.end() && in.chunks->host_memory)
        z = exchange_zero_group(in, p, j);
      if (!z)
        throw std::logic_error("ZeRO through the devices: no zero group of " + in.chunks->name +
                               " chunks for pipeline rank " + std::to_string(p));
      out[{p, j}] = std::move(z);
    }
  }
  return out;
}

// A device stage's chunks and its ends of the lane's links.
std::shared_ptr<const device_chunks_config> device_config(const build_inputs& in,
                                                          const device_links& links,
                                                          const zero_group_map& zero_groups,
                                                          const stage_config& c) {
  auto dc = std::make_shared<device_chunks_config>();
  dc->factory = in.chunks;
  dc->B = in.r.batch.micro_batch;
  // The longest micro-batch: of the training lengths, and evaluation's (batch.seq_len).
  dc->T = std::max(*std::max_element(in.seq_lens.begin(), in.seq_lens.end()), in.r.batch.seq_len);
  dc->slots = engine::device_stage_slots(in.r, c.rank);
  if (const auto z = zero_groups.find({c.rank, c.tp_rank}); z != zero_groups.end())
    dc->zero_group = z->second;
  // A ring reducer across processes, unless an NCCL group averages the buckets on the devices.
  dc->stage_buckets =
      in.mesh && in.r.parallel.dp > 1 && !links.groups.contains({c.rank, c.tp_rank});
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

}  // namespace

void spawn_stages(caf::actor_system& sys, run_actors& a, const build_inputs& in) {
  const auto& r = in.r;
  const auto& pl = in.placement;
  const device_links links = make_links(in);
  const zero_group_map zero_groups = make_zero_groups(in, links);
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
          if (const auto t = links.tensor_groups.find({d, p}); t != links.tensor_groups.end()) {
            members = t->second;                                // NCCL across processes
          } else if (in.mesh && pl.tensor_group_spans(d, p)) {  // members in several processes
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
      if (!in.resume_dir.empty()) c.resume = in.resume_dir.string();  // it, not c.init
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
      c.test_capture_delay_ms = in.o.test_capture_delay_ms;
      std::string name = "stage " + std::to_string(p) + " · dp " + std::to_string(d);
      if (tp > 1) name += " · tp " + std::to_string(j);
      c.trace = add_track(a, in, name, "stage", p, lane);
      a.stages.back().push_back(
          place(sys, a, in, pl.stage_id(d, p, j), pl.process_of_stage(d, p, j), name, [&] {
            if (in.chunks) c.device = device_config(in, links, zero_groups, c);
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
        if (zero_through_devices(in, p, j)) {  // the stages do it, through their zero group
          a.reducers.back().emplace_back();
          continue;
        }
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
  // Across processes: a reducer per stage (of every lane), over the replicas of its shard. Where
  // an NCCL group spans the replicas' processes, a dp reducer of the one replica drives this
  // process's rank of it; otherwise a ring reducer, ringing through host memory.
  for (int lane = 0; lane < r.parallel.dp * tp; ++lane) {
    const int d = lane / tp, j = lane % tp;
    a.reducers.emplace_back();
    for (int p = 0; p < r.parallel.pp; ++p) {
      const bool nccl = nccl_reduced(in, p, j);
      std::string name = std::string(nccl ? "dp reducer " : "ring reducer ") + std::to_string(p) +
                         " · dp " + std::to_string(d);
      if (tp > 1) name += " · tp " + std::to_string(j);
      auto trace = add_track(a, in, name, "collective", p, lane);
      a.reducers.back().push_back(
          place(sys, a, in, pl.reducer_id(d, p, j), pl.process_of_stage(d, p, j), name,
                [&]() -> caf::actor {
                  if (!nccl)
                    return caf::actor_cast<caf::actor>(spawn_ring_reducer(
                        sys, ring_reducer_config{p, d, r.parallel.dp, std::move(trace)}));
                  reducer_config c{p, 1, std::move(trace), links.groups.at({p, j})};
                  c.first_replica = d;
                  return caf::actor_cast<caf::actor>(spawn_dp_reducer(
                      sys, std::move(c), a.tracer,
                      {a.stages[static_cast<std::size_t>(lane)][static_cast<std::size_t>(p)]}));
                }));
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

namespace {

bool is_local(const run_actors& a, const caf::actor& h) {
  return std::find(a.local.begin(), a.local.end(), h) != a.local.end();
}

}  // namespace

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
      // shard); a reducer of an NCCL group knows its stage already.
      if (((in.mesh && r.parallel.dp > 1) || r.parallel.zero > 0) && !nccl_reduced(in, k, j) &&
          a.reducers[static_cast<std::size_t>(lane)][static_cast<std::size_t>(k)]) {
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

}  // namespace troupe::actors
