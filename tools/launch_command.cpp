// `troupe launch --nproc N [--port P] [--addr A] [--grace SECONDS] -- COMMAND...`: starts N
// copies of this troupe binary with COMMAND as their arguments, each with the environment of a
// Troupe-launched rank (TROUPE_LAUNCHER=troupe, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT, TROUPE_JOB_TOKEN; see docs/operations.md, "Launch locally"), and
// supervises them:
// - SIGINT, SIGTERM and SIGHUP reaching the launcher go to every child's process group (each
//   child leads its own, so a terminal's Ctrl-C reaches a child once, through the launcher);
//   a signal the launcher was started ignoring (nohup) is ignored by the children too.
// - When a child fails (non-zero exit or a signal), the others get --grace seconds to notice
//   on their own, then SIGTERM, then SIGKILL 5 seconds later. A child whose launcher dies gets
//   SIGTERM from the kernel (PR_SET_PDEATHSIG).
// - The exit status is 0 if every child succeeded, else the first failing child's (128+signal
//   for a signal), with one line on stderr naming its rank. Bad arguments exit 2 with one line.
// - With --max-restarts R (docs/checkpoints.md): when the job fails (a child's non-zero exit or a
//   signal; not bad input, exit 2, and not a signal the launcher was sent), every child is torn
//   down as above and the job starts again, each child with TROUPE_RESTART_COUNT=k, so that
//   `troupe train` resumes from its last committed checkpoint. More than R restarts within
//   --restart-window seconds, or more than --max-total-restarts in all (default 10 x R): exit 3
//   with a report of every failure.
// - A child ended by a signal is named by the signal and its meaning ("killed by SIGXFSZ (File
//   size limit exceeded)").
// The hidden option --program PATH runs PATH instead of this binary (tests use /bin/sh).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tools/commands.hpp"
#include "transport/launch_env.hpp"

extern char** environ;

namespace troupe::tools {
namespace {

using steady = std::chrono::steady_clock;
constexpr std::chrono::seconds kill_after_term{5};
constexpr int forwarded_signals[] = {SIGINT, SIGTERM, SIGHUP};

struct launch_options {
  int nproc = 0;
  int port = 0;
  std::string addr = "127.0.0.1";
  double grace_s = 30;
  int max_restarts = 0;
  double restart_window_s = 3600;
  int max_total_restarts = -1;  // -1: 10 x max_restarts
  std::string program;          // hidden: default this binary
  std::vector<std::string> command;
  CLI::App* app = nullptr;
};

int bad_input(const std::string& message) {
  std::fprintf(stderr, "troupe launch: %s\n", message.c_str());
  return exit_bad_input;
}

// "SIGXFSZ (File size limit exceeded)": the signal's name and what it means.
std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  const char* meaning = ::strsignal(sig);
  return (abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig)) +
         (meaning ? std::string(" (") + meaning + ")" : "");
}

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", s);
  return text;
}

// A port the kernel considers free on addr now (rank 0 binds it a moment later).
int free_port(const std::string& addr, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(addr.c_str(), "0", &hints, &found); rc != 0) {
    error = ::gai_strerror(rc);
    return 0;
  }
  int port = 0;
  error = "no address";
  for (addrinfo* a = found; a && port == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (fd >= 0 && ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      error = std::strerror(errno);
    }
    if (fd >= 0) ::close(fd);
  }
  ::freeaddrinfo(found);
  return port;
}

// 32 random bytes from /dev/urandom as 64 hex digits, or "" if it cannot be read.
std::string random_token() {
  unsigned char bytes[32];
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::read(fd, bytes + got, sizeof bytes - got);
    if (n <= 0 && errno != EINTR) break;
    if (n > 0) got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  if (got < sizeof bytes) return "";
  std::string hex;
  for (unsigned char b : bytes) {
    static const char digits[] = "0123456789abcdef";
    hex += digits[b >> 4];
    hex += digits[b & 15];
  }
  return hex;
}

struct child {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
};

class supervisor {
 public:
  // Runs `exec_path` (argv[0] `program`) in every child.
  supervisor(const launch_options& o, std::string exec_path, std::string program,
             std::vector<std::string> env_base)
      : o_(o),
        exec_path_(std::move(exec_path)),
        program_(std::move(program)),
        env_base_(std::move(env_base)) {}
  int run();
  // Why the job failed (after run() returned non-zero); whether the launcher itself was sent a
  // signal (then nothing is restarted).
  std::string failure() const { return "rank " + std::to_string(first_failed_) + " " + first_how_; }
  bool interrupted() const { return interrupted_; }

