// Launch environments from environment maps (never the real environment): each launcher's
// variables, the precedence between launchers, variables that are missing, malformed or
// inconsistent (the error names the variable), Slurm hostlists, job token sources and the
// derived rendezvous ports.
#include <unistd.h>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "transport/launch_env.hpp"

using namespace troupe::transport;
using Catch::Matchers::Contains;

namespace {

// The launch_error text of detect_launch_env(env), or "" if it succeeds.
std::string error_of(const env_map& env) {
  try {
    detect_launch_env(env);
  } catch (const launch_error& e) {
    return e.what();
  }
  return "";
}

std::string hostlist_error(const std::string& list) {
  try {
    expand_hostlist(list);
  } catch (const launch_error& e) {
    return e.what();
  }
  return "";
}

env_map torchrun_vars() {
  return {{"RANK", "5"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29500"}};
}

env_map slurm_vars() {
  return {{"SLURM_PROCID", "3"},
          {"SLURM_NTASKS", "4"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "1"},
          {"SLURM_TASKS_PER_NODE", "2(x2)"},
          {"SLURM_JOB_NODELIST", "gpu[07-08]"},
          {"SLURM_JOB_ID", "42"},
          {"SLURM_STEP_ID", "1"}};
}

env_map openmpi_vars() {
  return {{"OMPI_COMM_WORLD_RANK", "2"},
          {"OMPI_COMM_WORLD_SIZE", "4"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
          {"OMPI_MCA_ess_base_jobid", "3719823361"}};
}

env_map with(env_map env, const std::string& key, const std::string& value) {
  env[key] = value;
  return env;
}
env_map without(env_map env, const std::string& key) {
  env.erase(key);
  return env;
}

}  // namespace

TEST_CASE("no launcher variables: a single process", "[unit][launch]") {
  const launch_env e = detect_launch_env({{"HOME", "/root"}, {"MASTER_ADDR", "10.0.0.9"}});
  CHECK(e.kind == launcher_kind::none);
  CHECK(e.rank == 0);
  CHECK(e.world == 1);
  CHECK(e.local_world == 1);
  CHECK(e.job_token.empty());
  CHECK(e.describe() == "single process (no launcher): rank 0 of 1");
}

TEST_CASE("troupe launch variables", "[unit][launch]") {
  env_map env = with(torchrun_vars(), "TROUPE_LAUNCHER", "troupe");
  env["TROUPE_JOB_TOKEN"] = "s3cret";
  const launch_env e = detect_launch_env(env);
  CHECK(e.kind == launcher_kind::troupe);
  CHECK(e.rank == 5);
  CHECK(e.world == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world == 4);
  CHECK(e.master_addr == "10.0.0.1");
  CHECK(e.master_port == 29500);
  CHECK(e.job_token == "s3cret");
  CHECK(e.job_id.empty());
  CHECK(e.describe() == "troupe launch: rank 5 of 8 (local 1 of 4), rendezvous 10.0.0.1:29500");
  // Without a token the rendezvous address stands in for it.
  CHECK(detect_launch_env(without(env, "TROUPE_JOB_TOKEN")).job_token == "10.0.0.1:29500");
  CHECK_THAT(error_of(with(env, "TROUPE_LAUNCHER", "srun")), Contains("TROUPE_LAUNCHER"));
  CHECK_THAT(error_of(without(env, "MASTER_PORT")), Contains("MASTER_PORT is missing"));
  CHECK_THAT(error_of(without(env, "LOCAL_RANK")), Contains("LOCAL_RANK is missing"));
}

TEST_CASE("torchrun-style variables", "[unit][launch]") {
  const launch_env e = detect_launch_env(torchrun_vars());
  CHECK(e.kind == launcher_kind::torchrun);
  CHECK(e.rank == 5);
  CHECK(e.world == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world == 4);
  CHECK(e.master_addr == "10.0.0.1");
  CHECK(e.master_port == 29500);
  CHECK(e.job_token == "10.0.0.1:29500");
  CHECK(e.describe() ==
        "torchrun-style environment: rank 5 of 8 (local 1 of 4), rendezvous 10.0.0.1:29500");

  const launch_env run = detect_launch_env(with(torchrun_vars(), "TORCHELASTIC_RUN_ID", "exp7"));
  CHECK(run.job_token == "torchrun:exp7");
  CHECK(run.job_id == "exp7");
  CHECK_THAT(run.describe(), Contains("torchrun run exp7: rank 5 of 8"));
  // torchrun's default run id "none" is shared by every job: it identifies nothing.
  CHECK(detect_launch_env(with(torchrun_vars(), "TORCHELASTIC_RUN_ID", "none")).job_token ==
        "10.0.0.1:29500");
  // torchrun's agent holds MASTER_PORT itself when its workers use its store: the port next to
  // it is the rendezvous.
  const env_map agent = with(torchrun_vars(), "TORCHELASTIC_USE_AGENT_STORE", "True");
  CHECK(detect_launch_env(agent).master_port == 29501);
  CHECK(detect_launch_env(with(agent, "MASTER_PORT", "65535")).master_port == 65534);
  CHECK(detect_launch_env(with(torchrun_vars(), "TORCHELASTIC_USE_AGENT_STORE", "False"))
            .master_port == 29500);
  // IPv6 rendezvous addresses are bracketed in messages and derived tokens.
  CHECK_THAT(detect_launch_env(with(torchrun_vars(), "MASTER_ADDR", "fd00::1")).describe(),
             Contains("rendezvous [fd00::1]:29500"));
}

TEST_CASE("malformed or inconsistent variables are named", "[unit][launch]") {
  const env_map t = torchrun_vars();
  CHECK_THAT(error_of(with(t, "RANK", "five")), Contains("RANK='five'"));
  CHECK_THAT(error_of(with(t, "RANK", "-1")), Contains("RANK='-1'"));
  CHECK_THAT(error_of(with(t, "RANK", "3x")), Contains("RANK='3x'"));
  CHECK_THAT(error_of(with(t, "RANK", "")), Contains("RANK=''"));
  CHECK_THAT(error_of(with(t, "RANK", "8")), Contains("RANK=8 is not below WORLD_SIZE=8"));
  CHECK_THAT(error_of(with(t, "WORLD_SIZE", "0")), Contains("WORLD_SIZE=0 is outside 1-65536"));
  CHECK_THAT(error_of(with(t, "WORLD_SIZE", "70000")), Contains("WORLD_SIZE"));
  CHECK_THAT(error_of(with(t, "LOCAL_RANK", "4")), Contains("LOCAL_RANK=4 is not below"));
  CHECK_THAT(error_of(with(t, "LOCAL_WORLD_SIZE", "9")), Contains("LOCAL_WORLD_SIZE=9 exceeds"));
  CHECK_THAT(error_of(with(t, "MASTER_PORT", "70000")), Contains("MASTER_PORT=70000 is outside"));
  CHECK_THAT(error_of(with(t, "MASTER_PORT", "0")), Contains("MASTER_PORT=0 is outside 1-65535"));
  CHECK_THAT(error_of(with(t, "MASTER_ADDR", "")), Contains("MASTER_ADDR is empty"));
  CHECK_THAT(error_of(without(t, "MASTER_ADDR")), Contains("MASTER_ADDR is missing"));
  // WORLD_SIZE alone is enough to select torchrun-style, so RANK is reported missing.
  CHECK_THAT(error_of({{"WORLD_SIZE", "2"}}), Contains("RANK is missing"));
}

TEST_CASE("precedence: troupe, torchrun-style, Slurm, OpenMPI", "[unit][launch]") {
  env_map all = slurm_vars();
  for (const auto& [k, v] : openmpi_vars()) all[k] = v;
  CHECK(detect_launch_env(all).kind == launcher_kind::slurm);
  for (const auto& [k, v] : torchrun_vars()) all[k] = v;
  CHECK(detect_launch_env(all).kind == launcher_kind::torchrun);
  all["TROUPE_LAUNCHER"] = "troupe";
  CHECK(detect_launch_env(all).kind == launcher_kind::troupe);
  CHECK(detect_launch_env(openmpi_vars()).kind == launcher_kind::openmpi);
}

TEST_CASE("Slurm variables", "[unit][launch]") {
  const launch_env e = detect_launch_env(slurm_vars());
  CHECK(e.kind == launcher_kind::slurm);
  CHECK(e.rank == 3);
  CHECK(e.world == 4);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world == 2);
  CHECK(e.master_addr == "gpu07");
  CHECK(e.master_port == slurm_derived_port(42, 1));
  CHECK(e.master_port == 24201);
  CHECK(e.job_token == "slurm:42.1");
  CHECK(e.job_id == "42");
  CHECK(e.describe() == "slurm job 42: rank 3 of 4 (local 1 of 2), rendezvous gpu07:24201");

  // MASTER_ADDR / MASTER_PORT override the first host and the derived port.
  env_map m = with(with(slurm_vars(), "MASTER_ADDR", "10.1.2.3"), "MASTER_PORT", "31000");
  CHECK(detect_launch_env(m).master_addr == "10.1.2.3");
  CHECK(detect_launch_env(m).master_port == 31000);
  // The step's own lists win over the job's.
  env_map step = with(slurm_vars(), "SLURM_STEP_NODELIST", "gpu08,gpu07");
  step["SLURM_STEP_NUM_TASKS"] = "3";
  step["SLURM_STEP_TASKS_PER_NODE"] = "1,2";
  step["SLURM_PROCID"] = "2";
  const launch_env s = detect_launch_env(step);
  CHECK(s.master_addr == "gpu08");
  CHECK(s.world == 3);
  CHECK(s.local_world == 2);
  CHECK_THAT(error_of(with(step, "SLURM_STEP_TASKS_PER_NODE", "2,2")), Contains("adds up to 4"));
  // The older SLURM_NODELIST and SLURM_STEPID names work too.
  env_map old = without(without(slurm_vars(), "SLURM_JOB_NODELIST"), "SLURM_STEP_ID");
  old["SLURM_NODELIST"] = "n1";
  old["SLURM_STEPID"] = "0";
  CHECK(detect_launch_env(old).master_addr == "n1");
  CHECK(detect_launch_env(old).job_token == "slurm:42.0");
  // --ntasks-per-node alone gives the local world.
  env_map ntpn = without(without(slurm_vars(), "SLURM_TASKS_PER_NODE"), "SLURM_NODEID");
  ntpn["SLURM_NTASKS_PER_NODE"] = "2";
  CHECK(detect_launch_env(ntpn).local_world == 2);
  // Equal counts per node need no SLURM_NODEID.
  CHECK(detect_launch_env(without(slurm_vars(), "SLURM_NODEID")).local_world == 2);
}

TEST_CASE("Slurm errors name the variable", "[unit][launch]") {
  const env_map s = slurm_vars();
  CHECK_THAT(error_of(with(s, "SLURM_PROCID", "4")), Contains("SLURM_PROCID=4 is not below"));
  CHECK_THAT(error_of(without(s, "SLURM_NTASKS")), Contains("SLURM_NTASKS is missing"));
  CHECK_THAT(error_of(without(s, "SLURM_LOCALID")), Contains("SLURM_LOCALID is missing"));
  CHECK_THAT(error_of(with(s, "SLURM_TASKS_PER_NODE", "2(x")), Contains("SLURM_TASKS_PER_NODE"));
  CHECK_THAT(error_of(with(s, "SLURM_TASKS_PER_NODE", "2,")), Contains("SLURM_TASKS_PER_NODE"));
  CHECK_THAT(error_of(with(s, "SLURM_TASKS_PER_NODE", "2(y2)")), Contains("SLURM_TASKS_PER_NODE"));
  CHECK_THAT(error_of(without(s, "SLURM_TASKS_PER_NODE")), Contains("SLURM_TASKS_PER_NODE"));
  CHECK_THAT(error_of(with(s, "SLURM_NODEID", "2")), Contains("SLURM_NODEID=2"));
  CHECK_THAT(error_of(with(without(s, "SLURM_NODEID"), "SLURM_TASKS_PER_NODE", "3,1")),
             Contains("SLURM_NODEID is missing"));
  CHECK_THAT(error_of(with(s, "SLURM_JOB_NODELIST", "gpu[07-08")),
             Contains("SLURM_JOB_NODELIST='gpu[07-08' does not parse"));
  CHECK_THAT(error_of(without(s, "SLURM_JOB_NODELIST")), Contains("SLURM_NODELIST is missing"));
  CHECK_THAT(error_of(without(s, "SLURM_STEP_ID")), Contains("SLURM_STEP_ID is missing"));
  CHECK_THAT(error_of(without(s, "SLURM_JOB_ID")), Contains("SLURM_JOB_ID is missing"));
  CHECK_THAT(error_of(with(s, "SLURM_JOB_ID", "4x")), Contains("SLURM_JOB_ID='4x'"));
  // With MASTER_PORT no step id is needed; the token then falls back to the address.
  const launch_env e = detect_launch_env(with(without(s, "SLURM_STEP_ID"), "MASTER_PORT", "31000"));
  CHECK(e.job_token == "gpu07:31000");
}

TEST_CASE("the Slurm port is stable, in range and differs between steps", "[unit][launch]") {
  std::set<int> ports;
  for (std::uint64_t job : {0ull, 1ull, 42ull, 99ull, 12345678ull, 18446744073709551615ull}) {
    for (std::uint64_t step = 0; step < 100; ++step) {
      const int p = slurm_derived_port(job, step);
      CHECK(p == slurm_derived_port(job, step));
      CHECK(p >= derived_port_base);
      CHECK(p < derived_port_base + derived_port_span);
      CHECK(p != slurm_derived_port(job, step + 1));
      if (job == 42) ports.insert(p);
    }
  }
  CHECK(ports.size() == 100);  // every step of a job gets its own port
  CHECK(slurm_derived_port(42, 0) != slurm_derived_port(43, 0));
  // The same through the environment.
  CHECK(detect_launch_env(slurm_vars()).master_port == detect_launch_env(slurm_vars()).master_port);
  CHECK(detect_launch_env(with(slurm_vars(), "SLURM_STEP_ID", "2")).master_port ==
        detect_launch_env(slurm_vars()).master_port + 1);
}

TEST_CASE("OpenMPI variables", "[unit][launch]") {
  const launch_env e = detect_launch_env(openmpi_vars());
  CHECK(e.kind == launcher_kind::openmpi);
  CHECK(e.rank == 2);
  CHECK(e.world == 4);
  CHECK(e.local_rank == 2);
  CHECK(e.local_world == 4);
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port == openmpi_derived_port("3719823361"));
  CHECK(e.master_port >= derived_port_base);
  CHECK(e.master_port < derived_port_base + derived_port_span);
  CHECK(openmpi_derived_port("3719823361") != openmpi_derived_port("3719823362"));
  CHECK(e.job_token == "openmpi:3719823361");
  CHECK(e.describe() ==
        "openmpi job 3719823361: rank 2 of 4 (local 2 of 4), rendezvous 127.0.0.1:" +
            std::to_string(e.master_port));

  // Spanning machines: MASTER_ADDR and MASTER_PORT are required.
  const env_map multi = with(openmpi_vars(), "OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  CHECK_THAT(error_of(with(multi, "OMPI_COMM_WORLD_LOCAL_RANK", "1")),
             Contains("MASTER_ADDR is missing"));
  env_map given = with(with(multi, "OMPI_COMM_WORLD_LOCAL_RANK", "1"), "MASTER_ADDR", "node1");
  CHECK_THAT(error_of(given), Contains("MASTER_PORT is missing"));
  given["MASTER_PORT"] = "29400";
  CHECK(detect_launch_env(given).master_addr == "node1");
  CHECK(detect_launch_env(given).master_port == 29400);
  CHECK_THAT(error_of(without(openmpi_vars(), "OMPI_MCA_ess_base_jobid")),
             Contains("OMPI_MCA_ess_base_jobid is missing"));
  CHECK_THAT(error_of(without(openmpi_vars(), "OMPI_COMM_WORLD_LOCAL_SIZE")),
             Contains("OMPI_COMM_WORLD_LOCAL_SIZE is missing"));
  CHECK_THAT(error_of(with(openmpi_vars(), "OMPI_COMM_WORLD_RANK", "4")),
             Contains("OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"));
}

TEST_CASE("job token sources", "[unit][launch]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("troupe-token-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path file = dir / "token";
  std::ofstream(file) << "from-file\n";

  env_map s = with(slurm_vars(), "TROUPE_JOB_TOKEN_FILE", file.string());
  CHECK(detect_launch_env(s).job_token == "from-file");  // trailing newline stripped
  CHECK(detect_launch_env(with(s, "TROUPE_JOB_TOKEN", "explicit")).job_token == "explicit");
  const std::string missing = (dir / "no-such-token").string();
  CHECK_THAT(error_of(with(slurm_vars(), "TROUPE_JOB_TOKEN_FILE", missing)),
             Contains("TROUPE_JOB_TOKEN_FILE=" + missing + " cannot be read"));
  CHECK_THAT(error_of(with(slurm_vars(), "TROUPE_JOB_TOKEN_FILE", dir.string())),
             Contains("TROUPE_JOB_TOKEN_FILE=" + dir.string() + " cannot be read"));
  std::ofstream(dir / "long") << std::string(2000, 'x');
  CHECK_THAT(error_of(with(slurm_vars(), "TROUPE_JOB_TOKEN_FILE", (dir / "long").string())),
             Contains("is longer than 1024 bytes"));
  std::ofstream(dir / "empty") << "\n";
  CHECK_THAT(error_of(with(slurm_vars(), "TROUPE_JOB_TOKEN_FILE", (dir / "empty").string())),
             Contains("is empty"));
  CHECK_THAT(error_of(with(slurm_vars(), "TROUPE_JOB_TOKEN", "")),
             Contains("TROUPE_JOB_TOKEN is empty"));
  CHECK_THAT(error_of(with(slurm_vars(), "TROUPE_JOB_TOKEN", std::string(1025, 'x'))),
             Contains("TROUPE_JOB_TOKEN is longer than 1024 bytes"));
  // A single process takes an explicit token too.
  CHECK(detect_launch_env({{"TROUPE_JOB_TOKEN", "solo"}}).job_token == "solo");
  // Different jobs never derive the same token.
  CHECK(detect_launch_env(slurm_vars()).job_token !=
        detect_launch_env(with(slurm_vars(), "SLURM_JOB_ID", "43")).job_token);
  CHECK(detect_launch_env(slurm_vars()).job_token !=
        detect_launch_env(with(slurm_vars(), "SLURM_STEP_ID", "2")).job_token);
  fs::remove_all(dir);
}

TEST_CASE("current_environment copies the process environment", "[unit][launch]") {
  REQUIRE(::setenv("TROUPE_TEST_LAUNCH_ENV", "a=b=c", 1) == 0);
  const env_map env = current_environment();
  ::unsetenv("TROUPE_TEST_LAUNCH_ENV");
  REQUIRE(env.count("TROUPE_TEST_LAUNCH_ENV") == 1);
  CHECK(env.at("TROUPE_TEST_LAUNCH_ENV") == "a=b=c");
}

TEST_CASE("hostlist expansion", "[unit][launch]") {
  using list = std::vector<std::string>;
  CHECK(expand_hostlist("gpu5") == list{"gpu5"});
  CHECK(expand_hostlist("a,b.example.org,c_d") == list{"a", "b.example.org", "c_d"});
  CHECK(expand_hostlist("node[01-03,7],gpu5,rack[1-2]-n[3-4]") ==
        list{"node01", "node02", "node03", "node7", "gpu5", "rack1-n3", "rack1-n4", "rack2-n3",
             "rack2-n4"});
  CHECK(expand_hostlist("n[8-10]") == list{"n8", "n9", "n10"});
  CHECK(expand_hostlist("n[08-10]") == list{"n08", "n09", "n10"});
  CHECK(expand_hostlist("n[098-101]") == list{"n098", "n099", "n100", "n101"});
  CHECK(expand_hostlist("[1-2]x") == list{"1x", "2x"});
  CHECK(expand_hostlist("n[5]") == list{"n5"});
  CHECK(expand_hostlist("n[0-9999]").size() == 10000);

  CHECK_THAT(hostlist_error(""), Contains("empty"));
  CHECK_THAT(hostlist_error("node[1-3"), Contains("'[' without ']'"));
  CHECK_THAT(hostlist_error("node1-3]"), Contains("']' without '['"));
  CHECK_THAT(hostlist_error("node[3-1]"), Contains("runs backwards"));
  CHECK_THAT(hostlist_error("node[]"), Contains("empty brackets"));
  CHECK_THAT(hostlist_error("node[a-b]"), Contains("not a list of numbers"));
  CHECK_THAT(hostlist_error("node[1-2-3]"), Contains("not a list of numbers"));
  CHECK_THAT(hostlist_error("node[1,,2]"), Contains("not a list of numbers"));
  CHECK_THAT(hostlist_error("node[1,2,]"), Contains("ends with ','"));
  CHECK_THAT(hostlist_error("node[1[2]]"), Contains("not a list of numbers"));
  CHECK_THAT(hostlist_error("a,,b"), Contains("empty host name"));
  CHECK_THAT(hostlist_error("a,b,"), Contains("ends with ','"));
  CHECK_THAT(hostlist_error(",a"), Contains("empty host name"));
  CHECK_THAT(hostlist_error("a b"), Contains("unexpected character ' '"));
  CHECK_THAT(hostlist_error("n[0-999999999]"), Contains("more than"));
  CHECK_THAT(hostlist_error("a[0-9999]b[0-9999]"), Contains("more than"));
  CHECK_THAT(hostlist_error("n[1-99999999999999999999]"), Contains("not a list of numbers"));
}
