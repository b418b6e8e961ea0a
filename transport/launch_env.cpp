// Launch environments: which launcher started this process and where the job's rendezvous is.
// Precedence (the first that applies wins): TROUPE_LAUNCHER=troupe, torchrun-style RANK/WORLD_SIZE,
// Slurm SLURM_PROCID, OpenMPI OMPI_COMM_WORLD_RANK/SIZE, else a plain single process. Every value
// is checked here, so later code can trust a launch_env (see its invariants in the header).
#include "transport/launch_env.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

extern char** environ;

namespace troupe::transport {
namespace {

const std::string* find(const env_map& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

const std::string* find_first(const env_map& env, std::initializer_list<const char*> names,
                              std::string* which) {
  for (const char* name : names) {
    if (const std::string* v = find(env, name)) {
      *which = name;
      return v;
    }
  }
  return nullptr;
}

std::uint64_t parse_u64(const std::string& name, const std::string& value) {
  std::uint64_t x = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, x);
  if (value.empty() || ec != std::errc{} || ptr != end)
    throw launch_error(name + "='" + value + "' is not a non-negative integer");
  return x;
}

int parse_int(const std::string& name, const std::string& value, int lo, int hi) {
  const std::uint64_t x = parse_u64(name, value);
  if (x < static_cast<std::uint64_t>(lo) || x > static_cast<std::uint64_t>(hi))
    throw launch_error(name + "=" + value + " is outside " + std::to_string(lo) + "-" +
                       std::to_string(hi));
  return static_cast<int>(x);
}

const std::string& require(const env_map& env, const std::string& name, const char* why) {
  const std::string* v = find(env, name);
  if (!v) throw launch_error(name + " is missing (" + why + ")");
  return *v;
}

int require_count(const env_map& env, const std::string& name, const char* why) {
  return parse_int(name, require(env, name, why), 1, max_world);
}
int require_index(const env_map& env, const std::string& name, const char* why) {
  return parse_int(name, require(env, name, why), 0, max_world - 1);
}
int parse_port(const std::string& name, const std::string& value) {
  return parse_int(name, value, 1, 65535);
}
std::string check_addr(const std::string& name, const std::string& value) {
  if (value.empty()) throw launch_error(name + " is empty");
  return value;
}

void check_ranks(launch_env& e, const char* rank, const char* world, const char* local_rank,
                 const char* local_world) {
  if (e.rank >= e.world)
    throw launch_error(std::string(rank) + "=" + std::to_string(e.rank) + " is not below " + world +
                       "=" + std::to_string(e.world));
  if (e.local_world > e.world)
    throw launch_error(std::string(local_world) + "=" + std::to_string(e.local_world) +
                       " exceeds " + world + "=" + std::to_string(e.world));
  if (e.local_rank >= e.local_world)
    throw launch_error(std::string(local_rank) + "=" + std::to_string(e.local_rank) +
                       " is not below " + local_world + "=" + std::to_string(e.local_world));
}

std::uint64_t fnv1a64(const std::string& s) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string checked_token(const std::string& what, std::string token) {
  if (token.empty()) throw launch_error(what + " is empty");
  if (token.size() > max_job_token_bytes)
    throw launch_error(what + " is longer than " + std::to_string(max_job_token_bytes) + " bytes");
  return token;
}

// TROUPE_JOB_TOKEN, else the file TROUPE_JOB_TOKEN_FILE names, else `derived`.
std::string job_token(const env_map& env, const std::string& derived) {
  if (const std::string* t = find(env, "TROUPE_JOB_TOKEN")) {
    return checked_token("TROUPE_JOB_TOKEN", *t);
  }
  if (const std::string* path = find(env, "TROUPE_JOB_TOKEN_FILE")) {
    const std::string what = "TROUPE_JOB_TOKEN_FILE=" + *path;
    const int fd = ::open(path->c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw launch_error(what + " cannot be read: " + std::strerror(errno));
    // Read at most one byte more than a token may have (plus a line ending): never all of a
    // huge or endless file.
    std::string text(max_job_token_bytes + 3, '\0');
    std::size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int error = errno;
        ::close(fd);
        throw launch_error(what + " cannot be read: " + std::strerror(error));
      }
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    ::close(fd);
    text.resize(got);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    return checked_token(what, std::move(text));
  }
  return derived;
}

std::string addr_port(const std::string& addr, int port) {
  const bool v6 = addr.find(':') != std::string::npos;
  return (v6 ? "[" + addr + "]" : addr) + ":" + std::to_string(port);
}

// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
launch_env torchrun_style(const env_map& env, launcher_kind kind, const char* why) {
  launch_env e;
  e.kind = kind;
  e.rank = require_index(env, "RANK", why);
  e.world = require_count(env, "WORLD_SIZE", why);
  e.local_rank = require_index(env, "LOCAL_RANK", why);
  e.local_world = require_count(env, "LOCAL_WORLD_SIZE", why);
  check_ranks(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  e.master_addr = check_addr("MASTER_ADDR", require(env, "MASTER_ADDR", why));
  e.master_port = parse_port("MASTER_PORT", require(env, "MASTER_PORT", why));
  return e;
}

launch_env troupe_env(const env_map& env) {
  launch_env e = torchrun_style(env, launcher_kind::troupe, "`troupe launch` sets it");
  e.job_token = job_token(env, addr_port(e.master_addr, e.master_port));
  return e;
}

launch_env torchrun_env(const env_map& env) {
  launch_env e = torchrun_style(env, launcher_kind::torchrun,
                                "a torchrun-style environment sets RANK, WORLD_SIZE, LOCAL_RANK, "
                                "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  const std::string* run_id = find(env, "TORCHELASTIC_RUN_ID");
  // torchrun's default --rdzv-id is the literal "none": shared by unrelated jobs, so no identity.
  if (run_id && !run_id->empty() && *run_id != "none") e.job_id = *run_id;
  // torchrun's agent itself listens on MASTER_PORT (its TCPStore) when it tells its workers
  // TORCHELASTIC_USE_AGENT_STORE=True: the rendezvous then takes the port next to it.
  if (const std::string* agent = find(env, "TORCHELASTIC_USE_AGENT_STORE");
      agent && (*agent == "True" || *agent == "true" || *agent == "1"))
    e.master_port = e.master_port < 65535 ? e.master_port + 1 : e.master_port - 1;
  e.job_token = job_token(
      env, e.job_id.empty() ? addr_port(e.master_addr, e.master_port) : "torchrun:" + e.job_id);
  return e;
}

// "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> parse_tasks_per_node(const std::string& name, const std::string& value) {
  std::vector<int> out;
  std::stringstream in(value);
  std::string item;
  const auto bad = [&] { return launch_error(name + "='" + value + "' does not parse"); };
  if (value.empty()) throw bad();
  while (std::getline(in, item, ',')) {
    const auto open = item.find('(');
    int count = 0, repeat = 1;
    try {
      count = parse_int(name, item.substr(0, open), 1, max_world);
      if (open != std::string::npos) {
        if (item.size() < open + 4 || item.compare(open, 2, "(x") != 0 || item.back() != ')')
          throw bad();
        repeat = parse_int(name, item.substr(open + 2, item.size() - open - 3), 1, max_world);
      }
    } catch (const launch_error&) {
      throw bad();
    }
    if (out.size() + static_cast<std::size_t>(repeat) > static_cast<std::size_t>(max_world))
      throw bad();
    out.insert(out.end(), static_cast<std::size_t>(repeat), count);
  }
  if (out.empty() || value.back() == ',') throw bad();
  return out;
}

int slurm_local_world(const env_map& env, int world) {
  std::string name;
  if (const std::string* v =
          find_first(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}, &name)) {
    const std::vector<int> per_node = parse_tasks_per_node(name, *v);
    if (name == "SLURM_STEP_TASKS_PER_NODE") {
      long sum = 0;
      for (int n : per_node) sum += n;
      if (sum != world)
        throw launch_error(name + "=" + *v + " adds up to " + std::to_string(sum) + " tasks, not " +
                           std::to_string(world));
    }
    if (const std::string* node = find(env, "SLURM_NODEID")) {
      const int index = parse_int("SLURM_NODEID", *node, 0, max_world - 1);
      if (static_cast<std::size_t>(index) >= per_node.size())
        throw launch_error("SLURM_NODEID=" + *node + " has no entry in " + name + "=" + *v);
      return per_node[static_cast<std::size_t>(index)];
    }
    for (int n : per_node) {
      if (n != per_node.front())
        throw launch_error("SLURM_NODEID is missing and " + name + "=" + *v +
                           " differs between nodes");
    }
    return per_node.front();
  }
  if (const std::string* v = find(env, "SLURM_NTASKS_PER_NODE"))
    return parse_int("SLURM_NTASKS_PER_NODE", *v, 1, max_world);
  throw launch_error(
      "SLURM_TASKS_PER_NODE is missing (srun sets it; so does --ntasks-per-node "
      "as SLURM_NTASKS_PER_NODE)");
}

launch_env slurm_env(const env_map& env) {
  const char* why = "srun sets it for every task of a job step";
  launch_env e;
  e.kind = launcher_kind::slurm;
  std::string name;
  e.rank = require_index(env, "SLURM_PROCID", why);
  const std::string* world = find_first(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, &name);
  if (!world) throw launch_error(std::string("SLURM_NTASKS is missing (") + why + ")");
  e.world = parse_int(name, *world, 1, max_world);
  e.local_rank = require_index(env, "SLURM_LOCALID", why);
  e.local_world = slurm_local_world(env, e.world);
  check_ranks(e, "SLURM_PROCID", name.c_str(), "SLURM_LOCALID", "SLURM_TASKS_PER_NODE");

  if (const std::string* addr = find(env, "MASTER_ADDR")) {
    e.master_addr = check_addr("MASTER_ADDR", *addr);
  } else {
    const std::string* list =
        find_first(env, {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"}, &name);
    if (!list)
      throw launch_error("SLURM_NODELIST is missing (set MASTER_ADDR to name the rendezvous host)");
    try {
      e.master_addr = expand_hostlist(*list).front();
    } catch (const launch_error& err) {
      throw launch_error(name + "='" + *list + "' does not parse: " + err.what());
    }
  }

  const std::string* job = find(env, "SLURM_JOB_ID");
  const std::string* step = find_first(env, {"SLURM_STEP_ID", "SLURM_STEPID"}, &name);
  std::uint64_t job_id = 0, step_id = 0;
  if (job) job_id = parse_u64("SLURM_JOB_ID", *job);
  if (step) step_id = parse_u64(name, *step);
  if (job) e.job_id = *job;
  if (const std::string* port = find(env, "MASTER_PORT")) {
    e.master_port = parse_port("MASTER_PORT", *port);
  } else {
    if (!job) throw launch_error("SLURM_JOB_ID is missing (needed for the rendezvous port)");
    if (!step)
      throw launch_error(
          "SLURM_STEP_ID is missing (needed for the rendezvous port): start the processes "
          "with srun, or set MASTER_PORT");
    e.master_port = slurm_derived_port(job_id, step_id);
  }
  e.job_token = job_token(
      env, job && step ? "slurm:" + *job + "." + *step : addr_port(e.master_addr, e.master_port));
  return e;
}

launch_env openmpi_env(const env_map& env) {
  const char* why = "mpirun sets it";
  launch_env e;
  e.kind = launcher_kind::openmpi;
  e.rank = require_index(env, "OMPI_COMM_WORLD_RANK", why);
  e.world = require_count(env, "OMPI_COMM_WORLD_SIZE", why);
  e.local_rank = require_index(env, "OMPI_COMM_WORLD_LOCAL_RANK", why);
  e.local_world = require_count(env, "OMPI_COMM_WORLD_LOCAL_SIZE", why);
  check_ranks(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE");
  const std::string* jobid = find(env, "OMPI_MCA_ess_base_jobid");
  if (jobid && !jobid->empty()) e.job_id = *jobid;
  const bool single_machine = e.local_world == e.world;
  const char* spans =
      "an OpenMPI job that spans machines needs MASTER_ADDR and MASTER_PORT: pass them with "
      "mpirun -x";
  if (const std::string* addr = find(env, "MASTER_ADDR")) {
    e.master_addr = check_addr("MASTER_ADDR", *addr);
  } else if (!single_machine) {
    throw launch_error(std::string("MASTER_ADDR is missing (") + spans + ")");
  }
  if (const std::string* port = find(env, "MASTER_PORT")) {
    e.master_port = parse_port("MASTER_PORT", *port);
  } else if (!single_machine) {
    throw launch_error(std::string("MASTER_PORT is missing (") + spans + ")");
  } else if (e.job_id.empty()) {
    throw launch_error(
        "OMPI_MCA_ess_base_jobid is missing (needed for the rendezvous port): set MASTER_PORT");
  } else {
    e.master_port = openmpi_derived_port(e.job_id);
  }
  e.job_token = job_token(
      env, e.job_id.empty() ? addr_port(e.master_addr, e.master_port) : "openmpi:" + e.job_id);
  return e;
}

// Expands one bracket group's content "01-03,7" (no brackets); `fail` makes the error.
template <class Fail>
std::vector<std::string> expand_group(const std::string& content, const Fail& fail) {
  if (content.empty()) throw fail("empty brackets []");
  std::vector<std::pair<std::string, std::string>> ranges;  // (lo, hi) as written
  std::uint64_t count = 0;
  std::stringstream in(content);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto dash = item.find('-');
    std::string lo = item.substr(0, dash);
    std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    const auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits(lo) || !digits(hi)) throw fail("'[" + content + "]' is not a list of numbers");
    const std::uint64_t a = std::stoull(lo), b = std::stoull(hi);
    if (b < a) throw fail("range " + item + " runs backwards");
    count += b - a + 1;
    if (count > max_hostlist_hosts)
      throw fail("more than " + std::to_string(max_hostlist_hosts) + " hosts");
    ranges.emplace_back(std::move(lo), std::move(hi));
  }
  if (content.back() == ',') throw fail("'[" + content + "]' ends with ','");
  std::vector<std::string> out;
  out.reserve(count);
  for (const auto& [lo, hi] : ranges) {
    for (std::uint64_t x = std::stoull(lo), b = std::stoull(hi); x <= b; ++x) {
      std::string digits = std::to_string(x);
      if (digits.size() < lo.size()) digits.insert(0, lo.size() - digits.size(), '0');
      out.push_back(std::move(digits));
    }
  }
  return out;
}

bool host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '.' || c == '_';
}

}  // namespace

int slurm_derived_port(std::uint64_t job_id, std::uint64_t step_id) {
  return derived_port_base + static_cast<int>(job_id % 100) * 100 + static_cast<int>(step_id % 100);
}

int openmpi_derived_port(const std::string& jobid) {
  return derived_port_base + static_cast<int>(fnv1a64(jobid) % derived_port_span);
}

std::vector<std::string> expand_hostlist(const std::string& list) {
  const auto fail = [&](const std::string& why) {
    return launch_error("hostlist '" + list + "': " + why);
  };
  if (list.empty()) throw fail("empty");
  std::vector<std::string> hosts;
  std::size_t i = 0;
  for (;;) {
    // One host expression up to the next ',' outside brackets: literal text and bracket groups.
    std::vector<std::vector<std::string>> parts;
    std::string literal;
    while (i < list.size() && list[i] != ',') {
      const char c = list[i];
      if (c == '[') {
        const auto close = list.find(']', i);
        if (close == std::string::npos) throw fail("'[' without ']'");
        if (!literal.empty()) parts.push_back({std::exchange(literal, {})});
        parts.push_back(expand_group(list.substr(i + 1, close - i - 1), fail));
        i = close + 1;
      } else if (c == ']') {
        throw fail("']' without '['");
      } else if (!host_char(c)) {
        throw fail(std::string("unexpected character '") + c + "'");
      } else {
        literal += c;
        ++i;
      }
    }
    if (!literal.empty()) parts.push_back({literal});
    if (parts.empty()) throw fail("empty host name");
    std::size_t count = 1;
    for (const auto& p : parts) {
      if (p.size() > (max_hostlist_hosts - hosts.size()) / count)
        throw fail("more than " + std::to_string(max_hostlist_hosts) + " hosts");
      count *= p.size();
    }
    // Cartesian product, the first group outermost (odometer over the parts).
    std::vector<std::size_t> digit(parts.size(), 0);
    for (std::size_t n = 0; n < count; ++n) {
      std::string host;
      for (std::size_t k = 0; k < parts.size(); ++k) host += parts[k][digit[k]];
      hosts.push_back(std::move(host));
      for (std::size_t k = parts.size(); k-- > 0;) {
        if (++digit[k] < parts[k].size()) break;
        digit[k] = 0;
      }
    }
    if (i == list.size()) break;
    if (++i == list.size()) throw fail("ends with ','");
  }
  return hosts;
}

std::string launch_env::describe() const {
  std::string what;
  switch (kind) {
    case launcher_kind::none:
      return "single process (no launcher): rank 0 of 1";
    case launcher_kind::troupe:
      what = "troupe launch";
      break;
    case launcher_kind::torchrun:
      what = job_id.empty() ? "torchrun-style environment" : "torchrun run " + job_id;
      break;
    case launcher_kind::slurm:
      what = "slurm job " + (job_id.empty() ? std::string("?") : job_id);
      break;
    case launcher_kind::openmpi:
      what = "openmpi job " + (job_id.empty() ? std::string("?") : job_id);
      break;
  }
  return what + ": rank " + std::to_string(rank) + " of " + std::to_string(world) + " (local " +
         std::to_string(local_rank) + " of " + std::to_string(local_world) + "), rendezvous " +
         addr_port(master_addr, master_port);
}

env_map current_environment() {
  env_map env;
  for (char** p = environ; p && *p; ++p) {
    const char* eq = std::strchr(*p, '=');
    if (!eq) continue;
    env.emplace(std::string(*p, static_cast<std::size_t>(eq - *p)), std::string(eq + 1));
  }
  return env;
}

launch_env detect_launch_env(const env_map& env) {
  if (const std::string* launcher = find(env, "TROUPE_LAUNCHER")) {
    if (*launcher != "troupe")
      throw launch_error("TROUPE_LAUNCHER='" + *launcher + "' is not 'troupe' (its only value)");
    return troupe_env(env);
  }
  if (find(env, "RANK") || find(env, "WORLD_SIZE")) return torchrun_env(env);
  if (find(env, "SLURM_PROCID")) return slurm_env(env);
  if (find(env, "OMPI_COMM_WORLD_RANK") || find(env, "OMPI_COMM_WORLD_SIZE"))
    return openmpi_env(env);
  launch_env e;
  e.job_token = job_token(env, "");
  return e;
}

}  // namespace troupe::transport