 private:
  bool spawn(int rank, const sigset_t& child_mask);
  void signal_children(int sig) {
    for (const child& c : children_)
      if (c.alive) ::kill(-c.pid, sig);  // its whole process group
  }
  void reap();
  bool any_alive() const {
    return std::any_of(children_.begin(), children_.end(), [](const child& c) { return c.alive; });
  }

  const launch_options& o_;
  std::string exec_path_, program_;
  std::vector<std::string> env_base_;
  std::vector<child> children_;
  int first_failed_ = -1, first_status_ = 0;
  bool interrupted_ = false;
  std::string first_how_;
  std::optional<steady::time_point> term_at_, kill_at_;
};

bool supervisor::spawn(int rank, const sigset_t& child_mask) {
  std::vector<std::string> env = env_base_;
  env.push_back("RANK=" + std::to_string(rank));
  env.push_back("LOCAL_RANK=" + std::to_string(rank));
  std::vector<char*> envp, argv;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string arg0 = program_;
  argv.push_back(arg0.data());
  std::vector<std::string> args = o_.command;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string exec_error =
      "troupe launch: rank " + std::to_string(rank) + ": cannot run " + program_ + ": ";
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    // The child: its own process group, SIGTERM when the launcher dies, stdin from /dev/null,
    // the signal mask the launcher started with.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(128 + SIGTERM);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) {
      ::dup2(null, STDIN_FILENO);
      if (null != STDIN_FILENO) ::close(null);
    }
    ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    ::execve(exec_path_.c_str(), argv.data(), envp.data());
    const char* why = std::strerror(errno);
    [[maybe_unused]] auto w1 = ::write(STDERR_FILENO, exec_error.data(), exec_error.size());
    [[maybe_unused]] auto w2 = ::write(STDERR_FILENO, why, std::strlen(why));
    [[maybe_unused]] auto w3 = ::write(STDERR_FILENO, "\n", 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so a signal sent right away reaches the group
  children_.push_back({rank, pid, true});
  return true;
}

void supervisor::reap() {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    auto it = std::find_if(children_.begin(), children_.end(),
                           [pid](const child& c) { return c.pid == pid; });
    if (it == children_.end()) continue;
    it->alive = false;
    int code = 0;
    std::string how;
    if (WIFEXITED(status)) {
      code = WEXITSTATUS(status);
      how = "exit code " + std::to_string(code);
    } else if (WIFSIGNALED(status)) {
      code = 128 + WTERMSIG(status);
      how = "killed by " + signal_name(WTERMSIG(status)) + ", exit code " + std::to_string(code);
    }
    if (code != 0 && first_failed_ < 0) {
      first_failed_ = it->rank;
      first_status_ = code;
      first_how_ = how;
      term_at_ = steady::now() + std::chrono::duration_cast<steady::duration>(
                                     std::chrono::duration<double>(o_.grace_s));
    }
  }
}

int supervisor::run() {
  // Signals arrive through a signalfd: block them (and SIGCHLD) for the launcher; children get
  // the original mask back before exec.
  sigset_t watched, original;
  ::sigemptyset(&watched);
  ::sigaddset(&watched, SIGCHLD);
  for (int sig : forwarded_signals) ::sigaddset(&watched, sig);
  ::sigprocmask(SIG_BLOCK, &watched, &original);
  const int sfd = ::signalfd(-1, &watched, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) {
    ::sigprocmask(SIG_SETMASK, &original, nullptr);
    std::fprintf(stderr, "troupe launch: signalfd failed: %s\n", std::strerror(errno));
    return exit_failure;
  }
  for (int rank = 0; rank < o_.nproc; ++rank) {
    if (!spawn(rank, original)) {
      std::fprintf(stderr, "troupe launch: cannot start rank %d: %s\n", rank, std::strerror(errno));
      if (first_failed_ < 0) {
        first_failed_ = rank;
        first_status_ = exit_failure;
        first_how_ = "not started";
      }
      signal_children(SIGTERM);
      kill_at_ = steady::now() + kill_after_term;
      break;
    }
  }
  while (any_alive()) {
    const auto now = steady::now();
    if (term_at_ && now >= *term_at_) {
      signal_children(SIGTERM);
      term_at_.reset();
      kill_at_ = now + kill_after_term;
    }
    if (kill_at_ && now >= *kill_at_) {
      signal_children(SIGKILL);
      kill_at_.reset();
    }
    int timeout_ms = -1;  // until the next escalation, or until a signal or a child's exit
    const auto until = [&](const std::optional<steady::time_point>& t) {
      if (!t) return;
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*t - now).count();
      const int wait = static_cast<int>(std::clamp<long long>(ms, 0, 1 << 30));
      timeout_ms = timeout_ms < 0 ? wait : std::min(timeout_ms, wait);
    };
    until(term_at_);
    until(kill_at_);
    pollfd p{sfd, POLLIN, 0};
    ::poll(&p, 1, timeout_ms);
    signalfd_siginfo info;
    while (::read(sfd, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig != SIGCHLD) {
        interrupted_ = true;
        signal_children(sig);
      }
    }
    reap();
  }
  ::close(sfd);
  ::sigprocmask(SIG_SETMASK, &original, nullptr);
  if (first_failed_ < 0) return exit_ok;
  std::fprintf(stderr, "troupe launch: rank %d of %d failed first (%s)\n", first_failed_, o_.nproc,
               first_how_.c_str());
  return first_status_;
}

