// Where the actors of a job live when it spans processes, and the job-wide ids that name them on
// the wire. Every process computes the same placement from the recipe and the world size, so no
// directory of actors is exchanged: a message's target id says which actor of the receiving
// process gets it.
//
// Processes: the p x d stages are cut into `world` contiguous blocks in replica-major order
// (stage (d, k) is number d*p + k), so a process holds whole pipeline neighbourhoods and the
// stages of one replica sit on consecutive ranks. Rank 0 also holds the coordinator, the
// schedule and the tracer; replica d's data loader sits with its first stage; a ring reducer
// sits with its stage.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe::topology {

class job_placement {
 public:
  job_placement(int pp, int dp, int world) : pp_(pp), dp_(dp), world_(world) {
    if (world < 1 || (pp * dp) % world != 0)
      throw std::invalid_argument(
          "world size " + std::to_string(world) +
          " does not divide parallel.pp x parallel.dp = " + std::to_string(pp * dp) + " stages");
  }
  int world() const { return world_; }
  int stages_per_process() const { return pp_ * dp_ / world_; }
  int process_of_stage(int replica, int rank) const {
    return (replica * pp_ + rank) / stages_per_process();
  }
  int process_of_loader(int replica) const { return process_of_stage(replica, 0); }
  static constexpr int control_process = 0;  // coordinator, schedule, tracer

  // Job-wide actor ids (0 is the receiving gateway itself).
  static constexpr std::uint32_t tracer_id = 1, schedule_id = 2, coordinator_id = 3;
  std::uint32_t stage_id(int replica, int rank) const {
    return first_ + static_cast<std::uint32_t>(replica * pp_ + rank);
  }
  std::uint32_t loader_id(int replica) const {
    return first_ + static_cast<std::uint32_t>(pp_ * dp_ + replica);
  }
  std::uint32_t reducer_id(int replica, int rank) const {
    return first_ + static_cast<std::uint32_t>(pp_ * dp_ + dp_ + replica * pp_ + rank);
  }

 private:
  static constexpr std::uint32_t first_ = 16;
  int pp_, dp_, world_;
};

}  // namespace troupe::topology
