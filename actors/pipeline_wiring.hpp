// Spawning and wiring the actors of one run (the part of actors/pipeline_run.cpp that builds a
// job's actors): which actors this process spawns and which it reaches through proxies
// (topology/placement.hpp), the stages with their chunks and links, the data loaders, and every
// local actor told its peers. Internal to actors/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "actors/gateway.hpp"
#include "actors/pipeline_run.hpp"
#include "engine/chunks/device_chunk.hpp"
#include "engine/parallel/pipeline_layout.hpp"
#include "engine/trace/trace.hpp"
#include "engine/trace/trace_recorder.hpp"
#include "engine/training/checkpoint.hpp"
#include "engine/training/watchdog.hpp"
#include "topology/placement.hpp"
#include "topology/process_links.hpp"
#include "topology/tensor_exchange.hpp"

namespace troupe::actors {

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
  std::vector<engine::trace::track> tracks;
};

struct build_inputs {
  const engine::recipe& r;
  const run_options& o;
  engine::pipeline_layout layout;
  engine::training_data data;
  std::vector<int> seq_lens;
  engine::trace::trace_clock::time_point origin;
  std::vector<std::shared_ptr<const engine::data::batch_sampler>> train{};  // by seq_lens
  std::shared_ptr<const engine::data::batch_sampler> val{};
  topology::job_placement placement{1, 1, 1};
  int rank = 0;
  remote_mesh* mesh = nullptr;                            // set when the job spans processes
  std::shared_ptr<const engine::chunk_factory> chunks{};  // device stages
  // From the rendezvous: an NCCL id per communicator of nccl_plan(), in order; empty: payloads,
  // buckets and tensor groups between processes are staged through host memory.
  std::vector<std::vector<std::uint8_t>> nccl_ids{};
  // Resuming: the checkpoint and its trainer state.
  std::filesystem::path resume_dir{};
  engine::checkpoint_state resumed{};
  std::shared_ptr<engine::action_watchdog> watchdog{};  // this process's
};

engine::trace::recorder add_track(run_actors& a, const build_inputs& in, std::string name,
                                  std::string role, int rank, int replica);

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

// The communicators NCCL serves between processes when the rendezvous gives ids, in the ids'
// order: a device job's pipeline links (topology::process_links), its tied wte's links
// (process_tied_links), then its data-parallel groups
// without ZeRO or with ZeRO through the devices (process_groups; ZeRO's host shards
// reduce-scatter and gather through host memory),
// then its tensor groups (process_tensor_groups). None for host chunks.
struct nccl_communicators {
  std::vector<topology::process_link> links, tied_links;
  std::vector<topology::process_group> groups;
  std::vector<topology::process_tensor_group> tensor_groups;
  std::size_t size() const {
    return links.size() + tied_links.size() + groups.size() + tensor_groups.size();
  }
  // "4 pipeline links, 4 tied wte links, 2 data-parallel groups, 1 tensor group"
  std::string describe() const;
};
nccl_communicators nccl_plan(const build_inputs& in);
// BLAS/OpenMP threads per stage: run_options::compute_threads, or this machine's cores over the
// stages it runs.
int compute_threads(const build_inputs& in);
// Tokens of one optimizer step, every replica together.
std::int64_t tokens_per_step(const build_inputs& in);
// Samplers are built before anything is written: a corpus too small for the batch shape is bad
// input (recipe_error naming data.train / data.val).
void make_samplers(build_inputs& in);
// The stages of every lane (with their reducers or ZeRO shards), and the data loaders.
void spawn_stages(caf::actor_system& sys, run_actors& a, const build_inputs& in);
void spawn_loaders(caf::actor_system& sys, run_actors& a, const build_inputs& in);
// Sends every local actor its peers (local actors or proxies).
void wire_actors(caf::actor_system& sys, run_actors& a, const build_inputs& in, caf::actor client);

}  // namespace troupe::actors
