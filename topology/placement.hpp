// Where the actors of a job live when it spans processes, and the job-wide ids that name them on
// the wire. Every process computes the same placement from the recipe and the world size, so no
// directory of actors is exchanged: a message's target id says which actor of the receiving
// process gets it.
//
// Processes: the p x d x t stages (tensor shard j of rank k of replica d, numbered (d*p + k)*t + j:
// replica-major, shards innermost, as Megatron orders its ranks) are cut into `world` contiguous
// blocks, so a process holds whole pipeline neighbourhoods and the shards of one stage sit on
// consecutive processes. When world divides p x d, every stage's shards share a process; past
// that a stage's tensor group spans processes. Rank 0 also holds the coordinator, the schedule
// and the tracer; each lane's data loader sits with its first stage; a ring reducer or zero shard
// sits with its stage.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe::topology {

class job_placement {
 public:
  job_placement(int pp, int dp, int world, int tp = 1) : pp_(pp), dp_(dp), tp_(tp), world_(world) {
    if (world < 1 || (pp * dp * tp) % world != 0)
      throw std::invalid_argument(
          "world size " + std::to_string(world) + " does not divide parallel.pp x parallel.dp" +
          (tp > 1 ? " x parallel.tp" : "") + " = " + std::to_string(pp * dp * tp) + " stages");
  }
  int world() const { return world_; }
  int stages_per_process() const { return pp_ * dp_ * tp_ / world_; }
  int process_of_stage(int replica, int rank, int shard = 0) const {
    return number(replica, rank, shard) / stages_per_process();
  }
  int process_of_loader(int lane) const { return process_of_stage(lane / tp_, 0, lane % tp_); }
  // Whether the tensor shards of (replica, rank) live in more than one process.
  bool tensor_group_spans(int replica, int rank) const {
    return process_of_stage(replica, rank, 0) != process_of_stage(replica, rank, tp_ - 1);
  }
  static constexpr int control_process = 0;  // coordinator, schedule, tracer

  // Job-wide actor ids (0 is the receiving gateway itself): stages, loaders (by lane), reducers,
  // then the tensor-group members of groups that span processes.
  static constexpr std::uint32_t tracer_id = 1, schedule_id = 2, coordinator_id = 3;
  std::uint32_t stage_id(int replica, int rank, int shard = 0) const {
    return first_ + static_cast<std::uint32_t>(number(replica, rank, shard));
  }
  std::uint32_t loader_id(int lane) const {
    return first_ + static_cast<std::uint32_t>(stages() + lane);
  }
  std::uint32_t reducer_id(int replica, int rank, int shard = 0) const {
    return first_ + static_cast<std::uint32_t>(stages() + dp_ * tp_ + number(replica, rank, shard));
  }
  std::uint32_t tensor_member_id(int replica, int rank, int shard) const {
    return first_ +
           static_cast<std::uint32_t>(2 * stages() + dp_ * tp_ + number(replica, rank, shard));
  }

 private:
  int stages() const { return pp_ * dp_ * tp_; }
  int number(int replica, int rank, int shard) const {
    return (replica * pp_ + rank) * tp_ + shard;
  }
  static constexpr std::uint32_t first_ = 16;
  int pp_, dp_, tp_, world_;
};

}  // namespace troupe::topology
