// The pipeline links and data-parallel groups of a device job that span processes
// (actors/pipeline_wiring.cpp gives each an NCCL communicator of its own where the rendezvous
// found every process on a device of its own; docs/processes.md). Every process computes the same
// lists from the layout and the placement, so the welcome's NCCL ids open them in order: the
// links of process_links(), of process_tied_links(), then the groups of process_groups(), then
// of process_tensor_groups() (actors/pipeline_wiring.hpp: nccl_plan).
#pragma once

#include <string>
#include <vector>

#include "engine/parallel/pipeline_layout.hpp"
#include "topology/placement.hpp"

namespace troupe::topology {

struct process_link {
  int lane = 0, from = 0, to = 0;  // lane d * tp + j; payloads from pipeline rank `from` to `to`
  bool tied = false;               // the tied wte's gradient copy, not the pipeline's payloads
  // "pp-0-1-2": lane 0, rank 1 -> rank 2; "tied-0-1-0" for the tied wte's
  std::string name() const;
  friend bool operator==(const process_link&, const process_link&) = default;
};

// By lane: the neighbouring virtual stages' rank pairs in virtual-stage order, both directions
// (each ordered pair once); only pairs whose ranks live in different processes.
std::vector<process_link> process_links(const engine::pipeline_layout& layout,
                                        const job_placement& placement, int dp, int tp);
// By lane: the embedding's rank to the head's and back, for the tied wte's gradient copies
// (topology/tied_wte.hpp), where the two ranks differ and live in different processes. Links of
// their own, beside the pipeline's between the same ranks.
std::vector<process_link> process_tied_links(const engine::pipeline_layout& layout,
                                             const job_placement& placement, int dp, int tp);

// The data-parallel group of tensor shard `shard` of pipeline rank `rank`: its dp replicas'
// gradient buckets, averaged by one NCCL communicator in which replica d is rank d.
struct process_group {
  int rank = 0, shard = 0;
  std::string name() const;  // "dp-1-0": pipeline rank 1, tensor shard 0
  friend bool operator==(const process_group&, const process_group&) = default;
};

// By pipeline rank, then tensor shard: the data-parallel groups (dp > 1) whose replicas each
// live in a process of their own. A group with two replicas in one process is not among them:
// NCCL refuses two ranks of a communicator on one device, which is where a process keeps its
// stages, so its buckets ring through host memory.
std::vector<process_group> process_groups(const job_placement& placement, int pp, int dp, int tp);

// The tensor-parallel group of pipeline rank `rank` of replica `replica`: its tp shards' sums,
// by one NCCL communicator in which shard j is rank j.
struct process_tensor_group {
  int replica = 0, rank = 0;
  std::string name() const;  // "tp-1-0": replica 1, pipeline rank 0
  friend bool operator==(const process_tensor_group&, const process_tensor_group&) = default;
};

// By replica, then pipeline rank: the tensor groups (tp > 1) whose shards each live in a
// process of their own (a group with two shards in one process sums through host memory).
std::vector<process_tensor_group> process_tensor_groups(const job_placement& placement, int pp,
                                                        int dp, int tp);

}  // namespace troupe::topology