int run_launch(const launch_options& o) {
  // CLI11 lists the "--" it saw among the extras; anything else there is an option of the
  // command given without "--" before it.
  for (const std::string& extra : o.app->remaining())
    if (extra != "--")
      return bad_input("unexpected argument " + extra +
                       ": put the command after -- (troupe launch --nproc N -- COMMAND...)");
  if (o.app->count("--nproc") == 0) return bad_input("--nproc N is required");
  if (o.nproc < 1 || o.nproc > transport::max_world)
    return bad_input("--nproc " + std::to_string(o.nproc) + " is outside 1-" +
                     std::to_string(transport::max_world));
  if (o.command.empty())
    return bad_input(
        "no command: troupe launch --nproc N -- COMMAND... (e.g. -- train recipe.toml)");
  if (o.port < 0 || o.port > 65535)
    return bad_input("--port " + std::to_string(o.port) + " is outside 0-65535 (0: a free port)");
  if (!(o.grace_s >= 0) || o.grace_s > 86400) {
    char grace[32];
    std::snprintf(grace, sizeof grace, "%g", o.grace_s);
    return bad_input(std::string("--grace ") + grace + " is outside 0-86400 seconds");
  }
  if (o.addr.empty()) return bad_input("--addr is empty");
  if (o.max_restarts < 0 || o.max_restarts > 1000000)
    return bad_input("--max-restarts " + std::to_string(o.max_restarts) + " is outside 0-1000000");
  if (!(o.restart_window_s > 0) || o.restart_window_s > 1e9)
    return bad_input("--restart-window " + seconds_text(o.restart_window_s) +
                     " is outside (0, 1e9] seconds");
  if (o.app->count("--max-total-restarts") &&
      (o.max_total_restarts < 0 || o.max_total_restarts > 10000000))
    return bad_input("--max-total-restarts " + std::to_string(o.max_total_restarts) +
                     " is outside 0-10000000");
  const long total_cap =
      o.app->count("--max-total-restarts") ? o.max_total_restarts : 10L * o.max_restarts;

  // This binary is started as /proc/self/exe (right even if its file was replaced meanwhile);
  // its path is argv[0].
  const std::string exec_path = o.program.empty() ? "/proc/self/exe" : o.program;
  std::string program = o.program;
  if (program.empty()) {
    std::vector<char> path(4096);
    const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
    if (n <= 0) return bad_input(std::string("cannot find this binary: ") + std::strerror(errno));
    program.assign(path.data(), static_cast<std::size_t>(n));
  }
  const auto env = transport::current_environment();
  std::vector<std::pair<double, std::string>> failures;  // (seconds since start, what failed)
  const auto start = steady::now();
  for (int attempt = 0;; ++attempt) {
    int port = o.port;
    if (port == 0) {  // a new one for each attempt: the last one may linger in TIME_WAIT
      std::string error;
      port = free_port(o.addr, error);
      if (port == 0) return bad_input("--addr " + o.addr + ": no free port: " + error);
    }
    // The children's environment: ours without what a rank gets set (RANK and LOCAL_RANK per
    // child).
    std::map<std::string, std::string> set = {{"TROUPE_LAUNCHER", "troupe"},
                                              {"WORLD_SIZE", std::to_string(o.nproc)},
                                              {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
                                              {"MASTER_ADDR", o.addr},
                                              {"MASTER_PORT", std::to_string(port)},
                                              {"TROUPE_RESTART_COUNT", std::to_string(attempt)}};
    if (!env.count("TROUPE_JOB_TOKEN") && !env.count("TROUPE_JOB_TOKEN_FILE")) {
      std::string token = random_token();
      if (token.empty()) return bad_input("cannot read /dev/urandom for the job token");
      set["TROUPE_JOB_TOKEN"] = token;
    }
    std::vector<std::string> env_base;
    for (const auto& [k, v] : env)
      if (!set.count(k) && k != "RANK" && k != "LOCAL_RANK") env_base.push_back(k + "=" + v);
    for (const auto& [k, v] : set) env_base.push_back(k + "=" + v);
    std::fflush(nullptr);  // nothing buffered may be written twice by the children
    supervisor s(o, exec_path, program, std::move(env_base));
    const int rc = s.run();
    if (rc == exit_ok || o.max_restarts == 0 || s.interrupted() || rc == exit_bad_input) return rc;
    const double now = std::chrono::duration<double>(steady::now() - start).count();
    failures.emplace_back(now, s.failure());
    int recent = 0;  // failures within the window, this one included
    for (const auto& [t, what] : failures) recent += now - t <= o.restart_window_s;
    const long total = static_cast<long>(failures.size());
    if (recent > o.max_restarts || total > total_cap) {
      std::string report =
          recent > o.max_restarts
              ? "troupe launch: giving up: the job failed " + std::to_string(recent) +
                    " times within " + seconds_text(o.restart_window_s) +
                    " s, more than --max-restarts " + std::to_string(o.max_restarts) +
                    " allows (--restart-window). Failures:"
              : "troupe launch: giving up: the job failed " + std::to_string(total) +
                    " times in all, more than --max-total-restarts " + std::to_string(total_cap) +
                    " allows. Failures:";
      // The first failures and the last ones: a long run of restarts is not listed whole.
      constexpr std::size_t shown = 10;
      for (std::size_t i = 0; i < failures.size(); ++i) {
        if (failures.size() > 2 * shown && i == shown)
          report += " ... " + std::to_string(failures.size() - 2 * shown) + " more ...;";
        if (failures.size() > 2 * shown && i >= shown && i < failures.size() - shown) continue;
        char line[64];
        std::snprintf(line, sizeof line, " attempt %zu at %.1f s: ", i + 1, failures[i].first);
        report += line + failures[i].second + ";";
      }
      report +=
          " its checkpoints stay: once the cause is fixed, `troupe train RECIPE --resume` "
          "goes on from the last committed one (troupe ckpt ls shows them).\n";
      std::fputs(report.c_str(), stderr);
      return exit_restarts_exhausted;
    }
    std::fprintf(stderr,
                 "troupe launch: restarting the job (restart %d of at most %ld; %d of at most %d "
                 "within %g s) from its last committed checkpoint\n",
                 attempt + 1, total_cap, recent, o.max_restarts, o.restart_window_s);
  }
}

}  // namespace

