// The pipeline links of a device job whose two ends live in different processes
// (actors/pipeline_wiring.cpp gives each an NCCL communicator of its own where the rendezvous
// found every process on a device of its own; docs/processes.md). Every process computes the same
// list from the layout and the placement, so link i of it is the one NCCL id i of the welcome
// opens.
#pragma once

#include <string>
#include <vector>

#include "engine/parallel/pipeline_layout.hpp"
#include "topology/placement.hpp"

namespace troupe::topology {

struct process_link {
  int lane = 0, from = 0, to = 0;  // lane d * tp + j; payloads from pipeline rank `from` to `to`
  std::string name() const;        // "pp-0-1-2": lane 0, rank 1 -> rank 2
  friend bool operator==(const process_link&, const process_link&) = default;
};

// By lane: the neighbouring virtual stages' rank pairs in virtual-stage order, both directions
// (each ordered pair once); only pairs whose ranks live in different processes. The tied wte's
// gradient between the embedding's rank and the head's is not among them: between processes it
// travels inside its message (topology/tied_wte.hpp).
std::vector<process_link> process_links(const engine::pipeline_layout& layout,
                                        const job_placement& placement, int dp, int tp);

}  // namespace troupe::topology
