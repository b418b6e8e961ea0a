// Where this process sits in a multi-process job, read from the environment its launcher set:
// `troupe launch`, a torchrun-style environment, Slurm (`srun`) or OpenMPI (`mpirun`). Pure
// functions of an environment map (no I/O except reading TROUPE_JOB_TOKEN_FILE), so every
// launcher is testable without starting it. docs/operations.md lists every variable, the
// precedence and how the rendezvous port and the job token are derived.
//
// Invariants of a returned launch_env: 0 <= rank < world <= max_world, 0 <= local_rank <
// local_world <= world, 1 <= master_port <= 65535 (0 only for kind none), master_addr non-empty.
// A variable that is missing, malformed or inconsistent throws launch_error naming it.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::transport {

struct launch_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class launcher_kind { none, troupe, torchrun, slurm, openmpi };

// The most processes one job may have (rendezvous sizes its limits from it).
inline constexpr int max_world = 65536;
// The longest job token accepted (bytes).
inline constexpr std::size_t max_job_token_bytes = 1024;

// Ports derived from a cluster job's identity lie in [derived_port_base, derived_port_base +
// derived_port_span): below Linux's default ephemeral range (32768-60999).
inline constexpr int derived_port_base = 20000;
inline constexpr int derived_port_span = 10000;

struct launch_env {
  launcher_kind kind = launcher_kind::none;  // none: a plain single process (world 1)
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string job_token;  // who may join this job's rendezvous (see docs/operations.md)
  std::string job_id;     // the cluster engine's id, for messages ("" if none)
  // e.g. "slurm job 42: rank 3 of 4 (local 1 of 2), rendezvous 10.0.0.1:29517"
  std::string describe() const;
};

using env_map = std::map<std::string, std::string>;

// A copy of this process's environment.
env_map current_environment();

// Throws launch_error naming the variable that is missing, malformed or inconsistent (rank >=
// world, port out of range, SLURM_NODELIST that does not parse, ...).
launch_env detect_launch_env(const env_map& env);

// Slurm hostlist syntax: "node[01-03,7],gpu5,rack[1-2]-n[3-4]" -> every host name, in order
// (several bracket groups expand left to right, the last varying fastest; a range keeps the
// width of its lower bound: 08-10 -> 08, 09, 10). Throws launch_error on malformed input or a
// list of more than max_hostlist_hosts names.
inline constexpr std::size_t max_hostlist_hosts = 1 << 20;
std::vector<std::string> expand_hostlist(const std::string& list);

// The rendezvous port of Slurm step `step_id` of job `job_id`:
// derived_port_base + (job_id mod 100) * 100 + (step_id mod 100). Consecutive steps of a job
// get consecutive ports; jobs whose ids differ by less than 100 never share one.
int slurm_derived_port(std::uint64_t job_id, std::uint64_t step_id);
// The rendezvous port of a single-machine OpenMPI job:
// derived_port_base + fnv1a64(jobid) mod derived_port_span.
int openmpi_derived_port(const std::string& jobid);

}  // namespace troupe::transport