std::function<int()> add_launch_command(CLI::App& app) {
  auto opts = std::make_shared<launch_options>();
  auto* cmd = app.add_subcommand(
      "launch", "Start N local processes of one job: troupe launch --nproc N -- COMMAND...");
  opts->app = cmd;
  cmd->allow_extras();
  cmd->add_option("--nproc", opts->nproc, "Processes to start (ranks 0..N-1)");
  cmd->add_option("--port", opts->port, "Rendezvous port (default: a free port)");
  cmd->add_option("--addr", opts->addr, "Rendezvous address rank 0 binds (default 127.0.0.1)");
  cmd->add_option("--grace", opts->grace_s,
                  "Seconds the other ranks get after one fails, before SIGTERM (default 30)");
  cmd->add_option("--max-restarts", opts->max_restarts,
                  "When the job fails, start it again (resuming from its last committed "
                  "checkpoint) up to this many times within --restart-window (default 0: never)");
  cmd->add_option("--restart-window", opts->restart_window_s,
                  "Seconds over which --max-restarts counts restarts (default 3600)");
  cmd->add_option("--max-total-restarts", opts->max_total_restarts,
                  "Restarts in all, whatever the window, before giving up with exit 3 (default "
                  "10 x --max-restarts)");
  cmd->add_option("--program", opts->program, "Run this program instead of troupe (tests)")
      ->group("");
  cmd->add_option("command", opts->command, "The troupe command each rank runs, after --");
  return [opts] { return run_launch(*opts); };
}

}  // namespace troupe::tools
